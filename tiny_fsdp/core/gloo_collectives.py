"""All-gather, reduce-scatter and reduce on gloo, built from broadcasts and point-to-point sends.

[Note: collectives on gloo]
On gloo (CPU), ``all_gather_into_tensor``, ``reduce_scatter_tensor`` and ``reduce`` are slow next
to gloo's own broadcast and to point-to-point sends. Measured on the 2-core development machine
(torch.distributed calls timed alone, median of 11, load ~1), 2 ranks, 51.8 MB input:
all-gather 52-77 ms against 22-25 ms for two broadcasts; reduce-scatter 80 ms, two reduces
54-58 ms, one send and one receive 30 ms (12.6 MB: two reduces 11.7 ms, a send and a receive
6.4). A reduce to one rank costs gloo about what an all-reduce does (2 ranks, 51 MB, median
of 7, load ~1: reduce 54 ms, of which 40 ms of CPU in the receiving process, against 21-24 ms
and 14-16 ms for one send and its receive). So on a gloo group ``comm.all_gather`` /
``comm.reduce_scatter`` / ``comm.reduce`` run as:

- all-gather of ``input`` (k,) into ``output`` (N * k,): copy ``input`` into chunk ``rank`` of
  ``output`` (no copy when ``input`` is that chunk: an in-place all-gather, as FSDP's units
  issue it), then broadcast chunk r from rank r, for every r, all issued asynchronously;
- reduce-scatter (a SUM) of ``input`` (2 * k,) into ``output`` (k,) on 2 ranks: send the other
  rank its chunk and receive its chunk ``rank`` straight into ``output`` when ``output`` is a
  tensor of its own (FSDP's unit reductions, ZeRO-2's buckets), both issued asynchronously;
  once both are done, add this rank's chunk: c_0 + c_1 (floating-point addition commutes: the
  same bits on either rank), no buffer besides. In place (``output`` is chunk ``rank`` of
  ``input``: ZeRO-1's buckets) the other rank's chunk is received into a buffer of its own, of
  ``output``'s size (``comm.reduce_scatter_receive_bytes``; ZeRO-1's store counts it), and added
  into ``output``: the same bits. Gloo says a send or receive is done only once it is waited
  for, so such a reduce-scatter counts as in flight until then ([Note: asynchronous reduction]
  retires it when its in-flight limit or the end of the backward waits for it);
- any other reduce-scatter (N > 2 ranks, where receiving N - 1 chunks at once would need N - 2
  more buffers and training steps measured no faster on the development machine's 4 ranks;
  another ``op``): reduce chunk r of ``input`` to
  rank r, for every r, all issued asynchronously; once they are done, copy chunk ``rank`` into
  ``output`` (no copy when ``output`` is that chunk). ``input`` is scratch afterwards (a reduce
  may leave partial sums in a chunk it does not deliver to this rank);
- reduce (a SUM) of ``tensor`` to rank ``dst`` on 2 ranks (ZeRO-3's unit reductions): the other
  rank sends its ``tensor``; ``dst`` receives it into ``output``, a tensor of its own, and adds
  its ``tensor`` once the receive is done (in place, ``output`` being ``tensor`` or not given,
  it receives into a new buffer, not one the block cache keeps for later, and adds that into
  ``tensor``: a checkpoint's or the planner's occasional reduce leaves no block behind). ZeRO-3
  passes an ``output`` where ``comm.reduces_into_output`` says so, so its byte ledger counts
  the receive buffer ([Note: asynchronous reduction]). Any other reduce is gloo's. ZeRO-3's
  steps against the same steps with gloo's reduce, alternating in one run, 2 ranks, load
  2.0-2.1: on gpt2_mini (12 rounds) a process's CPU time per step went from 1,706 to 1,658 ms
  and the step from 0.88 to 0.85 x FSDP2's; on an HF Llama of 12 layers of width 768 (3
  rounds, batch 2 x 256) from 5,613 to 5,131 ms and from 1.075 to 1.028 x our DDP's.

The result is the same collective: the same elements summed, the same bytes on the ledger,
which counts the logical all-gather or reduce-scatter once ([Note: communication ledger]). The
returned ``GlooWorks`` waits for all of the rank's works and then does the sum or copy; every
caller waits before it reads ``output`` (the asynchronous reductions, [Note: asynchronous
reduction], and the streams' ``wait``). The sends carry a tag of their own (``P2P_TAG``), and
gloo matches the messages between two ranks in the order they were sent, so reduce-scatters and
reduces in flight at once pair up in issue order, as collectives do. NCCL and other backends use
their own all-gather, reduce-scatter and reduce; gloo has them too, and
``tests/test_backend_collectives.py`` trains every strategy with them on gloo (the calls a
multi-GPU NCCL run makes).

CUDA tensors on gloo (several ranks sharing one GPU, where NCCL refuses two ranks on a device):
gloo has an all-reduce, a broadcast and an all-gather for them but no reduce and no
reduce-scatter. Those two run as one all-reduce of the whole input (``input`` is scratch
afterwards, every rank holds the sum; a reduce-scatter then copies the rank's own chunk into
``output``): the same sums, N times the traffic of a reduce-scatter; the ledger still counts the
logical collective. A testing and small-scale path, not a fast one. ``reduce`` and
``reduce_scatter`` here take every gloo reduction, CPU or CUDA (``is_gloo``).
"""

