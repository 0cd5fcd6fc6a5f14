"""The one seam between layer math and a data-parallel strategy.

[Note: param handler]
A wrapped layer (see ``base.py``) never touches communication. Each layer has a
``param_handler`` that answers three questions, and a strategy is nothing more than a handler
(the words full / local / shard / owned are defined in [Note: glossary], ``core/glossary.py``):

- ``fetch(module, phase)``: the *full* parameters the layer computes with, in
  ``module.param_names`` order (``None`` for an absent bias). Single-device and DDP return the
  parameters themselves; FSDP all-gathers dim-0 shards; ZeRO-3 broadcasts from the owner.
- ``release(module, phase)``: the layer is done with the full parameters (free gathered storage).
- ``reduce_grads(module, grads)``: turn the gradients of the full parameters into the gradients
  of the *local* parameters (the tensors the module really holds: the full tensor, a dim-0 shard,
  or an empty tensor on a rank that does not own it). Autograd then accumulates the result into
  ``local_param.grad``, so tied parameters and accumulation need no special code.

``phase`` is a ``TrainingPhase``: ``FORWARD`` or ``BACKWARD``. The backward fetch is where a
strategy that freed its parameters after forward gathers them again. A forward fetch also
happens inside backward when gradient checkpointing recomputes a block.
"""

import enum
from typing import Optional, Tuple

import torch
from torch import nn

Params = Tuple[Optional[torch.Tensor], ...]


class TrainingPhase(enum.Enum):
    """Which pass a ``fetch`` / ``release`` belongs to ([Note: param handler])."""

    FORWARD = "forward"
    BACKWARD = "backward"


class ParamHandler:
    """Single-device behaviour: local parameters are the full parameters, gradients pass through."""

    def fetch(self, module: nn.Module, phase: TrainingPhase) -> Params:
        return tuple(getattr(module, name) for name in module.param_names)

    def release(self, module: nn.Module, phase: TrainingPhase) -> None:
        pass

    def reduce_grads(self, module: nn.Module, grads: Params) -> Params:
        return grads


LOCAL_HANDLER = ParamHandler()
