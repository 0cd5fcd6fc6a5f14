"""DDP: every rank holds the whole model and the gradients are averaged over ranks in backward.

[Note: DDP backward]
DDP's backward is the shared engine ([Note: bucketed backward]) with ``AllReduceBuckets`` as its
gradient store. At wrap time the trainable parameters (``requires_grad``; a tied parameter counts
once) are grouped into flat buckets in reverse order ([Note: gradient bucket layout]). A hook
copies ``param.grad / world_size`` into the parameter's bucket slot; a bucket's reduction is one
all-reduce, and finishing it copies the averages back into ``param.grad``. Without
``enable_async_communication`` every bucket is reduced at the end of backward.

Parameters unused in a forward: the end of backward still sends their slot, so every rank issues
the same collectives. A rank without a gradient sends zeros, so ``param.grad`` becomes the sum of
the other ranks' gradients divided by the world size, exactly the single-device gradient of the
global batch. If NO rank had a gradient, ``param.grad`` stays None (optimizers skip it, as on one
device).

Gradient accumulation: inside ``no_sync()`` autograd keeps accumulating into ``param.grad`` and
the next synchronised backward sends the accumulated total. As with ``torch``'s DDP, a backward
after a synchronised one (no ``zero_grad`` between) adds onto the averaged ``param.grad``.
"""

from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from tiny_fsdp.core import comm
from tiny_fsdp.core.bucketed_backward import BucketedBackward
from tiny_fsdp.core.ddp.bucket import AllReduceBuckets, GradBucket
from tiny_fsdp.core.module import CallbackModule
from tiny_fsdp.core.precision import MixedPrecisionHandler, MixedPrecisionPolicy
from tiny_fsdp.core.ownership import owner_of
from tiny_fsdp.core.wrapper import DataParallelWrapper


def is_ddp_param(tensor: torch.Tensor) -> bool:
    """True if ``tensor`` is a parameter of a live ``DDP``-wrapped module."""
    return isinstance(owner_of(tensor), DDP)


class DDP(DataParallelWrapper):
    """Distributed data parallel: replicate ``module``, average gradients over ranks.

    Args:
        module: the model; converted in place to tiny_fsdp layers (``LOCAL_HANDLER``: every
            layer computes with its full local parameters). Rank 0's parameters and buffers are
            broadcast to every rank at construction.
        bucket_cap_mb: maximum gradient bytes (MiB) per all-reduce bucket.
        enable_async_communication: overlap bucket all-reduces with backward ([Note: bucketed
            backward]); False reduces the same buckets at the end of backward.
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
        _broadcast_from_rank0(self.module)

        self.bucket_cap_mb = bucket_cap_mb
        self.world_size = dist.get_world_size()
        trainable = [p for p in params if p.requires_grad]  # frozen parameters take no part
        reduce_dtype = None if mixed_precision is None else mixed_precision.reduce_dtype
        store = AllReduceBuckets(
            trainable, int(bucket_cap_mb * 2**20), self.world_size, reduce_dtype
        )
        self.buckets: List[GradBucket] = store.buckets
        if mixed_precision is not None:
            handler = MixedPrecisionHandler(mixed_precision)
            for layer in self.module.modules():
                if isinstance(layer, CallbackModule):
                    layer.param_handler = handler
        self._backward = BucketedBackward(self, store)

    def extra_state_tensors(self) -> Dict[str, Sequence[torch.Tensor]]:
        # Flat all-reduce buckets (gradients / N and one flag per parameter), kept between steps.
        return {"buffers": [bucket.buffer for bucket in self.buckets]}


@torch.no_grad()
def _broadcast_from_rank0(module: nn.Module) -> None:
    """Make every rank start from rank 0's parameters and buffers."""
    for tensor in [*module.parameters(), *module.buffers()]:
        comm.broadcast(tensor.detach(), src=0)
