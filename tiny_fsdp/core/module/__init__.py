"""Layer wrappers whose math is written once and whose parameters a strategy manages."""

from tiny_fsdp.core.module.base import CallbackFunction, CallbackModule
from tiny_fsdp.core.module.embedding import Embedding
from tiny_fsdp.core.module.handler import LOCAL_HANDLER, ParamHandler
from tiny_fsdp.core.module.layernorm import LayerNorm
from tiny_fsdp.core.module.linear import Linear
from tiny_fsdp.core.module.registry import (
    WRAPPERS,
    UnsupportedModuleError,
    convert_module,
    register_wrapper,
)

__all__ = [
    "CallbackFunction",
    "CallbackModule",
    "Embedding",
    "LayerNorm",
    "Linear",
    "LOCAL_HANDLER",
    "ParamHandler",
    "UnsupportedModuleError",
    "WRAPPERS",
    "convert_module",
    "register_wrapper",
]
