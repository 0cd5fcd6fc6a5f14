"""Optimizers for ZeRO-1/2-wrapped models: AdamW, SGD or a torch.optim class on this rank's shard.

[Note: ZeRO optimizer step]
At construction the optimizer finds the ``Zero1`` / ``Zero2`` wrapper of its parameters and takes
this rank's *pieces* ([Note: ZeRO flat layout]). Each piece gets a master tensor of ``numel``
elements: a view of the parameter buffer when its parameter is 32-bit or wider (it IS the
master; nothing is duplicated), else an fp32 copy: a view of the model's fp32 master shard (one
chunk per bucket of such parameters, ``wrapper.master_shard()``), one for all the model's
optimizers, each of which owns its pieces of it; under mixed precision it holds the exact values
of wrap time (an element the parameters changed since is taken from them). ``step``:

1. applies the unchanged update rule (``adamw_update_`` / ``sgd_update_``, or a torch.optim
   class's: [Note: torch.optim rules on pieces]) to every piece's
   master with its reduced gradient (``wrapper.reduced_grad``: a view into the gradient store,
   [Note: ZeRO gradient stores]; cast to fp32 by the rule) and its own state, so optimizer
   state exists for owned elements only. Pieces of parameters no rank had a gradient for are
   skipped (``wrapper.params_without_grad``), as torch.optim skips a ``.grad`` of None;
2. writes separate masters back into the parameter buffer, rounded to the parameter dtype (one
   copy per run of adjacent pieces, ``flat_buffer.spans``);
3. all-gathers the parameter buffer bucket by bucket: every rank has the new full parameters.

Bytes per rank (P trainable elements, N ranks, padding aside), AdamW: fp32 params:
ZeRO-1 4P + 4P + 8P/N, ZeRO-2 4P + 12P/N; bf16 params: ZeRO-1 2P + 2P + 12P/N, ZeRO-2 2P + 14P/N.

Checkpoints: [Note: consolidated ZeRO state].
"""

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Type

import torch
import torch.distributed as dist
from torch import Tensor

from tiny_fsdp.core.local_state import StatePiece
from tiny_fsdp.core.optim import SGD, AdamW, TorchRule
from tiny_fsdp.core.torch_checkpoint import for_torch_checkpoint, refuse_torch_checkpoint
from tiny_fsdp.core.zero.consolidated_state import check_loadable, consolidate, slice_pieces
from tiny_fsdp.core.zero.flat_buffer import Piece, ShardBuffer, spans
from tiny_fsdp.core.zero.zero import Zero1, Zero2, ZeroWrapper, zero_owner


@dataclass
class OwnedPiece:
    """One piece this rank updates: flat (numel,) views aligned element by element."""

    opt_index: int  # the parameter's id in this optimizer's state_dict
    piece: Piece
    master: Tensor  # fp32 master (or the parameter buffer itself for >= 32-bit parameters)
    grad: Tensor  # reduced, averaged gradient (parameter dtype)
    param: Tensor  # the parameter buffer's elements

    @property
    def separate(self) -> bool:
        """The master is an fp32 copy, written back into ``param`` after a step."""
        return self.master is not self.param


def _follow_written(master: Tensor, param: Tensor) -> None:
    """An element of ``param`` that differs from ``master`` rounded to its dtype was written
    from outside: ``master`` takes its value; the others keep their precision."""
    written = param != master.to(param.dtype)
    master.copy_(torch.where(written, param.to(master.dtype), master))


