"""Which wrapper replaces which ``torch.nn`` layer, and the in-place model conversion."""

from typing import Dict, Type

from torch import nn

from tiny_fsdp.core.module.base import CallbackModule
from tiny_fsdp.core.module.embedding import Embedding
from tiny_fsdp.core.module.fallback import make_fallback_wrapper
from tiny_fsdp.core.module.layernorm import LayerNorm
from tiny_fsdp.core.module.linear import Linear

WRAPPERS: Dict[Type[nn.Module], Type[CallbackModule]] = {
    nn.Linear: Linear,
    nn.LayerNorm: LayerNorm,
    nn.Embedding: Embedding,
}


class UnsupportedModuleError(TypeError):
    """A module holds parameters but no wrapper is registered for its class."""


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


def convert_module(model: nn.Module, fallback: bool = False) -> nn.Module:
    """Swap, in place, every registered layer of ``model`` for its wrapper; return ``model``.

    Only the class of each module changes: parameter objects are kept, so weights are unchanged and
    a parameter shared by two modules (GPT-2's tied ``wte``/``lm_head``) stays shared. A module
    that directly holds parameters and has no wrapper raises ``UnsupportedModuleError`` naming it,
    unless ``fallback=True``: then it gets the generic wrapper of ``fallback.py`` (with a warning).
    """
    for path, module in model.named_modules():
        if isinstance(module, CallbackModule):
            continue
        wrapper = WRAPPERS.get(type(module))
        if wrapper is not None:
            module.__class__ = wrapper
            check = getattr(module, "check_supported", None)
            if check is not None:
                check()
        elif any(True for _ in module.parameters(recurse=False)):
            if fallback:
                make_fallback_wrapper(module, path)
                continue
            names = [name for name, _ in module.named_parameters(recurse=False)]
            raise UnsupportedModuleError(
                f"module '{path or '<root>'}' of type {type(module).__module__}."
                f"{type(module).__qualname__} holds parameters {names} but has no tiny_fsdp "
                "wrapper. Write a CallbackModule subclass of it (forward_callback / "
                "backward_callback) and call tiny_fsdp.core.module.register_wrapper("
                f"{type(module).__qualname__}, YourWrapper) before wrapping the model, or opt in "
                "to the slower generic wrapper with convert_module(model, fallback=True)."
            )
    return model
