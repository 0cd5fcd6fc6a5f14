"""Optimizers whose math is one update rule over lists of tensors ([Note: one update rule])."""

from .adamw import AdamW, adamw_update_
from .base import BaseOptimizer, normalize_param_group, normalize_param_groups
from .sgd import SGD, sgd_update_
from .torch_rule import TorchRule

__all__ = [
    "AdamW",
    "BaseOptimizer",
    "SGD",
    "TorchRule",
    "adamw_update_",
    "normalize_param_group",
    "normalize_param_groups",
    "sgd_update_",
]
