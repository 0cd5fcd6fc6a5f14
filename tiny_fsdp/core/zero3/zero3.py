"""``Zero3``: ZeRO-3 without splitting tensors; each whole parameter lives on one rank.

[Note: zero3 inter-tensor]
The partition table (``partition.py``) gives every parameter one owner. Only the owner stores
the parameter, its gradient and its optimizer state; the other ranks keep an empty ``(0,)``
tensor in its place. Layers receive full parameters by broadcast from the owners just before
they compute, in forward and again in backward, and gradients are reduced to the owners, a
unit (by default a block) at a time ([Note: zero3 tensor life cycle] in ``unit.py``). Per rank,
between steps: owned parameters + owned gradients + owned optimizer state; during a step, in
addition, the parameters of the unit being computed (and of the ``prefetch_limit`` next ones
with async communication, [Note: prefetch]). Traffic per step and rank, ring model: about 3
(N-1)/N x model bytes (two broadcasts and one reduce per use of a tensor; fewer when a unit
stays full from forward to backward), 1.5 x DDP's all-reduce (2 (N-1)/N).

Limits: every rank must call the same layers in the same order (no data-dependent skipping of
layers: the broadcasts and reduces of all ranks must pair up). Gradient sync is decided when
``Zero3.forward`` runs (as in torch DDP).
"""

import warnings
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from tiny_fsdp.core import comm, streams
from tiny_fsdp.core.clip import HeldGrads
from tiny_fsdp.core.fetching_wrapper import FetchingWrapper
from tiny_fsdp.core.local_state import LocalPiece
from tiny_fsdp.core.meta_init import (
    MetaInitError,
    ModuleInit,
    has_meta_buffers,
    materialize_buffers,
    agree_on_every_rank,
)
from tiny_fsdp.core.precision import MixedPrecisionPolicy
from tiny_fsdp.core.reductions import ReduceStats
from tiny_fsdp.core.replicated import broadcast_module_buffers
from tiny_fsdp.core.unit_layout import UnitSpec
from tiny_fsdp.core.utils.dist import default_device
from tiny_fsdp.core.zero3.grads import ReduceToOwnerGrads
from tiny_fsdp.core.zero3.partition import zero3_partition_tensors
from tiny_fsdp.core.zero3.unit import BroadcastUnit
from tiny_fsdp.core.zero3.runtime import ATTR, FetchStats, TensorInfo, Zero3Runtime


