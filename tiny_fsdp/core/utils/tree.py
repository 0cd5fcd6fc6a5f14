"""The tensors inside what modules take and return: tuples (named ones too), lists, dicts and
dataclasses."""

import copy
import dataclasses
from typing import Any, Callable

import torch


def map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``value`` with ``fn(t)`` in place of each tensor ``t``, visited in a fixed order; the
    containers keep their types (a namedtuple, an ``OrderedDict``, a ``defaultdict``)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(map_tensors(v, fn) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(map_tensors(v, fn) for v in value)
    if isinstance(value, dict):
        mapped = copy.copy(value)
        for key, item in value.items():
            mapped[key] = map_tensors(item, fn)
        return mapped
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = [f.name for f in dataclasses.fields(value) if f.init]
        return dataclasses.replace(value, **{n: map_tensors(getattr(value, n), fn) for n in fields})
    return value
