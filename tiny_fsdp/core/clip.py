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
(element by element: no communication; under ZeRO-2 torch's found none and raised). The two
halves of ``clip_grad_norm_`` that torch also offers (torchtitan's way) are replaced alike:
``get_total_norm(grads)`` takes gradient tensors, so it recognises among them the ``.grad``
shards of FSDP / ZeRO-3 parameters and the ``.grad`` of ZeRO-1 parameters, whose average after a
synchronised backward is only in this rank's owned chunks (looked up in the live wrappers), and
combines the norm of what each rank holds of them over the group; ``clip_grads_with_norm_(params,
max_norm, total)`` scales what this rank holds.
(ZeRO-2 keeps no ``.grad``, so a norm of ``p.grad`` tensors finds none there: clip with
``clip_grad_norm_``.) A script that imported torch's functions by name before importing
tiny_fsdp keeps torch's: the functions are also ``tiny_fsdp.core``'s.
"""

import math
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Set, Tuple, Union

import torch
import torch.distributed as dist

from tiny_fsdp.core import comm
from tiny_fsdp.core.optim.base import sum_of_squares
from tiny_fsdp.core.ownership import live_wrappers, owner_of

_TORCH_CLIP = torch.nn.utils.clip_grad_norm_
_TORCH_CLIP_VALUE = torch.nn.utils.clip_grad_value_
_TORCH_TOTAL_NORM = torch.nn.utils.get_total_norm
_TORCH_CLIP_WITH_NORM = torch.nn.utils.clip_grads_with_norm_


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
    held = _held_grads(params)
    total = _total_norm(held, norm_type, error_if_nonfinite, params[0].device)
    _scale(held, max_norm, total)
    return total


@torch.no_grad()
def get_total_norm(
    tensors: Union[torch.Tensor, Iterable[torch.Tensor]],
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: Optional[bool] = None,
) -> torch.Tensor:
    """``torch.nn.utils.get_total_norm`` over ranks: gradients (``p.grad``) of FSDP / ZeRO-3
    parameters are this rank's shards, and ZeRO-1's hold the average in this rank's owned
    chunks only (after a synchronised backward), so their norm is that of what each rank
    holds, combined over the group, as ``clip_grad_norm_`` does; any other tensor counts as
    every rank's own. Every rank calls it when any tensor is such a gradient (as with FSDP2's
    DTensor norm)."""
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    covered, sharded = _sharded_held(tensors)
    if not sharded:
        return _TORCH_TOTAL_NORM(tensors, norm_type, error_if_nonfinite, foreach)
    held = [HeldGrads([t for t in tensors if id(t) not in covered], sharded=False), *sharded]
    return _total_norm(held, norm_type, error_if_nonfinite, tensors[0].device)


@torch.no_grad()
def clip_grads_with_norm_(
    parameters: Union[torch.Tensor, Iterable[torch.Tensor]],
    max_norm: float,
    total_norm: torch.Tensor,
    foreach: Optional[bool] = None,
) -> None:
    """``torch.nn.utils.clip_grads_with_norm_`` for parameters of any wrapper: the gradients
    this rank holds (ZeRO-1/2: its reduced chunks) scaled by ``max_norm / total_norm``."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    if all(owner_of(param) is None for param in params):
        return _TORCH_CLIP_WITH_NORM(params, max_norm, total_norm, foreach)
    _scale(_held_grads(params), max_norm, total_norm)
    return None


def _total_norm(
    held: List[HeldGrads], norm_type: float, error_if_nonfinite: bool, device: torch.device
) -> torch.Tensor:
    """The ``norm_type``-norm over ranks of ``held``: replicated tensors counted once, sharded
    ones summed over their group (``p``-th powers; the maximum for ``inf``)."""
    p = float(norm_type)
    if not (p > 0):
        raise ValueError(f"a gradient norm over ranks needs norm_type > 0, got {norm_type}")
    replicated: List[torch.Tensor] = []
    sharded: List[torch.Tensor] = []
    groups: Dict[int, Any] = {}
    for part in held:
        if part.sharded:
            groups[id(part.group)] = part.group
        (sharded if part.sharded else replicated).extend(g.detach() for g in part.grads)
    if len(groups) > 1:
        raise NotImplementedError(
            "a gradient norm over parameters sharded over different process groups; take "
            "each wrapper's norm in its own call"
        )
    device = (replicated + sharded)[0].device if replicated + sharded else device
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
    return total


def _scale(held: List[HeldGrads], max_norm: float, total: torch.Tensor) -> None:
    """Scale every held gradient by ``min(1, max_norm / (total + 1e-6))``, torch's arithmetic."""
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for part in held:
        for grad in part.grads:
            grad.detach().mul_(coef.to(grad.device))


def _sharded_held(tensors: List[torch.Tensor]) -> Tuple[Set[int], List[HeldGrads]]:
    """The ids of the tensors among ``tensors`` that are the ``.grad`` of parameters whose
    gradient the ranks hold in parts (FSDP / ZeRO-3 shards, ZeRO-1's owned chunks), and what
    this rank holds of those gradients, per wrapper."""
    wanted = {id(t) for t in tensors}
    covered: Set[int] = set()
    held: List[HeldGrads] = []
    for wrapper in live_wrappers():
        params = [p for p in wrapper.parameters() if p.grad is not None and id(p.grad) in wanted]
        if not params:
            continue
        ids = [id(p.grad) for p in params]  # before held_grads, which may adopt a new .grad
        part = wrapper.held_grads(params)
        if part.sharded:  # else every rank holds the whole of each (DDP): counted as given
            covered.update(ids)
            held.append(part)
    return covered, held


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
    norms = [_norm(g, p).to(device) for g in grads]
    return torch.linalg.vector_norm(torch.stack(norms), p)


def _norm(grad: torch.Tensor, p: float) -> torch.Tensor:
    """``grad``'s ``p``-norm in float32 (of the moduli for a complex ``grad``, as torch's)."""
    if grad.is_complex():
        return torch.linalg.vector_norm(grad, p).float()
    return torch.linalg.vector_norm(grad, p, dtype=torch.float32)


def install() -> None:
    """Put the functions above in torch's place (see the note)."""
    for module in (torch.nn.utils, torch.nn.utils.clip_grad):
        module.clip_grad_norm_ = clip_grad_norm_
        module.clip_grad_value_ = clip_grad_value_
    torch.nn.utils.get_total_norm = get_total_norm
    torch.nn.utils.clip_grads_with_norm_ = clip_grads_with_norm_
