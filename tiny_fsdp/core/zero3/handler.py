"""ZeRO-3 inter-tensor layer handler: broadcast from the owner, free, reduce to the owner.

[Note: zero3 tensor life cycle]
Every parameter has one owner rank (the partition table). The owner's ``param.data`` is the full
tensor; on every other rank it is an empty ``(0,)`` tensor of the same dtype and device, and the
full shape is kept in ``param._tiny_fsdp_zero3`` (a ``TensorInfo``, ``runtime.py``). Each layer
is a *unit* ([Note: glossary]): its ``BroadcastUnit`` (``unit.py``) implements the
prefetcher's verbs ([Note: prefetch]); the handler routes the layer seam to it:

- ``fetch``: ``unshard``: the owner broadcasts its tensor; the other ranks receive it into fresh
  buffers (the owner computes with its own tensor, no copy). Every use broadcasts afresh: a
  layer is never kept full between uses (``is_unsharded`` is always False).
- ``release``: ``reshard``: the buffers are dropped. Nothing else holds them (the layer
  callbacks save inputs, never weights), so they are freed; ``Zero3Runtime.stats`` counts them.
- ``reduce_grads``: each rank divides its full gradient by N and launches its SUM-reduce to the
  owner; every rank returns None, and at the end of the backward the owner accumulates the
  result into ``param.grad`` ([Note: asynchronous reduction]). A tied parameter is fetched and
  reduced by both of its layers; the two parts are summed there.

A walk of one parameter through a step: ``zero3.py`` (wrap: owners, handlers) -> the layer
(``module/base.py`` or ``module/generic.py``) -> this file -> ``prefetch.py`` -> ``unit.py``
(broadcast) in forward and backward; -> ``runtime.py`` -> ``reductions.py`` (reduce to the
owner, delivery) in backward; ``optim.py`` (step on the owned tensors).

Under ``no_sync()`` every rank (owner included, so the owner's part is divided by N exactly
once) adds its gradient to a full-size buffer kept here per parameter, and returns None; the next
synchronised backward reduces buffer + gradient. Memory cost: one full gradient per parameter
touched in ``no_sync``, on every rank, i.e. the whole model's gradients, as in DDP.

Mixed precision ([Note: mixed precision]): the owner broadcasts a ``param_dtype`` copy of its
fp32 tensor (received buffers are ``param_dtype``: half the bytes with bf16), the gradient is
reduced in ``reduce_dtype`` and the owner's result is accumulated into the fp32
``param.grad``. The ``no_sync`` buffer is kept in the parameter's dtype (fp32), like ``.grad``.

Prefetch ([Note: prefetch]): with async communication on, a fetch issues the broadcasts of the
next ``prefetch_limit`` layers of the recorded order (``async_op=True``), so at most
``prefetch_limit + 1`` layers are fetched at once outside gradient checkpointing (whose
recomputation nests a layer's forward fetch inside its backward one). Results are bitwise equal
with and without prefetching: the same tensors are broadcast and the same math runs.
"""

from torch import nn

from tiny_fsdp.core.module import ParamHandler
from tiny_fsdp.core.module.handler import Params, TrainingPhase
from tiny_fsdp.core.zero3.runtime import Zero3Runtime
from tiny_fsdp.core.zero3.unit import BroadcastUnit


class Zero3Handler(ParamHandler):
    """Param handler of one layer under ZeRO-3 ([Note: zero3 tensor life cycle]): routes
    fetch / release to the layer's ``BroadcastUnit`` through the prefetcher, reduces to owners."""

    def __init__(self, module: nn.Module, runtime: Zero3Runtime) -> None:
        self.runtime = runtime
        self.unit = BroadcastUnit(module, runtime)
        module.param_handler = self

    def fetch(self, module: nn.Module, phase: TrainingPhase) -> Params:
        self.runtime.fetch(self.unit, phase)
        return self.unit.hold()

    def release(self, module: nn.Module, phase: TrainingPhase) -> None:
        self.unit.reshard()

    def reduce_grads(self, module: nn.Module, grads: Params) -> Params:
        """Launch the reduces of this layer's gradients; delivered at the end of the backward."""
        params, totals = [], []
        for name, grad in zip(module.param_names, grads):
            local = getattr(module, name)
            if local is None or grad is None:  # absent / frozen: alike on every rank
                continue
            total = self.runtime.prepare_reduce(local, grad)
            if total is not None:
                params.append(local)
                totals.append(total)
        if params:
            self.runtime.launch_reduces(params, totals)
        return (None,) * len(grads)  # [Note: asynchronous reduction]
