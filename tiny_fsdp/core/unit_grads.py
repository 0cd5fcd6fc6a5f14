"""The gradients of one unit: summed into one buffer per group, reduced with one collective each.

[Note: unit reduction]
A unit's layers ([Note: full units]) hand their full gradients to the unit's ``UnitGradients``
as their backward produces them (``add``). Each is written (or, for a parameter that several
layers of the unit use, a tied weight, added) into the buffer of its *group*: the tensors that
travel in one collective. When every layer of the unit that has a trainable parameter has
added its part, each buffer is divided by world_size and reduced: a SUM of pre-divided
gradients is the average, on any backend. The collective is launched, not waited for; slices
of its output are this rank's gradients, delivered into ``.grad`` at the end of the backward
([Note: asynchronous reduction]). The strategies say what a group is and how it is reduced:

- FSDP (``fsdp/grads.py``): a group is the unit's tensors of one dtype; its buffer is
  rank-major, (world_size, numel), row r what rank r's shards receive (padding rows zero), and
  it is reduce-scattered.
- ZeRO-3 (``zero3/grads.py``): a group is the unit's tensors of one owner and dtype; its
  buffer is their full gradients concatenated, reduced to the owner.

One collective per unit and group, like FSDP2's per-module reduce-scatter: with per-block units
(the default) a GPT-2 step issues about n_layer + 1 of them instead of one per tensor, and a
tied weight's gradient travels once. ``unit="tensor"`` keeps one per tensor.

End of the backward. A unit whose layers did not all add (a layer whose output did not reach
the loss, a layer called twice whose second backward comes after the launch) is launched by
``end_of_backward``, which the reductions run before delivering ([Note: asynchronous
reduction]), or, if the unit is a module, when the module's backward is over ([Note: unit
module events]): what was added is reduced, nothing is lost. A parameter with no gradient on
this rank contributes zeros (its columns); its part is still handed over, flagged unused, and
``finalize`` delivers it only if another rank gave it a gradient. So the ranks issue the same
collectives in the same order as long as they run the same units in the same order, whichever
layers of a unit run.

``no_sync``: nothing is launched; the buffer is kept (in the parameters' dtype, fp32, like
``.grad``) and the next synchronised backward adds to it, then casts it once to the policy's
``reduce_dtype`` before its reduce-scatter. A synchronised backward writes directly in
``reduce_dtype``.

Memory: the buffers of the unit being filled are counted with the reductions in flight
(``ReduceStats``) from their allocation; buffers kept across ``no_sync`` backwards are counted in
the state's ``accumulated_bytes``.

The state (FSDP's ``FSDPState``, ZeRO-3's ``Zero3Runtime``) provides ``world_size``,
``grad_divisor``, ``require_grad_sync``, ``reduce_dtype(dtype)``, ``track_accumulated(nbytes)`` and
``reductions`` (``PendingReductions``).
"""

from typing import Any, Dict, FrozenSet, List, Optional, Sequence, Set, Tuple

import torch
from torch import nn

from tiny_fsdp.core.module.handler import Params, layer_params
from tiny_fsdp.core.unit_layout import grouped, unit_params
from tiny_fsdp.core.utils import huge_pages
from tiny_fsdp.core.utils.storage import view_at

Column = Tuple[int, int]  # (group index, offset of the parameter in its group)