class _ZeroOptimizer:
    """Mixin before ``AdamW`` / ``SGD`` / ``TorchRule``: update only this rank's pieces ([Note:
    ZeRO optimizer step]). Subclasses set the ``wrapper_cls`` they update and the update
    ``rule``'s name (checkpoints record it)."""

    takes_strategy_params = True

    wrapper_cls: Optional[Type[ZeroWrapper]] = None
    rule: str
    # Each rank yields only its own pieces ([Note: clipping over shards]).
    grads_are_sharded = True
    # Provided by torch.optim.Optimizer (declared for readers and type checkers).
    state: Dict[Tensor, Dict[str, Any]]
    param_groups: List[Dict[str, Any]]

    def __init__(self, params: Any, *args: Any, **kwargs: Any) -> None:
        if self.wrapper_cls is None:
            raise TypeError(
                f"{type(self).__name__} is a mixin: use Zero1AdamW, Zero2Optimizer, ..."
            )
        self._wrapper: Optional[ZeroWrapper] = None
        self._master_shard: Optional[ShardBuffer] = None  # for buckets of < 32-bit parameters
        self._pieces: Dict[int, List[OwnedPiece]] = {}  # id(param group) -> its pieces
        self._consolidated: Optional[Dict[str, Any]] = None
        super().__init__(params, *args, **kwargs)  # type: ignore[call-arg]
        self._versions_seen = self._param_versions()  # [Note: writes outside the optimizer]

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        super().add_param_group(param_group)  # type: ignore[misc]
        groups = self.param_groups
        first = sum(len(g["params"]) for g in groups[:-1])
        self._pieces[id(groups[-1])] = self._bind(groups[-1], first)

    def _bind(self, group: Dict[str, Any], first_index: int) -> List[OwnedPiece]:
        owned = []
        for k, (name, p) in enumerate(zip(group["param_names"], group["params"])):
            wrapper = self._check_owner(name, p)
            index = wrapper.index_of(p)
            if index is None:  # frozen at wrap time: not in the buffers, never updated
                if p.requires_grad:
                    wrapper.take_trainable([wrapper.name_of(p)])  # raises: unfrozen later
                continue
            piece = wrapper.owned_pieces.get(index)
            if piece is None:
                continue  # this rank owns no element of p
            param = wrapper.param_buffer.piece(piece)
            master = param
            if self._master_shard is not None and self._master_shard.has(piece.bucket):
                master = self._master_shard.piece(piece)
                _follow_written(master, param)  # [Note: writes outside the optimizer]
            grad = wrapper.reduced_grad(piece)
            owned.append(OwnedPiece(first_index + k, piece, master, grad, param))
        return owned

    def _check_owner(self, name: str, p: Tensor) -> ZeroWrapper:
        cls, needed = type(self).__name__, self.wrapper_cls.__name__
        wrapper = zero_owner(p)
        if wrapper is None:
            raise ValueError(
                f"{cls}: parameter '{name}' does not belong to a {needed}-wrapped model; "
                f"wrap first (model = {needed}(model)) and pass model.named_parameters()"
            )
        if not isinstance(wrapper, self.wrapper_cls):
            got = type(wrapper).__name__
            raise ValueError(
                f"{cls} needs a {needed}-wrapped model but parameter '{name}' belongs to "
                f"a {got}; use {cls.replace(needed, got, 1)}"
            )
        if self._wrapper is None:
            self._wrapper = wrapper
            wrapper.register_optimizer(self)
            self._master_shard = wrapper.master_shard()  # shared by the model's optimizers
        elif wrapper is not self._wrapper:
            raise ValueError(f"{cls}: parameter '{name}' belongs to another wrapped model")
        return wrapper

    def _all_pieces(self) -> List[OwnedPiece]:
        return [op for g in self.param_groups for op in self._pieces[id(g)]]

    # ------------------------------------------------------------------ step

    def _tensors_to_update(self, group: Dict[str, Any]) -> Any:
        if not self._wrapper.grads_reduced:
            return  # no synchronised backward since the last zero_grad: nothing to apply
        skipped = self._wrapper.params_without_grad
        for op in self._pieces[id(group)]:
            if op.piece.index not in skipped:
                yield op.master, op.grad, self.state[op.master]

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """ZeRO-2: torch's GradScaler then hands its step to ``step``, which refuses it."""
        return self.wrapper_cls is Zero2

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Update the owned pieces, write them back and all-gather the parameters."""
        if getattr(self, "found_inf", None) is not None:  # set by torch's GradScaler.step
            raise TypeError(
                f"{type(self).__name__}: ZeRO-2 keeps its reduced gradients in shards, never in "
                ".grad, so a GradScaler can neither unscale nor check them. For fp16 with loss "
                "scaling use Zero1, DDP, FSDP or Zero3 (with torch.amp.GradScaler); bf16 needs "
                "no loss scaling."
            )
        self._follow_outside_writes()
        self._wrapper.adopt_assigned_grads()
        loss = super().step(closure)  # type: ignore[misc]
        if self._wrapper.grads_reduced:  # the same on every rank: collectives stay paired
            self._publish()
        self._consolidated = None  # stale now
        return loss

    def _publish(self) -> None:
        # Rounded to the parameter dtype, one copy per run of adjacent pieces (a kernel each on
        # a GPU), not one per piece. Only this optimizer's pieces: another's are not joined.
        params, masters = self._wrapper.param_buffer, self._master_shard
        for span in spans(op.piece for op in self._all_pieces() if op.separate):
            params.piece(span).copy_(masters.piece(span))
        self._wrapper.all_gather_params()

    @torch.no_grad()
    def reload_masters(self) -> None:
        """Re-read separate masters after the model's parameters were written from outside
        (a load, an init): an element that differs from its master rounded to the parameter's
        dtype takes the parameter's value; one that does not still holds what ``_publish``
        wrote, and keeps its master's precision (a ``model.apply`` that changes nothing, or a
        load of the same values, changes no master)."""
        for op in self._all_pieces():
            if op.separate:
                _follow_written(op.master, op.param)
        self._versions_seen = self._param_versions()

    def _param_versions(self) -> int:
        return sum(p._version for group in self.param_groups for p in group["params"])

    def _follow_outside_writes(self) -> None:
        """[Note: writes outside the optimizer]

        With parameters below 32 bits the optimizer updates separate fp32 masters and writes
        them back rounded. A write to the parameters from outside (``model.module.load_state_dict``
        as torch DDP code loads, ``nn.init`` or ``copy_`` under ``no_grad``) would be undone by
        the next step's write-back, silently. Every in-place write through a parameter bumps its
        version counter, which the optimizer's own write-back (through the flat buffer, not the
        parameter) does not: a changed sum of versions means the masters are re-read first.
        A parameter's ``.data`` replaced (``p.data = p.data * 0.5``, old code's way) is no view of
        the flat buffer any more, which the step updates and all-gathers: its values are copied
        into the buffer and ``.data`` made the buffer's view again (``adopt_replaced_data``).
        """
        replaced = self._wrapper.adopt_replaced_data()
        if self._master_shard is not None and (
            replaced or self._param_versions() != self._versions_seen
        ):
            self.reload_masters()

    def state_pieces(self, saving: bool) -> List[StatePiece]:
        """The owned pieces, whose state is keyed by their masters ([Note: strategy state])."""
        self._follow_outside_writes()
        params = [p for g in self.param_groups for p in g["params"]]
        return [
            StatePiece(
                params[op.opt_index],
                op.piece.param_start,
                op.master,
                op.master if op.separate else None,
            )
            for op in self._all_pieces()
        ]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of this optimizer's parameters (see ``ZeroWrapper.zero_grad``;
        [Note: one optimizer of several])."""
        params = [p for group in self.param_groups for p in group["params"]]
        self._wrapper.zero_grad(set_to_none, params)

    # ------------------------------------------------------------------ checkpoints

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the full optimizer state on rank ``to`` (call on every rank); then call
        ``state_dict()`` there. Format: [Note: consolidated ZeRO state]."""
        self._follow_outside_writes()
        self._consolidated = consolidate(
            self._wrapper,
            self._all_pieces(),
            self.state,
            self.param_groups,
            self.rule,
            self._master_dtypes(),
            to,
        )

    def _master_dtypes(self) -> List[torch.dtype]:
        """The masters' dtype of each of the layout's groups."""
        wrapper = self._wrapper
        return [m or d for m, d in zip(wrapper.master_dtypes, wrapper.dtypes)]

    def state_dict(self) -> Dict[str, Any]:
        """The consolidated state (only on the ``to`` rank of the last consolidation)."""
        if for_torch_checkpoint():  # every rank, consolidated or not: [Note: torch's ...]
            refuse_torch_checkpoint(type(self).__name__)
        if self._consolidated is None:
            raise RuntimeError(
                f"{type(self).__name__}.state_dict(): the state is sharded. Call "
                "optimizer.consolidate_state_dict(to=rank) on every rank first (again after "
                "every step), then state_dict() on that rank only."
            )
        return self._consolidated

    @torch.no_grad()
    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a consolidated state (call on every rank, any world size): each rank takes its
        pieces; then the parameters are set to the masters (and all-gathered)."""
        check_loadable(type(self).__name__, self.rule, self.param_groups, state_dict)
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in saved.items() if k not in ("params", "param_names")})
        self.state = defaultdict(dict)
        self.state.update(slice_pieces(self._all_pieces(), state_dict["state"]))
        self._consolidated = None
        self._publish()
        self._versions_seen = self._param_versions()  # the masters are the loaded ones


