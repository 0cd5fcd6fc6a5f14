"""``torch.nn.utils.clip_grad_norm_`` over the gradients of every rank.

[Note: clipping with torch's function]
Training loops clip with ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)``. It
takes the norm of the ``.grad`` a rank holds: right under DDP (every rank holds the whole
averaged gradient), silently wrong where gradients are split: under FSDP a rank holds its
shards, under ZeRO-3 the tensors it owns, under ZeRO-1/2 the reduced gradients live in owned
chunks (ZeRO-2 keeps no ``.grad`` at all). Each rank then clipped by its own factor (measured: a
norm of 1.74 or 0.77 instead of 2.58, a clip of nothing under ZeRO-2). FSDP2 gets it right
through DTensor. So importing ``tiny_fsdp.core`` puts ``clip_grad_norm_`` below in torch's place
(``torch.nn.utils`` and ``torch.nn.utils.clip_grad``): parameters no wrapper manages go to
torch's function unchanged; for a wrapper's, the wrapper says which gradient tensors this rank
holds and whether the ranks hold each element once (``HeldGrads``). The norm is the local norm
of the replicated ones combined with the sharded ones' norm summed over the group (``p``-th
powers; the maximum for ``inf``), and every held gradient is scaled in place by
``min(1, max_norm / (norm + 1e-6))``, torch's arithmetic. Every rank must call it (it
all-reduces), as with FSDP2. ``clip_grad_value_`` likewise clamps the held gradients
(element by element: no communication; under ZeRO-2 torch's found none and raised). A script
that imported torch's functions by name before importing tiny_fsdp keeps torch's:
``tiny_fsdp.core.clip_grad_norm_`` / ``clip_grad_value_`` are the same functions.
"""

import math
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Union

import torch
import torch.distributed as dist

from tiny_fsdp.core import comm
from tiny_fsdp.core.optim.base import sum_of_squares
from tiny_fsdp.core.ownership import owner_of

_TORCH_CLIP = torch.nn.utils.clip_grad_norm_
_TORCH_CLIP_VALUE = torch.nn.utils.clip_grad_value_


class HeldGrads(NamedTuple):
    """The gradient tensors a rank holds for some parameters.

    ``sharded``: across the ranks of ``group`` (None: the default group) each element is held
    once; otherwise every rank holds the same tensors."""

    grads: List[torch.Tensor]
    sharded: bool
    group: Optional[Any] = None


@torch.no_grad()
def clip_grad_norm_(
    parameters: Union[torch.Tensor, Iterable[torch.Tensor]],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: Optional[bool] = None,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for parameters of any wrapper ([Note: clipping with
    torch's function]); returns the total norm (0-d float32). ``foreach`` is passed on to
    torch's function (parameters of no wrapper) and ignored otherwise."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    if all(owner_of(param) is None for param in params):
        return _TORCH_CLIP(params, max_norm, norm_type, error_if_nonfinite, foreach)
    p = float(norm_type)
    if not (p > 0):
        raise ValueError(f"clip_grad_norm_ over ranks needs norm_type > 0, got {norm_type}")
    replicated: List[torch.Tensor] = []
    sharded: List[torch.Tensor] = []
    groups: Dict[int, Any] = {}
    for held in _held_grads(params):
        if held.sharded:
            groups[id(held.group)] = held.group
        (sharded if held.sharded else replicated).extend(g.detach() for g in held.grads)
    if len(groups) > 1:
        raise NotImplementedError(
            "clip_grad_norm_: these parameters are sharded over different process groups; clip "
            "each wrapper's parameters in its own call"
        )
    device = (replicated + sharded + [params[0]])[0].device
    total = _local_norm(replicated, p, device)
    if groups:
        (group,) = groups.values()
        across = _local_norm(sharded, p, device)
        if math.isinf(p):
            comm.all_reduce(across, op=dist.ReduceOp.MAX, group=group)
            total = torch.maximum(total, across)
        else:
            across = across.pow(p)
            comm.all_reduce(across, group=group)
            total = across.pow(1.0 / p) if not replicated else (total.pow(p) + across).pow(1 / p)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is "
            "non-finite, so it cannot be clipped. To disable this error and scale the gradients "
            "by the non-finite norm anyway, set `error_if_nonfinite=False`"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in replicated + sharded:
        grad.mul_(coef.to(grad.device))
    return total


@torch.no_grad()
def clip_grad_value_(
    parameters: Union[torch.Tensor, Iterable[torch.Tensor]],
    clip_value: float,
    foreach: Optional[bool] = None,
) -> None:
    """``torch.nn.utils.clip_grad_value_`` for parameters of any wrapper: every gradient
    element a rank holds clamped to ``[-clip_value, clip_value]``."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    if all(owner_of(param) is None for param in params):
        return _TORCH_CLIP_VALUE(params, clip_value, foreach)
    for held in _held_grads(params):
        for grad in held.grads:
            grad.detach().clamp_(min=-clip_value, max=clip_value)
    return None


def _held_grads(params: List[torch.Tensor]) -> List[HeldGrads]:
    """What this rank holds of ``params``' gradients, per wrapper (and for parameters of none)."""
    by_owner: Dict[int, List[torch.Tensor]] = {}
    owners: Dict[int, Any] = {}
    for param in params:
        owner = owner_of(param)
        owners[id(owner)] = owner
        by_owner.setdefault(id(owner), []).append(param)
    return [
        (
            HeldGrads([q.grad for q in owned if q.grad is not None], sharded=False)
            if owners[key] is None
            else owners[key].held_grads(owned)
        )
        for key, owned in by_owner.items()
    ]


def _local_norm(grads: List[torch.Tensor], p: float, device: torch.device) -> torch.Tensor:
    """The ``p``-norm of all elements of ``grads``, float32 on ``device``. L2 by the optimizers'
    ``sum_of_squares`` (accurate on large CPU tensors, where torch's norm kernel is not), so
    that torch's function and an optimizer's ``clip_grad_norm_`` agree; others as torch's
    ``get_total_norm``."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    by_device: Dict[torch.device, List[torch.Tensor]] = {}
    for grad in grads:
        by_device.setdefault(grad.device, []).append(grad)
    if p == 2.0:
        return sum(sum_of_squares(g).to(device) for g in by_device.values()).sqrt()
    norms = [torch.linalg.vector_norm(g, p, dtype=torch.float32).to(device) for g in grads]
    return torch.linalg.vector_norm(torch.stack(norms), p)


def install() -> None:
    """Put ``clip_grad_norm_`` and ``clip_grad_value_`` in torch's place (see the note)."""
    for module in (torch.nn.utils, torch.nn.utils.clip_grad):
        module.clip_grad_norm_ = clip_grad_norm_
        module.clip_grad_value_ = clip_grad_value_
