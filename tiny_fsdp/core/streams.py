"""Where collectives run: CUDA side streams ordered by events, or (CPU) the calling thread.

[Note: communication streams]
FSDP and ZeRO-3 issue two kinds of collectives: ``GATHER`` (all-gathers / broadcasts that make
parameters full) and ``REDUCE`` (gradient reduce-scatters / reduces). ``CommStreams`` gives them
one verb set, written once for both devices:

- ``issue(kind, launch, async_op)``: run ``launch(async_op)`` (which calls ``comm``) and return
  a ``CommHandle``. On CUDA the collective is issued on the kind's own stream, after that stream
  has waited for the work already queued on the caller's (compute) stream, so it reads finished
  inputs; the side stream then waits for the collective (``work.wait()`` on a CUDA work orders
  the current stream after it, the host does not block) and records an event. On CPU the
  collective runs on the process group's thread (``async_op=True``) or at once.
- ``wait(handle)``: make the caller's stream wait for the event (CUDA, no host synchronisation),
  or the host wait for the work (CPU). After it the outputs can be read and the inputs freed.

Buffer lifetime: every tensor a collective reads or writes is allocated by the caller on the
compute stream and referenced by the caller's pending record until ``wait(handle)`` has run; then
the compute stream is ordered after the collective, so freeing the tensor (which lets the caching
allocator hand its memory to later compute-stream work) is safe. No ``record_stream`` is needed,
and memory is returned exactly when the compute stream is past the collective.

Where every collective stays on one rank (world size 1, an FSDP mesh of one rank per group) each
is the identity, done at once ([Note: collectives on one rank]), so ``streams_for`` gives the
plain behaviour: no side stream, no event.

The CUDA calls go through a small ``backend`` (streams, events, the current stream), so a test can
drive this class on a CPU machine with a fake one; ``streams_for(device)`` picks the real one.
"""

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence, Union

import torch
import torch.distributed as dist

GATHER = "gather"
REDUCE = "reduce"
KINDS = (GATHER, REDUCE)

Launch = Callable[[bool], Union[None, dist.Work, Sequence[Optional[dist.Work]]]]


@dataclass
class CommHandle:
    """One issued collective (or several issued together): what ``wait`` needs."""

    works: List[Any] = field(default_factory=list)  # CPU: works to wait for on the host
    event: Any = None  # CUDA: recorded on the side stream after the collective


def _works(result: Union[None, Any, Sequence[Any]]) -> List[Any]:
    if result is None:
        return []
    if isinstance(result, (list, tuple)):
        return [w for w in result if w is not None]
    return [result]


class CommStreams:
    """CPU behaviour: no streams; ``wait`` blocks the host until the work is done."""

    uses_streams = False

    def issue(self, kind: str, launch: Launch, async_op: bool) -> CommHandle:
        return CommHandle(works=_works(launch(async_op)))

    def wait(self, handle: CommHandle) -> None:
        for work in handle.works:
            work.wait()
        handle.works = []

    def is_done(self, handle: CommHandle) -> bool:
        """Whether ``wait(handle)`` would return at once (never blocks)."""
        return all(work.is_completed() for work in handle.works)


class CudaBackend:
    """The CUDA calls ``CudaStreams`` makes; a test substitutes a fake with the same methods."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def new_stream(self) -> Any:
        return torch.cuda.Stream(self.device)

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream)


class CudaStreams(CommStreams):
    """One side stream per kind, ordered with the compute stream by events.

    See [Note: communication streams]."""

    uses_streams = True

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.streams = {kind: backend.new_stream() for kind in KINDS}

    def issue(self, kind: str, launch: Launch, async_op: bool) -> CommHandle:
        side = self.streams[kind]
        side.wait_stream(self.backend.current_stream())  # inputs were written on compute
        with self.backend.use_stream(side):
            for work in _works(launch(True)):
                work.wait()  # the side stream waits for the collective; the host does not
            return CommHandle(event=side.record_event())

    def wait(self, handle: CommHandle) -> None:
        if handle.event is not None:
            self.backend.current_stream().wait_event(handle.event)
            handle.event = None

    def is_done(self, handle: CommHandle) -> bool:
        return handle.event is None or bool(handle.event.query())


def streams_for(device: torch.device, communicates: bool = True) -> CommStreams:
    """``CudaStreams`` on a CUDA device whose collectives reach other ranks; the plain (CPU)
    behaviour anywhere else, and where every group has one rank (each collective is then done at
    once, [Note: collectives on one rank]: nothing to overlap, and a side stream's events and
    switches cost host time, about 0.2 ms per collective on an H200 host)."""
    if communicates and torch.device(device).type == "cuda":
        return CudaStreams(CudaBackend(torch.device(device)))
    return CommStreams()