class Zero1AdamW(_ZeroOptimizer, AdamW):
    """``AdamW`` (same arguments) for a ``Zero1`` model: state and fp32 master sharded."""

    wrapper_cls, rule = Zero1, "AdamW"


class Zero2AdamW(_ZeroOptimizer, AdamW):
    """``AdamW`` (same arguments) for a ``Zero2`` model: state and fp32 master sharded."""

    wrapper_cls, rule = Zero2, "AdamW"


class Zero1SGD(_ZeroOptimizer, SGD):
    """``SGD`` (same arguments) for a ``Zero1`` model: momentum and fp32 master sharded."""

    wrapper_cls, rule = Zero1, "SGD"


class Zero2SGD(_ZeroOptimizer, SGD):
    """``SGD`` (same arguments) for a ``Zero2`` model: momentum and fp32 master sharded."""

    wrapper_cls, rule = Zero2, "SGD"


class _ZeroTorchRule(_ZeroOptimizer, TorchRule):
    """A torch.optim class on a ZeRO model, taking ``ZeroRedundancyOptimizer``'s arguments so
    that its scripts run with only the construction changed."""

    def __init__(
        self,
        params: Any,
        optimizer_class: Type[torch.optim.Optimizer],
        process_group: Optional[Any] = None,
        parameters_as_bucket_view: bool = False,
        overlap_with_ddp: bool = False,
        **defaults: Any,
    ) -> None:
        """``optimizer_class`` with ``defaults``; the other arguments are
        ``ZeroRedundancyOptimizer``'s: ``process_group`` must hold every rank (None: the
        default group), as the wrapper shards over every rank; ``parameters_as_bucket_view``
        is accepted either way (the parameters are always views of the wrapper's flat
        buffers); ``overlap_with_ddp=True`` (the step inside DDP's backward) is refused."""
        cls = type(self).__name__
        if (
            process_group is not None
            and dist.get_world_size(process_group) != dist.get_world_size()
        ):
            raise ValueError(
                f"{cls}(process_group=...) with {dist.get_world_size(process_group)} of "
                f"{dist.get_world_size()} ranks: the {self.wrapper_cls.__name__} wrapper shards "
                "over every rank; leave process_group out"
            )
        if overlap_with_ddp:
            raise ValueError(
                f"{cls}(overlap_with_ddp=True) is not supported: the step runs after backward, "
                f"whose gradient reductions the {self.wrapper_cls.__name__} wrapper already "
                "overlaps with compute; leave it out"
            )
        super().__init__(params, optimizer_class, **defaults)


class Zero1Optimizer(_ZeroTorchRule):
    """``optimizer_class`` (an element-wise torch.optim class, e.g. ``torch.optim.Adam``) with
    its keyword arguments, for a ``Zero1`` model, as ``ZeroRedundancyOptimizer``'s
    ``optimizer_class``: state and fp32 master sharded ([Note: torch.optim rules on pieces])."""

    wrapper_cls = Zero1


class Zero2Optimizer(_ZeroTorchRule):
    """``optimizer_class`` with its keyword arguments for a ``Zero2`` model (see
    ``Zero1Optimizer``): state, gradients and fp32 master sharded."""

    wrapper_cls = Zero2
