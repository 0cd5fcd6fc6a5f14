"""DDP mixed precision without layer wrappers: parameters compute with low-precision copies.

[Note: DDP mixed precision]
DDP trains the user's modules as they are ([Note: replicated strategies]), so no layer can cast
what it fetches ([Note: mixed precision]). Instead, under ``MixedPrecisionPolicy(param_dtype,
reduce_dtype)``, each parameter's *data* changes for the length of a forward and its backward,
while the Parameter objects stay the ones every module holds:

1. ``to_compute`` (a forward pre-hook of the inner model, so any call of it: through DDP, a
   method of the model such as ``generate``, ``model.module(x)``): each floating parameter puts
   its fp32 tensor aside (its *master*) and ``param.data`` becomes a ``param_dtype`` copy of it.
   Every module, a tied head, a parent reading a child's weight: all compute in ``param_dtype``
   without a change to their code. (A submodule called on its own, outside a call of the
   model, finds the fp32 masters in place and computes in fp32.)
2. Backward: autograd saves leaf parameters as the objects themselves, so the copies must stay
   in place until backward ends. Gradients come out in ``param_dtype``; DDP's store divides them
   into its buckets, whose dtype is ``reduce_dtype`` (what the all-reduce moves).
3. ``to_master`` (the end of backward, ``store.end`` in [Note: bucketed backward]):
   ``param.data`` is the fp32 master again and ``param.grad`` an fp32 tensor: the bucket slot
   itself when ``reduce_dtype`` is the master dtype (gradient as bucket view, [Note: gradient
   bucket layout]), else an fp32 copy of the average. The optimizer updates fp32 masters with
   fp32 gradients into fp32 state.

torch refuses to give a parameter that holds ``param_dtype`` data an fp32 ``.grad``, so the store
assigns gradients through ``set_grad``, which keeps such an assignment until ``to_master``. An fp32
``.grad`` that exists before the forward stays (only ``.data`` changes), and autograd adds the
``param_dtype`` gradients into it in place, in fp32: ``no_sync`` micro-steps accumulate in fp32
(the store moves a fresh ``param_dtype`` gradient into fp32 at the end of its micro-step).

A forward that no backward follows (gradients disabled: evaluation under ``torch.no_grad()``;
one that raised) restores the masters when it returns; ``state_dict`` / ``load_state_dict``
restore them too. The hooks (and the policy's input casts) act on DDP's own model while DDP
lives: a copy of the inner model (``copy.deepcopy(model.module)``: an EMA, an export), or the
model once DDP is dropped, is the plain fp32 model; a copy of DDP hooks its own. A
second forward before the backward reuses the copies. Between a forward with gradients and its
backward the parameters hold the copies, as in torch's DDP: do not step the optimizer there.
Frozen parameters compute in ``param_dtype`` too. Buffers keep their dtype: a module that mixes
them with ``param_dtype`` activations must cast them itself, except BatchNorm, whose fp32 running
statistics get its weight and bias in their dtype ([Note: batch norm under a policy]).
Memory: one ``param_dtype`` copy of the parameters from forward to the end of backward; nothing
is kept between steps.
"""

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from tiny_fsdp.core.utils.casts import cast_all


class ParamCast:
    """Swaps ``params`` between their masters and ``dtype`` compute copies ([Note: DDP mixed
    precision]). Parameters already of ``dtype``, or not floating point, are left alone."""

    def __init__(self, params: Sequence[nn.Parameter], dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.params: List[nn.Parameter] = [
            p for p in params if p.is_floating_point() and p.dtype != dtype
        ]
        self._masters: Optional[List[torch.Tensor]] = None  # set while the copies are in place
        self._deferred: Dict[int, Tuple[nn.Parameter, torch.Tensor]] = {}  # id(param) -> grad

    @property
    def in_compute(self) -> bool:
        """The parameters hold their compute copies (between ``to_compute`` and ``to_master``)."""
        return self._masters is not None

    @torch.no_grad()
    def to_compute(self) -> None:
        """``param.data`` := a ``dtype`` copy of the master (no-op if the copies are in place)."""
        if self.in_compute:
            return
        self._masters = [p.data for p in self.params]
        for p, copy in zip(self.params, cast_all(self._masters, self.dtype)):
            p.data = copy  # [Note: casts in one launch]

    def to_master(self, attach_grads: bool = True) -> None:
        """``param.data`` := the master again; then the gradients kept by ``set_grad`` become
        ``.grad`` (``attach_grads`` False: they are dropped, after a failed backward)."""
        if self._masters is None:
            return
        for p, master in zip(self.params, self._masters):
            p.data = master
        self._masters = None
        deferred, self._deferred = self._deferred, {}
        if attach_grads:
            for p, grad in deferred.values():
                p.grad = grad

    def set_grad(self, param: nn.Parameter, grad: Optional[torch.Tensor]) -> None:
        """``param.grad = grad``, at ``to_master`` if ``param`` holds a copy of another dtype."""
        if grad is not None and grad.dtype != param.dtype:
            assert self.in_compute, "a gradient of another dtype than its master"
            param.grad = None  # frees the low-precision gradient now
            self._deferred[id(param)] = (param, grad)
            return
        self._deferred.pop(id(param), None)
        param.grad = grad
