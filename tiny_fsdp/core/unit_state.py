"""State shared by the units of one FSDP or ZeRO-3 model: switches, streams, reductions, dtypes.

Both strategies' per-model state (``FSDPState``, ``Zero3Runtime``) is a ``UnitState``: the
model's ``Prefetcher`` ([Note: prefetch]) plus what every unit and ``UnitGradients`` read
([Note: unit reduction]): world size and rank, the gradient-sync switch, the mixed precision
policy's dtypes, the communication streams ([Note: communication streams]), the pending
reductions ([Note: asynchronous reduction]) with the agreement on overflow that ends them
([Note: agreeing on overflow]), the watch on local gradients ([Note: parameters in the loss])
and the bytes of ``no_sync`` sums.
"""

from typing import List, Optional

import torch
import torch.distributed as dist

from tiny_fsdp.core.loss_reads import LocalGradWatch
from tiny_fsdp.core.overflow import agree_on_overflow
from tiny_fsdp.core.precision import MixedPrecisionPolicy
from tiny_fsdp.core.prefetch import Prefetcher
from tiny_fsdp.core.reductions import PendingReductions
from tiny_fsdp.core.streams import CommStreams


class UnitState(Prefetcher):
    """The switches and bookkeeping the units and their gradients share."""

    def __init__(
        self,
        world_size: int,
        rank: int,
        prefetch_limit: int,
        policy: Optional[MixedPrecisionPolicy] = None,
    ) -> None:
        super().__init__(prefetch_limit)
        self.world_size = world_size
        self.rank = rank
        self.policy = policy
        self.require_grad_sync = True  # the wrapper's switch (no_sync)
        self.unit_grads: List = []  # every unit's UnitGradients, in the order of ``units``
        self.streams = CommStreams()  # replaced by ``use_streams`` once the device is known
        self.reductions = PendingReductions(self.streams)
        self.reductions.on_finalized = self.backward_finished
        self.accumulated_bytes = 0  # of gradient sums kept across no_sync backwards
        self.grad_watch: Optional[LocalGradWatch] = None  # set by the wrapper
        self._out_of_step: List["_OnHost"] = []  # agreements not read yet, oldest first

    @property
    def grad_divisor(self) -> int:
        """Ranks a gradient is averaged over (HSDP: more than ``world_size``)."""
        return self.world_size

    @property
    def shard_group(self) -> Optional[dist.ProcessGroup]:
        """The ranks this model's gradient shards are spread over (None: the default group)."""
        return None

    @property
    def shard_label(self) -> Optional[str]:
        """Ledger label of the shard group's collectives ([Note: communication ledger])."""
        return None

    def backward_finished(self, grads: List[torch.Tensor], device: Optional[torch.device]) -> None:
        """The reductions' finalize is done (``grads``: the gradients it delivered into;
        ``device``: None after a no_sync backward). Reshard every unit left full: one holding
        layers that never ran backward (frozen ones fed no gradient, a frozen teacher run under
        no_grad) would stay full until the next forward ([Note: full units]). After a
        synchronised backward, a gradient that is not finite on one rank makes every rank's
        non-finite ([Note: agreeing on overflow])."""
        self.drop_transients()
        if device is not None and self.world_size > 1:
            out_of_step = agree_on_overflow(
                grads, device, self.shard_group, self.shard_label, unshard_order=self.unshard_order
            )
            self._out_of_step.append(_OnHost(out_of_step))
            if device.type == "cpu":  # on the host already: raise from this backward
                self.check_in_step()
        if self.grad_watch is not None:  # after the last write: [Note: parameters in the loss]
            self.grad_watch.note_grads()

    def check_in_step(self) -> None:
        """Raise if an agreement found the ranks out of step ([Note: ranks out of step]): on the
        CPU at the end of that backward; on an accelerator, whose flag is copied to the host
        without waiting, at the next forward (by then the copy is normally done), so every rank
        raises at the same call. The order starts again, so a run that catches it can go on."""
        pending, self._out_of_step = self._out_of_step, []
        if any(flag.value() for flag in pending):
            self.unshard_order = 0
            raise RuntimeError(_OUT_OF_STEP)

    def use_streams(self, streams: CommStreams) -> None:
        """Issue unshards and reductions through ``streams``."""
        self.streams = streams
        self.reductions.streams = streams

    def gather_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """dtype in which parameters of ``dtype`` are unsharded (and layers compute)."""
        return dtype if self.policy is None else self.policy.param_dtype

    def reduce_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """dtype in which gradients of parameters of ``dtype`` are reduced."""
        return dtype if self.policy is None else self.policy.reduce_dtype

    def track_accumulated(self, nbytes: int) -> None:
        self.accumulated_bytes += nbytes

    def pre_forward(self, prefetch: bool, grad_enabled: bool) -> None:
        """A wrapper forward starts: drop what a backward that raised left, start resharded."""
        self.check_in_step()
        self.reductions.abandon()  # only a backward that raised leaves any
        for grads in self.unit_grads:
            grads.drop_unfinished()
        self.drop_transients()
        super().pre_forward(prefetch, grad_enabled)


_OUT_OF_STEP = (
    "the ranks did not unshard the same units in the same order ([Note: ranks out of step]): "
    "some rank skipped or added a layer the others ran (a LayerDrop whose draws differ per "
    "rank, a branch on this rank's data), so their collectives paired across different layers "
    "and this step's gradients were wrong; they were made NaN. Under FSDP and ZeRO-3 every rank "
    "must run the same modules in the same order: draw such choices from a generator seeded "
    "alike on every rank, or run the layer on every rank and drop its output where it is skipped."
)


class _OnHost:
    """A 0-dim bool tensor on its way to the host: copied without waiting on an accelerator."""

    def __init__(self, flag: torch.Tensor) -> None:
        self._event = None
        if flag.device.type == "cpu":
            self._host = flag
        else:
            self._host = torch.empty((), dtype=torch.bool, pin_memory=True)
            self._host.copy_(flag, non_blocking=True)
            self._event = torch.Event(flag.device.type)
            self._event.record()

    def value(self) -> bool:
        """The flag, once the copy is done (waiting for it if need be)."""
        if self._event is not None:
            self._event.synchronize()
        return bool(self._host)