import functools
import threading
from datetime import timedelta
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist

from tiny_fsdp.core.utils import huge_pages
from tiny_fsdp.core.utils.dist import get_collective_timeout

P2P_TAG = 0x7D5F  # the sends of a reduce-scatter or a reduce ([Note: collectives on gloo])


class GlooWorks:
    """The works of one all-gather / reduce-scatter built from several operations.

    Each work is waited for once: a second ``wait`` on a gloo send or receive waits for another
    message, which never comes. ``is_completed`` is False until then: gloo's sends and receives
    say they are done only once waited for. ``timeout``: how long a send or receive may wait,
    the group's collective timeout when issued (theirs is otherwise the one the group was made
    with, which ``set_collective_timeout`` does not change).
    """

    def __init__(
        self,
        works: List[Any],
        finish: Optional[Callable[[], None]] = None,
        timeout: Optional[timedelta] = None,
    ) -> None:
        self.works = works
        self._finish = finish  # run once, when every work is done (a sum, a copy)
        self._timeout = timeout
        self._lock = threading.Lock()  # a traced step's waiter thread may wait too
        self._done = False
        self._error: Optional[BaseException] = None

    def is_completed(self) -> bool:
        return self._done or all(work.is_completed() for work in list(self.works))

    def get_future(self) -> torch.futures.Future:
        """A future that completes when the operations have; the sum or copy that ``wait`` then
        runs is not in it, so it tells when the communication ended, not that ``output`` holds
        the result (the trace's use: [Note: trace recorder]). One operation (every reduction of
        CUDA tensors: one all-reduce) gives its own future, whose callbacks run on streams that
        wait for it. Gloo's sends and receives have none: ``RuntimeError``, as theirs."""
        futures = [work.get_future() for work in self.works]
        if len(futures) == 1:
            return futures[0]
        return torch.futures.collect_all(futures)

    def wait(self) -> bool:
        with self._lock:
            if self._error is not None:
                raise self._error
            if not self._done:
                try:
                    while self.works:
                        work = self.works.pop(0)
                        if self._timeout is None:
                            work.wait()
                        else:
                            work.wait(self._timeout)
                    if self._finish is not None:
                        self._finish()
                except BaseException as error:
                    self._error = error
                    raise
                self._finish, self._done = None, True
        return True


def uses_gloo(tensor: torch.Tensor, group: Optional[dist.ProcessGroup]) -> bool:
    """Whether ``group`` is a gloo group and ``tensor`` on the CPU ([Note: collectives on gloo])."""
    return tensor.device.type == "cpu" and dist.get_backend(group) == "gloo"


def is_gloo(group: Optional[dist.ProcessGroup]) -> bool:
    """Whether ``group`` is a gloo group: its reduce / reduce-scatter go through this module."""
    return dist.get_backend(group) == "gloo"


def pairs(tensor: torch.Tensor, group: Optional[dist.ProcessGroup]) -> bool:
    """Whether a SUM ``reduce`` (or a reduce-scatter into a tensor of its own) of ``tensor`` on
    ``group`` is one send and one receive: 2 ranks, CPU ([Note: collectives on gloo])."""
    return tensor.device.type == "cpu" and dist.get_world_size(group) == 2


def output_apart(output: Optional[torch.Tensor], tensor: torch.Tensor) -> bool:
    """Whether a reduce's ``output`` is given and is not ``tensor`` itself (in place)."""
    return output is not None and output.data_ptr() != tensor.data_ptr()


def reduce(
    tensor: torch.Tensor,
    dst: int,
    op: dist.ReduceOp,
    group: Optional[dist.ProcessGroup],
    async_op: bool,
    output: Optional[torch.Tensor] = None,
) -> Any:
    """``output`` (default: ``tensor``) on global rank ``dst`` <- the reduction of every rank's
    ``tensor``; on 2 CPU ranks, a SUM by a send and a receive, else gloo's reduce (of a CUDA
    tensor, which gloo cannot reduce, an all-reduce: every rank gets the reduction)."""
    if op == dist.ReduceOp.SUM and pairs(tensor, group):
        return _finish(_sum_to_pair(tensor, dst, output, group), async_op)
    copy = None
    if output_apart(output, tensor) and dist.get_rank() == dst:
        copy = functools.partial(output.copy_, tensor)
    if tensor.device.type != "cuda":
        works = [dist.reduce(tensor, dst=dst, op=op, group=group, async_op=True)]
    else:
        works = [dist.all_reduce(tensor, op=op, group=group, async_op=True)]
    return _finish(GlooWorks(works, copy), async_op)


