"""Buffers made once, whose memory comes and goes: the unshard buffers of FSDP and ZeRO-3.

[Note: buffers made once]
An unshard of a unit of n tensors needs, besides its copies, several views per tensor: its
flat local shard, its place in the send or receive buffer, its full tensor (FSDP also its block
of the copy-out). Made anew in every unshard they are host work that grows with the number of
tensors (GPT-2 124M under FSDP: ~2,000 view ops a step, on a GPU each a host call while the
device may wait). So a unit makes its buffers once, with every view of them (``Memory``), and
gives them memory only while they are in use: ``allocate`` resizes a buffer's storage to its
size, ``free`` to zero (what FSDP2 does with its all-gather output, and our generic layer with
its full parameters). A view follows its storage, so views made once stay valid in every
unshard.

Lifetimes are those of tensors allocated anew ([Note: communication streams]): allocated on the
caller's stream before the collective, freed once the caller has waited for it and no longer
needs it. A buffer is never allocated twice: an unshard issued while the last one still holds
its buffer raises instead of writing over parameters in use. An unshard that raised (a
collective or a copy) drops its group's buffers instead of freeing them, since a collective may
still write them; the next unshard makes new ones. A full tensor handed to a layer
holds no memory after the reshard (its storage is empty), as a dropped tensor would not (on the
CPU path below, one still referenced keeps its block from reuse, as a tensor would).

``MadeOnce`` keeps a unit's buffers, per group: made at the first unshard, again where the gather
dtype or the device changed, after an unshard that raised, and in a copy of the wrapper
(``copy.deepcopy``), which must not gather into the original's memory. ``LocalViews`` keeps
views of a group's local parameters, made again when a parameter's memory
moved (``param.data`` replaced: a dtype or device change), which ``data_ptr`` shows: the kept
views pin the old memory, so a new tensor cannot reuse its address.

Buffers are made outside ``inference_mode`` even when the first unshard runs inside it (a
``generate()``): an inference tensor could not be written in the next training step.

On the CPU, a buffer of ``huge_pages.CACHE_BYTES`` or more takes its memory from the blocks
freed before instead ([Note: reusing large CPU blocks]): a storage's memory cannot be swapped
for another's, so ``Memory`` makes its views again on the block at each ``allocate`` (a few
view ops, host time that only a GPU's step would feel) and puts back, at ``free``, the views
made once, which hold no memory; those keep the shapes and the byte count.
"""

import functools
import math
from typing import Any, Callable, Dict, Generic, Iterator, List, Optional, Sequence, Tuple, TypeVar

import torch

from tiny_fsdp.core.utils import huge_pages

B = TypeVar("B")
V = TypeVar("V")


class MadeOnce(Generic[B]):
    """A unit's buffers, one entry per group, made at the group's first unshard and made again
    where its key (the gather dtype and the device) changed, or after ``forget`` (an unshard
    that raised). A copy of the unit (``copy.deepcopy``) starts without any."""

    def __init__(self, groups: int) -> None:
        self._made: List[Optional[B]] = [None] * groups
        self._keys: List[Any] = [None] * groups

    def get(self, index: int, key: Any, make: Callable[[], B]) -> B:
        """Group ``index``'s buffers for ``key``, made by ``make()`` if need be."""
        made = self._made[index]
        if made is None or self._keys[index] != key:
            made = self._made[index] = make()
            self._keys[index] = key
        return made

    def forget(self, failed: Sequence[B]) -> None:
        """Make these again at their next unshard: dropped, not freed, since a collective may
        still write them; their memory goes with the last reference."""
        self._made = [None if any(m is f for f in failed) else m for m in self._made]

    def __iter__(self) -> Iterator[B]:
        return (made for made in self._made if made is not None)

    def __deepcopy__(self, memo: Dict[int, Any]) -> "MadeOnce[B]":
        return MadeOnce(len(self._made))


