"""Which wrapper manages a parameter: one tag, set at wrap time.

[Note: ownership tag]
Every parameter of a model wrapped by a strategy (DDP, ZeRO-1/2/3, FSDP) carries one attribute,
``_tiny_fsdp_owner``: a weak reference to its wrapper (weak, so a discarded wrapper does not live
on through its parameters). It answers the questions asked from outside a strategy:

- "is this model already wrapped?": wrapping a parameter with a live owner raises (wrap once);
- "was it changed by a wrapper that is gone?": a strategy that gave a parameter storage of its
  own (a flat buffer's view, a shard, an empty tensor on a rank that does not own it) changed it
  for good, so a model one of them wrapped, its wrapper since dropped (``FSDP(block)`` written as
  FSDP2's in-place ``fully_shard(block)``), is refused too (``changed_by``: the reference keeps
  the wrapper's class, and the strategy marks it ``changed`` once it has replaced the data); a
  dropped DDP, or a wrapper whose construction failed before that point, left the parameters as
  they were, and wrapping them again works;
- "may a plain optimizer update it?": not when the owner updates only its local part
  (``DataParallelWrapper.updates_local_part``); the optimizers ask ``owner_of``.

What a strategy keeps about the parameter's geometry (FSDP's shard, ZeRO-3's owner rank and full
shape) is the strategy's own business and lives with the strategy.
"""

import weakref
from typing import Any, List, Optional

import torch

from tiny_fsdp.core.pickling import refuse_pickling

TAG_PREFIX = "_tiny_fsdp_"  # every attribute a strategy puts on a parameter starts so
OWNER_ATTR = TAG_PREFIX + "owner"
_LIVE: "weakref.WeakSet[Any]" = weakref.WeakSet()  # every wrapper that tagged a tensor


class _OwnerRef(weakref.ref):
    """A weak reference to a wrapper that keeps, for when the wrapper is gone, its class name and
    whether it gave the tagged parameter storage of its own."""

    def __new__(cls, wrapper: Any, changed: bool) -> "_OwnerRef":
        # weakref.ref's second argument is a callback run when the wrapper dies: none here.
        return super().__new__(cls, wrapper)

    def __init__(self, wrapper: Any, changed: bool) -> None:
        super().__init__(wrapper)
        self.kind = type(wrapper).__name__
        self.changed = changed

    def __reduce__(self) -> Any:
        owner = self()
        if owner is not None and owner.gathers_full_tensors:
            refuse_pickling(type(owner).__name__)
        return type(None), ()  # a pickled copy is no wrapper's: [Note: pickling a wrapped model]

    def __copy__(self) -> "_OwnerRef":
        return self  # as copy treats a weakref.ref: atomic

    def __deepcopy__(self, memo: Any) -> "_OwnerRef":
        return self


def owner_of(tensor: torch.Tensor) -> Optional[Any]:
    """The live wrapper that manages ``tensor``, or None."""
    ref = getattr(tensor, OWNER_ATTR, None)
    return ref() if ref is not None else None


def changed_by(tensor: torch.Tensor) -> Optional[str]:
    """The class name of a wrapper, now gone, that gave ``tensor`` storage of its own (a flat
    buffer's view, a shard); None if there was none or it is alive ([Note: ownership tag])."""
    ref = getattr(tensor, OWNER_ATTR, None)
    if ref is None or ref() is not None or not ref.changed:
        return None
    return ref.kind


def tag_owner(tensor: torch.Tensor, wrapper: Any, changed: Optional[bool] = None) -> None:
    """Mark ``tensor`` as managed by ``wrapper`` ([Note: ownership tag]); ``changed``: the
    wrapper has given it storage of its own (None: as its tag says, False without one; a deep
    copy's parameters keep what the original's said)."""
    if changed is None:
        changed = bool(getattr(getattr(tensor, OWNER_ATTR, None), "changed", False))
    setattr(tensor, OWNER_ATTR, _OwnerRef(wrapper, changed))
    _LIVE.add(wrapper)


def live_wrappers() -> List[Any]:
    """The wrappers alive in this process (a gradient tensor carries no tag: look there)."""
    return list(_LIVE)
