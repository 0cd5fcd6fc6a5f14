"""What a *layer* is, and the one place where a layer's parameter registration is swapped.

A layer is what a strategy fetches parameters for and what a gather unit groups ([Note: param
handler]): a module with ``param_names`` (its direct parameters, in order) and a
``param_handler``. Registered wrappers (``CallbackModule`` subclasses) are layers by class; any
other module holding parameters becomes one when the generic path attaches to it ([Note: generic
layer], ``generic.py``).

While a generic layer computes, its ``_parameters`` entries point at full tensors instead of its
local parameters (the tensors the strategy keeps: full, shard or empty). ``swap_in`` /
``swap_out`` do that and remember the local parameter, so that ``local_param`` answers the
strategy's question "which tensor do you really hold?" at any time, swapped or not.
"""

import weakref
from typing import Any, ContextManager, Dict

import torch
from torch import nn

from tiny_fsdp.core.module.base import CallbackModule

# module -> {attribute: the local parameter it holds while the attribute is swapped}
_SWAPPED: "weakref.WeakKeyDictionary[nn.Module, Dict[str, nn.Parameter]]" = (
    weakref.WeakKeyDictionary()
)


def is_layer(module: nn.Module) -> bool:
    """Whether ``module`` has ``param_names`` and a ``param_handler`` a strategy sets."""
    if isinstance(module, CallbackModule):
        return True
    return bool(getattr(module, "param_names", ())) and hasattr(module, "param_handler")


def local_param(module: nn.Module, name: str) -> torch.Tensor:
    """The parameter ``module`` really holds under ``name``, even while it is swapped."""
    originals = _SWAPPED.get(module)
    if originals is not None and name in originals:
        return originals[name]
    return getattr(module, name)


def swap_in(module: nn.Module, attr: str, tensor: torch.Tensor) -> None:
    """Make ``module.<attr>`` return ``tensor`` until ``swap_out``; the local one is kept."""
    originals = _SWAPPED.setdefault(module, {})
    originals.setdefault(attr, module._parameters[attr])
    module._parameters[attr] = tensor


def swap_out(module: nn.Module, attr: str) -> None:
    """Put the local parameter back under ``attr`` (no-op if it is not swapped)."""
    originals = _SWAPPED.get(module)
    if originals is None or attr not in originals:
        return
    module._parameters[attr] = originals.pop(attr)
    if not originals:
        del _SWAPPED[module]


def is_swapped(module: nn.Module, attr: str) -> bool:
    originals = _SWAPPED.get(module)
    return originals is not None and attr in originals


_IN_STRATEGY_CODE = [0]  # > 0 while strategy code (fetch, reduce) runs on local parameters


class _StrategyCode:
    """The context of ``strategy_code``: a counter, so that it nests; a class rather than a
    generator-based context manager, since it wraps every fetch, release and reduction of every
    layer (a few hundred a step)."""

    def __enter__(self) -> None:
        _IN_STRATEGY_CODE[0] += 1

    def __exit__(self, *exc_info: Any) -> None:
        _IN_STRATEGY_CODE[0] -= 1


_STRATEGY_CODE = _StrategyCode()


def strategy_code() -> ContextManager[None]:
    """Mark code that legitimately reads local parameters ([Note: outside reads])."""
    return _STRATEGY_CODE


def in_strategy_code() -> bool:
    return _IN_STRATEGY_CODE[0] > 0
