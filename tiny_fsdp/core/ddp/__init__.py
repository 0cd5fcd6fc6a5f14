"""DDP: replicated model, gradients averaged over ranks by bucketed, overlapped all-reduces."""

from tiny_fsdp.core.ddp.bucket import AllReduceBuckets, GradBucket, build_buckets
from tiny_fsdp.core.ddp.ddp import DDP, is_ddp_param
from tiny_fsdp.core.ddp.optim import DDPSGD, DDPAdamW

__all__ = [
    "AllReduceBuckets",
    "DDP",
    "DDPAdamW",
    "DDPSGD",
    "GradBucket",
    "build_buckets",
    "is_ddp_param",
]
