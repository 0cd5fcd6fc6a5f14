"""Every collective the library issues goes through here, and is counted in the ledger.

[Note: communication ledger]
``LEDGER`` counts, per collective kind, the number of calls and the *payload* bytes of one rank:
the tensor it contributes or receives in full (all-reduce: the tensor; all-gather: the gathered
output; reduce-scatter: the unsharded input; broadcast / reduce: the tensor). ``traffic_bytes()``
turns payloads into the bytes a rank sends with ring algorithms, the model the ZeRO paper uses:
an all-reduce moves 2 (N-1)/N of its payload, an all-gather, a reduce-scatter, a broadcast or a
reduce (N-1)/N. Counting costs two dictionary updates per call.

[Note: contiguous payloads]
gloo sends and receives a tensor's memory as it lies, ignoring its strides, so a transposed or
``channels_last`` tensor arrives scrambled, silently, unless both ends happen to share its
layout; NCCL refuses it. Every collective here therefore refuses a non-contiguous tensor with
an error, and a parameter, whose layout is the user's choice, is broadcast in place through
``broadcast_into``, which sends a contiguous copy and writes it back.

A collective issued with a ``label`` (HSDP's ``"shard"`` and ``"replicate"`` groups, [Note:
hybrid sharding]) is also counted under it in ``group_calls`` / ``group_payload_bytes`` (keys
``(label, kind)``), so intra-group and inter-group traffic can be told apart;
``group_traffic_bytes(label, group_size)`` applies the ring model with that group's size. The
totals above count every collective, labelled or not. A label names the role, not the process
group: one group can play both roles (a 1 x N mesh's shard group is the default group).

[Note: complex payloads]
NCCL has no complex type, and gloo in torch 2.8 refuses complex broadcasts, reduces and
reduce-scatters ("Invalid scalar type"; 2.11 takes them); torch's own functions view complex as
real for some collectives and not others (2.11: not its reduce or reduce-scatter). So every
collective here hands the backend a complex tensor as the flat real view of its (real,
imaginary) pairs: the same memory, twice the elements. That is exact: a copy moves the same
bytes, and a sum or average of complex numbers is the sum or average of their parts; the pairs
of one complex element never straddle two ranks' chunks (a chunk of k complex elements is 2k
real ones). Other reductions (max, product) have no meaning on complex numbers and are refused.

[Note: collectives on one rank]
On a group of one rank every collective is the identity: an all-reduce, broadcast or reduce
leaves the tensor as it is, an all-gather's output and a reduce-scatter's input are the rank's
own tensor. Such a collective (a strategy at world size 1, HSDP's groups of one) is done here,
by a copy where output and input are different tensors, without calling the backend. There the
backend's call is all cost: FSDP training GPT-2 124M on one H200 with NCCL spent 0.11 ms of host
time issuing each all-gather and about 0.6 ms more in the stream's wait on its work (cProfile,
38 collectives a step), while the GPU waited for the host. It is counted in the ledger and
recorded in a trace as any other; an asynchronous one returns a work that is already complete.

[Note: leaving after collectives]
A collective's work object holds its tensors, and the backend's worker thread (gloo's
``pt_gloo_runloop``) holds the work until shortly after it completes. Where that thread drops
the last reference, freeing a tensor made in Python (or the ``contextvars`` object that torch
>= 2.13 keeps in thread-local state during ``backward()``) needs the GIL. If the script ends
first, the thread takes the GIL while the interpreter shuts down, is made to exit there, and the
process aborts ("terminate called without an active exception"): a finished run that
``torchrun`` reports as failed. It happened in about 1 of 4 two-rank gloo runs that end with
``destroy_process_group()`` right after a step. So once this process has issued a collective, an
``atexit`` handler (run while the interpreter is still whole) releases the GIL for a moment
(``EXIT_GRACE_S``), letting those threads drop their references.
"""

import atexit
import functools
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from tiny_fsdp.core import gloo_collectives
from tiny_fsdp.trace import recorder as _trace

