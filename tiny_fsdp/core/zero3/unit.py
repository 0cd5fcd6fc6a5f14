"""One ZeRO-3 layer as a prefetcher unit: its parameters broadcast from their owners, then freed.

Implements the prefetcher's verbs ([Note: prefetch]) for one layer ([Note: zero3 tensor life
cycle] in ``handler.py``). A layer can be fetched twice at once: its backward reads its saved
input, which makes gradient checkpointing recompute the block, this layer's forward included,
inside that backward; so the fetches in use are a stack, innermost last.
"""

from dataclasses import dataclass
from typing import Any, List, Optional

import torch
from torch import nn

from tiny_fsdp.core import comm
from tiny_fsdp.core.module import local_param
from tiny_fsdp.core.module.handler import Params
from tiny_fsdp.core.streams import GATHER, CommHandle
from tiny_fsdp.core.zero3.runtime import ATTR, TensorInfo, Zero3Runtime


@dataclass
class PendingBroadcast:
    """One layer's full parameters, possibly still arriving (``handle`` not yet waited)."""

    full: Params
    handle: CommHandle  # the layer's broadcasts ([Note: communication streams])
    nbytes: int  # bytes of the received (non-owned) buffers


class BroadcastUnit:
    """The broadcasts of one layer's parameters, and the fetches of them in use."""

    def __init__(self, module: nn.Module, runtime: Zero3Runtime) -> None:
        self.module = module
        self.runtime = runtime
        self._in_use: List[PendingBroadcast] = []  # innermost last

    def hold(self) -> Params:
        """The full parameters of the innermost fetch (after ``wait_for_unshard``)."""
        return self._in_use[-1].full

    is_unsharded = False  # every use broadcasts afresh: nothing is kept full between uses

    def unshard(self, async_op: bool) -> PendingBroadcast:
        """Issue this layer's broadcasts; the result is valid after ``wait_for_unshard``."""
        rt = self.runtime
        full_params: List[Optional[torch.Tensor]] = []
        broadcasts, nbytes = [], 0
        for name in self.module.param_names:
            local = local_param(self.module, name)  # also while a generic layer computes
            if local is None:  # absent bias
                full_params.append(None)
                continue
            info: TensorInfo = getattr(local, ATTR)
            dtype = local.dtype if rt.policy is None else rt.policy.param_dtype
            if info.owner == rt.rank and dtype == local.dtype:
                full = local.detach()  # the owner computes with its own tensor
            else:
                if info.owner == rt.rank:  # mixed precision: the owner sends a cast copy
                    full = local.detach().to(dtype)
                else:
                    full = torch.empty(info.shape, dtype=dtype, device=local.device)
                rt.stats.add(full)
                nbytes += full.numel() * full.element_size()
            if rt.world_size > 1:
                broadcasts.append((full, info.owner))
            full_params.append(full)

        def launch(async_op: bool) -> List[Any]:
            return [comm.broadcast(t, src=src, async_op=async_op) for t, src in broadcasts]

        handle = rt.streams.issue(GATHER, launch, async_op)
        return PendingBroadcast(tuple(full_params), handle, nbytes)

    def wait_for_unshard(self, pending: PendingBroadcast) -> None:
        """Wait for the broadcasts; ``fetch`` hands out their buffers until ``reshard``."""
        self.runtime.streams.wait(pending.handle)
        self._in_use.append(pending)

    def discard(self, pending: PendingBroadcast) -> None:
        """Forget a prefetch that will not be used, once its broadcasts have finished."""
        self.runtime.streams.wait(pending.handle)
        self.runtime.stats.live_bytes -= pending.nbytes

    def reshard(self) -> None:
        """Drop the innermost fetch's buffers."""
        if self._in_use:
            self.runtime.stats.live_bytes -= self._in_use.pop().nbytes
