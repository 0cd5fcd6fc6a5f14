"""A model's gradient checkpointing (recompute each block in backward), switched on and off.

Models say it two ways: a ``gradient_checkpointing`` attribute on the model (``GPT2Model``, the
convention of nanoGPT-style code), or HuggingFace's methods (``activation_checkpointing_enable``
in transformers 5, ``gradient_checkpointing_enable`` before), which set the attribute on the
inner modules that recompute. Non-reentrant ``torch.utils.checkpoint`` is asked for explicitly:
older transformers default to the reentrant one, whose inner backward the DDP / ZeRO-1/2 engine
does not support ([Note: bucketed backward]).
"""

from typing import Optional

from torch import nn

_NON_REENTRANT = {"use_reentrant": False}


def gradient_checkpointing(model: nn.Module) -> bool:
    """Whether ``model`` recomputes its blocks in backward."""
    if hasattr(model, "gradient_checkpointing"):
        return bool(model.gradient_checkpointing)
    return any(bool(getattr(m, "gradient_checkpointing", False)) for m in model.modules())


def set_gradient_checkpointing(model: nn.Module, enable: bool) -> None:
    """Turn ``model``'s gradient checkpointing on or off (a HuggingFace model's methods first:
    they also give the modules their checkpoint function); AttributeError if it has none."""
    method = _hf_method(model, "enable" if enable else "disable")
    if method is not None and enable:
        method(dict(_NON_REENTRANT))  # first parameter: the torch.utils.checkpoint kwargs
    elif method is not None:
        method()
    elif hasattr(model, "gradient_checkpointing"):
        model.gradient_checkpointing = enable
    else:
        raise AttributeError(
            f"{type(model).__name__} has no gradient checkpointing to switch: neither a "
            "'gradient_checkpointing' attribute nor HuggingFace's "
            "activation_checkpointing_enable / gradient_checkpointing_enable"
        )


def _hf_method(model: nn.Module, verb: str) -> Optional[object]:
    for name in (f"activation_checkpointing_{verb}", f"gradient_checkpointing_{verb}"):
        method = getattr(model, name, None)
        if callable(method):
            return method
    return None
