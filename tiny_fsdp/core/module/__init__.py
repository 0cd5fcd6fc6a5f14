"""Layer wrappers whose math is written once and whose parameters a strategy manages."""

from tiny_fsdp.core.module.base import CallbackFunction, CallbackModule
from tiny_fsdp.core.module.conv import Conv1d, Conv2d
from tiny_fsdp.core.module.embedding import Embedding
from tiny_fsdp.core.module.generic import GenericLayer, attach_generic, generic_layer
from tiny_fsdp.core.module.handler import LOCAL_HANDLER, ParamHandler, TrainingPhase
from tiny_fsdp.core.module.layer import is_layer, local_param
from tiny_fsdp.core.module.layernorm import LayerNorm
from tiny_fsdp.core.module.linear import Linear
from tiny_fsdp.core.module.registry import (
    WRAPPERS,
    UnsupportedModuleError,
    convert_module,
    register_wrapper,
)
from tiny_fsdp.core.module.rmsnorm import RMSNorm

__all__ = [
    "CallbackFunction",
    "CallbackModule",
    "Conv1d",
    "Conv2d",
    "Embedding",
    "GenericLayer",
    "LayerNorm",
    "Linear",
    "LOCAL_HANDLER",
    "ParamHandler",
    "RMSNorm",
    "TrainingPhase",
    "UnsupportedModuleError",
    "WRAPPERS",
    "convert_module",
    "attach_generic",
    "generic_layer",
    "is_layer",
    "local_param",
    "register_wrapper",
]