class UnitGradients:
    """Sum-then-reduce of one unit's gradients ([Note: unit reduction]); subclasses say what a
    group is (``group_key``), how a gradient is laid out in its buffer (``numel_in_group``,
    ``buffer_numel``, ``write``) and how a group is reduced (``reduce_group``)."""

    def __init__(
        self, name: str, layers: Sequence[nn.Module], state: Any, per_tensor: bool = False
    ) -> None:
        self.layers = list(layers)
        self.state = state
        self.per_tensor = per_tensor
        self._params: Optional[List[nn.Parameter]] = None  # unit_params, found once
        self._key: Optional[Tuple[bool, ...]] = None  # requires_grad flags the layout is for
        self._groups: List[List[nn.Parameter]] = []
        self._columns: Dict[int, Column] = {}  # id(param) -> where its gradient goes
        self._expected: Set[int] = set()  # ids of the layers with a trainable parameter
        self._buffers: Optional[List[torch.Tensor]] = None  # per group: (world, group numel)
        self._written: Set[int] = set()  # ids of the parameters with a gradient in the buffers
        self._added: Set[int] = set()  # ids of the layers that added in this backward
        self._kept_bytes = 0  # buffers kept across no_sync backwards (accumulated_bytes)
        self._live_bytes = 0  # buffers being filled (counted with the reductions)
        # False: launch at the end of the backward only ([Note: unit module events])
        self.launch_when_complete = True

    def add(self, layer: nn.Module, grads: Params) -> None:
        """Write ``layer``'s full gradients (``layer.param_names`` order) into the buffers."""
        state = self.state
        state.reductions.at_end_of_backward(self.end_of_backward)
        self._added.add(id(layer))
        if all(grad is None for grad in grads):
            return  # e.g. a layer whose parameters are all frozen
        if self._buffers is None:
            self._allocate(grads)
        elif self._kept_bytes:  # a no_sync sum is being added to
            state.track_accumulated(-self._kept_bytes)
            state.reductions.stats.track(self._kept_bytes)
            self._live_bytes, self._kept_bytes = self._kept_bytes, 0
        for param, grad in zip(layer_params(layer), grads):
            if grad is None:
                continue
            index, offset = self._columns[id(param)]
            self.write(self._buffers[index], param, offset, grad, id(param) in self._written)
            self._written.add(id(param))
        if state.require_grad_sync and self.launch_when_complete and self._expected <= self._added:
            self._launch()

    def end_of_backward(self) -> None:
        """Launch what a synchronised backward added; keep a no_sync sum for the next one."""
        self._added.clear()
        if self._buffers is None:
            return
        if self.state.require_grad_sync:
            self._launch()
        elif self._live_bytes:
            self.state.reductions.stats.track(-self._live_bytes)
            self.state.track_accumulated(self._live_bytes)
            self._kept_bytes, self._live_bytes = self._live_bytes, 0

    def module_backward_done(self) -> None:
        """The unit's module finished its backward: launch what was added, whichever layers
        ran ([Note: unit module events])."""
        if self._buffers is not None and self.state.require_grad_sync:
            self._launch()

    def drop_unfinished(self) -> None:
        """Forget the sums of a backward that raised before its end (kept no_sync sums stay)."""
        if self._live_bytes:
            self.discard()

    def forget_layout(self) -> None:
        """Lay the gradients out again at the next backward (the parameters were copied:
        [Note: copying a wrapped model])."""
        self._params, self._key = None, None

    def discard(self) -> None:
        """Forget every sum."""
        self.state.track_accumulated(-self._kept_bytes)
        self.state.reductions.stats.track(-self._live_bytes)
        self._buffers, self._kept_bytes, self._live_bytes = None, 0, 0
        self._written.clear()
        self._added.clear()

    # ---------------------------------------------------------------- internals
    def _allocate(self, grads: Params) -> None:
        """Lay out the trainable parameters (again if requires_grad changed); new buffers."""
        if self._params is None:  # the unit's local parameters: fixed until a copy
            self._params = unit_params(self.layers)
        key = tuple(p.requires_grad for p in self._params)
        if key != self._key:
            self._layout([p for p in self._params if p.requires_grad])
            self._key = key
        sync = self.state.require_grad_sync
        like = next(g for g in grads if g is not None)
        self._buffers = []
        for group in self._groups:
            dtype = self.state.reduce_dtype(group[0].dtype) if sync else group[0].dtype
            numel = sum(self.numel_in_group(p) for p in group)
            self._buffers.append(huge_pages.empty(self.buffer_numel(numel), dtype, like.device))
        self._live_bytes = sum(_nbytes(b) for b in self._buffers)
        self.state.reductions.stats.track(self._live_bytes)

    def _layout(self, trainable: List[nn.Parameter]) -> None:
        self._groups = grouped(trainable, self.group_key, self.per_tensor)
        self._columns = {}
        for index, group in enumerate(self._groups):
            offset = 0
            for param in group:
                self._columns[id(param)] = (index, offset)
                offset += self.numel_in_group(param)
        ids = {id(p) for p in trainable}
        self._expected = {
            id(layer)
            for layer in self.layers
            if any(id(getattr(layer, n)) in ids for n in layer.param_names)
        }

    def _launch(self) -> None:
        """Average and reduce every buffer; the written parameters get their parts."""
        state = self.state
        buffers, written = self._buffers, self._written
        state.reductions.stats.track(-self._live_bytes)  # launch counts them as inputs
        self._buffers, self._written, self._added, self._live_bytes = None, set(), set(), 0
        for group, buffer in zip(self._groups, buffers):
            offset = 0
            for param in group:
                if id(param) not in written:  # no gradient on this rank: contribute zeros
                    self.write(buffer, param, offset, None, False)
                offset += self.numel_in_group(param)
            buffer = buffer.to(state.reduce_dtype(group[0].dtype))  # a no_sync fp32 sum: cast
            if state.grad_divisor != 1:  # x / 1 is x, bit for bit: no pass over the buffer
                buffer.div_(state.grad_divisor)  # SUM of grad / N == average, on every backend
            unused = frozenset(id(p) for p in group if id(p) not in written)
            self.reduce_group(group, buffer, unused)

    # ---------------------------------------------------------------- the strategy's part
    def group_key(self, param: nn.Parameter) -> object:
        """Parameters with equal keys share a buffer and a collective."""
        raise NotImplementedError

    def numel_in_group(self, param: nn.Parameter) -> int:
        """Elements ``param`` takes in its group's layout (the offsets advance by it)."""
        raise NotImplementedError

    def buffer_numel(self, group_numel: int) -> int:
        """Elements of a group's buffer, given the sum of its parameters' ``numel_in_group``."""
        raise NotImplementedError

    def write(
        self,
        buffer: torch.Tensor,
        param: nn.Parameter,
        offset: int,
        grad: Optional[torch.Tensor],
        accumulate: bool,
    ) -> None:
        """Write (or add) the full ``grad`` of ``param`` into ``buffer``; None: write zeros."""
        raise NotImplementedError

    def reduce_group(
        self, group: List[nn.Parameter], buffer: torch.Tensor, unused: FrozenSet[int]
    ) -> None:
        """Launch the reduction of the averaged ``buffer``, with a part for every parameter
        this rank holds a share of; ``unused``: ids of those this rank gave no gradient."""
        raise NotImplementedError


def write_at(
    buffer: torch.Tensor,
    shape: Sequence[int],
    offset: int,
    grad: Optional[torch.Tensor],
    accumulate: bool,
) -> None:
    """Write (or add) ``grad`` of ``shape`` into ``buffer`` from element ``offset`` on, through
    one view in its shape (no flattening of the gradient); None: write zeros. For a layout
    that holds each full gradient whole: ZeRO-3's, FSDP's on one rank."""
    region = view_at(buffer, shape, offset)
    if grad is None:
        region.zero_()
    elif accumulate:
        region.add_(grad)
    else:
        region.copy_(grad)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
