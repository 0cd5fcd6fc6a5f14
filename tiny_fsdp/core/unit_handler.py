"""The layer handler of FSDP and ZeRO-3: the seam routed to the layer's unit and its gradients.

[Note: unit handler]
Under FSDP and ZeRO-3 every layer belongs to one unit ([Note: full units]; FSDP's
``GatherUnit``, ZeRO-3's ``BroadcastUnit``) and each unit has its ``UnitGradients`` ([Note:
unit reduction]). A layer's ``UnitHandler`` only routes the seam ([Note: param handler]):

- ``fetch``: the strategy's prefetcher makes the unit full (its prefetched unshard, or one
  issued now) and prefetches what follows ([Note: prefetch]); the layer's full parameters are
  then read from the unit.
- ``release``: the unit reshards once all its layers that read it are done in this phase.
- ``describe``: the unit's ``described`` tensors, for the backward of a layer that reads only
  its parameters' description (an embedding): nothing is unsharded or held ([Note: full
  units]).
- ``reduce_grads``: the layer's full gradients go into the unit's sums, reduced once the unit's
  last layer has added and delivered into ``.grad`` at the end of the backward; so ``None`` is
  returned for every parameter ([Note: asynchronous reduction]).

The walk of one parameter through a step, file by file (none is entered twice in one chain):
the wrapper (``fsdp/fsdp.py`` or ``zero3/zero3.py``: shard or assign owners, build units and
handlers) -> the layer (``module/base.py``, or ``module/generic.py``) -> this file ->
``prefetch.py`` -> the unit (``fsdp/unit.py`` all-gather, ``zero3/unit.py`` broadcast) ->
``streams.py`` -> ``comm.py``, in forward and in backward; in backward also this file ->
``unit_grads.py`` -> the strategy's layout (``fsdp/grads.py``, ``zero3/grads.py``) -> its
state (``fsdp/state.py``, ``zero3/runtime.py``) -> ``reductions.py`` (launch; delivery at the
end of the backward); then the optimizer (``fsdp/optim.py``, ``zero3/optim.py``) steps on the
local part.
"""

from torch import nn

from tiny_fsdp.core.full_unit import FullUnit
from tiny_fsdp.core.module.handler import ParamHandler, Params, TrainingPhase
from tiny_fsdp.core.module.layer import strategy_code
from tiny_fsdp.core.unit_grads import UnitGradients


class UnitHandler(ParamHandler):
    """Fetch / release through ``unit`` and its state's prefetcher; gradients into ``grads``."""

    def __init__(self, module: nn.Module, unit: FullUnit, grads: UnitGradients) -> None:
        self.unit = unit
        self.grads = grads
        self.n_slots = len(module.param_names)
        module.param_handler = self

    # Each entry is strategy code: it reads local parameters, its unit's and the units it
    # prefetches ([Note: outside reads]).
    def fetch(self, module: nn.Module, phase: TrainingPhase) -> Params:
        with strategy_code():
            self.unit.state.fetch(self.unit, phase)  # the state is the strategy's prefetcher
            return self.unit.hold(module)

    def release(self, module: nn.Module, phase: TrainingPhase) -> None:
        with strategy_code():
            self.unit.release(module, phase)

    def describe(self, module: nn.Module) -> Params:
        return self.unit.described(module)  # nothing gathered, nothing held

    def reduce_grads(self, module: nn.Module, grads: Params) -> Params:
        with strategy_code():
            self.grads.add(module, grads)
        return (None,) * self.n_slots  # [Note: asynchronous reduction]

    def __repr__(self) -> str:
        return f"UnitHandler({self.unit.name!r})"