def all_gather(
    output: torch.Tensor, input: torch.Tensor, group: Optional[dist.ProcessGroup], async_op: bool
) -> Optional[GlooWorks]:
    """``output`` (N * k,) <- every rank's ``input`` (k,), by N broadcasts."""
    n, rank, k = dist.get_world_size(group), dist.get_rank(group), input.numel()
    chunks = output.view(n, k)
    if chunks[rank].data_ptr() != input.data_ptr():  # else in place: input is that chunk
        chunks[rank].copy_(input)
    works = [
        dist.broadcast(chunks[r], src=_global(group, r), group=group, async_op=True)
        for r in range(n)
    ]
    return _finish(GlooWorks(works), async_op)


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    op: dist.ReduceOp,
    group: Optional[dist.ProcessGroup],
    async_op: bool,
) -> Optional[GlooWorks]:
    """``output`` (k,) <- chunk ``rank`` of the reduction of every rank's ``input`` (N * k,):
    on 2 ranks a SUM by a send and a receive, else by N reduces (CUDA: one all-reduce);
    ``input`` is scratch afterwards."""
    n, rank, k = dist.get_world_size(group), dist.get_rank(group), output.numel()
    chunks = input.view(n, k)
    own = chunks[rank]
    in_place = own.data_ptr() == output.data_ptr()
    apart = output.untyped_storage().data_ptr() != input.untyped_storage().data_ptr()
    if (apart or in_place) and op == dist.ReduceOp.SUM and pairs(input, group):
        return _finish(_sum_scatter_pair(output, chunks, group, in_place), async_op)
    if input.device.type == "cuda":  # gloo has no CUDA reduce
        works = [dist.all_reduce(input, op=op, group=group, async_op=True)]
    else:
        works = [
            dist.reduce(chunks[r], dst=_global(group, r), op=op, group=group, async_op=True)
            for r in range(n)
        ]
    copy = None if in_place else functools.partial(output.copy_, own)
    return _finish(GlooWorks(works, copy), async_op)


def _sum_scatter_pair(
    output: torch.Tensor,
    chunks: torch.Tensor,
    group: Optional[dist.ProcessGroup],
    in_place: bool,
) -> GlooWorks:
    """Two ranks: the other rank's chunk of ``chunks`` (2, k) sent to it, its chunk ``rank``
    received into ``output``, then this rank's added; ``in_place`` (``output`` is this rank's
    chunk), the other's is received into a buffer of its own and added to it ([Note:
    collectives on gloo])."""
    rank = dist.get_rank(group)
    peer = _global(group, 1 - rank)
    own = chunks[rank]
    if in_place:
        into = huge_pages.empty(output.shape, output.dtype, output.device)
        finish = functools.partial(output.add_, into)
    else:
        into, finish = output, functools.partial(output.add_, own)
    works = [
        dist.irecv(into, src=peer, group=group, tag=P2P_TAG),
        dist.isend(chunks[1 - rank], dst=peer, group=group, tag=P2P_TAG),
    ]
    return GlooWorks(works, finish, _timeout(group))


def _sum_to_pair(
    tensor: torch.Tensor,
    dst: int,
    output: Optional[torch.Tensor],
    group: Optional[dist.ProcessGroup],
) -> GlooWorks:
    """Two ranks: the other rank sends its ``tensor`` to ``dst``, which receives it into
    ``output`` and adds its own (in place: into a buffer of its own first, then added into
    ``tensor``) ([Note: collectives on gloo])."""
    peer = _global(group, 1 - dist.get_rank(group))
    if dist.get_rank() != dst:
        works = [dist.isend(tensor, dst=peer, group=group, tag=P2P_TAG)]
        return GlooWorks(works, None, _timeout(group))
    if not output_apart(output, tensor):
        into = huge_pages.empty(tensor.shape, tensor.dtype, tensor.device, reuse=False)
        finish = functools.partial(tensor.add_, into)
    else:
        into, finish = output, functools.partial(output.add_, tensor)
    works = [dist.irecv(into, src=peer, group=group, tag=P2P_TAG)]
    return GlooWorks(works, finish, _timeout(group))


def _timeout(group: Optional[dist.ProcessGroup]) -> Optional[timedelta]:
    timeout_s = get_collective_timeout(group)
    return None if timeout_s is None else timedelta(seconds=timeout_s)


def _global(group: Optional[dist.ProcessGroup], rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _finish(works: GlooWorks, async_op: bool) -> Optional[GlooWorks]:
    if async_op:
        return works
    works.wait()
    return None
