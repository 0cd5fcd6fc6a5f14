"""Parameters read outside the forward under FSDP / ZeRO-3 (a penalty in the loss): a warning.

[Note: parameters in the loss]
Outside the forward, ``model.parameters()`` are what a rank holds: FSDP's dim-0 shards (padding
rows zero), ZeRO-3's owned tensors (empty tensors for the others'). A loss term computed from
them there (``lam * sum(p.pow(2).sum() for p in model.parameters())``, an L2 penalty) reaches
``.grad`` through autograd's own ``AccumulateGrad``, before the end of the backward adds the
reduced gradients to it ([Note: asynchronous reduction]). For a sum over elements that is what
torch's DDP computes: each element's gradient needs only that element, and the term is the same
on every rank, so its average over ranks is itself. Its value is this rank's part (summed over
ranks: the whole). A function of a whole tensor (its norm, under FSDP) or of several (a global
norm) sees parts and trains wrong; inside the forward the same read gets full tensors ([Note:
outside reads]).

Such a term is found by its effect: autograd accumulating into a local parameter's ``.grad``,
which no layer of the strategies lets it do (a layer returns no gradient for its local
parameters; the reduced one is delivered at the end of the backward). ``LocalGradWatch`` notes
each local ``.grad`` (object and version) at every forward with grad enabled and after every
delivery, and a post-accumulate-grad hook on each local parameter (which autograd also calls
when nothing was accumulated) compares: a ``.grad`` that changed since is such a term, and it
warns, once, with the above. ``check_no_param_hooks`` tells its hooks from a user's.
"""

import os
import sys
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

import tiny_fsdp
from tiny_fsdp.core.utils.weak_hooks import remove_when_gone, weak_hook

Stamp = Optional[Tuple[int, int]]  # a .grad's object and version, or None

LOSS_READ_WARNING = (
    "{what}: autograd accumulated a gradient into this rank's part of a parameter: the loss "
    "used model.parameters() outside the forward (e.g. a penalty lam * sum(p.pow(2).sum() ...)). "
    "Outside the forward a rank holds only its part of each parameter (FSDP: a dim-0 shard, "
    "ZeRO-3: the tensors it owns, empty tensors for the others), so the term's value is this "
    "rank's part (sum it over ranks to see the whole). A sum over elements (L2, L1) trains as "
    "under torch's DDP; a function of a whole tensor (its norm) does not: compute it in the "
    "model's forward, which reads full tensors. [Note: parameters in the loss]"
)


class LocalGradWatch:
    """Warns once if autograd accumulates into a local parameter ([Note: parameters in the
    loss]); ``note_grads`` at every forward with grad enabled and after every delivery."""

    def __init__(self, module: nn.Module, what: str) -> None:
        self.what = what
        self.warned = False
        self._params: List[nn.Parameter] = []  # hooked: trainable now or since wrapping
        self._frozen = list(module.parameters())  # not hooked yet: frozen so far
        self._seen: Dict[int, Stamp] = {}  # id(param) -> its .grad when last noted
        self._handles: List[RemovableHandle] = []
        remove_when_gone(self, self._handles)
        self._hook_trainable()

    def note_grads(self) -> None:
        """The ``.grad`` every local parameter has now is no such term's."""
        if not self.warned:
            self._hook_trainable()  # a parameter unfrozen after wrapping
            self._seen = {id(p): _stamp(p.grad) for p in self._params}

    def _hook_trainable(self) -> None:
        for param in [p for p in self._frozen if p.requires_grad]:
            # [Note: tensor hooks hold their owner weakly]
            hook = weak_hook(self._accumulated)
            self._handles.append(param.register_post_accumulate_grad_hook(hook))
            self._params.append(param)
        self._frozen = [p for p in self._frozen if not p.requires_grad]

    def _accumulated(self, param: torch.Tensor) -> None:
        if self.warned or param.grad is None:
            return
        if _stamp(param.grad) != self._seen.get(id(param)):
            self.warned = True
            message = LOSS_READ_WARNING.format(what=self.what)
            warnings.warn(message, stacklevel=_callers_level())


def is_loss_read_hook(hook: Callable[..., Any]) -> bool:
    """Whether ``hook`` is a strategy's own (a ``LocalGradWatch``'s, live or not), not a user's."""
    return issubclass(getattr(hook, "owner_type", type(None)), LocalGradWatch)


def _callers_level() -> int:
    """``stacklevel`` for ``warnings.warn`` called by this function's caller: the first frame
    outside torch and tiny_fsdp (the user's ``loss.backward()``), not autograd's engine."""
    internal = tuple(os.path.dirname(m.__file__) for m in (torch, tiny_fsdp))
    frame, level = sys._getframe(2), 2
    while frame.f_back is not None and frame.f_code.co_filename.startswith(internal):
        frame, level = frame.f_back, level + 1
    return level


def _stamp(grad: Optional[torch.Tensor]) -> Stamp:
    return None if grad is None else (id(grad), grad._version)