# torch >= 2.13 renames the *_into_tensor / *_tensor collectives; use whichever exists.
_torch_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_torch_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _all_gather_tensor(
    output: torch.Tensor, input: torch.Tensor, group: Any = None, async_op: bool = False
) -> Any:
    if gloo_collectives.uses_gloo(output, group):  # [Note: collectives on gloo]
        return gloo_collectives.all_gather(output, input, group, async_op)
    return _torch_all_gather(output, input, group=group, async_op=async_op)


def _reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: dist.ReduceOp = dist.ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    if gloo_collectives.is_gloo(group):  # [Note: collectives on gloo]
        return gloo_collectives.reduce_scatter(output, input, op, group, async_op)
    return _torch_reduce_scatter(output, input, op=op, group=group, async_op=async_op)


def _reduce_tensor(
    tensor: torch.Tensor,
    dst: int,
    op: dist.ReduceOp = dist.ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
    output: Optional[torch.Tensor] = None,
) -> Any:
    if gloo_collectives.is_gloo(group):  # [Note: collectives on gloo]
        return gloo_collectives.reduce(tensor, dst, op, group, async_op, output)
    work = dist.reduce(tensor, dst=dst, op=op, group=group, async_op=async_op)
    if not gloo_collectives.output_apart(output, tensor) or dist.get_rank() != dst:
        return work
    if work is not None:
        work.wait()  # CUDA: the current stream waits for the reduce, not the host
    output.copy_(tensor)
    return _DoneWork() if async_op else None


_RING_FACTOR = {"all_reduce": 2.0}  # every other kind: 1.0


@dataclass
class CommLedger:
    """Calls and payload bytes per collective kind on this rank ([Note: communication ledger])."""

    calls: Counter = field(default_factory=Counter)
    payload_bytes: Counter = field(default_factory=Counter)
    group_calls: Counter = field(default_factory=Counter)  # (label, kind) -> calls
    group_payload_bytes: Counter = field(default_factory=Counter)  # (label, kind) -> bytes

    def record(self, kind: str, tensor: torch.Tensor, label: Optional[str] = None) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        self.calls[kind] += 1
        self.payload_bytes[kind] += nbytes
        if label is not None:
            self.group_calls[label, kind] += 1
            self.group_payload_bytes[label, kind] += nbytes

    def reset(self) -> None:
        self.calls.clear()
        self.payload_bytes.clear()
        self.group_calls.clear()
        self.group_payload_bytes.clear()

    def group_traffic_bytes(self, label: str, group_size: int) -> Dict[str, float]:
        """Bytes this rank sends per kind inside the groups labelled ``label`` (ring model)."""
        payloads = {k: n for (name, k), n in self.group_payload_bytes.items() if name == label}
        return ring_bytes(payloads, group_size)

    def traffic_bytes(self, world_size: int) -> Dict[str, float]:
        """Bytes this rank sends per kind under the ring model (0 on one rank)."""
        return ring_bytes(self.payload_bytes, world_size)


def ring_bytes(payloads: Dict[str, int], size: int) -> Dict[str, float]:
    """Per kind, the bytes a rank of a ``size``-rank ring sends for these payloads."""
    scale = (size - 1) / size
    return {kind: n * _RING_FACTOR.get(kind, 1.0) * scale for kind, n in payloads.items()}


LEDGER = CommLedger()

EXIT_GRACE_S = 0.1  # [Note: leaving after collectives]
_issued_any = False


@atexit.register
def _let_collective_threads_finish() -> None:
    if _issued_any:
        time.sleep(EXIT_GRACE_S)


