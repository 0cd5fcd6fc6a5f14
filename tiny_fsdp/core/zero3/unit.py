"""A ZeRO-3 unit: the whole tensors of one or more layers, broadcast from their owners, then freed.

[Note: zero3 tensor life cycle]
Every parameter has one owner rank (the partition table). The owner's ``param.data`` is the full
tensor; on every other rank it is an empty ``(0,)`` tensor of the same dtype and device, and the
full shape is kept in ``param._tiny_fsdp_zero3`` (a ``TensorInfo``, ``runtime.py``). Each layer
belongs to a *unit* ([Note: glossary]; the model's blocks by default, ``unit_layout.py``), and
its ``UnitHandler`` routes the layer seam ([Note: unit handler]):

- ``fetch``: the unit's ``unshard`` (this file): each owner broadcasts its tensors of the unit
  (one collective per owner and dtype); the other ranks receive them into buffers that get
  memory for the fetch ([Note: buffers made once]).
- ``release``: once all the unit's layers are done, ``reshard``: the buffers' memory is freed
  (the layer callbacks save inputs, never weights, so nothing reads it later);
  ``Zero3Runtime.stats`` counts them.
- ``reduce_grads``: the layer's full gradients are summed into the unit's buffers, one per
  owner and dtype ([Note: unit reduction], ``grads.py``); divided by N and SUM-reduced to the
  owner once the unit's last layer has added; at the end of the backward the owner accumulates
  the result into ``param.grad`` ([Note: asynchronous reduction]). A tied parameter used by two
  layers of one unit is broadcast and reduced once.

Under ``no_sync()`` every rank (owner included, so the owner's part is divided by N exactly
once) keeps the unit's buffers, full size, and the next synchronised backward adds to them and
reduces the total. Memory cost: the whole model's gradients on every rank, as in DDP.

Mixed precision ([Note: mixed precision]): the owner broadcasts a ``param_dtype`` copy of its
fp32 tensor (received buffers are ``param_dtype``: half the bytes with bf16), the gradient is
reduced in ``reduce_dtype`` and the owner's result is accumulated into the fp32
``param.grad``. The ``no_sync`` buffer is kept in the parameter's dtype (fp32), like ``.grad``.

Prefetch ([Note: prefetch]): with async communication on, a fetch issues the broadcasts of the
next ``prefetch_limit`` units of the recorded order (``async_op=True``), so at most
``prefetch_limit + 1`` units are fetched at once, and a unit kept from forward to backward (the
first of the backward). Results are bitwise equal with and without prefetching: the same
tensors are broadcast and the same math runs.

The unit implements the prefetcher's verbs ([Note: prefetch]); holding and releasing are
``FullUnit``'s ([Note: full units]). The unit's tensors of one owner and dtype travel in one
broadcast: the owner sends them concatenated into one buffer (a single tensor as it is), every
other rank receives into its buffer and computes with views of it; the owner computes with
its own tensors (with a cast copy under mixed precision). With ``unit="tensor"`` every tensor
has its own broadcast, as the first ZeRO-3 here did.
"""

import functools
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import nn

from tiny_fsdp.core import comm
from tiny_fsdp.core.full_unit import FullUnit, copied_model_error
from tiny_fsdp.core.streams import GATHER, CommHandle
from tiny_fsdp.core.unit_layout import grouped, unit_params
from tiny_fsdp.core.utils.storage import LocalViews, MadeOnce, Memory, packed_views
from tiny_fsdp.core.zero3.runtime import ATTR, TensorInfo, Zero3Runtime, owner_and_dtype


@dataclass
class PendingBroadcast:
    """A unit's full parameters, possibly still arriving (``handle`` not yet waited)."""

    full: Dict[int, torch.Tensor]  # id(local parameter) -> full tensor
    handle: CommHandle  # the unit's broadcasts ([Note: communication streams])
    buffers: List["_GroupBuffer"]  # allocated for this fetch (received, or the owner's sends)


