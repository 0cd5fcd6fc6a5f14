"""Which wrapper manages a parameter: one tag, set at wrap time.

[Note: ownership tag]
Every parameter of a model wrapped by a strategy (DDP, ZeRO-1/2/3, FSDP) carries one attribute,
``_tiny_fsdp_owner``: a weak reference to its wrapper (weak, so a discarded wrapper does not live
on through its parameters). It answers the two questions asked from outside a strategy:

- "is this model already wrapped?": wrapping a parameter with a live owner raises (wrap once);
- "may a plain optimizer update it?": not when the owner updates only its local part
  (``DataParallelWrapper.updates_local_part``); the optimizers ask ``owner_of``.

What a strategy keeps about the parameter's geometry (FSDP's shard, ZeRO-3's owner rank and full
shape) is the strategy's own business and lives with the strategy.
"""

import weakref
from typing import Any, List, Optional

import torch

TAG_PREFIX = "_tiny_fsdp_"  # every attribute a strategy puts on a parameter starts so
OWNER_ATTR = TAG_PREFIX + "owner"
_LIVE: "weakref.WeakSet[Any]" = weakref.WeakSet()  # every wrapper that tagged a tensor


def owner_of(tensor: torch.Tensor) -> Optional[Any]:
    """The live wrapper that manages ``tensor``, or None."""
    ref = getattr(tensor, OWNER_ATTR, None)
    return ref() if ref is not None else None


def tag_owner(tensor: torch.Tensor, wrapper: Any) -> None:
    """Mark ``tensor`` as managed by ``wrapper`` ([Note: ownership tag])."""
    setattr(tensor, OWNER_ATTR, weakref.ref(wrapper))
    _LIVE.add(wrapper)


def live_wrappers() -> List[Any]:
    """The wrappers alive in this process (a gradient tensor carries no tag: look there)."""
    return list(_LIVE)
