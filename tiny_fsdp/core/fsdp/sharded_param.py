"""One parameter split along dim 0 into ``world_size`` equal, zero-padded shards.

[Note: dim-0 shards]
A parameter of full shape ``(rows, *rest)`` (a 0-d tensor counts as one row) is cut into
``world_size`` shards of ``shard_rows = ceil(rows / world_size)`` rows; rank ``r`` keeps rows
``[r * shard_rows, (r + 1) * shard_rows)`` and the rows past ``rows`` are zero padding. Because a
contiguous tensor is row-major, a dim-0 shard is also a contiguous run of the flattened tensor,
so the concatenation of every rank's flat shard in rank order (what an all-gather produces) is
the full flat tensor followed by the padding: ``full = gathered[:numel].view(full_shape)``, with
no copy. Padding rows are zero on every rank, always: the shard starts zero-padded, the
reduce-scattered gradient of a padding row is a sum of zeros, and the FSDP optimizers only
update the real rows. So a rank whose shard is all padding (fewer rows than ranks) still takes
part in every collective with a tensor of the common size, and nothing hangs.
"""

import math
from collections import defaultdict
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from tiny_fsdp.core import comm
from tiny_fsdp.core.meta_init import ModuleInit, has_meta_buffers, materialize_buffers
from tiny_fsdp.core.utils.dist import default_device

# Attribute set on every sharded nn.Parameter; its presence is what marks a tensor as a shard.
SHARD_ATTR = "_tiny_fsdp_shard"


