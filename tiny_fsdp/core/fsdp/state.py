"""State shared by the gather units of one FSDP model: switches, prefetch, byte counters.

The order of units and the prefetch of the next ones are the shared ``Prefetcher``'s ([Note:
prefetch]); what FSDP adds is which unit stays full after forward. The unit that comes first in
backward is not resharded after a forward with grad enabled: its backward follows at once, so
resharding it would only mean gathering it again (FSDP2 does the same for its root). With
``reshard_after_forward=False`` no unit is resharded until its backward.

``world_size`` / ``rank`` are those of the shard group, the ranks one copy of the shards is
spread over (every rank in plain FSDP); under HSDP gradients are averaged over all
``grad_divisor`` ranks and the reduced shards all-reduced across the replicas ([Note: hybrid
sharding]).
"""

from typing import Any, List, Optional, Sequence

import torch

from tiny_fsdp.core import comm
from tiny_fsdp.core.fsdp.mesh import MeshGroups
from tiny_fsdp.core.module.handler import TrainingPhase
from tiny_fsdp.core.precision import MixedPrecisionPolicy
from tiny_fsdp.core.prefetch import Prefetcher
from tiny_fsdp.core.reductions import Part, PendingReductions
from tiny_fsdp.core.streams import CommStreams


class FSDPState(Prefetcher):
    """Switches and bookkeeping of one FSDP model; the units and handlers read and update it."""

    def __init__(
        self,
        world_size: int,
        rank: int,
        reshard_after_forward: bool = True,
        prefetch_limit: int = 1,
        groups: Optional[MeshGroups] = None,
    ) -> None:
        super().__init__(prefetch_limit)
        self.groups = groups or MeshGroups(None, world_size, rank, None, 1, 0)
        if (self.groups.shard_size, self.groups.shard_rank) != (world_size, rank):
            raise ValueError(
                f"FSDPState: world_size={world_size}, rank={rank} but the shard group has "
                f"{self.groups.shard_size} ranks and this is its rank {self.groups.shard_rank}"
            )
        self.world_size = world_size  # of the shard group
        self.rank = rank  # in the shard group
        self.reshard_after_forward = reshard_after_forward
        self.require_grad_sync = True
        self.policy: Optional[MixedPrecisionPolicy] = None  # set by FSDP(mixed_precision=...)
        self.units: List[Any] = []  # every GatherUnit of the model
        self.streams = CommStreams()  # replaced by ``use_streams`` once the device is known
        self.reductions = PendingReductions(self.streams)  # [Note: asynchronous reduction]
        # Bytes of gathered full parameters alive now / at most since the last reset, and of
        # no_sync gradient accumulation buffers.
        self.gathered_bytes = 0
        self.peak_gathered_bytes = 0
        self.accumulated_bytes = 0

    def use_streams(self, streams: CommStreams) -> None:
        """Issue gathers and reductions through ``streams`` ([Note: communication streams])."""
        self.streams = streams
        self.reductions.streams = streams

    @property
    def grad_divisor(self) -> int:
        """Ranks a gradient is averaged over: the whole world, replicas included."""
        return self.groups.world_size

    def launch_reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, parts: Sequence[Part]
    ) -> None:
        """Reduce-scatter ``input`` (world * k,) into ``output`` (k,) in the shard group, then
        (HSDP) all-reduce ``output`` across the replicas; ``parts`` go to ``.grad`` at the end
        of the backward ([Note: asynchronous reduction], [Note: hybrid sharding])."""
        groups = self.groups

        def launch(async_op: bool) -> Any:
            return comm.reduce_scatter(
                output, input, group=groups.shard_group, async_op=async_op, label=groups.shard_label
            )

        def across_replicas(async_op: bool) -> Any:
            return comm.all_reduce(
                output, group=groups.replicate_group, async_op=async_op, label="replicate"
            )

        then = None if groups.replicate_group is None else across_replicas
        self.reductions.launch(launch, (input, output), parts, self.async_comm, then=then)

    # ---------------------------------------------------------------- mixed precision
    def gather_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """dtype in which shards of ``dtype`` are all-gathered (and layers compute)."""
        return dtype if self.policy is None else self.policy.param_dtype

    def reduce_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """dtype in which gradients of parameters of ``dtype`` are reduce-scattered."""
        return dtype if self.policy is None else self.policy.reduce_dtype

    # ---------------------------------------------------------------- memory counters
    def track_gathered(self, nbytes: int) -> None:
        self.gathered_bytes += nbytes
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)

    def track_accumulated(self, nbytes: int) -> None:
        self.accumulated_bytes += nbytes

    # ---------------------------------------------------------------- passes
    def pre_forward(self, prefetch: bool, grad_enabled: bool) -> None:
        """A wrapper forward starts: check the last backward, start from resharded units."""
        self.reductions.abandon()  # only a backward that raised leaves any
        for unit in self.units:
            unit.tied.check_complete()
        self.drop_transients()
        super().pre_forward(prefetch, grad_enabled)

    def keeps_after_forward(self, unit: Any) -> bool:
        """Whether ``unit`` stays full after a forward fetch is released."""
        if not self._grad_forward:
            return False
        backward = self.orders.get(TrainingPhase.BACKWARD)
        first_in_backward = bool(backward) and unit is backward[0]
        return first_in_backward or not self.reshard_after_forward

    def drop_transients(self) -> None:
        """Discard unconsumed prefetches and reshard units kept full from an earlier pass."""
        self.drain()
        for unit in self.units:
            unit.reshard()
