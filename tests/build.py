"""How the tests build a strategy: ``build(strategy, model, optimizer, **kw)``, the only place.

``strategy``: ``"single"`` (``convert_module``: our layers on one device), ``"ddp"``,
``"zero1"``, ``"zero2"``, ``"zero3"`` or ``"fsdp"``. ``optimizer``: an ``Optim`` (``adamw(...)``
or ``sgd(...)``), built as that strategy's own class (``Zero2AdamW``, ``FSDPSGD``, ...); None
builds the model alone. Other keywords go to the wrapper (``bucket_cap_mb``,
``enable_async_communication``, ``unit``, ``mixed_precision``, ...); for ``"single"``,
``mixed_precision`` is applied to the converted layers and ``enable_async_communication``
ignored, so that one set of keywords builds every strategy.

ZeRO-3 needs a partition table: unless ``parts`` is given, ``build`` partitions the model's
parameters over the process group's ranks (``evenness`` as in ``zero3_partition_tensors``) and
hands the table to the optimizer too. ``groups(named_parameters)`` turns the parameters into
param groups (e.g. weight decay for matrices only).
"""

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

NamedParams = Iterable[Tuple[str, nn.Parameter]]
WRAPPERS = {"ddp": "DDP", "zero1": "Zero1", "zero2": "Zero2", "zero3": "Zero3", "fsdp": "FSDP"}
OPTIMIZER_NAMES = {"adamw": "AdamW", "sgd": "SGD"}  # ours: <wrapper><name>, torch: torch.optim


@dataclass(frozen=True)
class Optim:
    """An optimizer by kind (``"adamw"`` or ``"sgd"``) and hyper-parameters: ``build`` makes
    the strategy's own class of it, ``reference`` PyTorch's for the one-device reference."""

    kind: str
    hyper: Dict[str, Any] = field(default_factory=dict)

    @property
    def reference_class(self) -> type:
        return getattr(torch.optim, OPTIMIZER_NAMES[self.kind])

    def reference(self, params: Iterable[Any]) -> torch.optim.Optimizer:
        return self.reference_class(params, **self.hyper)


def adamw(**hyper: Any) -> Optim:
    return Optim("adamw", hyper)


def sgd(**hyper: Any) -> Optim:
    return Optim("sgd", hyper)


def zero3_table(
    model: nn.Module, evenness: float = 0.0, world_size: Optional[int] = None
) -> Mapping[str, int]:
    """ZeRO-3 owner of each of ``model``'s parameters over ``world_size`` CPU ranks (default:
    the process group's)."""
    from tiny_fsdp.core import zero3_partition_tensors

    ranks = ["cpu"] * (dist.get_world_size() if world_size is None else world_size)
    return zero3_partition_tensors(dict(model.named_parameters()), ranks, evenness)[0]


def build(
    strategy: str,
    model: nn.Module,
    optimizer: Optional[Optim],
    *,
    groups: Optional[Callable[[NamedParams], List[dict]]] = None,
    evenness: float = 0.0,
    parts: Optional[Mapping[str, int]] = None,
    **kw: Any,
) -> Tuple[nn.Module, Optional[torch.optim.Optimizer]]:
    """``(model under strategy, its optimizer or None)``; see the module docstring."""
    from tiny_fsdp import core

    extra: Dict[str, Any] = {}
    if strategy == "single":
        kw.pop("enable_async_communication", None)  # one device: no communication to overlap
        policy = kw.pop("mixed_precision", None)
        wrapped = core.convert_module(model, **kw)
        if policy is not None:
            core.apply_mixed_precision(wrapped, policy)  # layers compute low, params stay
        named, prefix = wrapped.named_parameters(), ""
    elif strategy == "zero3":
        extra["param_part_table"] = zero3_table(model, evenness) if parts is None else parts
        wrapped = core.Zero3(model, extra["param_part_table"], **kw)
        named, prefix = wrapped.module.named_parameters(), "Zero3"  # the plain model's names
    else:
        prefix = WRAPPERS[strategy]
        wrapped = getattr(core, prefix)(model, **kw)
        named = wrapped.named_parameters()
    if optimizer is None:
        return wrapped, None
    cls = getattr(core, prefix + OPTIMIZER_NAMES[optimizer.kind])
    return wrapped, cls(named if groups is None else groups(named), **optimizer.hyper, **extra)
