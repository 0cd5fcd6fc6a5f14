"""A unit's module tells the unit when its forward and its backward are over.

[Note: unit module events]
A unit of several layers ([Note: full units]) reshards after a phase, and launches its gradient
reduction ([Note: unit reduction]), once *every* one of its layers is done. That count is local:
a block whose layers do not all run on every rank (a mixture of experts that calls only the
experts its tokens picked, a branch taken on one rank) would reach it on one rank and not on
another. The first rank would then reshard the unit and gather it again, or launch its
reduction, where the other does not, and the ranks' collectives would pair up wrongly: another
unit's gradients summed into this one's, silently.

So a unit that is a module (a block of ``unit="auto"``, a module of a ``unit=[...]`` list) also
hears from that module, whose calls every rank makes alike:

- after the module's forward, layers that did not run count as done in the forward (the unit
  reshards unless the prefetcher keeps it for the backward);
- when the gradients of the module's inputs are computed, i.e. the module's backward is over
  (an identity autograd function on its inputs, FSDP2's post-backward hook), layers that did
  not run count as done in the backward: the unit reshards and its sums are reduced.

Where every layer runs, the count is reached first and the module's events find nothing left
to do; where some did not, the events come at the point the count would have been reached on
the other ranks, before any collective of another unit. A parameter that this rank did not use
contributes zeros to the sums; which parameters receive the reduced gradient is decided in
``PendingReductions.finalize`` ([Note: asynchronous reduction]). A module none of whose inputs
(tensors, also inside tuples, namedtuples, lists and dicts) needs a gradient has no backward
event: its unit's sums are then launched at the end of the backward, which every rank reaches
alike, not when its count completes.
"""

from typing import Any, Callable, Dict, List, Tuple

import torch
from torch import nn

from tiny_fsdp.core.full_unit import FullUnit
from tiny_fsdp.core.module.handler import TrainingPhase
from tiny_fsdp.core.module.layer import strategy_code
from tiny_fsdp.core.unit_grads import UnitGradients
from tiny_fsdp.core.utils.tree import map_tensors


class _BackwardDone(torch.autograd.Function):
    """Identity on the module's inputs; its backward runs once their gradients are complete."""

    @staticmethod
    def forward(ctx: Any, callback: Callable[[], None], *inputs: torch.Tensor) -> Any:
        ctx.callback = callback
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        ctx.callback()
        return (None, *grads)


WATCH_ATTR = "_tiny_fsdp_unit_events"  # on the module: (unit, grads) its hooks tell


def watch_unit_module(module: nn.Module, unit: FullUnit, grads: UnitGradients) -> None:
    """Hook ``module``'s forward and backward ends to ``unit`` and ``grads`` ([Note: unit
    module events]). The hooks find them on the module, not in a closure, so a copy of the
    wrapped model tells its own ([Note: copying a wrapped model])."""
    setattr(module, WATCH_ATTR, (unit, grads))
    module.register_forward_pre_hook(_before, with_kwargs=True)
    module.register_forward_hook(_after)


def _before(module: nn.Module, args: Tuple, kwargs: Dict[str, Any]) -> Tuple[Tuple, Dict[str, Any]]:
    if not torch.is_grad_enabled():
        return args, kwargs
    unit, grads = getattr(module, WATCH_ATTR)
    found: List[torch.Tensor] = []
    _needing_grad((args, kwargs), lambda t: found.append(t) or t)
    # Without an input that needs a gradient there is no backward event: the unit's sums
    # wait for the end of the backward on every rank, not for a count that is local.
    grads.launch_when_complete = bool(found)
    if not found:
        return args, kwargs

    def backward_done() -> None:
        with strategy_code():
            unit.module_done(TrainingPhase.BACKWARD)
            grads.module_backward_done()

    done = iter(_BackwardDone.apply(backward_done, *found))
    return _needing_grad((args, kwargs), lambda _: next(done))


def _after(module: nn.Module, *_: Any) -> None:
    unit, _grads = getattr(module, WATCH_ATTR)
    with strategy_code():  # it reads local parameters ([Note: outside reads])
        unit.module_done(TrainingPhase.FORWARD)


def _needing_grad(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``value`` with ``fn(t)`` in place of each tensor ``t`` that needs a gradient."""
    return map_tensors(value, lambda t: fn(t) if t.requires_grad else t)
