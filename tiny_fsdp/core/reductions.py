"""Gradient reductions of one backward: issued asynchronously, delivered into ``.grad`` at its end.

[Note: asynchronous reduction]
FSDP's reduce-scatters and ZeRO-3's reduces are issued by a layer's backward ([Note: param
handler]) but nothing waits for them there: ``launch`` issues the collective (``async_op=True``
with async communication on) and returns, so it travels while the earlier layers' backward
computes. The layer hands ``None`` to autograd for those parameters; the reduced gradients are
delivered by ``finalize``, which the first ``launch`` of a backward queues on the autograd engine
(``queue_callback``): it runs once the backward's last node has run, before ``backward()``
returns.

``finalize`` waits for every reduction in issue order, then, per parameter and in issue order, casts
each part to the parameter's dtype (the reduction's whole output at once, one kernel, when the
strategy names it: ``output``; each part is then a view of the cast) and sums the parts (a tied
parameter reduced by two layers has two), and accumulates the sum into ``param.grad`` (``.grad =
sum`` when there is none, else ``.grad += sum``). That is exactly what autograd did when the layers
returned the parts (its input buffer sums a node's incoming gradients, then ``AccumulateGrad`` adds
them), so results are bitwise the same as before, and the same with async communication on and off:
off, each collective runs at once (``async_op=False``), in the same order, delivered by the same
code.
A part of a parameter this rank gave no gradient (an expert only other ranks' tokens picked,
[Note: unit module events]) is delivered only if it is not all zeros, i.e. if another rank
gave one: as torch's DDP with ``find_unused_parameters=True``, a parameter no rank used keeps
``.grad`` None and is not stepped. (A gradient that another rank gave and that is exactly zero
on this rank's whole shard would be taken for no gradient; this test reads the part on the
host, only for such parts, so a model whose ranks use every parameter never syncs here.)
Accumulation across backwards, ``no_sync`` (nothing is launched: the strategies sum locally),
clipping after ``backward()``, tied and frozen parameters (no part) keep their meaning. Two
differences from autograd's accumulation: gradient hooks on these parameters would be called
without the gradient, so a forward refuses them (``check_no_param_hooks`` in
``wrap_checks.py``), and ``torch.autograd.grad(..., inputs=params)`` returns None for them
(their gradients still go to ``.grad``). Last, ``on_finalized`` (the strategy's) gets the
delivered gradients: it reshards what the backward left full and the ranks agree on overflow
([Note: agreeing on overflow]).

Memory bound. A reduction holds its *input* (the padded full gradients it reduces) until it is
retired, and its *output* (this rank's part) until ``finalize`` delivers it. At most
``in_flight_limit`` reductions are unretired: launching one more first retires the oldest
(waiting for it), and each launch retires, without waiting, those already done. The unit whose
gradients are being summed ([Note: unit reduction]) holds the next input, counted from its
allocation. So at any time

    reduce_bytes <= (in_flight_limit + 1) * (largest reduction input)
                    + outputs launched in this backward (<= the local gradients, reduce dtype)

and ``peak_reduce_bytes`` counts it (``FSDP.memory_stats()``, ``Zero3.reduce_stats``).
``in_flight_limit`` is 2: one reduction travelling and the next queued behind it, so the process
group never idles for want of work, and waiting for the oldest stalls the backward only when
communication is the bottleneck anyway. The
outputs are not extra memory when ``.grad`` is None (the output becomes ``.grad``, no copy), as
before; when gradients accumulate onto an existing ``.grad`` they live until ``finalize`` instead
of being added at once. A synchronous reduction keeps one input being filled and one travelling.

Two-stage reductions (HSDP: a reduce-scatter in the shard group, then an all-reduce of its
output across the replicas, [Note: hybrid sharding]): ``launch(..., then=second)``. The second
collective reads what the first writes, so it must not start before the first has finished. On
CUDA both are issued at once on the reduction stream, whose order is enough. On CPU (gloo), a
collective on another process group runs on another thread, so the second is issued only once
the first is done: by the next ``launch`` that finds it done (``_retire_done``, which looks at
the reductions in issue order and stops at the first unfinished one, so every rank issues the
second stages in the same order), or by the retirement that waits for it. A reduction counts as
in flight, and keeps its input, until both stages are done.

If a backward raises before ``finalize``, the next forward calls ``abandon``: it waits for what
is in flight and drops it undelivered (as autograd drops a failed backward's gradients).
"""