def _issue(
    kind: str,
    payload: torch.Tensor,
    fn: Callable,
    *args: Any,
    group: Any,
    async_op: bool,
    label: Optional[str] = None,
    **kw: Any,
) -> Any:
    """``fn(*args, group=group, async_op=async_op, **kw)``: the collective, counted in the ledger
    (under ``label`` too, if given) and, while a step is traced, recorded from issue to
    completion ([Note: trace recorder], ``tiny_fsdp/trace/recorder.py``)."""
    for arg in args:  # [Note: contiguous payloads]
        if isinstance(arg, torch.Tensor) and not arg.is_contiguous():
            raise ValueError(
                f"{kind}: tensor of shape {tuple(arg.shape)} and strides {arg.stride()} is not "
                "contiguous; collectives would send its memory in storage order (use "
                "comm.broadcast_into for a parameter, or .contiguous())"
            )
    if any(_is_complex(value) for value in (*args, *kw.values())):  # [Note: complex payloads]
        if kw.get("op", dist.ReduceOp.SUM) not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise ValueError(f"{kind}: {kw['op']} is not defined on complex tensors")
        args = tuple(_as_real(value) for value in args)
        kw = {key: _as_real(value) for key, value in kw.items()}
    LEDGER.record(kind, payload, label)
    if dist.get_world_size(group) == 1:  # [Note: collectives on one rank]
        fn = functools.partial(_on_one_rank, kind)
    global _issued_any
    _issued_any = True
    rec = _trace.ACTIVE
    if rec is None:
        return fn(*args, group=group, async_op=async_op, **kw)
    call = functools.partial(fn, *args, group=group, async_op=async_op, **kw)
    lane = "default" if group is None else str(getattr(group, "group_name", id(group)))
    if payload.is_cuda:
        lane += f" stream {torch.cuda.current_stream(payload.device).stream_id}"
    return rec.collective(kind, payload.numel() * payload.element_size(), lane, async_op, call)


