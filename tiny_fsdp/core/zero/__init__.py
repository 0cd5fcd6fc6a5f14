"""ZeRO-1 and ZeRO-2: replicated parameters in flat buffers; sharded optimizer state / gradients."""

from tiny_fsdp.core.zero.flat_buffer import FlatBuffer, FlatLayout
from tiny_fsdp.core.zero.grad_stores import FullGradBuffer, StagedGradShard, ZeroGradStore
from tiny_fsdp.core.zero.optim import (
    Zero1AdamW,
    Zero1Optimizer,
    Zero1SGD,
    Zero2AdamW,
    Zero2Optimizer,
    Zero2SGD,
)
from tiny_fsdp.core.zero.zero import Zero1, Zero2, ZeroWrapper, zero_owner

__all__ = [
    "FlatBuffer",
    "FlatLayout",
    "FullGradBuffer",
    "StagedGradShard",
    "Zero1",
    "Zero1AdamW",
    "Zero1Optimizer",
    "Zero1SGD",
    "Zero2",
    "Zero2AdamW",
    "Zero2Optimizer",
    "Zero2SGD",
    "ZeroGradStore",
    "ZeroWrapper",
    "zero_owner",
]
