"""State shared by the gather units of one FSDP model: the common ``UnitState`` plus gathered bytes.

The order of units, the prefetch of the next ones and which unit stays full after forward are
the shared ``Prefetcher``'s ([Note: prefetch]); switches, dtypes and reductions the shared
``UnitState``'s; FSDP adds the reduce-scatter launch and the gathered-bytes counters.
"""

from typing import Any, Sequence

import torch

from tiny_fsdp.core import comm
from tiny_fsdp.core.reductions import Part
from tiny_fsdp.core.unit_state import UnitState


class FSDPState(UnitState):
    """Switches and bookkeeping of one FSDP model; the units and handlers read and update it."""

    def __init__(
        self,
        world_size: int,
        rank: int,
        reshard_after_forward: bool = True,
        prefetch_limit: int = 1,
    ) -> None:
        super().__init__(world_size, rank, prefetch_limit)
        self.reshard_after_forward = reshard_after_forward
        # Bytes of gathered full parameters alive now / at most since the last reset.
        self.gathered_bytes = 0
        self.peak_gathered_bytes = 0

    def launch_reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, parts: Sequence[Part]
    ) -> None:
        """Reduce-scatter ``input`` (world * k,) into ``output`` (k,); ``parts`` go to ``.grad``
        at the end of the backward ([Note: asynchronous reduction])."""

        def launch(async_op: bool) -> Any:
            return comm.reduce_scatter(output, input, async_op=async_op)

        self.reductions.launch(launch, (input, output), parts, self.async_comm)

    def track_gathered(self, nbytes: int) -> None:
        self.gathered_bytes += nbytes
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)