def _is_complex(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_complex()


def _as_real(value: Any) -> Any:
    """A complex tensor as the flat real tensor of its (real, imaginary) pairs, a view of the
    same memory (2 * numel elements); anything else as it is ([Note: complex payloads])."""
    return torch.view_as_real(value).view(-1) if _is_complex(value) else value


class _DoneWork:
    """The work of a collective done at once ([Note: collectives on one rank])."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(None)
        return future


def _on_one_rank(kind: str, *args: Any, group: Any, async_op: bool, **kw: Any) -> Any:
    """``kind`` on a group of one rank: the identity ([Note: collectives on one rank])."""
    if kind in ("all_gather", "reduce_scatter"):  # args: (output, input)
        output, input = args
        if output.data_ptr() != input.data_ptr():
            output.view(-1).copy_(input.view(-1))
    if kind == "reduce" and gloo_collectives.output_apart(kw.get("output"), args[0]):
        kw["output"].copy_(args[0])  # args: (tensor,)
    return _DoneWork() if async_op else None


def all_reduce(
    tensor: torch.Tensor,
    op: dist.ReduceOp = dist.ReduceOp.SUM,
    group: Optional[dist.ProcessGroup] = None,
    async_op: bool = False,
    label: Optional[str] = None,
) -> Optional[dist.Work]:
    return _issue(
        "all_reduce",
        tensor,
        dist.all_reduce,
        tensor,
        op=op,
        group=group,
        async_op=async_op,
        label=label,
    )


def all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    group: Optional[dist.ProcessGroup] = None,
    async_op: bool = False,
    label: Optional[str] = None,
) -> Optional[dist.Work]:
    """``output`` (N * k,) <- the ``input`` (k,) of every rank, in rank order ([Note:
    collectives on gloo])."""
    return _issue(
        "all_gather",
        output,
        _all_gather_tensor,
        output,
        input,
        group=group,
        async_op=async_op,
        label=label,
    )


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    op: dist.ReduceOp = dist.ReduceOp.SUM,
    group: Optional[dist.ProcessGroup] = None,
    async_op: bool = False,
    label: Optional[str] = None,
) -> Optional[dist.Work]:
    """``output`` (k,) <- rank r's chunk of the reduction of every rank's ``input`` (N * k,);
    on gloo ``input`` is scratch afterwards ([Note: collectives on gloo])."""
    return _issue(
        "reduce_scatter",
        input,
        _reduce_scatter_tensor,
        output,
        input,
        op=op,
        group=group,
        async_op=async_op,
        label=label,
    )


def broadcast(
    tensor: torch.Tensor,
    src: int,
    group: Optional[dist.ProcessGroup] = None,
    async_op: bool = False,
    label: Optional[str] = None,
) -> Optional[dist.Work]:
    return _issue(
        "broadcast",
        tensor,
        dist.broadcast,
        tensor,
        src=src,
        group=group,
        async_op=async_op,
        label=label,
    )


@torch.no_grad()
def broadcast_into(
    tensor: torch.Tensor,
    src: int,
    group: Optional[dist.ProcessGroup] = None,
    label: Optional[str] = None,
) -> None:
    """Rank ``src``'s values written into ``tensor`` in place, whatever its strides (a
    transposed or ``channels_last`` parameter); synchronous ([Note: contiguous payloads])."""
    if tensor.is_contiguous():
        broadcast(tensor, src, group=group, label=label)
        return
    flat = tensor.contiguous()
    broadcast(flat, src, group=group, label=label)
    tensor.copy_(flat)


def reduce(
    tensor: torch.Tensor,
    dst: int,
    op: dist.ReduceOp = dist.ReduceOp.SUM,
    group: Optional[dist.ProcessGroup] = None,
    async_op: bool = False,
    label: Optional[str] = None,
    output: Optional[torch.Tensor] = None,
) -> Optional[dist.Work]:
    """``output`` (default: ``tensor`` itself) on global rank ``dst`` <- the reduction of every
    rank's ``tensor``; ``output`` is ignored on the other ranks, and ``tensor`` is scratch
    afterwards wherever it is not the output. ``reduces_into_output`` says when an ``output``
    apart from ``tensor`` costs no copy."""
    return _issue(
        "reduce",
        tensor,
        _reduce_tensor,
        tensor,
        dst=dst,
        op=op,
        group=group,
        async_op=async_op,
        label=label,
        output=output,
    )


def reduces_into_output(tensor: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> bool:
    """Whether a SUM ``reduce`` of ``tensor`` on ``group`` receives the other rank's tensor into
    ``output`` and adds ``tensor`` to it (2 CPU ranks on gloo, [Note: collectives on gloo]):
    then an ``output`` apart from ``tensor`` is the receive buffer, where in place the
    destination receives into a buffer of its own. Elsewhere ``reduce`` works in place and
    an ``output`` apart costs a copy."""
    return gloo_collectives.is_gloo(group) and gloo_collectives.pairs(tensor, group)


def reduce_scatter_receive_bytes(
    output: torch.Tensor, input: torch.Tensor, group: Optional[dist.ProcessGroup] = None
) -> int:
    """Bytes of the buffer a SUM ``reduce_scatter`` of ``input`` into ``output`` allocates until
    it completes: ``output``'s on 2 CPU ranks on gloo when ``output`` is this rank's chunk of
    ``input`` (the other rank's chunk is received apart, [Note: collectives on gloo]); else 0
    (a receive straight into ``output``, or the backend's own buffers)."""
    if not reduces_into_output(input, group):  # the 2-rank pair: received into ``output``...
        return 0
    own = input.view(2, output.numel())[dist.get_rank(group)]
    in_place = own.data_ptr() == output.data_ptr()  # ...unless it is this rank's chunk
    return output.numel() * output.element_size() if in_place else 0


def all_gather_object(obj: object, group: Optional[dist.ProcessGroup] = None) -> List[object]:
    """Every rank's ``obj`` in rank order (metadata only; not counted in the ledger)."""
    out: List[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def gather_object(obj: object, dst: int = 0) -> Optional[List[object]]:
    """Every rank's ``obj`` in rank order on ``dst``, None elsewhere (not counted)."""
    out: Optional[List[object]] = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(obj, out, dst=dst)
    return out
