"""State shared by the gather units of one FSDP model: switches, prefetch, byte counters.

The order of units, the prefetch of the next ones and which unit stays full after forward are
the shared ``Prefetcher``'s ([Note: prefetch]); the state adds the switches and byte counters.
"""

from typing import Any, List, Optional, Sequence

import torch

from tiny_fsdp.core import comm
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
    ) -> None:
        super().__init__(prefetch_limit)
        self.world_size = world_size
        self.rank = rank
        self.reshard_after_forward = reshard_after_forward
        self.require_grad_sync = True
        self.policy: Optional[MixedPrecisionPolicy] = None  # set by FSDP(mixed_precision=...)
        self.units: List[Any] = []  # every GatherUnit of the model
        self.unit_grads: List[Any] = []  # every unit's UnitGradients, in the same order
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

    def launch_reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, parts: Sequence[Part]
    ) -> None:
        """Reduce-scatter ``input`` (world * k,) into ``output`` (k,); ``parts`` go to ``.grad``
        at the end of the backward ([Note: asynchronous reduction])."""

        def launch(async_op: bool) -> Any:
            return comm.reduce_scatter(output, input, async_op=async_op)

        self.reductions.launch(launch, (input, output), parts, self.async_comm)

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
        for grads in self.unit_grads:
            grads.drop_unfinished()
        self.drop_transients()
        super().pre_forward(prefetch, grad_enabled)

    def drop_transients(self) -> None:
        """Discard unconsumed prefetches and reshard units kept full from an earlier pass."""
        self.drain()
        for unit in self.units:
            unit.reshard()
