"""A model's own parameter count, called through a wrapper: one device's numbers.

[Note: counting methods]
Under FSDP / ZeRO-3 ``model.parameters()`` are what a rank holds (a dim-0 shard, or an empty
tensor for a tensor another rank owns), so a model's own count (HuggingFace's
``num_parameters()``, nanoGPT's ``get_num_params()``: ``sum(p.numel() for p in
self.parameters())``) would give this rank's part, different on every rank; under FSDP2 a
parameter is a DTensor, whose ``numel()`` is the whole tensor's. Called through the wrapper
(``model.num_parameters()``), such a method (``COUNT_METHODS``) runs with each parameter the
strategy splits answering shape questions (``numel``, ``shape``, ``size``, ``dim``:
``SHAPE_QUERIES``) with its full shape: nothing is gathered, every rank gets one device's count.
For the call's duration the parameter's class is ``_FullShapeParam`` (a ``Parameter``); a
``Parameter`` subclass keeps its class and counts its part. A loop of your own over
``model.parameters()`` still counts what this rank holds; ``model.full_shape(p)`` is the whole.
"""

import contextlib
import functools
from typing import Any, Callable, Dict, Iterator

import torch
from torch import nn

from tiny_fsdp.core.utils.tensor_queries import SHAPE_QUERIES, stand_in

#: Methods of a model that count its parameters: called through the wrapper, they see full
#: shapes ([Note: counting methods]).
COUNT_METHODS = frozenset({"num_parameters", "get_num_params"})

_FULL: Dict[int, torch.Tensor] = {}  # id(parameter) -> stand-in of its full shape, in a call


def full_shape_method(wrapper: Any, method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` run with the wrapper's split parameters answering full shapes."""

    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        with full_shapes(wrapper):
            return method(*args, **kwargs)

    return run


@contextlib.contextmanager
def full_shapes(wrapper: Any) -> Iterator[None]:
    """Inside: every parameter ``wrapper`` holds a part of answers shape questions with
    ``wrapper.full_shape(param)``."""
    swapped = []
    try:
        for param in wrapper.module.parameters():
            shape = tuple(wrapper.full_shape(param))
            if type(param) is nn.Parameter and wrapper.manages(param) and shape != param.shape:
                _FULL[id(param)] = stand_in(shape, param.dtype, torch.device("meta"))
                param.__class__ = _FullShapeParam
                swapped.append(param)
        yield
    finally:
        for param in swapped:
            param.__class__ = nn.Parameter
            _FULL.pop(id(param), None)


class _FullShapeParam(nn.Parameter):
    """A split parameter during a counting method ([Note: counting methods])."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            if func in SHAPE_QUERIES and args and id(args[0]) in _FULL:
                return func(_FULL[id(args[0])], *args[1:], **kwargs)
            return func(*args, **kwargs)
