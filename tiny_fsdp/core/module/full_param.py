"""The full tensor a generic layer computes with, next to the local parameter a strategy keeps.

A ``FullParam`` is made once per parameter of a module on the generic path ([Note: generic
layer], ``generic.py``) or per parameter read outside its layer ([Note: outside reads]). Its
``full`` tensor object lives as long as the layer; only its storage comes and goes: filled
(resized, copied in through ``.data``, so autograd's version counter does not move) before the
module computes, freed (resized to 0 bytes) after.
"""

import copy
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from tiny_fsdp.core.module.layer import local_param
from tiny_fsdp.core.utils import huge_pages


class FullParam:
    """One parameter a generic layer computes with ([Note: generic layer]).

    Attributes:
        local: the parameter the strategy keeps (full, a dim-0 shard, or empty).
        owner: the layer whose handler fetches and reduces it; ``slot``: its index in
            ``owner.param_names``.
        holders: ``(module, attribute)`` registrations swapped to ``full`` while computing.
        full: full-shape tensor object, storage empty when not in use; made at first fill.
    """

    def __init__(self, name: str, owner: nn.Module, slot: int) -> None:
        self.name = name
        self.owner = owner
        self.slot = slot
        self.holders: List[Tuple[nn.Module, str]] = []
        self.full: Optional[nn.Parameter] = None

    def __deepcopy__(self, memo: Dict[int, Any]) -> "FullParam":
        """A copy (of a wrapped model: [Note: copying a wrapped model]) makes its own ``full``
        at its first fill: the original's storage is freed between uses, and a tensor whose
        storage holds 0 bytes cannot be copied."""
        new = FullParam.__new__(FullParam)
        memo[id(self)] = new  # first: the owner's copy reaches this object again
        new.name, new.slot, new.full = self.name, self.slot, None
        new.owner = copy.deepcopy(self.owner, memo)
        new.holders = copy.deepcopy(self.holders, memo)
        return new

    @property
    def local(self) -> nn.Parameter:
        # Looked up, not stored: a strategy may replace the object (a meta parameter made real).
        return local_param(self.owner, self.owner.param_names[self.slot])

    def fill(self, source: torch.Tensor) -> bool:
        """Copy ``source`` into the full storage; True if a new full object had to be made."""
        full, made = self.full, False
        if (
            full is None
            or full.shape != source.shape
            or full.dtype != source.dtype
            or full.device != source.device
            or full.requires_grad != self.local.requires_grad
        ):
            full = torch.empty(source.shape, dtype=source.dtype, device=source.device)
            self.full = full = nn.Parameter(full, requires_grad=self.local.requires_grad)
            made = True
        nbytes = full.numel() * full.element_size()
        storage = full.untyped_storage()
        if storage.size() != nbytes:
            storage.resize_(nbytes)
            huge_pages.advise(full)  # [Note: huge pages for transient buffers]
        with torch.no_grad():
            full.data.copy_(source)  # .data: the version counter does not move
        return made

    def free(self) -> None:
        if self.full is not None:
            self.full.untyped_storage().resize_(0)

    @property
    def is_full(self) -> bool:
        return self.full is not None and self.full.untyped_storage().size() > 0
