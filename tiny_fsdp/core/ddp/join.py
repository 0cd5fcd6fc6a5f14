"""Uneven inputs under DDP: torch's join context, ``with model.join(): ...``.

[Note: DDP join]
Ranks with different numbers of batches would wait for each other forever at the first
collective of a rank whose data ran out. Inside ``model.join()`` (torch's ``Join`` context with
DDP as its ``Joinable``, so ``Join([model, ...])`` works too) such a rank *joins*: at the end of
the ``with`` block it keeps issuing the collectives of the others' iterations, contributing
nothing, until every rank has joined. One iteration is one forward and one backward (as with
torch's DDP; a second forward before the backward would be read as another iteration).

An active rank's forward, per iteration:
1. ``Join.notify_join_context``: an all-reduce that tells the joined ranks one more iteration
   runs (they count the ranks still active);
2. one all-reduce (SUM) of ``[backward synchronises, buffers are broadcast, one-hot of the
   rank]``: every rank learns whether this iteration's backward reduces gradients (``no_sync``,
   ``torch.no_grad()`` forwards do not), whether the buffers are broadcast, and which ranks are
   active;
3. the buffers are broadcast from the highest active rank (rank 0 may have joined);
and its backward reduces the buckets as always. A joined rank's ``main_hook`` issues 2 and 3,
then, if the iteration synchronises, the end of a backward in which no gradient arrived: every
bucket (sparse reductions and a communication hook's collectives included) in launch order,
with zero gradients and zero flags (``BucketedBackward.reduce_without_gradients``).

Gradients are divided by the world size, so a joined rank counts as a zero gradient
(``divide_by_initial_world_size=True``, torch's default), or by the number of active ranks
(False: the average over the ranks that had data; not with a communication hook, which divides
by itself). After every rank has joined, the parameters and buffers of the highest rank among
the last to join are broadcast (``post_hook``): a joined rank did not step, its replica is
stale. Its optimizer state stays stale, as under torch's DDP.
"""

import warnings
from typing import TYPE_CHECKING, List, Tuple

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, JoinHook

from tiny_fsdp.core import comm
from tiny_fsdp.core.replicated import broadcast_module_buffers

if TYPE_CHECKING:
    from tiny_fsdp.core.ddp.ddp import DDP


class JoinContext(Join):
    """torch's ``Join``, leaving the global warnings filters as it found them (torch's sets
    ``simplefilter("once")`` for the whole process when a rank joins)."""

    def __exit__(self, *exc: object) -> None:  # type: ignore[override]
        with warnings.catch_warnings():
            super().__exit__(*exc)  # type: ignore[arg-type]


def agree(device: torch.device, rank_counts: bool, *flags: bool) -> Tuple[List[bool], List[int]]:
    """One all-reduce (SUM) over every rank of ``flags`` and a one-hot of this rank (only where
    ``rank_counts``): which flags some rank set, and the ranks that counted themselves."""
    world = dist.get_world_size()
    votes = torch.zeros(len(flags) + world, dtype=torch.int32, device=device)
    votes[: len(flags)] = torch.tensor(flags, dtype=torch.int32)
    if rank_counts:
        votes[len(flags) + dist.get_rank()] = 1
    comm.all_reduce(votes)
    total = votes.tolist()
    return [v > 0 for v in total[: len(flags)]], [r for r in range(world) if total[len(flags) + r]]


class DDPJoinHook(JoinHook):
    """What a rank does for ``ddp`` once it has joined ([Note: DDP join])."""

    def __init__(self, ddp: "DDP", divide_by_initial_world_size: bool) -> None:
        self.ddp = ddp
        self.divide_by_initial_world_size = divide_by_initial_world_size

    def begin_iteration(self) -> None:
        """An active rank's forward starts an iteration: steps 1 to 3 of the Note, but the
        broadcast, which the forward does from ``ddp.buffer_source``."""
        work = Join.notify_join_context(self.ddp)
        if work is not None:
            work.wait()
        ddp = self.ddp
        _, active = agree(ddp.join_device, True, ddp.backward_synchronises(), ddp.buffers_due)
        ddp.buffer_source = active[-1]
        divisor = dist.get_world_size() if self.divide_by_initial_world_size else len(active)
        ddp.set_gradient_divisor(divisor)

    def main_hook(self) -> None:
        """A joined rank shadows one iteration of the active ranks."""
        ddp = self.ddp
        (synchronises, broadcast), active = agree(ddp.join_device, False, False, False)
        if broadcast:
            broadcast_module_buffers(ddp.module, src=active[-1])
        if synchronises:
            ddp.reduce_without_gradients()

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank takes the model of the highest rank among the last to join."""
        _, last = agree(self.ddp.join_device, is_last_joiner)
        self.ddp.sync_module_states(src=last[-1])
        self.ddp.buffer_source = 0
        self.ddp.set_gradient_divisor(dist.get_world_size())