class BroadcastUnit(FullUnit):
    """Broadcasts the tensors of ``layers`` from their owners, one collective per group."""

    def __init__(
        self,
        name: str,
        layers: Sequence[nn.Module],
        runtime: Zero3Runtime,
        per_tensor: bool = False,
    ) -> None:
        super().__init__(name, layers, runtime)
        self.runtime = runtime  # the state, typed
        self.groups = grouped(unit_params(self.layers), owner_and_dtype, per_tensor)
        self._made: MadeOnce[_GroupBuffer] = MadeOnce(len(self.groups))
        self._buffers: List[_GroupBuffer] = []  # allocated for the current fetch, freed at reshard

    def unshard(self, async_op: bool) -> PendingBroadcast:
        """Issue the unit's broadcasts; the result is valid after ``wait_for_unshard``."""
        rt = self.runtime
        full: Dict[int, torch.Tensor] = {}
        broadcasts, buffers = [], []
        try:
            for index, group in enumerate(self.groups):
                owner, dtype = _info(group[0]).owner, rt.gather_dtype(group[0].dtype)
                own, cast = owner == rt.rank, dtype != group[0].dtype
                made = self._group_buffer(index, group, dtype)
                if own and not cast:  # the owner computes with its own tensors, no copy
                    full.update(zip(made.ids, made.own.of(group)))
                    if rt.world_size == 1:
                        continue
                    if len(group) == 1:  # sent as it is
                        broadcasts.append((made.local.of(group)[0], owner))
                        continue
                # A buffer: to send the owned tensors concatenated (and cast), or to receive.
                views = made.memory.allocate()  # the full parameters, views of the buffer
                flat = made.memory.buffer
                rt.stats.add(flat)
                buffers.append(made)
                if own:  # one multi-tensor copy (and cast) into the full tensors' views
                    torch._foreach_copy_(list(views.values()), made.own.of(group))
                if not own or cast:
                    full.update(views)
                if rt.world_size > 1:
                    broadcasts.append((flat, owner))

            def launch(async_op: bool) -> List[Any]:
                return [comm.broadcast(t, src=src, async_op=async_op) for t, src in broadcasts]

            handle = rt.streams.issue(GATHER, launch, async_op)
        except BaseException:
            self._forget(buffers)
            raise
        return PendingBroadcast(full, handle, buffers)

    def wait_for_unshard(self, pending: PendingBroadcast) -> None:
        """Wait for the broadcasts; the layers hold their views until ``reshard``."""
        self._wait(pending)
        self._buffers = pending.buffers
        self.set_full(pending.full)

    def discard(self, pending: PendingBroadcast) -> None:
        """Forget a prefetch that will not be used, once its broadcasts have finished."""
        self._wait(pending)
        self._free(pending.buffers)

    def _wait(self, pending: PendingBroadcast) -> None:
        try:
            self.runtime.streams.wait(pending.handle)
        except BaseException:
            self._forget(pending.buffers)
            raise

    def _forget(self, failed: List["_GroupBuffer"]) -> None:
        """After an error in an unshard (a collective or a copy that raised): uncount these
        buffers and make new ones next time ([Note: buffers made once])."""
        self.runtime.stats.live_bytes -= sum(made.nbytes for made in failed)
        self._made.forget(failed)

    def on_reshard(self) -> None:
        self._free(self._buffers)
        self._buffers = []

    def _free(self, buffers: List["_GroupBuffer"]) -> None:
        for made in buffers:
            made.memory.free()
        self.runtime.stats.live_bytes -= sum(made.nbytes for made in buffers)

    def _group_buffer(
        self, index: int, group: List[nn.Parameter], dtype: torch.dtype
    ) -> "_GroupBuffer":
        """Group ``index``'s buffer ([Note: buffers made once])."""
        device = group[0].device
        make = functools.partial(_GroupBuffer, group, dtype, device)
        return self._made.get(index, (dtype, device), make)


class _GroupBuffer:
    """One group's broadcast buffer (numel,) and the full tensors that view it, made once at
    the first fetch that needs them, plus views of the owner's tensors ([Note: buffers made
    once])."""

    def __init__(self, group: List[nn.Parameter], dtype: torch.dtype, device: torch.device):
        self.shapes = [_info(param).shape for param in group]
        self.ids = [id(param) for param in group]
        self.dtype, self.device = dtype, device
        self._memory: Optional[Memory[Dict[int, torch.Tensor]]] = None
        self.own = LocalViews(flat=False)  # the owner computes with these (no cast)
        self.local = LocalViews(flat=True)  # the owner sends these

    @property
    def memory(self) -> Memory[Dict[int, torch.Tensor]]:
        """The buffer and the full tensors, id(local parameter) -> view of it; an owner that
        neither casts nor concatenates never makes it."""
        if self._memory is None:
            numel = sum(shape.numel() for shape in self.shapes)
            self._memory = Memory(numel, self.dtype, self.device, self._full_views)
        return self._memory

    def _full_views(self, flat: torch.Tensor) -> Dict[int, torch.Tensor]:
        return dict(zip(self.ids, packed_views(flat, self.shapes)))

    @property
    def nbytes(self) -> int:
        """Bytes of the buffer while it holds memory (without making it)."""
        return sum(shape.numel() for shape in self.shapes) * self.dtype.itemsize


def _info(param: nn.Parameter) -> TensorInfo:
    info = getattr(param, ATTR, None)
    if info is None:
        raise copied_model_error("Zero3")
    return info
