"""tiny_fsdp.core: layer wrappers, optimizers and the data-parallel strategies.

The earlier Tiny-FSDP imports keep working::

    from tiny_fsdp.core import SGD, AdamW
    from tiny_fsdp.core import DDP, DDPAdamW
    from tiny_fsdp.core import Zero3, Zero3AdamW, zero3_partition_tensors
    from tiny_fsdp.core import FSDP, FSDPAdamW
"""

from tiny_fsdp.core import clip
from tiny_fsdp.core.clip import (
    clip_grad_norm_,
    clip_grad_value_,
    clip_grads_with_norm_,
    get_total_norm,
)
from tiny_fsdp.core.ddp import DDP, DDPSGD, DDPAdamW
from tiny_fsdp.core.fsdp import FSDP, FSDPSGD, FSDPAdamW
from tiny_fsdp.core.module import (
    Conv1d,
    Conv2d,
    Embedding,
    LayerNorm,
    Linear,
    RMSNorm,
    convert_module,
    register_wrapper,
)
from tiny_fsdp.core.optim import SGD, AdamW
from tiny_fsdp.core.precision import (
    MixedPrecisionHandler,
    MixedPrecisionPolicy,
    apply_mixed_precision,
)
from tiny_fsdp.core.utils.failure import (
    NonFiniteError,
    PeerFailureError,
    fail_fast,
    nonfinite_ranks,
)
from tiny_fsdp.core.zero import (
    Zero1,
    Zero1AdamW,
    Zero1Optimizer,
    Zero1SGD,
    Zero2,
    Zero2AdamW,
    Zero2Optimizer,
    Zero2SGD,
)
from tiny_fsdp.core.zero3 import Zero3, Zero3AdamW, Zero3SGD, zero3_partition_tensors

clip.install()  # torch.nn.utils.clip_grad_norm_ over ranks ([Note: clipping with torch's function])

__all__ = [
    "clip_grad_norm_",
    "clip_grad_value_",
    "clip_grads_with_norm_",
    "get_total_norm",
    "SGD",
    "AdamW",
    "DDP",
    "DDPAdamW",
    "DDPSGD",
    "FSDP",
    "FSDPAdamW",
    "FSDPSGD",
    "Zero1",
    "Zero1AdamW",
    "Zero1Optimizer",
    "Zero1SGD",
    "Zero2",
    "Zero2AdamW",
    "Zero2Optimizer",
    "Zero2SGD",
    "Zero3",
    "Zero3AdamW",
    "Zero3SGD",
    "zero3_partition_tensors",
    "Conv1d",
    "Conv2d",
    "Embedding",
    "LayerNorm",
    "Linear",
    "RMSNorm",
    "MixedPrecisionHandler",
    "MixedPrecisionPolicy",
    "apply_mixed_precision",
    "NonFiniteError",
    "PeerFailureError",
    "fail_fast",
    "nonfinite_ranks",
    "convert_module",
    "register_wrapper",
]