@dataclass(frozen=True)
class ShardedParam:
    """Geometry of one parameter's dim-0 shard on ``rank`` of ``world_size`` ranks.

    ``group``: the process group of those ranks (None: the default group; HSDP's shard group,
    [Note: hybrid sharding]). Immutable, so the derived sizes are computed once (the unit
    handlers read them for every tensor of every unshard).
    """

    full_shape: Tuple[int, ...]
    rank: int
    world_size: int
    group: Optional[Any] = field(default=None, compare=False, repr=False)

    @cached_property
    def rows(self) -> int:
        return self.full_shape[0] if len(self.full_shape) else 1

    @cached_property
    def row_shape(self) -> Tuple[int, ...]:
        return tuple(self.full_shape[1:])

    @cached_property
    def row_numel(self) -> int:
        return math.prod(self.row_shape)

    @cached_property
    def numel(self) -> int:
        return self.rows * self.row_numel

    @cached_property
    def shard_rows(self) -> int:
        return -(-self.rows // self.world_size)  # ceil

    @cached_property
    def shard_shape(self) -> Tuple[int, ...]:
        return (self.shard_rows, *self.row_shape)

    @cached_property
    def shard_numel(self) -> int:
        return self.shard_rows * self.row_numel

    @cached_property
    def valid_rows(self) -> int:
        """Rows of this rank's shard that are real (the rest is padding); 0 <= valid <= shard."""
        return max(0, min(self.shard_rows, self.rows - self.rank * self.shard_rows))

    def shard_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's zero-padded shard ``(shard_rows, *rest)`` of ``full``, a new tensor."""
        if tuple(full.shape) != tuple(self.full_shape):
            raise ValueError(
                f"expected a tensor of shape {self.full_shape}, got {tuple(full.shape)}"
            )
        shard = full.new_zeros(self.shard_shape)
        start = self.rank * self.shard_rows
        shard[: self.valid_rows].copy_(
            full.reshape(self.rows, *self.row_shape)[start:][: self.valid_rows]
        )
        return shard

    def full_view(self, gathered: torch.Tensor) -> torch.Tensor:
        """The full tensor as a view of ``gathered``, every rank's flat shard in rank order.

        ``gathered``: (world_size * shard_numel,) contiguous. No copy ([Note: dim-0 shards]).
        """
        return gathered[: self.numel].view(self.full_shape)

    def copy_in(self, full: torch.Tensor, gathered: torch.Tensor, accumulate: bool) -> None:
        """Write (or add) ``full`` into ``gathered`` (world_size, shard_numel), padding kept 0.

        Lays a full gradient out as every rank's padded shard, the input a reduce-scatter
        expects (the inverse of the all-gather's copy-out, ``GatherUnit.wait_for_unshard``).
        Without ``accumulate`` the padding rows are zeroed.
        """
        if self.numel == 0:
            return
        if self.rows == self.world_size * self.shard_rows:  # an even split: no padding, one op
            (gathered.add_ if accumulate else gathered.copy_)(full.reshape(gathered.shape))
            return
        src, dst, q, rem = self._blocks(full, gathered)
        whole = src[: q * self.shard_rows].view(q, self.shard_rows, self.row_numel)
        if accumulate:  # padding rows are already zero
            dst[:q].add_(whole)
            if rem:
                dst[q, :rem].add_(src[q * self.shard_rows :])
            return
        dst[:q].copy_(whole)
        if rem:
            dst[q, :rem].copy_(src[q * self.shard_rows :])
            dst[q, rem:].zero_()
            q += 1
        dst[q:].zero_()

    def _blocks(
        self, full: torch.Tensor, gathered: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor, int, int]:
        """(full as (rows, row_numel), gathered as (world, shard_rows, row_numel), q, rem).

        Rows [0, q * shard_rows) fill the first q ranks' shards entirely; rank q gets ``rem``.
        """
        flat_full = full.reshape(self.rows, self.row_numel)
        per_rank = gathered.view(self.world_size, self.shard_rows, self.row_numel)
        q, rem = divmod(self.rows, self.shard_rows)
        return flat_full, per_rank, q, rem


def shard_info(tensor: torch.Tensor) -> Optional[ShardedParam]:
    """The ``ShardedParam`` of an FSDP-sharded parameter, else None."""
    return getattr(tensor, SHARD_ATTR, None)


def make_shard_parameter(
    param: nn.Parameter,
    full: torch.Tensor,
    rank: int,
    world_size: int,
    group: Optional[Any] = None,
) -> nn.Parameter:
    """Turn ``param`` into its shard of ``full``; return the Parameter to keep.

    ``param`` itself is kept (its ``.data`` becomes the shard, so tying and references survive),
    except for a ``meta`` parameter, whose data cannot be swapped for a real tensor: a new
    Parameter is returned, and the caller must put it wherever the old one was.
    """
    info = ShardedParam(tuple(full.shape), rank, world_size, group)
    shard = info.shard_of(full)
    if param.device.type == "meta":
        param = nn.Parameter(shard, requires_grad=param.requires_grad)
    else:
        param.grad = None
        param.data = shard
    setattr(param, SHARD_ATTR, info)
    return param


def shard_module(
    root: nn.Module,
    rank: int,
    world_size: int,
    device: Optional[torch.device],
    sync: bool,
    group: Optional[Any] = None,
) -> List[str]:
    """Shard ``root`` in place at wrap time, one unique parameter at a time; returns the paths
    of tensors left for the model's init method ([Note: tensors the model's init method
    sets]).

    For each parameter: take its full value (materialised when on ``meta``: [Note: meta
    parameters]; moved to ``device`` if given), broadcast it from rank 0 if ``sync`` (ranks cannot
    silently disagree), keep this rank's shard, and free the full tensor before the next one,
    so a rank never holds a second full copy of the model. Buffers on ``meta`` are made real
    first by the model's own initialisation ([Note: meta buffers]). ``rank`` / ``world_size``:
    in ``group``, the ranks the shards are spread over (HSDP: the shard group); the broadcasts
    reach every rank, so every replica starts from rank 0's values.
    """
    unset: List[str] = []  # tensors left for the model's init method
    if has_meta_buffers(root):  # before the parameters: an init may need their full shapes
        unset = materialize_buffers(root, _meta_device(device), "FSDP")
    holders = defaultdict(list)  # id(param) -> [(module, attribute)] that hold it
    for module in root.modules():
        for attr, param in module._parameters.items():
            if param is not None:
                holders[id(param)].append((module, attr))
    init = getattr(root, "init_parameter", None) or ModuleInit(root, _meta_device(device), "FSDP")
    for name, param in list(root.named_parameters()):  # a tied parameter comes once
        full = _full_tensor(root, name, param, device, init)
        if sync and dist.get_world_size() > 1:
            comm.broadcast_into(full, src=0)
        shard = make_shard_parameter(param, full, rank, world_size, group)
        del full
        if shard is not param:  # meta: a new Parameter takes the old one's places
            for module, attr in holders[id(param)]:
                module._parameters[attr] = shard
    for module_name, module in root.named_modules():
        for name, buffer in module._buffers.items():
            if buffer is None:
                continue
            if buffer.device.type == "meta":
                raise ValueError(f"buffer '{module_name}.{name}' is on meta; FSDP cannot fill it")
            if device is not None:
                module._buffers[name] = buffer = buffer.to(device)
            if sync and dist.get_world_size() > 1:
                comm.broadcast_into(buffer, src=0)  # buffers stay whole, equal on every rank
    return unset + (init.unset if isinstance(init, ModuleInit) else [])


def _meta_device(device: Optional[torch.device]) -> torch.device:
    """Where ``meta`` tensors are materialised: ``device``, else CUDA with NCCL, else CPU."""
    return torch.device(device) if device is not None else default_device()


def _full_tensor(
    root: nn.Module, name: str, param: nn.Parameter, device: Optional[torch.device], init: Callable
) -> torch.Tensor:
    """The full value of ``param`` on the device its shard will live on (maybe materialised
    with ``init(name, tensor)``, [Note: meta parameters])."""
    if param.device.type != "meta":
        full = param.detach()
        return full if device is None else full.to(device)
    full = torch.empty(param.shape, dtype=param.dtype, device=_meta_device(device))
    init(name, full)
    return full
