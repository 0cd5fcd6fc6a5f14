"""Hooks on tensors that hold the object they call weakly.

[Note: tensor hooks hold their owner weakly]
autograd keeps a tensor's hooks (``register_post_accumulate_grad_hook``, ``register_hook``) in
C++, where Python's garbage collector does not look. A hook that references, even through other
objects, the tensor it is registered on therefore makes a cycle the collector never frees: a
strategy's object that holds the parameters it hooks (a layer's full tensors, the watch over the
local parameters) would keep them, their gradients, and through a layer the module itself, alive
after the wrapper is dropped; in a sweep or a notebook that builds one model after another, each
one's memory for good. So a hook on a tensor calls its owner's method through a weak reference
(``weak_hook``): the owner goes with the wrapper, and its hooks then do nothing (the user may
keep the tensors). Hooks on modules need none of this (the module's hook dicts are Python
objects the collector sees through). An owner whose hooks stay on tensors the user keeps (the
model, once its wrapper is dropped) removes them when it goes (``remove_when_gone``): wrapping
that model again then finds no hook the user did not register.
"""

import weakref
from typing import Any, Callable, List

from torch import Tensor
from torch.utils.hooks import RemovableHandle


def weak_hook(method: Callable[..., Any], *args: Any) -> Callable[[Tensor], Any]:
    """A tensor hook that calls ``method(*args, tensor)`` while ``method``'s object lives, and
    afterwards nothing. Its ``owner_type`` attribute is that object's type (it outlives it)."""
    owner_ref = weakref.ref(method.__self__)  # type: ignore[attr-defined]
    function = method.__func__  # type: ignore[attr-defined]

    def hook(tensor: Tensor) -> Any:
        owner = owner_ref()
        if owner is not None:
            return function(owner, *args, tensor)
        return None

    hook.owner_type = type(method.__self__)  # type: ignore[attr-defined]
    return hook


def remove_when_gone(owner: object, handles: List[RemovableHandle]) -> None:
    """Remove the hooks of ``handles`` (a list the owner may still extend) once ``owner`` is
    collected."""
    weakref.finalize(owner, _remove_all, handles).atexit = False


def _remove_all(handles: List[RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()
