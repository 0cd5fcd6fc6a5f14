"""``FSDP``: every rank keeps a 1/N dim-0 shard of every parameter; layers gather them to compute.

[Note: FSDP]
At wrap time each unique parameter, one at a time, is (materialised from ``meta`` if needed,)
broadcast from rank 0 and cut to this rank's zero-padded dim-0 shard ([Note: dim-0 shards]); the
module's ``nn.Parameter`` object is kept with the shard as its data, so tying survives and
optimizers see shards. The layers are grouped into gather units (by default the model's repeated
blocks plus a root unit, [Note: gather units]) and every layer gets a ``UnitHandler`` ([Note:
unit handler]): a unit is all-gathered just before its first layer computes and freed
after its last one, in forward and again in backward; its layers' gradients are summed and the
unit launches one reduce-scatter of their average, delivered into ``shard.grad`` when the
backward ends ([Note: unit reduction], [Note: asynchronous reduction]). Between steps a rank
holds only shards: parameters, gradients and optimizer state are each 1/N of the model (plus
padding).

The tied GPT-2 weight stays one Parameter with one shard: with per-layer units ``wte`` and
``lm_head`` each gather it and each reduce-scatter their own part of its gradient, summed into
``.grad``; in one unit (the default layout) it is gathered and reduced once.

With a 2-D ``mesh`` (replicas, shard_size) the same happens inside each shard group, and the
reduced gradient shards are all-reduced across the replicas ([Note: hybrid sharding]).
"""

from typing import Any, Dict, Iterable, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from tiny_fsdp.core import comm, streams
from tiny_fsdp.core.fetching_wrapper import FetchingWrapper
from tiny_fsdp.core.fsdp import dtensor_state
from tiny_fsdp.core.fsdp.mesh import MeshGroups, mesh_groups
from tiny_fsdp.core.fsdp.sharded_param import shard_info, shard_module
from tiny_fsdp.core.fsdp.state import FSDPState
from tiny_fsdp.core.fsdp.unit import GatherUnit
from tiny_fsdp.core.fsdp.grads import ReduceScatterGrads
from tiny_fsdp.core.clip import HeldGrads
from tiny_fsdp.core.local_state import LocalPiece
from tiny_fsdp.core.precision import MixedPrecisionPolicy
from tiny_fsdp.core.utils.dist import require_process_group


