"""FSDP's per-layer ``ParamHandler``: full parameters from the layer's gather unit, gradients to it.

[Note: FSDP layer handler]
Each wrapped layer gets one ``FSDPHandler``; its parameters are dim-0 shards ([Note: dim-0
shards]) and it belongs to one gather unit ([Note: gather units]). The handler only routes:

- ``fetch``: the shared prefetcher makes the unit full (its prefetched all-gather, or one
  issued now) and prefetches what follows ([Note: prefetch]); the layer's full parameters are
  then read from the unit.
- ``release``: the unit reshards once all its layers are done in this phase.
- ``reduce_grads``: the layer's full gradients go into the unit's sum, reduce-scattered once
  the unit's last layer has added ([Note: unit reduction]) and delivered into ``.grad`` at the
  end of the backward; so ``None`` is returned for every parameter ([Note: asynchronous
  reduction]).

A walk of one parameter through a step: ``fsdp.py`` (wrap: shard, build units and handlers)
-> ``module/base.py`` or ``module/generic.py`` (the layer) -> this file -> ``prefetch.py`` ->
``unit.py`` (all-gather) in forward and backward; -> ``core/unit_grads.py`` -> ``grads.py`` ->
``state.py`` -> ``reductions.py`` (reduce-scatter, delivery) in backward; ``optim.py`` (step
on the shard).
"""

from torch import nn

from tiny_fsdp.core.fsdp.state import FSDPState
from tiny_fsdp.core.fsdp.unit import GatherUnit
from tiny_fsdp.core.module.handler import ParamHandler, Params, TrainingPhase
from tiny_fsdp.core.unit_grads import UnitGradients


class FSDPHandler(ParamHandler):
    """Fetch / release through a gather unit; gradients into the unit's sum."""

    def __init__(
        self, module: nn.Module, unit: GatherUnit, grads: UnitGradients, state: FSDPState
    ) -> None:
        self.unit = unit
        self.grads = grads
        self.state = state
        self.n_slots = len(module.param_names)

    def fetch(self, module: nn.Module, phase: TrainingPhase) -> Params:
        self.state.fetch(self.unit, phase)
        return self.unit.hold(module)

    def release(self, module: nn.Module, phase: TrainingPhase) -> None:
        self.unit.release(module, phase)

    def reduce_grads(self, module: nn.Module, grads: Params) -> Params:
        self.grads.add(module, grads)
        return (None,) * self.n_slots  # [Note: asynchronous reduction]