class Zero3(FetchingWrapper):
    """ZeRO-3 inter-tensor data parallelism ([Note: zero3 inter-tensor]).

    Args:
        module: the model; a normal one (every rank builds the same weights, e.g. same seed; the
            owner keeps its tensors) or one built on the ``meta`` device, in which case each
            owner allocates its tensors and fills them with ``module.init_parameter(name,
            tensor)``, else the model's own init of each module ([Note: meta parameters]), so
            the whole model never exists on one rank; its buffers are made real by the
            model's own initialisation ([Note: meta buffers]).
        param_part_table: name -> owner rank for every ``module.named_parameters()`` name, as
            returned by ``zero3_partition_tensors``; its ``ranks_map`` device (if given) is
            where this rank's tensors live. Omitted: ``zero3_partition_tensors(
            module.named_parameters())`` (contiguous runs of tensors, as FSDP needs no table);
            read it back as ``self.param_part_table``.
        enable_async_communication: prefetch the next layers' broadcasts ([Note: prefetch]) and
            leave gradient reduces in flight while backward goes on ([Note: asynchronous
            reduction]); on by default, also settable as an attribute (read at each forward).
            Results are bitwise identical on and off.
        prefetch_limit: at most this many prefetched layers unconsumed at once (>= 1).
        prefetch_depth: deprecated name of ``prefetch_limit``.
        sync_module_states: broadcast every tensor and buffer from rank 0 first (normal models
            only; default, as FSDP and DDP), so the model is rank 0's: ranks built with
            different seeds, or a checkpoint loaded on rank 0 only, cannot disagree. False keeps
            each owner's own values.
        mixed_precision: owners broadcast ``param_dtype`` copies and gradients are reduced in
            ``reduce_dtype``; owned tensors, ``.grad`` and optimizer state stay fp32 ([Note:
            mixed precision]).
        unit: which layers are broadcast and reduced together: ``"auto"`` (default: the
            model's repeated blocks, else per layer), ``"layer"``, ``"tensor"`` (one collective
            per tensor), or a list of modules (``unit_layout.py``); within a unit, one
            broadcast and one reduce per owner and dtype.
        registered_layers: as ``FSDP``'s (False: the generic path for every module).
    """

    materializes_meta = True
    separates_storage = True
    updates_local_part = True
    local_params = "owned_tensors"  # [Note: optimizers of other libraries]
    gathers_full_tensors = True

    def __init__(
        self,
        module: nn.Module,
        param_part_table: Optional[Mapping[str, int]] = None,
        enable_async_communication: bool = True,
        *,
        prefetch_limit: int = 2,
        sync_module_states: bool = True,
        mixed_precision: Optional[MixedPrecisionPolicy] = None,
        prefetch_depth: Optional[int] = None,
        unit: UnitSpec = "auto",
        registered_layers: bool = True,
    ) -> None:
        super().__init__(
            module, enable_async_communication, mixed_precision, registered_layers, unit
        )
        if prefetch_depth is not None:
            warnings.warn(
                "Zero3(prefetch_depth=...) is deprecated; use prefetch_limit=... (same meaning, "
                "the name FSDP uses)",
                DeprecationWarning,
                stacklevel=2,
            )
            prefetch_limit = prefetch_depth
        rank, world_size = dist.get_rank(), dist.get_world_size()
        self._runtime = Zero3Runtime(rank, world_size, prefetch_limit, self.mixed_precision)
        named = list(self.module.named_parameters())  # tied parameters appear once
        if param_part_table is None:
            param_part_table = zero3_partition_tensors(named)[0]
        check_table(param_part_table, named, world_size, "Zero3", _aliases(self.module))
        tables = comm.all_gather_object(sorted(param_part_table.items()))
        differ = [r for r, table in enumerate(tables) if table != tables[0]]
        if differ:
            raise ValueError(
                f"Zero3: the partition table differs between ranks (ranks {differ} differ from "
                "rank 0); build it the same way on every rank (same model, ranks_map and "
                "evenness_priority)"
            )
        self.param_part_table = param_part_table
        self.device = _choose_device(param_part_table, named, rank)
        unset = self._materialize(named, self.device, sync_module_states)
        # Owned whole or empty now (meta parameters were replaced by new objects).
        self.claim(self.module.parameters(), changed=True)
        self._runtime.use_streams(streams.streams_for(self.device, dist.get_world_size() > 1))
        self.build_units(self._runtime, unit, BroadcastUnit, ReduceToOwnerGrads, self.device, unset)

    def transient_bytes(self) -> Dict[str, int]:
        """Bytes of fetched (non-owned) parameter buffers and of reductions in flight now (read
        at every compute boundary of a traced step, ``tiny_fsdp/trace``)."""
        rt = self._runtime
        return {"gathered": rt.stats.live_bytes, "reductions": rt.reductions.stats.live_bytes}

    @property
    def fetch_stats(self) -> FetchStats:
        """Bytes of fetched, non-owned parameter buffers on this rank (live and peak)."""
        return self._runtime.stats

    @property
    def reduce_stats(self) -> ReduceStats:
        """Bytes of gradient reduction buffers in flight on this rank ([Note: asynchronous
        reduction]): live, peak, and the largest reduction's input."""
        return self._runtime.reductions.stats

    @property
    def prefetch_depth(self) -> int:
        """Deprecated name of ``prefetch_limit``."""
        return self._runtime.prefetch_limit

    @property
    def no_sync_bytes(self) -> int:
        """Bytes of the gradients accumulated under ``no_sync()`` and not reduced yet."""
        return self._runtime.accumulated_bytes

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # Gradient sync is decided at forward time, like torch DDP: a forward run inside
        # no_sync() accumulates in its backward even if backward runs outside the block.
        self._runtime.require_grad_sync = self.require_backward_grad_sync
        return super().forward(*args, **kwargs)

    @torch.no_grad()
    def _materialize(
        self, named: List[Tuple[str, nn.Parameter]], device: torch.device, sync: bool
    ) -> List[str]:
        """Keep (or create) the owned tensors on ``device``; leave (0,) tensors elsewhere.
        Returns the tensors left for the model's init method ([Note: tensors the model's init
        method sets])."""
        rt = self._runtime
        init = getattr(self.module, "init_parameter", None)
        init = init or ModuleInit(self.module, device, "Zero3")  # [Note: meta parameters]
        on_meta = any(param.is_meta for _, param in named)
        failed = None  # ModuleInit's error on this rank, raised on all after the loop
        unset: List[str] = []
        if has_meta_buffers(self.module):  # [Note: meta buffers]; before the parameters
            unset = materialize_buffers(self.module, device, "Zero3")
        for name, param in named:
            info = TensorInfo(name, self.param_part_table[name], param.shape)
            owned = info.owner == rt.rank
            if param.is_meta:
                shape = info.shape if owned else (0,)
                data = torch.empty(shape, dtype=param.dtype, device=device)
                if owned:
                    try:
                        init(name, data)
                    except MetaInitError as error:
                        failed = failed or str(error)
                # A meta Parameter cannot take real data in place: swap the object, in every
                # module that holds it (both ends of a tied pair).
                new = nn.Parameter(data, requires_grad=param.requires_grad)
                for layer in self.module.modules():
                    for key, value in layer._parameters.items():
                        if value is param:
                            layer._parameters[key] = new
                param = new
            else:
                data = param.data.to(device)
                if sync and rt.world_size > 1:
                    comm.broadcast_into(data, src=0)
                param.data = data if owned else torch.empty(0, dtype=param.dtype, device=device)
            setattr(param, ATTR, info)
        if sync and rt.world_size > 1:
            broadcast_module_buffers(self.module)  # whole on every rank, rank 0's values
        if isinstance(init, ModuleInit) and on_meta:
            unset += agree_on_every_rank(failed, init.unset)
        return unset

    # ---------------------------------------------------------------- what this rank holds
    def _info(self, param: torch.Tensor) -> TensorInfo:
        return getattr(param, ATTR)

    def full_tensor(self, param: torch.Tensor) -> torch.Tensor:
        """Broadcast from the owner (the owner's entry aliases its live tensor, as torch.nn)."""
        return self._runtime.gather_full(param)

    def full_shape(self, param: torch.Tensor) -> Tuple[int, ...]:
        return tuple(self._info(param).shape)

    def load_full_(self, param: torch.Tensor, full: torch.Tensor) -> None:
        if self._info(param).owner == self._runtime.rank:
            param.detach().copy_(full)

    def local_piece(self, param: torch.Tensor) -> Optional[LocalPiece]:
        return (
            LocalPiece(0, param.detach()) if self._info(param).owner == self._runtime.rank else None
        )

    def saved_piece(self, param: torch.Tensor) -> Optional[LocalPiece]:
        return self.local_piece(param)

    def held_grads(self, params: Sequence[torch.Tensor]) -> HeldGrads:
        """The owned tensors' gradients: each element on its owner only."""
        grads = [
            p.grad
            for p in params
            if p.grad is not None and self._info(p).owner == self._runtime.rank
        ]
        return HeldGrads(grads, sharded=True)


