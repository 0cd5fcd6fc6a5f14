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
buffer is not invalidated by the new version. A forward without gradients that would broadcast
(an evaluation right after a training step) first waits for every rank ([Note: arrival
check]): the torch DDP habit of evaluating on rank 0 alone, which there waits in the broadcast
until the collective timeout (30 minutes on gloo) with no word, warns after 10 s with the fix
and raises at the timeout, or at once if the other ranks have exited.

[Note: trainable set after wrapping]
Freezing or unfreezing parameters after wrapping (``requires_grad_``: a fine-tuning run that
unfreezes the backbone after some steps, a GAN loop that freezes the discriminator for the
generator's step) changes which parameters have gradients. Every forward first compares the
parameters' ``requires_grad`` flags with those of the previous forward (one pass over the flags);
on a change, the parameters that now need a gradient but have no place in the strategy's
gradient store go to the strategy's ``take_trainable``:

- DDP builds new buckets and a new backward engine over the parameters it had and those, so an
  unfrozen parameter's gradient is averaged over the ranks like any other; gradients kept in the
  old buckets (``no_sync`` micro-steps) are copied into the new ones by the next backward.
  torch's DDP registers its parameters once: there an unfrozen parameter's gradient stays
  local and the replicas drift apart, silently.
- ZeRO-1/2 put the trainable parameters into the flat buffer and the optimizer's shards at wrap
  time: a parameter unfrozen later has no place there, so the forward raises and names it.

A parameter frozen later keeps its place: no rank has a gradient for it, so its slot travels as
zeros and it is not stepped (its ``.grad`` stays None), as an unused parameter ([Note: bucketed
backward]). Toggling ``requires_grad`` every step therefore builds nothing. FSDP and ZeRO-3 read
``requires_grad`` at every backward and need none of this. Every rank must change the same
parameters before the same forward, as it runs the same code.
"""

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from tiny_fsdp.core import comm
from tiny_fsdp.core.precision import MixedPrecisionPolicy
from tiny_fsdp.core.utils.arrival import every_rank_arrives
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
        self.buffer_source = 0  # the rank whose buffers are broadcast ([Note: DDP join])
        self._sync_buffers_before_forward = True  # torch's DDP starts with a broadcast too
        self._named_params = list(self.module.named_parameters())  # a tied parameter once
        self._requires_grad = self._requires_grad_flags()

    def _requires_grad_flags(self) -> Tuple[bool, ...]:
        return tuple(p.requires_grad for _, p in self._named_params)

    def follow_trainable_set(self) -> None:
        """Hand the strategy the parameters that need a gradient and have no place in its
        store ([Note: trainable set after wrapping]); every forward calls this first."""
        flags = self._requires_grad_flags()
        if flags == self._requires_grad:
            return
        new = [name for name, p in self._named_params if p.requires_grad and not self.has_place(p)]
        if new:
            self.take_trainable(new)  # may raise: the flags stay, the next forward sees it again
        self._requires_grad = flags

    def name_of(self, param: torch.Tensor) -> str:
        """``param``'s name in the model (the first, for a tied parameter)."""
        return next(name for name, p in self._named_params if p is param)

    def has_place(self, param: torch.Tensor) -> bool:
        """``param``'s gradient has a place in the strategy's gradient store."""
        raise NotImplementedError

    def take_trainable(self, names: List[str]) -> None:
        """Give the parameters ``names`` (trainable now, no place yet) a place, or raise."""
        raise NotImplementedError

    @property
    def buffers_due(self) -> bool:
        """The next forward broadcasts the buffers (on one rank they are rank 0's already)."""
        return (
            self.broadcast_buffers
            and self._sync_buffers_before_forward
            and dist.get_world_size() > 1
        )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.buffers_due:
            if not torch.is_grad_enabled():  # maybe an evaluation on rank 0 alone
                every_rank_arrives(f"{type(self).__name__} forward without gradients", _FIX)
            broadcast_module_buffers(self.module, src=self.buffer_source)
        output = self.module(*args, **kwargs)
        self._sync_buffers_before_forward = (
            torch.is_grad_enabled() and self.require_backward_grad_sync
        )
        return output


_FIX = (
    "After a training step the next forward gives every rank rank 0's buffers (one broadcast, "
    "as torch's DDP does), so every rank must run it: evaluate on every rank, or call the plain "
    "model, model.module(...), on one rank alone (no collective)."
)


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