class Memory(Generic[V]):
    """A buffer of ``numel`` elements and the views ``make_views(buffer)`` derives from it,
    made once; memory only between ``allocate`` and ``free`` ([Note: buffers made once])."""

    def __init__(
        self,
        numel: int,
        dtype: torch.dtype,
        device: torch.device,
        make_views: Callable[[torch.Tensor], V],
    ) -> None:
        self.numel, self.dtype, self.device = numel, dtype, device
        self.nbytes = numel * dtype.itemsize
        self._make_views = make_views
        self._reuses = huge_pages.reuses(self.nbytes, device)
        with torch.inference_mode(False):
            self.buffer = torch.empty(numel, dtype=dtype, device=device)
            self.views = make_views(self.buffer)
        _free(self.buffer)  # views are made while there is memory; then it goes until needed
        self._made_once = self.buffer, self.views

    def allocate(self) -> V:
        """Give the buffer memory; its views, valid until ``free``."""
        if self._reuses:
            if self.buffer is not self._made_once[0]:
                raise _allocated_twice()
            with torch.inference_mode(False):
                self.buffer = huge_pages.empty(self.numel, self.dtype, self.device)
                self.views = self._make_views(self.buffer)
        else:
            _allocate(self.buffer)
        return self.views

    def free(self) -> None:
        """Return the memory (to the CPU cache: [Note: reusing large CPU blocks])."""
        if self._reuses:
            self.buffer, self.views = self._made_once
        else:
            _free(self.buffer)

    @property
    def holds_memory(self) -> bool:
        return holds_memory(self.buffer)


def _allocated_twice() -> RuntimeError:
    return RuntimeError(
        "a unit was unsharded again while its last unshard still held its buffer ([Note: "
        "buffers made once]): a bug in tiny_fsdp's prefetch order, please report it"
    )


def _allocate(tensor: torch.Tensor) -> torch.Tensor:
    """Give a freed buffer its memory back (on the CPU in huge pages when large)."""
    storage = tensor.untyped_storage()
    if storage.nbytes():
        raise _allocated_twice()
    storage.resize_(tensor.numel() * tensor.element_size())
    huge_pages.advise(tensor)
    return tensor


def _free(tensor: torch.Tensor) -> None:
    """Return a buffer's memory; it and its views stay, spanning no memory until ``allocate``."""
    tensor.untyped_storage().resize_(0)


def holds_memory(tensor: Optional[torch.Tensor]) -> bool:
    """Whether ``tensor`` exists and spans memory (a freed buffer and its views do not)."""
    return tensor is not None and tensor.untyped_storage().nbytes() > 0


class LocalViews:
    """Views of a group's local parameters, flattened (``flat``) or as they are."""

    def __init__(self, flat: bool) -> None:
        self.flat = flat
        self._ptrs: List[int] = []
        self._views: List[torch.Tensor] = []

    def of(self, group: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """The views of ``group``'s tensors, made again where a tensor's memory moved."""
        # A forward's local parameters are a subclass whose __torch_function__ sees each call
        # ([Note: outside reads]): an address needs none of it.
        with torch._C.DisableTorchFunctionSubclass():
            ptrs = [param.data_ptr() for param in group]
        if ptrs != self._ptrs:
            with torch.inference_mode(False):
                self._views = [p.detach().reshape(-1) if self.flat else p.detach() for p in group]
            # A reshape that copied (a non-contiguous tensor) is no view: made each time.
            self._ptrs = ptrs if all(p.is_contiguous() for p in group) else []
        return self._views


def packed_views(flat: torch.Tensor, shapes: Sequence[Sequence[int]]) -> List[torch.Tensor]:
    """Contiguous views of ``flat`` (contiguous) in ``shapes``, back to back from its start: one
    op each, where ``flat.split(sizes)`` and a ``view`` of each piece cost two (host work per
    tensor and backward in the reductions' parts)."""
    views, offset = [], 0
    for shape in shapes:
        views.append(view_at(flat, shape, offset))
        offset += math.prod(shape)
    return views


def view_at(flat: torch.Tensor, shape: Sequence[int], offset: int) -> torch.Tensor:
    """The contiguous view of ``flat`` (contiguous) in ``shape`` from element ``offset`` on;
    one op (a slice and a ``view`` are two)."""
    shape = tuple(shape)
    return flat.as_strided(shape, _contiguous_strides(shape), flat.storage_offset() + offset)


@functools.lru_cache(maxsize=None)
def _contiguous_strides(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    """The strides ``torch.empty(shape)`` has (a size 0 counts as 1, as torch does)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