def _aliases(module: nn.Module) -> Dict[str, str]:
    """Second names of tied parameters -> the name ``named_parameters()`` gives them."""
    first: Dict[int, str] = {}
    aliases: Dict[str, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


def check_table(
    table: Mapping[str, int],
    named: List[Tuple[str, torch.Tensor]],
    world_size: int,
    what: str,
    aliases: Optional[Mapping[str, str]] = None,
) -> None:
    """Raise ValueError (saying how to fix it) unless ``table`` fits ``named`` on N ranks."""
    fix = (
        "build the table for this model and process group: zero3_partition_tensors("
        "OrderedDict(model.named_parameters()), ranks_map=[one device per rank])"
    )
    made_for = getattr(table, "world_size", None)
    if made_for is not None and made_for != world_size:
        raise ValueError(
            f"{what}: the partition table was made for {made_for} ranks but the process group "
            f"has {world_size}; {fix}"
        )
    bad = {name: rank for name, rank in table.items() if not 0 <= rank < world_size}
    if bad:
        raise ValueError(f"{what}: owner ranks outside [0, {world_size}): {bad}; {fix}")
    names = [name for name, _ in named]
    for alias, name in (aliases or {}).items():  # a tied tensor has one owner
        if alias in table and name in table and table[alias] != table[name]:
            raise ValueError(
                f"{what}: '{alias}' is tied to '{name}' (one tensor, one owner) but the table "
                f"gives them ranks {table[alias]} and {table[name]}; give '{alias}' the owner "
                f"of '{name}' or leave it out"
            )
    missing = [n for n in names if n not in table]
    extra = [n for n in table if n not in set(names) and n not in (aliases or {})]
    if missing or extra:
        raise ValueError(
            f"{what}: the partition table was made for another model: parameters missing from "
            f"the table {missing[:5]}{'...' if len(missing) > 5 else ''}, table names not in "
            f"the model {extra[:5]}{'...' if len(extra) > 5 else ''}; {fix}"
        )
    nbytes = getattr(table, "nbytes", None)
    if nbytes is not None:  # same names, other sizes: e.g. another GPTConfig
        sizes = {n: full_numel(p) * p.element_size() for n, p in named}
        wrong = [n for n in names if sizes[n] != nbytes[n]]
        if wrong:
            raise ValueError(
                f"{what}: the partition table was made for another model: sizes differ for "
                f"{wrong[:5]} (table {[nbytes[n] for n in wrong[:5]]} bytes, model "
                f"{[sizes[n] for n in wrong[:5]]}); {fix}"
            )


def full_numel(param: torch.Tensor) -> int:
    """Elements of the full tensor, also on a rank that holds an empty placeholder."""
    info: Optional[TensorInfo] = getattr(param, ATTR, None)
    return param.numel() if info is None else info.shape.numel()


def _choose_device(
    table: Mapping[str, int], named: List[Tuple[str, nn.Parameter]], rank: int
) -> torch.device:
    """This rank's device: ``ranks_map[rank]`` if the table has it, else the parameters'."""
    devices = getattr(table, "devices", None)
    if devices and devices[rank] is not None:
        return torch.device(devices[rank])
    for _, param in named:
        if not param.is_meta:
            return param.device
    return default_device()
