"""DDP: every rank holds the whole model and the gradients are averaged over ranks in backward.

[Note: DDP backward]
At wrap time the trainable parameters (``requires_grad``; a tied parameter counts once) are
grouped into flat buckets in reverse order ([Note: gradient bucket layout]), and each gets a
``register_post_accumulate_grad_hook``: autograd calls it once per backward, after the
parameter's gradient is fully accumulated into ``param.grad`` (a tied parameter is one leaf, so
its hook fires once, after both uses). In a synchronised backward the hook

1. on the first call of the backward, queues ``_end_of_backward`` on the autograd engine;
2. copies ``param.grad / world_size`` into the parameter's bucket slot;
3. with ``enable_async_communication``, launches the all-reduce (``async_op=True``) of every
   complete bucket whose predecessors are all launched. Launching strictly in bucket order makes
   the collectives of all ranks pair up even if their gradients become ready in another order,
   and the reductions run while backward computes the remaining gradients.

``_end_of_backward`` launches the buckets not launched yet (all of them when asynchronous
communication is off), filling the slots of parameters whose hook never fired, then waits for
every bucket and copies the averages back into ``param.grad``. Results are bitwise identical with
asynchronous communication on and off: same buckets, same data, same collectives.

Parameters unused in a forward: their hook does not fire, so they never hold a bucket back; the
end-of-backward callback still sends their slot, so every rank issues the same collectives. A
rank without a gradient sends zeros, so ``param.grad`` becomes the sum of the other ranks'
gradients divided by the world size, exactly the single-device gradient of the global batch.
If NO rank had a gradient, ``param.grad`` stays None (optimizers skip it, as on one device).

Gradient accumulation: while ``require_backward_grad_sync`` is False (``no_sync()``), hooks
return at once and autograd keeps accumulating into ``param.grad``; the next synchronised
backward sends the accumulated total. The flag is read when a backward's first hook fires.

Limits: every rank must run backward through at least one trainable parameter in a synchronised
step (otherwise its end-of-backward callback is never queued and the other ranks wait); the set
of trainable parameters is fixed at wrap time; reentrant backward (``torch.utils.checkpoint``
with ``use_reentrant=True``) would end the bucket cycle inside the inner backward and is not
supported (``GPT2Model`` checkpoints with ``use_reentrant=False``).
"""

import weakref
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from tiny_fsdp.core import comm
from tiny_fsdp.core.ddp.bucket import GradBucket, build_buckets
from tiny_fsdp.core.module import CallbackModule
from tiny_fsdp.core.precision import MixedPrecisionHandler, MixedPrecisionPolicy
from tiny_fsdp.core.utils.dist import check_backend_device
from tiny_fsdp.core.wrapper import DataParallelWrapper, check_same_model_on_all_ranks

# Set on every parameter of a DDP-wrapped module: a weak reference to the wrapper.
_OWNER_ATTR = "_tiny_fsdp_ddp_owner"


def is_ddp_param(tensor: torch.Tensor) -> bool:
    """True if ``tensor`` is a parameter of a live ``DDP``-wrapped module."""
    owner = getattr(tensor, _OWNER_ATTR, None)
    return owner is not None and owner() is not None


