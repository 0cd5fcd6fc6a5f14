"""The one seam between layer math and a data-parallel strategy.

[Note: param handler]
A wrapped layer (see ``base.py``) never touches communication. Each layer has a
``param_handler`` that answers three questions (and a fourth, with a default), and a strategy
is nothing more than a handler (the words full / local / shard / owned are defined in [Note:
glossary], ``core/glossary.py``):

- ``fetch(module, phase)``: the *full* parameters the layer computes with, in
  ``module.param_names`` order (``None`` for an absent bias). Single-device and DDP return the
  parameters themselves; FSDP all-gathers dim-0 shards; ZeRO-3 broadcasts from the owner.
- ``release(module, phase)``: the layer is done with the full parameters (free gathered storage).
- ``describe(module)``: tensors with the shape, dtype and device of the full parameters, whose
  values are not read: what the backward of a layer with ``backward_reads_params`` False (an
  embedding) gets instead of a fetch; nothing to release. By default a fetch and a release
  (the description outlives the values); FSDP and ZeRO-3 gather nothing for it.
- ``reduce_grads(module, grads)``: turn the gradients of the full parameters into the gradients
  of the *local* parameters (the tensors the module really holds: the full tensor, a dim-0 shard,
  or an empty tensor on a rank that does not own it). Per parameter it returns EITHER the local
  gradient, which the caller hands on (autograd accumulates it into ``local_param.grad``), OR
  None: nothing to hand on, because the parameter is absent or frozen, or because the strategy
  delivers the gradient itself. FSDP and ZeRO-3 always do the latter: ``reduce_grads`` only
  *launches* the reduction (asynchronously with async communication on) and the strategy's
  end-of-backward finalize, queued on the autograd engine, accumulates the result into
  ``local_param.grad`` (in the parameter's dtype) before ``backward()`` returns ([Note:
  asynchronous reduction] in ``core/reductions.py``). A caller treats None as "delivered
  later", never as an error. Either way tied parameters (each use's part summed) and
  accumulation onto an existing ``.grad`` need no code in the layers.

Every reduction goes through ``reduce_grads``, whoever calls it (a layer's Function, or a hook
of the generic path), so every caller gets the strategy's asynchronous reduction.

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


def layer_params(module: nn.Module) -> Params:
    """``module``'s parameters in ``param_names`` order (None for an absent bias), read from
    its registered parameters without ``nn.Module.__getattr__`` (a layer's hot path)."""
    params = module._parameters
    return tuple(
        params[name] if name in params else getattr(module, name) for name in module.param_names
    )


class ParamHandler:
    """Single-device behaviour: local parameters are the full parameters, gradients pass through.

    ``reuses_forward_fetch``: the layer may keep what the forward ``fetch`` returned for its
    backward instead of fetching again ([Note: callback layers]): only for a handler whose
    fetch makes copies the backward may use (never one that frees or regathers them).
    """

    reuses_forward_fetch = False

    def fetch(self, module: nn.Module, phase: TrainingPhase) -> Params:
        return layer_params(module)

    def release(self, module: nn.Module, phase: TrainingPhase) -> None:
        pass

    def describe(self, module: nn.Module) -> Params:
        params = self.fetch(module, TrainingPhase.BACKWARD)
        self.release(module, TrainingPhase.BACKWARD)
        return params

    def reduce_grads(self, module: nn.Module, grads: Params) -> Params:
        return grads


LOCAL_HANDLER = ParamHandler()
