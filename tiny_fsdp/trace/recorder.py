"""What one rank did during the traced steps: compute spans, collectives, memory samples.

[Note: trace recorder]
``ACTIVE`` is None except while ``trace_step`` (``session.py``) records, so the library's hot
paths (``core/comm.py``, ``core/module/base.py``) pay one module-level ``is None`` check when
tracing is off. While it is set, the ``Recorder`` keeps, for this rank:

- compute spans ``(name, phase, begin, end)``: a layer's ``forward`` / ``backward`` (the layer
  seam: only the layer math, its fetch and release excluded) and ``optimizer.step``. When a
  collective is issued (or runs synchronously) inside an open span, the span is cut at the issue
  and resumed when the call returns, so a span never contains a blocking collective. Spans nest
  (an outer one is cut while an inner one runs). Model code runs on one thread at a time (the
  caller's in forward, autograd's in backward), so one stack of open spans serves them all.
- collectives ``(kind, payload bytes, lane, begin, end)``: ``begin`` when ``core/comm.py``
  issues it; ``end`` when it completes. A synchronous call has completed when it returns. An
  asynchronous one completes when the process group finishes it, not when the caller happens to
  wait, so the picture shows communication overlapping compute exactly as much as it does. On
  CPU one thread of ours (per traced step) blocks in ``work.wait()``, the GIL released, for each
  collective in issue order and marks its end when it returns; one that finishes before an
  earlier one is marked when the earlier one finishes (a process group mostly runs them in
  order). Not ``work.get_future()`` callbacks: a Python callback runs on gloo's worker thread,
  which must then take the GIL (up to the 5 ms switch interval while the model's Python code
  holds it) before it can start the next collective, which slows the traced step itself. While
  a step is traced the switch interval is 0.2 ms, so the waiter gets the GIL soon. On CUDA,
  ``work.get_future()``'s callback records an event: it runs with a current stream that waits
  for the collective, so the event marks its completion on the device. The lane names the
  process group (and the CUDA stream it was issued on).
- memory samples at every compute boundary: saved-activation bytes, the strategy's transient
  buffers (``transient``: a callable, gathered parameters and reductions in flight) and the
  allocator's count; plus the memory ledger's params / grads / optimizer / buffers, which only
  change between phases and are sampled there (``sample_states``: a ledger walk costs 1-5 ms).

Cost (gpt2_mini, 2 CPU ranks, gloo, batch 2 x 128, on a 2-core VM with load average 7-15): the
time spent inside the recorder during a traced step (spans, collectives, samples, activation
bookkeeping; the ``call()`` of each collective excluded) was 14-18 ms for FSDP (36 collectives,
57 spans, 118 samples) and 10-11 ms for DDP, 0.2 % of their 4.5-7.8 s steps; entering and leaving
``trace_step`` (two ledger walks, hooks) 5-20 ms more, outside the examples' step timing. Whole
steps traced against untraced, alternating, medians of 10 pairs: +1.4 % (DDP) and +1.2 % (FSDP,
CPU time) on one rank; on two ranks the machine's load moved single steps by -50 % to +130 %,
more than any recording cost, so no figure finer than that could be read there.

Timestamps are ``Clock`` marks: on CPU ``perf_counter_ns`` (one monotonic clock for every
process of the machine, so ranks line up); on CUDA events on the current stream, turned into
nanoseconds of the host clock by ``finish`` (one ``synchronize``), so a CUDA timeline is the
device's, not the launch times.
"""

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch

ACTIVE: Optional["Recorder"] = None  # [Note: trace recorder]

Mark = Any  # int nanoseconds (CPU) or a torch.cuda.Event (CUDA)


class _Waiter:
    """A thread of ours that waits for CPU works in issue order and marks each end
    ([Note: trace recorder]). One per traced step: starting a thread per collective costs
    milliseconds on a loaded machine (``Thread.start`` waits for the new thread to run)."""

    def __init__(self) -> None:
        self.queue: "queue.SimpleQueue[Optional[tuple]]" = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="trace-waiter", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            work, callback = item
            try:
                work.wait()
            except Exception:  # the caller's own wait reports the failure
                pass
            callback()

    def add(self, work: Any, callback: Callable[[], None]) -> None:
        self.queue.put((work, callback))

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join()


class Clock:
    """Host clock: a mark is ``perf_counter_ns()``."""

    def mark(self) -> Mark:
        return time.perf_counter_ns()

    def finish(self) -> None:
        pass

    def ns(self, mark: Mark) -> int:
        return mark