class DDP(DataParallelWrapper):
    """Distributed data parallel: replicate ``module``, average gradients over ranks.

    Args:
        module: the model; converted in place to tiny_fsdp layers (``LOCAL_HANDLER``: every
            layer computes with its full local parameters). Rank 0's parameters and buffers are
            broadcast to every rank at construction.
        bucket_cap_mb: maximum gradient bytes (MiB) per all-reduce bucket.
        enable_async_communication: overlap bucket all-reduces with backward (see
            [Note: DDP backward]); False reduces the same buckets at the end of backward.
        mixed_precision: layers compute with ``param_dtype`` copies of the fp32 parameters
            (``MixedPrecisionHandler``) and the buckets are of ``reduce_dtype``, so the
            all-reduced bytes halve with bf16; ``param.grad`` stays fp32 ([Note: mixed
            precision]).

    ``state_dict()`` / ``load_state_dict()`` use the plain model's keys (no ``module.`` prefix).
    """

    def __init__(
        self,
        module: nn.Module,
        bucket_cap_mb: float = 25.0,
        enable_async_communication: bool = False,
        mixed_precision: Optional[MixedPrecisionPolicy] = None,
    ) -> None:
        super().__init__(module, enable_async_communication, mixed_precision)
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
        params = list(self.module.parameters())  # deduplicated: a tied parameter appears once
        for name, p in self.module.named_parameters():
            if is_ddp_param(p):
                raise ValueError(
                    f"parameter '{name}' already belongs to another DDP wrapper; wrap a model once"
                )
        check_backend_device(self.module.named_parameters(), "DDP", ("broadcast", "all_reduce"))
        check_same_model_on_all_ranks(self.module, "DDP")
        _broadcast_from_rank0(self.module)

        self.bucket_cap_mb = bucket_cap_mb
        self.world_size = dist.get_world_size()
        trainable = [p for p in params if p.requires_grad]  # frozen parameters take no part
        reduce_dtype = None if mixed_precision is None else mixed_precision.reduce_dtype
        self.buckets: List[GradBucket] = build_buckets(
            trainable, int(bucket_cap_mb * 2**20), self.world_size, reduce_dtype
        )
        if mixed_precision is not None:
            handler = MixedPrecisionHandler(mixed_precision)
            for layer in self.module.modules():
                if isinstance(layer, CallbackModule):
                    layer.param_handler = handler
        self._next_launch = 0  # buckets before this index are launched in this backward
        self._backward_active = False  # a synchronised backward is in progress

        owner = weakref.ref(self)
        for p in params:
            setattr(p, _OWNER_ATTR, owner)
        # Hooks hold the wrapper weakly: a discarded wrapper does not live on through them.
        self._hook_handles = [
            p.register_post_accumulate_grad_hook(_grad_ready_hook(owner, b, slot))
            for b, bucket in enumerate(self.buckets)
            for slot, p in enumerate(bucket.params)
        ]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._backward_active:
            # The previous backward raised before its end callback ran: drop its half state.
            self._reset_backward_state()
        return super().forward(*args, **kwargs)

    # ------------------------------------------------------------------ backward machinery

    def _on_grad_ready(self, bucket_index: int, slot: int, param: nn.Parameter) -> None:
        if not self._backward_active:
            if not self.require_backward_grad_sync:
                return  # no_sync: autograd accumulates into param.grad, nothing to do
            self._backward_active = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        bucket = self.buckets[bucket_index]
        with torch.no_grad():
            bucket.add_grad(slot, param.grad)
        if self.enable_async_communication and bucket.complete:
            self._launch_complete_buckets()

    def _launch_complete_buckets(self) -> None:
        """Launch, in order, the complete buckets that follow the last launched one."""
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].complete:
            self.buckets[self._next_launch].launch(async_op=True)
            self._next_launch += 1

    def _end_of_backward(self) -> None:
        try:
            with torch.no_grad():
                for bucket in self.buckets[self._next_launch :]:
                    bucket.add_missing()
                    bucket.launch(async_op=self.enable_async_communication)
                for bucket in self.buckets:
                    bucket.finish()
        finally:
            self._reset_backward_state()

    def _reset_backward_state(self) -> None:
        for bucket in self.buckets:
            bucket.reset()
        self._next_launch = 0
        self._backward_active = False


def _grad_ready_hook(
    owner: "weakref.ref[DDP]", bucket_index: int, slot: int
) -> Callable[[nn.Parameter], None]:
    def hook(param: nn.Parameter) -> None:
        ddp = owner()
        if ddp is not None:
            ddp._on_grad_ready(bucket_index, slot, param)

    return hook


@torch.no_grad()
def _broadcast_from_rank0(module: nn.Module) -> None:
    """Make every rank start from rank 0's parameters and buffers."""
    for tensor in [*module.parameters(), *module.buffers()]:
        comm.broadcast(tensor.detach(), src=0)