from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, FrozenSet, List, Optional, Sequence, Tuple

import torch
from torch import nn

from tiny_fsdp.core.streams import REDUCE, CommHandle, CommStreams, Launch

Part = Tuple[nn.Parameter, torch.Tensor]  # (local parameter, its reduced gradient part)


@dataclass
class _Reduction:
    handle: CommHandle
    inputs: Sequence[torch.Tensor]  # kept alive until retired
    parts: Sequence[Part]  # delivered at finalize
    output: Optional[torch.Tensor]  # contiguous; the parts are views of it
    unused: FrozenSet[int]  # ids of the parameters this rank gave no gradient
    input_bytes: int
    output_bytes: int
    retired: bool = False
    then: Optional[Launch] = None  # the second stage, not issued yet
    async_op: bool = True


@dataclass
class ReduceStats:
    """Bytes of reduction buffers alive now and at most ([Note: asynchronous reduction])."""

    live_bytes: int = 0
    peak_bytes: int = 0
    peak_in_flight: int = 0  # most reductions unretired at once
    largest_input_bytes: int = 0  # of any reduction launched so far

    def track(self, nbytes: int) -> None:
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)


class PendingReductions:
    """The reductions of the current backward of one model ([Note: asynchronous reduction])."""

    def __init__(self, streams: CommStreams, in_flight_limit: int = 2) -> None:
        if in_flight_limit < 1:
            raise ValueError(f"in_flight_limit must be >= 1, got {in_flight_limit}")
        self.streams = streams
        self.in_flight_limit = in_flight_limit
        self.stats = ReduceStats()
        self._all: List[_Reduction] = []  # launched in this backward, in order
        self._in_flight: Deque[_Reduction] = deque()  # launched, not retired
        self._finalize_queued = False
        # Run by finalize before it waits, in registration order; a dict, since every layer's
        # backward registers its unit's callback (a hash lookup, not a scan of the list).
        self._at_end: Dict[Callable[[], None], None] = {}
        # Called last by every finalize: the gradients it delivered into and the device of
        # this backward's reductions (None when it launched none: a no_sync backward).
        self.on_finalized: Optional[
            Callable[[List[torch.Tensor], Optional[torch.device]], None]
        ] = None
        self._device: Optional[torch.device] = None  # of the reductions launched last

    def at_end_of_backward(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` (once) when this backward ends, before ``finalize`` delivers; it may
        launch more reductions (a strategy's partly filled buffers)."""
        self._queue_finalize()
        self._at_end.setdefault(callback)

    def _queue_finalize(self) -> None:
        if not self._finalize_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self.finalize)
            self._finalize_queued = True

    def launch(
        self,
        launch: Launch,
        inputs: Sequence[torch.Tensor],
        parts: Sequence[Part],
        async_op: bool,
        then: Optional[Launch] = None,
        unused: FrozenSet[int] = frozenset(),
        output: Optional[torch.Tensor] = None,
    ) -> None:
        """Issue one reduction; ``parts`` are read (and delivered) only at ``finalize``.

        ``launch(async_op)`` calls the collective; ``inputs`` are the tensors it reads, kept
        alive until it is retired; ``parts``: (parameter, slice of the output) pairs;
        ``then``: a second collective on the output, started once the first is done;
        ``unused``: ids of the parameters of ``parts`` this rank gave no gradient; ``output``:
        the contiguous tensor every part is a view of, if there is one (cast at once).
        """
        if then is not None and (self.streams.uses_streams or not async_op):
            launch, then = _in_sequence(launch, then), None  # stream order / synchronous
        self._queue_finalize()
        self._device = inputs[0].device
        while len(self._in_flight) >= self.in_flight_limit:
            self._retire(self._in_flight.popleft())
        # Every part is a view of ``output`` when there is one: one storage to look up.
        outputs = _storages([output] if parts and output is not None else [t for _, t in parts])
        reduction = _Reduction(
            handle=self.streams.issue(REDUCE, launch, async_op),
            inputs=tuple(inputs),
            parts=tuple(parts),
            output=output,
            unused=unused,
            # an input that is also an output (ZeRO-3's owner) counts as an output
            input_bytes=sum(n for p, n in _storages(inputs).items() if p not in outputs),
            output_bytes=sum(outputs.values()),
            then=then,
            async_op=async_op,
        )
        self._all.append(reduction)
        stats = self.stats
        stats.largest_input_bytes = max(stats.largest_input_bytes, reduction.input_bytes)
        self.stats.track(reduction.input_bytes + reduction.output_bytes)
        self._in_flight.append(reduction)
        self.stats.peak_in_flight = max(self.stats.peak_in_flight, len(self._in_flight))
        if not async_op:
            self._retire(self._in_flight.pop())
        self._retire_done()

    @torch.no_grad()
    def finalize(self) -> None:
        """Wait for every reduction and accumulate the parts into ``.grad`` (end of backward)."""
        at_end, self._at_end = self._at_end, {}
        for callback in at_end:
            callback()
        reductions, self._all = self._all, []
        device = self._device if reductions else None  # launched: on every rank alike
        self._finalize_queued = False
        while self._in_flight:
            self._retire(self._in_flight.popleft())
        sums: Dict[int, List] = {}  # id(param) -> [param, sum of its parts, used here]
        for reduction in reductions:
            cast = {}  # dtype -> the output cast to it, once
            for param, part in reduction.parts:
                part = _cast(part, param.dtype, reduction.output, cast)
                used = id(param) not in reduction.unused
                entry = sums.get(id(param))
                if entry is None:
                    sums[id(param)] = [param, part, used]
                else:
                    entry[1], entry[2] = entry[1] + part, entry[2] or used
            self.stats.track(-reduction.output_bytes)
        del reductions
        # Unused here: used by another rank if its reduced part is not all zeros.
        sums = {k: v for k, v in sums.items() if v[2] or bool(v[1].any())}
        for param, total, _ in sums.values():
            if param.grad is None:
                param.grad = total  # no graph under no_grad: no detach (an op per parameter)
            else:
                param.grad += total
        if self.on_finalized is not None:
            self.on_finalized([param.grad for param, _, _ in sums.values()], device)

    def abandon(self) -> None:
        """Drop (after waiting for them) the reductions of a backward that never finalized."""
        while self._in_flight:
            self._retire(self._in_flight.popleft())
        for reduction in self._all:
            self.stats.track(-reduction.output_bytes)
        self._all = []
        self._at_end = {}
        self._finalize_queued = False

    def _retire(self, reduction: _Reduction) -> None:
        self.streams.wait(reduction.handle)
        if reduction.then is not None:
            self._start_second(reduction)
            self.streams.wait(reduction.handle)
        reduction.inputs = ()
        reduction.retired = True
        self.stats.track(-reduction.input_bytes)

    def _retire_done(self) -> None:
        for reduction in self._in_flight:  # in issue order: second stages start in that order
            if reduction.then is None:
                continue
            if not self.streams.is_done(reduction.handle):
                break
            self._start_second(reduction)
        while self._in_flight and self._is_done(self._in_flight[0]):
            self._retire(self._in_flight.popleft())

    def _is_done(self, reduction: _Reduction) -> bool:
        return reduction.then is None and self.streams.is_done(reduction.handle)

    def _start_second(self, reduction: _Reduction) -> None:
        """Issue the second stage of a reduction whose first stage is done."""
        self.streams.wait(reduction.handle)  # returns at once
        then, reduction.then = reduction.then, None
        reduction.handle = self.streams.issue(REDUCE, then, reduction.async_op)


def _cast(
    part: torch.Tensor,
    dtype: torch.dtype,
    output: Optional[torch.Tensor],
    cast: Dict[torch.dtype, torch.Tensor],
) -> torch.Tensor:
    """``part`` in ``dtype``: with ``output`` (contiguous, ``part`` a view of it), the same view
    of ``output`` cast once (``cast`` keeps it); else ``part.to(dtype)``."""
    if part.dtype == dtype or output is None:
        return part.to(dtype)
    whole = cast.get(dtype)
    if whole is None:
        whole = cast[dtype] = output.to(dtype)
    offset = part.storage_offset() - output.storage_offset()
    return whole.as_strided(part.shape, part.stride(), whole.storage_offset() + offset)


def _storages(tensors: Sequence[torch.Tensor]) -> Dict[int, int]:
    """Address -> bytes of the distinct storages behind ``tensors`` (slices of one count once)."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def _in_sequence(first: Launch, second: Launch) -> Launch:
    """One launch that runs ``first``, orders the caller after it, then runs ``second``."""

    def launch(async_op: bool) -> Any:
        works = first(async_op)
        for work in works if isinstance(works, (list, tuple)) else [works]:
            if work is not None:
                work.wait()  # CUDA: the current stream waits (the host does not); CPU: the host
        return second(async_op)

    return launch
