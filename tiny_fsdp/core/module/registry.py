"""Which wrapper replaces which ``torch.nn`` layer, and the in-place model conversion."""

from typing import Dict, Type

from torch import nn

from tiny_fsdp.core.module.base import CallbackModule
from tiny_fsdp.core.module.embedding import Embedding
from tiny_fsdp.core.module.generic import UnsupportedModuleError, attach_generic
from tiny_fsdp.core.module.layernorm import LayerNorm
from tiny_fsdp.core.module.linear import Linear

WRAPPERS: Dict[Type[nn.Module], Type[CallbackModule]] = {
    nn.Linear: Linear,
    nn.LayerNorm: LayerNorm,
    nn.Embedding: Embedding,
}

__all__ = ["WRAPPERS", "UnsupportedModuleError", "convert_module", "register_wrapper"]


def register_wrapper(torch_cls: Type[nn.Module], wrapper_cls: Type[CallbackModule]) -> None:
    """Make ``convert_module`` turn every ``torch_cls`` instance into ``wrapper_cls``.

    ``wrapper_cls`` must subclass both ``CallbackModule`` and ``torch_cls`` (so the constructor,
    parameters and ``state_dict`` keys stay those of ``torch_cls``).
    """
    if not (issubclass(wrapper_cls, CallbackModule) and issubclass(wrapper_cls, torch_cls)):
        raise TypeError(
            f"{wrapper_cls.__name__} must subclass both CallbackModule and {torch_cls.__name__}"
        )
    WRAPPERS[torch_cls] = wrapper_cls


def convert_module(model: nn.Module, registered_layers: bool = True) -> nn.Module:
    """Make every module of ``model`` that holds parameters a layer, in place; return ``model``.

    A registered layer's class is swapped for its wrapper (the explicit, fast path); any other
    module holding parameters of its own gets the generic path's hooks ([Note: generic layer]),
    its class and ``forward`` untouched. ``registered_layers=False``: every module takes the
    generic path, so autograd sees the model's own ops (second derivatives, [Note: backward for
    inputs only]). Parameter objects are kept, so weights are unchanged and a parameter shared
    by two modules (GPT-2's tied ``wte``/``lm_head``) stays shared.
    """
    for module in model.modules() if registered_layers else ():
        if isinstance(module, CallbackModule):
            continue
        wrapper = WRAPPERS.get(type(module))
        if wrapper is not None and wrapper.implements(module):  # else: the generic path
            module.__class__ = wrapper
            check = getattr(module, "check_supported", None)
            if check is not None:
                check()
    for module in model.modules():
        if not isinstance(module, CallbackModule):
            attach_generic(module)
    return model
