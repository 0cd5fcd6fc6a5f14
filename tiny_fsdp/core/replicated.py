"""What DDP, ZeRO-1 and ZeRO-2 share: the user's modules as they are, buffers as in torch's DDP.

[Note: replicated strategies]
DDP, ZeRO-1 and ZeRO-2 keep every parameter whole on every rank through forward and backward:
they never fetch a parameter, so no layer needs a tiny_fsdp wrapper. Like
``torch.nn.parallel.DistributedDataParallel`` they train any ``nn.Module``: the modules are not
converted (``converts_layers = False``: no class swap, no recompute, no warning), each computes
with its own parameters (own layer classes, raw ``nn.Parameter``s, a parent reading a child's
weight, a module called twice, structured outputs), and gradients are caught by hooks on the
parameters themselves ([Note: bucketed backward]). Mixed precision needs no layer either: ZeRO-1/2
store the parameters in ``param_dtype`` ([Note: ZeRO-1/2 wrapper]); DDP swaps each parameter's
data to a ``param_dtype`` copy for the step ([Note: DDP mixed precision]).

Buffers (BatchNorm's running statistics, rotary tables, position ids) follow torch's DDP: rank
0's are broadcast at wrap time and, with ``broadcast_buffers=True`` (the default), again before a
forward whose previous forward ran with gradients enabled and ``require_backward_grad_sync``
(the first forward included). So a forward after an evaluation under ``torch.no_grad()`` or
after a ``no_sync`` micro-step does not broadcast: during accumulation each rank's statistics
evolve from rank 0's of the last synchronised step, as in torch. ``broadcast_buffers=False``:
only at wrap time, then every rank keeps its own. One broadcast per buffer dtype (the buffers
flattened into one tensor), written back through ``.data``, so an autograd graph that saved a
buffer is not invalidated by the new version.
"""

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from tiny_fsdp.core import comm
from tiny_fsdp.core.precision import MixedPrecisionPolicy
from tiny_fsdp.core.wrapper import DataParallelWrapper


class ReplicatedWrapper(DataParallelWrapper):
    """Base of ``DDP``, ``Zero1`` and ``Zero2`` ([Note: replicated strategies]).

    Args:
        module: any ``nn.Module``; it is not converted.
        enable_async_communication: overlap gradient reductions with backward (results are
            bitwise identical with it off).
        mixed_precision: see the strategy.
        broadcast_buffers: broadcast rank 0's buffers before each forward that follows a
            synchronised forward with gradients (True, as torch's DDP), or only at wrap time.
    """

    converts_layers = False

    def __init__(
        self,
        module: nn.Module,
        enable_async_communication: bool = True,
        mixed_precision: Optional[MixedPrecisionPolicy] = None,
        broadcast_buffers: bool = True,
    ) -> None:
        super().__init__(module, enable_async_communication, mixed_precision)
        self.broadcast_buffers = broadcast_buffers
        self._sync_buffers_before_forward = True  # torch's DDP starts with a broadcast too

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.broadcast_buffers and self._sync_buffers_before_forward:
            broadcast_module_buffers(self.module)
        output = self.module(*args, **kwargs)
        self._sync_buffers_before_forward = (
            torch.is_grad_enabled() and self.require_backward_grad_sync
        )
        return output


@torch.no_grad()
def broadcast_module_buffers(module: nn.Module, src: int = 0) -> None:
    """Give every rank rank ``src``'s buffers of ``module``: one broadcast per (dtype, device)."""
    groups: Dict[Tuple[torch.dtype, torch.device], List[torch.Tensor]] = {}
    for buffer in module.buffers():  # a buffer shared by two modules comes once
        if buffer.numel() and buffer.device.type != "meta":
            groups.setdefault((buffer.dtype, buffer.device), []).append(buffer)
    receive = dist.get_rank() != src
    for buffers in groups.values():
        flat = torch.cat([b.reshape(-1) for b in buffers])
        comm.broadcast(flat, src=src)
        if receive:
            offset = 0
            for b in buffers:
                # Through .data: no version bump, a graph that saved the buffer stays valid.
                b.data.copy_(flat[offset : offset + b.numel()].view_as(b))
                offset += b.numel()