class FSDP(FetchingWrapper):
    """Fully sharded data parallel wrapper ([Note: FSDP]).

    Args:
        module: any model; converted in place to tiny_fsdp layers (registered wrappers, else
            the generic path, [Note: generic layer]) and sharded. It may be built
            on ``meta``: each tensor is then materialised with ``module.init_parameter(name,
            full)``, else the model's own init of its module ([Note: meta parameters]),
            sharded and freed, one at a time; buffers by the model's own initialisation
            ([Note: meta buffers]).
        world_size, rank: default to the default process group's; if given they must match it.
        reshard_after_forward: free full parameters after each layer's forward (default) or
            keep them until its backward (less communication, more memory).
        enable_async_communication: prefetch the next units' all-gathers ([Note: prefetch]) and
            leave gradient reduce-scatters in flight while backward goes on ([Note:
            asynchronous reduction]); on by default, also settable as an attribute (read at each
            forward). Results are bitwise the same on and off.
        prefetch_limit: at most this many prefetched gathers unconsumed at once (>= 1).
        sync_module_states: broadcast every full tensor from rank 0 before sharding it.
        device: where to materialise ``meta`` tensors (default: the current CUDA device with
            NCCL, else CPU) and where shards live (default: each parameter's device).
        unit: what is all-gathered together: ``"auto"`` (default: the model's repeated blocks,
            the children of its ``nn.ModuleList`` / ``nn.Sequential`` of same-type modules, else
            per layer; ``unit_layout.py``), ``"layer"``, ``"tensor"``,
            or a list of modules (e.g. the transformer blocks; the other layers form a root
            unit). Gradients are reduce-scattered once per unit (per tensor with ``"tensor"``).
            [Note: gather units]
        mixed_precision: shards are cast to ``param_dtype`` before each all-gather (half the
            gathered bytes with bf16) and gradients reduce-scattered in ``reduce_dtype``; the
            shards, their ``.grad`` and the optimizer state stay fp32 ([Note: mixed precision]).
        mesh: None or a 1-D ``DeviceMesh`` over every rank (plain FSDP), or a 2-D one of shape
            ``(replicas, shard_size)`` named ``("replicate", "shard")`` (HSDP: shards of
            ``1 / shard_size`` within each shard group, replicated across them, [Note: hybrid
            sharding]); ``hsdp_mesh(replicas)`` builds one. The ``world_size`` / ``rank``
            arguments stay the whole world's; the properties of those names are the shard
            group's.
        registered_layers: False puts every module on the generic path: the model's own ops
            compute, so a backward with ``create_graph=True`` (a gradient penalty) works, which
            a registered layer's hand-written backward refuses ([Note: backward for inputs
            only]).
    """

    materializes_meta = True
    separates_storage = True
    updates_local_part = True
    local_params = "dim0_shards"  # [Note: optimizers of other libraries]
    gathers_full_tensors = True

    def __init__(
        self,
        module: nn.Module,
        world_size: Optional[int] = None,
        rank: Optional[int] = None,
        *,
        reshard_after_forward: bool = True,
        enable_async_communication: bool = True,
        prefetch_limit: int = 1,
        sync_module_states: bool = True,
        device: Optional[torch.device] = None,
        unit: Union[str, Iterable[nn.Module]] = "auto",
        mixed_precision: Optional[MixedPrecisionPolicy] = None,
        mesh: Optional[Any] = None,
        registered_layers: bool = True,
    ) -> None:
        require_process_group(type(self).__name__)
        _check_group(world_size, rank)
        groups = mesh_groups(mesh, type(self).__name__)  # raises on every rank alike
        shard_size, shard_rank = groups.shard_size, groups.shard_rank
        # Created before the base __init__, which sets a switch that forwards to it.
        self._state = FSDPState(
            shard_size, shard_rank, reshard_after_forward, prefetch_limit, groups
        )
        super().__init__(
            module, enable_async_communication, mixed_precision, registered_layers, unit
        )
        self._state.policy = self.mixed_precision
        unset = shard_module(
            self.module, shard_rank, shard_size, device, sync_module_states, groups.shard_group
        )
        # Shards now (meta parameters were replaced by new objects).
        self.claim(self.module.parameters(), changed=True)
        shard_device = next((p.device for p in self.module.parameters()), torch.device("cpu"))
        communicates = shard_size > 1 or groups.replicate_group is not None
        self._state.use_streams(streams.streams_for(shard_device, communicates))
        self.build_units(self._state, unit, GatherUnit, ReduceScatterGrads, shard_device, unset)

    # A switch the handlers read during backward lives in the shared state.
    @property
    def require_backward_grad_sync(self) -> bool:
        return self._state.require_grad_sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self._state.require_grad_sync = bool(value)

    @property
    def world_size(self) -> int:
        """Ranks the shards are spread over: the shard group (every rank without a mesh)."""
        return self._state.world_size

    @property
    def rank(self) -> int:
        """This rank's place in its shard group (its global rank without a mesh)."""
        return self._state.rank

    @property
    def mesh_groups(self) -> MeshGroups:
        """Shard and replicate groups, sizes and ranks ([Note: hybrid sharding])."""
        return self._state.groups

    # ---------------------------------------------------------------- memory
    def transient_bytes(self) -> Dict[str, int]:
        """Bytes of gathered units and of reductions in flight now: two counters, no walk (read
        at every compute boundary of a traced step, ``tiny_fsdp/trace``)."""
        return {
            "gathered": self._state.gathered_bytes,
            "reductions": self._state.reductions.stats.live_bytes,
        }

    def memory_stats(self) -> Dict[str, int]:
        """Bytes this rank holds: shards, gathered units, no_sync accumulation buffers and
        reduction buffers in flight ([Note: asynchronous reduction])."""
        state, reduce = self._state, self._state.reductions.stats
        return {
            "shard_bytes": sum(_nbytes(p) for p in self.module.parameters()),
            "gathered_bytes": state.gathered_bytes,
            "peak_gathered_bytes": state.peak_gathered_bytes,
            "accumulated_grad_bytes": state.accumulated_bytes,
            "reduce_bytes": reduce.live_bytes,
            "peak_reduce_bytes": reduce.peak_bytes,
        }

    def reset_peak_memory_stats(self) -> None:
        self._state.peak_gathered_bytes = self._state.gathered_bytes
        reduce = self._state.reductions.stats
        reduce.peak_bytes = reduce.live_bytes

    # ---------------------------------------------------------------- what this rank holds
    def full_tensor(self, param: torch.Tensor) -> torch.Tensor:
        info = shard_info(param)
        flat = param.new_empty(info.world_size * info.shard_numel)
        groups = self._state.groups
        comm.all_gather(
            flat, param.detach().reshape(-1), groups.shard_group, label=groups.shard_label
        )
        return info.full_view(flat).clone()  # drop the padding

    def full_shape(self, param: torch.Tensor) -> Tuple[int, ...]:
        return tuple(shard_info(param).full_shape)

    def load_full_(self, param: torch.Tensor, full: torch.Tensor) -> None:
        info = shard_info(param)
        if dtensor_state.is_dtensor(full):  # checkpoint_part's form, through torch's DCP
            param.detach()[: info.valid_rows].copy_(dtensor_state.rows_of(full, info, "FSDP"))
            return
        param.detach().copy_(info.shard_of(full))

    def checkpoint_part(self, param: torch.Tensor) -> torch.Tensor:
        """The real rows as a ``Shard(0)`` DTensor, no gather; a 0-d parameter whole, as its
        shape says ([Note: torch's distributed checkpoint])."""
        info = shard_info(param)
        if not info.full_shape:
            return self.full_tensor(param)
        return dtensor_state.rows_as_dtensor(param.detach(), info)

    def local_piece(self, param: torch.Tensor) -> Optional[LocalPiece]:
        """The real rows of the shard (padding rows are not part of the tensor)."""
        info = shard_info(param)
        start = info.rank * info.shard_rows * info.row_numel
        return LocalPiece(start, param.detach()[: info.valid_rows])  # a contiguous prefix

    def saved_piece(self, param: torch.Tensor) -> Optional[LocalPiece]:
        """Replica 0 writes its shard group's pieces; the other replicas hold the same."""
        return self.local_piece(param) if self._state.groups.replicate_rank == 0 else None

    def held_grads(self, params: Sequence[torch.Tensor]) -> HeldGrads:
        """The shards' gradients, each element once per shard group. Their padding rows are
        zero after a backward; a ``.grad`` assigned by the user may fill them
        (``torch.full_like(p, c)``), so they are zeroed here, outside every full tensor."""
        grads = []
        for p in params:
            if p.grad is not None:
                info = shard_info(p)
                if info is not None and info.valid_rows < info.shard_rows:
                    p.grad.detach()[info.valid_rows :].zero_()
                grads.append(p.grad)
        return HeldGrads(grads, sharded=True, group=self._state.groups.shard_group)


def _check_group(world_size: Optional[int], rank: Optional[int]) -> None:
    actual = (dist.get_world_size(), dist.get_rank())
    for name, given, real in (("world_size", world_size, actual[0]), ("rank", rank, actual[1])):
        if given is not None and given != real:
            raise ValueError(f"FSDP got {name}={given} but the process group has {name}={real}")


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
