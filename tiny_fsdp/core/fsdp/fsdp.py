"""``FSDP``: every rank keeps a 1/N dim-0 shard of every parameter; layers gather them to compute.

[Note: FSDP]
At wrap time each unique parameter, one at a time, is (materialised from ``meta`` if needed,)
broadcast from rank 0 and cut to this rank's zero-padded dim-0 shard ([Note: dim-0 shards]); the
module's ``nn.Parameter`` object is kept with the shard as its data, so tying survives and
optimizers see shards. The layers are grouped into gather units (one per layer by default,
[Note: gather units]) and every layer gets an ``FSDPHandler`` ([Note: FSDP layer handler]):
a unit is all-gathered just before its first layer computes and freed after its last one, in
forward and again in backward, and each layer launches the reduce-scatter of the averaged
gradient of its parameters, delivered into ``shard.grad`` when the backward ends ([Note:
asynchronous reduction]). Between steps a rank holds only shards: parameters, gradients
and optimizer state are each 1/N of the model (plus padding).

The tied GPT-2 weight stays one Parameter with one shard: with per-layer units ``wte`` and
``lm_head`` each gather it and each reduce-scatter their own part of its gradient, summed into
``.grad``; in one unit (the default layout) it is gathered and reduced once ([Note: tied
reduction]).
"""

from collections import OrderedDict
from typing import Any, Dict, Iterable, List, Mapping, NamedTuple, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from tiny_fsdp.core import comm, streams
from tiny_fsdp.core.fsdp.handler import FSDPHandler
from tiny_fsdp.core.fsdp.sharded_param import shard_info, shard_module
from tiny_fsdp.core.fsdp.state import FSDPState
from tiny_fsdp.core.fsdp.unit import GatherUnit, unit_layers
from tiny_fsdp.core.precision import MixedPrecisionPolicy
from tiny_fsdp.core.utils.dist import require_process_group
from tiny_fsdp.core.wrapper import (
    DataParallelWrapper,
    check_no_shared_storage,
    check_same_model_on_all_ranks,
)


class IncompatibleKeys(NamedTuple):
    missing_keys: List[str]
    unexpected_keys: List[str]


class FSDP(DataParallelWrapper):
    """Fully sharded data parallel wrapper ([Note: FSDP]).

    Args:
        module: the model; converted in place to tiny_fsdp layers and sharded. It may be built
            on ``meta``: each tensor is then materialised with ``module.init_parameter(name,
            full)``, sharded and freed, one at a time.
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
            found in its largest ``nn.ModuleList``, else per layer), ``"layer"``, ``"tensor"``,
            or a list of modules (e.g. the transformer blocks; the other layers form a root
            unit). Gradients are reduce-scattered per layer (per tensor with ``"tensor"``).
            [Note: gather units]
        mixed_precision: shards are cast to ``param_dtype`` before each all-gather (half the
            gathered bytes with bf16) and gradients reduce-scattered in ``reduce_dtype``; the
            shards, their ``.grad`` and the optimizer state stay fp32 ([Note: mixed precision]).
    """

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
    ) -> None:
        require_process_group(type(self).__name__)
        world_size, rank = _check_group(world_size, rank)
        # Created before the base __init__, which sets a switch that forwards to it.
        self._state = FSDPState(world_size, rank, reshard_after_forward, prefetch_limit)
        super().__init__(module, enable_async_communication, mixed_precision)
        self._state.policy = mixed_precision
        check_no_shared_storage(self.module, "FSDP")
        check_same_model_on_all_ranks(self.module, "FSDP")
        shard_module(self.module, rank, world_size, device, sync_module_states)
        shard_device = next((p.device for p in self.module.parameters()), torch.device("cpu"))
        self._state.use_streams(streams.streams_for(shard_device))
        per_tensor = isinstance(unit, str) and unit == "tensor"
        for name, layers in unit_layers(self.module, unit):
            gather_unit = GatherUnit(name, layers, self._state, per_tensor)
            self._state.units.append(gather_unit)
            for layer in layers:
                layer.param_handler = FSDPHandler(layer, gather_unit, self._state, per_tensor)

    @property
    def units(self) -> List[GatherUnit]:
        """The gather units, in module order ([Note: gather units])."""
        return list(self._state.units)

    # A switch the handlers read during backward lives in the shared state.
    @property
    def require_backward_grad_sync(self) -> bool:
        return self._state.require_grad_sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self._state.require_grad_sync = bool(value)

    @property
    def prefetch_limit(self) -> int:
        return self._state.prefetch_limit

    @property
    def world_size(self) -> int:
        return self._state.world_size

    @property
    def rank(self) -> int:
        return self._state.rank

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._state.pre_forward(self.enable_async_communication, torch.is_grad_enabled())
        try:
            return self.module(*args, **kwargs)
        finally:
            self._state.post_forward()

    # ---------------------------------------------------------------- memory
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

    # ---------------------------------------------------------------- checkpoints
    def state_dict(
        self, *, destination: Optional[Dict] = None, prefix: str = "", keep_vars: bool = False
    ) -> Dict[str, torch.Tensor]:
        """Full tensors under the plain model's keys (tied keys included). Call on every rank."""
        out = OrderedDict() if destination is None else destination
        gathered: Dict[int, torch.Tensor] = {}  # a tied parameter is gathered once
        for key, value in self.module.state_dict(keep_vars=True).items():
            info = shard_info(value)
            if info is None:
                out[prefix + key] = value if keep_vars else value.detach()
                continue
            if id(value) not in gathered:
                flat = value.new_empty(info.world_size * info.shard_numel)
                comm.all_gather(flat, value.detach().reshape(-1))
                gathered[id(value)] = info.full_view(flat).clone()  # drop the padding
            out[prefix + key] = gathered[id(value)]
        return out

    def load_state_dict(
        self, state_dict: Mapping[str, torch.Tensor], strict: bool = True, assign: bool = False
    ) -> IncompatibleKeys:
        """Load full tensors (plain model keys) by keeping this rank's shard of each."""
        if assign:
            raise NotImplementedError("FSDP.load_state_dict shards into the existing params")
        own = self.module.state_dict(keep_vars=True)
        missing = [key for key in own if key not in state_dict]
        unexpected = [key for key in state_dict if key not in own]
        if strict and (missing or unexpected):
            raise RuntimeError(
                f"FSDP.load_state_dict: missing keys {missing}, unexpected keys {unexpected}. "
                f"Keys are the plain model's (e.g. {next(iter(own), '')!r}), without 'module.'."
            )
        self._state.drop_transients()  # prefetched or held params would be stale
        with torch.no_grad():
            for key, target in own.items():
                if key not in state_dict:
                    continue
                source = state_dict[key]
                info = shard_info(target)
                shape = tuple(info.full_shape if info is not None else target.shape)
                if tuple(source.shape) != shape:
                    raise RuntimeError(
                        f"FSDP.load_state_dict: '{key}' has shape {tuple(source.shape)}, "
                        f"the model expects {shape}"
                    )
                source = source.to(target.device, target.dtype)
                target.copy_(info.shard_of(source) if info is not None else source)
        return IncompatibleKeys(missing, unexpected)


def _check_group(world_size: Optional[int], rank: Optional[int]) -> Tuple[int, int]:
    actual = (dist.get_world_size(), dist.get_rank())
    for name, given, real in (("world_size", world_size, actual[0]), ("rank", rank, actual[1])):
        if given is not None and given != real:
            raise ValueError(f"FSDP got {name}={given} but the process group has {name}={real}")
    return actual


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
