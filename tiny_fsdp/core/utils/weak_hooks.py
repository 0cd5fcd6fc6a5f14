"""Hooks on tensors that hold the object they call weakly.

[Note: tensor hooks hold their owner weakly]
autograd keeps a tensor's hooks (``register_post_accumulate_grad_hook``, ``register_hook``) in
C++, where Python's garbage collector does not look. A hook that references, even through other
objects, the tensor it is registered on therefore makes a cycle the collector never frees: a
strategy's object that holds the parameters it hooks (a layer's full tensors, the watch over the
local parameters) would keep them, their gradients, and through a layer the module itself, alive
after the wrapper is dropped; in a sweep or a notebook that builds one model after another, each
one's memory for good. So a hook on a tensor calls its owner's method through a weak reference
(``WeakHook``): the owner goes with the wrapper, and its hooks then do nothing (the user may keep
the tensors). Hooks on modules need none of this (the module's hook dicts are Python objects the
collector sees through). A deep copy takes a ``WeakHook`` as it is, as it takes a function.
An owner whose hooks stay on tensors the user keeps (the model, once its wrapper is dropped)
removes them when it goes (``remove_when_gone``): wrapping that model again then finds no hook
the user did not register.
"""

import weakref
from typing import Any, Callable, Dict, List

from torch.utils.hooks import RemovableHandle


class WeakHook:
    """``method(*args, *hook_args)`` while ``method``'s object lives; afterwards nothing.
    ``owner_type``: that object's type (it outlives the object)."""

    __slots__ = ("_method", "_args", "owner_type")

    def __init__(self, method: Callable[..., Any], *args: Any) -> None:
        self._method = weakref.WeakMethod(method)
        self._args = args
        self.owner_type = type(method.__self__)

    def __deepcopy__(self, memo: Dict[int, Any]) -> "WeakHook":
        return self

    def __call__(self, *hook_args: Any) -> Any:
        method = self._method()
        if method is None:
            return None
        return method(*self._args, *hook_args)


def remove_when_gone(owner: object, handles: List[RemovableHandle]) -> None:
    """Remove the hooks of ``handles`` (a list the owner may still extend) once ``owner`` is
    collected."""
    weakref.finalize(owner, _remove_all, handles).atexit = False


def _remove_all(handles: List[RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()