class CudaClock(Clock):
    """Device clock: a mark is an event on the current stream, resolved after ``finish``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        torch.cuda.synchronize(device)
        self.origin = torch.cuda.Event(enable_timing=True)
        self.origin.record()
        torch.cuda.synchronize(device)
        self.origin_ns = time.perf_counter_ns()  # the origin event has just completed

    def mark(self) -> Mark:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def finish(self) -> None:
        torch.cuda.synchronize(self.device)

    def ns(self, mark: Mark) -> int:
        return self.origin_ns + int(self.origin.elapsed_time(mark) * 1e6)


def clock_for(device: torch.device) -> Clock:
    return CudaClock(device) if torch.device(device).type == "cuda" else Clock()


@dataclass
class _Span:
    name: str
    phase: str
    begin: Optional[Mark]  # None while cut by a collective
    pieces: List[list] = field(default_factory=list)  # [begin, end] marks


class Recorder:
    """Events of one rank while ``ACTIVE`` ([Note: trace recorder]).

    Args:
        device: where the model computes (picks the clock).
        transient: bytes of the strategy's transient buffers now (``{name: bytes}``), or None.
        allocated: bytes the allocator holds now, or None.
    """

    def __init__(
        self,
        device: torch.device,
        transient: Optional[Callable[[], Dict[str, int]]] = None,
        allocated: Optional[Callable[[], Optional[int]]] = None,
    ) -> None:
        self.device = torch.device(device)
        self.clock = clock_for(self.device)
        self.transient = transient
        self.allocated = allocated
        self.step: Optional[int] = None
        self.layer_names: Dict[int, str] = {}  # id(module) -> its name in the model
        self.spans: List[dict] = []  # finished compute spans
        self.comms: List[dict] = []  # collectives (end set on completion)
        self.samples: List[dict] = []  # memory samples
        self.activation_bytes = 0
        self._saved: Dict[int, List[int]] = {}  # storage address -> [references, bytes]
        self._stack: List[_Span] = []  # open compute spans, innermost last
        self._waiter = None if self.device.type == "cuda" else _Waiter()

    # ---------------------------------------------------------------- compute
    def begin(self, name: str, phase: str) -> _Span:
        """Open a compute span (the open one, if any, is cut until this one ends)."""
        now = self.clock.mark()
        if self._stack:
            self._cut(self._stack[-1], now)
        span = _Span(name, phase, now)
        self._stack.append(span)
        self.sample(now)
        return span

    def begin_layer(self, module: Any, phase: str) -> _Span:
        """``begin`` for a layer of the library, named after its place in the model."""
        if phase == "forward" and torch._C._current_graph_task_id() != -1:
            phase = "forward (recompute)"  # gradient checkpointing, inside backward
        name = self.layer_names.get(id(module)) or type(module).__name__
        return self.begin(name, phase)

    def end(self, span: _Span) -> None:
        now = self.clock.mark()
        self._cut(span, now)
        if span in self._stack:  # spans of hooks may end out of order
            self._stack.remove(span)
        for begin, end in span.pieces:
            self.spans.append(dict(name=span.name, phase=span.phase, step=self.step,
                                   begin=begin, end=end))  # fmt: skip
        self.sample(now)
        if self._stack and self._stack[-1].begin is None:
            self._stack[-1].begin = now

    def _cut(self, span: _Span, now: Mark) -> None:
        if span.begin is not None:
            span.pieces.append([span.begin, now])
            span.begin = None

    # ---------------------------------------------------------------- collectives
    def collective(
        self, kind: str, nbytes: int, lane: str, async_op: bool, call: Callable[[], Any]
    ) -> Any:
        """Run ``call`` (the collective) and record it from issue to completion."""
        in_span = bool(self._stack)  # issued from inside a compute span: cut it meanwhile
        event = dict(kind=kind, bytes=nbytes, lane=lane, step=self.step, sync=not async_op,
                     begin=self.clock.mark(), end=None)  # fmt: skip
        if in_span:
            self._cut(self._stack[-1], event["begin"])
        self.comms.append(event)
        result = call()

        def done() -> None:
            event["end"] = self.clock.mark()

        if not async_op or result is None:
            done()
        elif self._waiter is None:  # CUDA: see [Note: trace recorder]
            result.get_future().add_done_callback(lambda _: done())
        else:
            self._waiter.add(result, done)
        if in_span and self._stack[-1].begin is None:
            self._stack[-1].begin = self.clock.mark()
        return result

    # ---------------------------------------------------------------- memory
    def save_activation(self, tensor: torch.Tensor) -> int:
        """A tensor autograd saved; returns its key for ``free_activation``."""
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        entry = self._saved.get(key)
        if entry is None:
            self._saved[key] = entry = [0, storage.nbytes()]
            self.activation_bytes += entry[1]
        entry[0] += 1
        return key

    def free_activation(self, key: int) -> None:
        entry = self._saved.get(key)
        if entry is not None:
            entry[0] -= 1
            if entry[0] == 0:
                del self._saved[key]
                self.activation_bytes -= entry[1]

    def sample(self, now: Optional[Mark] = None, states: Optional[Dict[str, int]] = None) -> None:
        """One memory sample: activations, transient buffers, allocator (and ledger ``states``)."""
        values = {"activations": self.activation_bytes}
        if self.transient is not None:
            values.update(self.transient())
        if self.allocated is not None:
            values["allocated"] = self.allocated()
        if states is not None:
            values.update(states)
        self.samples.append(dict(t=self.clock.mark() if now is None else now, step=self.step,
                                 values=values))  # fmt: skip

    def sample_states(self, states: Dict[str, int]) -> None:
        """A sample carrying the memory ledger's categories ([Note: memory ledger])."""
        self.sample(states=states)

    # ---------------------------------------------------------------- result
    def records(self, rank: int) -> Dict[str, Any]:
        """Everything recorded, marks turned into host nanoseconds: picklable, for rank 0."""
        if self._waiter is not None:  # it has waited for every collective issued
            self._waiter.close()
            self._waiter = None
        deadline = time.monotonic() + 5.0  # a CUDA callback may trail the wait by a hair
        while any(c["end"] is None for c in self.comms) and time.monotonic() < deadline:
            time.sleep(0.001)
        now = self.clock.mark()
        self.clock.finish()
        ns = self.clock.ns
        for c in self.comms:  # still travelling (none in our strategies): ends at the trace's end
            c["completed"] = c["end"] is not None
            c["end"] = now if c["end"] is None else c["end"]
        return dict(
            rank=rank,
            spans=[dict(s, begin=ns(s["begin"]), end=ns(s["end"])) for s in self.spans],
            comms=[dict(c, begin=ns(c["begin"]), end=ns(c["end"])) for c in self.comms],
            samples=[dict(s, t=ns(s["t"])) for s in self.samples],
        )
