"""FSDP's per-layer ``ParamHandler``: params from the layer's gather unit, grads reduce-scattered.

[Note: FSDP layer handler]
Each wrapped layer gets one ``FSDPHandler``; its parameters are dim-0 shards ([Note: dim-0
shards]).

- ``fetch`` / ``release``: delegated to the layer's ``GatherUnit`` ([Note: gather units]),
  which unshards the unit before its first layer computes and reshards it after its last one.
- ``reduce_grads``: lay the layer's full gradients out as every rank's padded shard (a
  (world_size, numel) rank-major buffer), divide by world_size and reduce-scatter: a SUM of
  pre-divided gradients is the average, on any backend. The reduce-scatter is launched, not
  waited for; slices of its output are the shard gradients, accumulated into ``param.grad`` at
  the end of the backward (a tied weight gets the sum of its layers' parts) and ``None`` is
  returned ([Note: asynchronous reduction]). Under ``no_sync`` the padded full gradients are
  summed into a per-layer buffer instead, and the next synchronised backward reduces the total.

Mixed precision: a synchronised backward lays the gradients out directly in the policy's
``reduce_dtype``; ``no_sync`` sums are kept in the parameters' dtype (fp32, like ``.grad``) and
cast once before their reduce-scatter.

Gradients of one dtype are reduced in one collective per layer (one per tensor with
``unit="tensor"``); a parameter that several layers of the unit share is reduced once, by the
unit ([Note: tied reduction]).
"""

from typing import Dict, List, Tuple

import torch
from torch import nn

from tiny_fsdp.core.fsdp.sharded_param import ShardedParam, shard_info
from tiny_fsdp.core.fsdp.state import FSDPState
from tiny_fsdp.core.fsdp.unit import GatherUnit
from tiny_fsdp.core.module.handler import ParamHandler, Params, TrainingPhase

Member = Tuple[int, ShardedParam]  # (slot in module.param_names, shard geometry)


class FSDPHandler(ParamHandler):
    """Fetch / release through a gather unit; reduce-scatter one layer's gradients."""

    def __init__(
        self, module: nn.Module, unit: GatherUnit, state: FSDPState, per_tensor: bool = False
    ) -> None:
        self.unit = unit
        self.state = state
        self.name = type(module).__name__
        self.n_slots = len(module.param_names)
        groups: Dict[object, List[Tuple[int, torch.dtype]]] = {}
        self._tied: Dict[int, nn.Parameter] = {}  # slot -> parameter reduced by unit.tied
        for slot, name in enumerate(module.param_names):
            param = getattr(module, name)
            if param is not None and param in unit.tied:
                self._tied[slot] = param
            elif param is not None:
                key = len(groups) if per_tensor else param.dtype
                groups.setdefault(key, []).append((slot, param.dtype))
        # Reduction groups: slots whose gradients share one reduce-scatter, and its dtype.
        self.groups = [([s for s, _ in g], g[0][1]) for g in groups.values()]
        self._infos = {
            slot: shard_info(getattr(module, module.param_names[slot]))
            for slots, _ in self.groups
            for slot in slots
        }
        self._acc: Dict[int, Tuple[Tuple[int, ...], torch.Tensor]] = {}  # no_sync grad sums

    def fetch(self, module: nn.Module, phase: TrainingPhase) -> Params:
        return self.unit.fetch(module, phase)

    def release(self, module: nn.Module, phase: TrainingPhase) -> None:
        self.unit.release(module, phase)

    def reduce_grads(self, module: nn.Module, grads: Params) -> Params:
        """Launch this layer's reduce-scatters; every gradient is delivered at finalize."""
        for slot, param in self._tied.items():
            if grads[slot] is not None:
                self.unit.tied.add(param, grads[slot])
        for index, (group_slots, dtype) in enumerate(self.groups):
            members: List[Member] = [
                (slot, self._infos[slot]) for slot in group_slots if grads[slot] is not None
            ]
            if members:
                self._reduce_group(module, index, dtype, members, grads)
        return (None,) * self.n_slots  # [Note: asynchronous reduction]

    def _reduce_group(
        self,
        module: nn.Module,
        index: int,
        dtype: torch.dtype,
        members: List[Member],
        grads: Params,
    ) -> None:
        """Lay one group's gradients out rank-major; reduce-scatter them or keep the no_sync sum."""
        world, state = self.state.world_size, self.state
        slots = tuple(slot for slot, _ in members)
        numel = sum(info.shard_numel for _, info in members)
        previous = self._acc.pop(index, None)
        if previous is not None:
            state.track_accumulated(-_nbytes(previous[1]))
            if previous[0] != slots:
                raise RuntimeError(
                    f"{self.name}: the parameters with gradients changed between no_sync "
                    f"micro-batches (slots {previous[0]}, then {slots})"
                )
            buffer = previous[1]
        else:
            sync = state.require_grad_sync
            buffer_dtype = state.reduce_dtype(dtype) if sync else dtype  # no_sync: fp32 sum
            buffer = grads[slots[0]].new_empty(world * numel, dtype=buffer_dtype)
        grid = buffer.view(world, numel)  # row r: what rank r's shards receive
        offset = 0
        for slot, info in members:
            columns = grid[:, offset : offset + info.shard_numel]
            info.copy_in(grads[slot], columns, accumulate=previous is not None)
            offset += info.shard_numel
        del grid, columns
        if not state.require_grad_sync:
            self._acc[index] = (slots, buffer)
            state.track_accumulated(_nbytes(buffer))
            return
        buffer = buffer.to(state.reduce_dtype(dtype))  # no copy unless a no_sync fp32 sum
        buffer.div_(state.grad_divisor)  # SUM of grad / world == average, on every backend
        reduced = buffer.new_empty(numel)  # (numel,): this rank's shards, concatenated
        parts, offset = [], 0
        for slot, info in members:
            shard_grad = reduced[offset : offset + info.shard_numel].view(info.shard_shape)
            parts.append((getattr(module, module.param_names[slot]), shard_grad))
            offset += info.shard_numel
        state.launch_reduce_scatter(reduced, buffer, parts)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
