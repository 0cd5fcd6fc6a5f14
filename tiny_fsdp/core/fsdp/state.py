"""State shared by the gather units of one FSDP model: switches, unit order, prefetch, bytes.

[Note: FSDP prefetch]
The first forward through the wrapper records the order in which units are fetched. The
forward order lists units by first fetch; the backward order by last fetch, reversed (backward
visits layers in reverse, so a unit is first needed at its last forward use). Afterwards, with
``enable_async_communication``, the first fetch of unit i in a pass issues the all-gathers of
the units that follow it in that pass's order asynchronously, at most ``prefetch_limit`` of
them unconsumed at any time, so that they travel while unit i computes; a later fetch of such
a unit waits on its pending gather instead of issuing one. Every rank makes the same decisions
from the same order, so the collectives stay matched. Rules that keep results identical with
prefetch on and off:

- A pending gather is only consumed within the pass that issued it: the next forward first
  waits for and drops whatever is left (e.g. a unit whose backward never ran), because the
  optimizer step may have changed the shards since.
- Forward prefetch only happens inside the wrapper's forward: a gradient-checkpointing
  recomputation runs forward fetches during backward, and prefetching "the next unit" there
  would gather a unit whose backward is already done.
- The position in the order is searched forward from the last position, so a unit that is
  skipped (no backward) or repeated does not derail the pass, and one that runs out of order
  just gets no prefetch.

The unit that comes first in backward is not freed after a forward with grad enabled: its
backward follows at once, so freeing it would only mean gathering it again (FSDP2 does the same
for its root).
"""

from typing import Any, Dict, List, Optional

import torch

from tiny_fsdp.core.precision import MixedPrecisionPolicy


class FSDPState:
    """Switches and bookkeeping of one FSDP model; the units and handlers read and update it."""

    def __init__(
        self,
        world_size: int,
        rank: int,
        reshard_after_forward: bool = True,
        enable_async: bool = False,
        prefetch_limit: int = 1,
    ) -> None:
        if prefetch_limit < 1:
            raise ValueError(f"prefetch_limit must be >= 1, got {prefetch_limit}")
        self.world_size = world_size
        self.rank = rank
        self.reshard_after_forward = reshard_after_forward
        self.enable_async = enable_async
        self.prefetch_limit = prefetch_limit
        self.require_grad_sync = True
        self.policy: Optional[MixedPrecisionPolicy] = None  # set by FSDP(mixed_precision=...)
        self.units: List[Any] = []  # every GatherUnit of the model
        self.forward_order: Optional[List[Any]] = None
        self.backward_order: List[Any] = []
        self._grad_forward = False  # inside a wrapper forward with grad enabled
        self._recording: Optional[List[Any]] = None
        self._in_forward = False
        self._cursor = {"forward": 0, "backward": 0}
        self._pending: Dict[Any, Any] = {}  # unit -> its issued, unconsumed gather
        # Bytes of gathered full parameters alive now / at most since the last reset, and of
        # no_sync gradient accumulation buffers.
        self.gathered_bytes = 0
        self.peak_gathered_bytes = 0
        self.accumulated_bytes = 0

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
    def begin_forward(self, grad_enabled: bool) -> None:
        for unit in self.units:
            unit.tied.check_complete()
        self.drop_transients()
        self._in_forward = True
        self._grad_forward = grad_enabled
        self._cursor = {"forward": 0, "backward": 0}
        if self.forward_order is None:
            self._recording = []

    def end_forward(self) -> None:
        self._in_forward = False
        if self._recording is not None:
            fetched, self._recording = self._recording, None
            self.forward_order = list(dict.fromkeys(fetched))  # by first fetch
            self.backward_order = list(dict.fromkeys(reversed(fetched)))  # by last fetch

    def keeps_after_forward(self, unit: Any) -> bool:
        """Whether ``unit`` stays gathered after a forward fetch is released."""
        if not self._grad_forward:
            return False
        first_in_backward = bool(self.backward_order) and unit is self.backward_order[0]
        return first_in_backward or not self.reshard_after_forward

    def drop_transients(self) -> None:
        """Wait for and drop unconsumed prefetches and full params held from an earlier pass."""
        for unit, gathered in self._pending.items():
            unit.discard(gathered)
        self._pending.clear()
        for unit in self.units:
            unit.drop()

    # ---------------------------------------------------------------- prefetch
    def take_prefetched(self, unit: Any) -> Optional[Any]:
        return self._pending.pop(unit, None)

    def after_fetch(self, unit: Any, phase: str) -> None:
        """Record the order (first forward); prefetch what follows ([Note: FSDP prefetch])."""
        if phase == "forward" and not self._in_forward:
            return  # recomputation inside backward: neither recorded nor prefetched from
        if self._recording is not None:
            self._recording.append(unit)
            return
        if not self.enable_async or self.forward_order is None:
            return
        order = self.forward_order if phase == "forward" else self.backward_order
        position = _find(order, unit, self._cursor[phase])
        if position is None:
            return  # not a new unit of this pass (or out of order): nothing to prefetch
        self._cursor[phase] = position + 1
        for upcoming in order[position + 1 : position + 1 + self.prefetch_limit]:
            if len(self._pending) >= self.prefetch_limit:
                break
            if upcoming.is_held or upcoming in self._pending:
                continue
            self._pending[upcoming] = upcoming.issue_gather(async_op=True)


def _find(order: List[Any], unit: Any, start: int) -> Optional[int]:
    """Index of ``unit`` in ``order[start:]``, or None (never earlier: no prefetching twice)."""
    for index in range(start, len(order)):
        if order[index] is unit:
            return index
    return None
