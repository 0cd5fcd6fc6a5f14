"""A gather unit: the parameters of one or more layers, all-gathered together and freed together.

[Note: gather units]
The unit of communication decides how many collectives a step issues and how much is gathered
at once. ``FSDP(unit=...)`` offers four:

- ``"auto"`` (default): the children of the model's largest ``nn.ModuleList`` of same-type
  modules (a transformer's blocks; "largest" by parameter elements) become units, the other
  layers the root unit, as with a list of modules below; a model without such a list gets
  ``"layer"``. The user names nothing.
- ``"layer"``: each wrapped layer is a unit; its flat shards are concatenated into one
  all-gather per fetch.
- ``"tensor"``: like ``"layer"``, but one all-gather per tensor (no concatenation / copy-out).
- a list of modules (e.g. the transformer blocks): all layers inside one listed module form a
  unit; layers outside every listed module form one more unit, the "root" (FSDP2's layout).

A unit is unsharded (all-gathered) when the first of its layers fetches and stays full until
every one of its layers has released it in that pass, then resharded ([Note: glossary]); a
parameter that appears in several of its layers (a tied weight) is gathered once, and its
gradient reduced once ([Note: tied reduction]). Other gradients are reduce-scattered per layer
(``handler.py``), launched as soon as the layer's backward has them and delivered at the end of
the backward ([Note: asynchronous reduction]).

A single-tensor collective yields the full tensor as a view of the gathered buffer; a
multi-tensor one is laid out rank-major (rank r's shards of every tensor, then rank r+1's), so
each tensor is copied out to its own storage and the buffer is freed at once.

Which unit, by measurement (the first round's FSDP benchmark, now part of ``example/benchmark.py``:
gpt2_mini, 2 CPU ranks on gloo, all variants and FSDP2 alternating in one run; step-time ratio to
FSDP2, median / paired median): per tensor 1.10-1.14 / 1.10 (158 collectives a step), per layer 1.15
/ 1.08 (83), per block + root 0.98 / 0.96 (36). Gloo collectives are slow here (milliseconds each, a
few hundred MB/s), so what counts is the number of collectives and the bytes moved: per block issues
the fewest and, with the tied weight in one unit, gathers and reduces GPT-2's 51 MB embedding once a
step instead of three and two times. Its price is memory: the root unit (the embedding) stays
gathered for the whole step, as in FSDP2, and a block is gathered at once instead of a layer.
Hence ``"auto"`` is the default: it finds the blocks itself, so the fast layout needs no
knowledge of the model from the user; ``"layer"`` gathers the least at a time (less memory).
With the defaults (``"auto"``, asynchronous reductions), ``torchrun --nproc_per_node=2
example/benchmark.py --model gpt2_mini --batch_size 4 --seq_len 256 --steps 15`` measured FSDP
at 0.95 x FSDP2's step time and ZeRO-3 at 1.03 x (median of per-round ratios), on a machine
whose load average was 7-13 on 2 cores: per-step times spread by 2x, so these are rough.
"""

from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from tiny_fsdp.core import comm
from tiny_fsdp.core.fsdp.sharded_param import ShardedParam, shard_info
from tiny_fsdp.core.fsdp.state import FSDPState
from tiny_fsdp.core.fsdp.tied import TiedReduction
from tiny_fsdp.core.module.layer import is_layer
from tiny_fsdp.core.module.handler import Params, TrainingPhase
from tiny_fsdp.core.streams import GATHER, CommHandle, Launch

# One collective per entry: (handle, output (world * numel,), input kept alive until waited).
PendingGather = List[Tuple[CommHandle, torch.Tensor, torch.Tensor]]


class GatherUnit:
    """Unshards, holds and reshards the full parameters of ``layers`` ([Note: gather units]).

    Implements the prefetcher's ``Unit`` verbs ([Note: prefetch]) with all-gathers of shards.
    """

    def __init__(
        self, name: str, layers: Sequence[nn.Module], state: FSDPState, per_tensor: bool = False
    ) -> None:
        self.name = name
        self.state = state
        self.layers = list(layers)
        shards: Dict[int, nn.Parameter] = {}  # the local parameters, each once
        for layer in self.layers:
            for param_name in layer.param_names:
                param = getattr(layer, param_name)
                if param is not None:
                    if shard_info(param) is None:
                        raise ValueError(f"{name}: {param_name} of {layer} is not an FSDP shard")
                    shards.setdefault(id(param), param)
        # A collective has one dtype: tensors of one dtype travel together (or each alone).
        groups: Dict[object, List[nn.Parameter]] = {}
        for param in shards.values():
            groups.setdefault(len(groups) if per_tensor else param.dtype, []).append(param)
        self.groups: List[List[nn.Parameter]] = list(groups.values())
        self.tied = TiedReduction(self.layers, state)  # parameters several layers here use
        self._full: Optional[Dict[int, torch.Tensor]] = None  # id(shard param) -> full tensor
        self._full_bytes = 0
        # Per phase, ids of the layers done with the full parameters since the unshard, and
        # how many fetches are computing with them now (a recomputation nests in a backward).
        self._released: Dict[TrainingPhase, set] = {phase: set() for phase in TrainingPhase}
        self._holders = 0

    def gathered_numel(self) -> int:
        """Elements of the padded all-gather outputs of one gather of this unit."""
        world = self.state.world_size
        return sum(world * shard_info(p).shard_numel for group in self.groups for p in group)

    # ---------------------------------------------------------------- layer seam
    def fetch(self, layer: nn.Module, phase: TrainingPhase) -> Params:
        """The full parameters of ``layer`` (unsharding the unit unless it is full)."""
        self.state.fetch(self, phase)
        self._holders += 1
        return tuple(
            None if p is None else self._full[id(p)]
            for p in (getattr(layer, n) for n in layer.param_names)
        )

    def release(self, layer: nn.Module, phase: TrainingPhase) -> None:
        """``layer`` is done; reshard once all layers are done in this phase and none computes.

        Per phase, so that the forward fetches of a recomputation inside the backward (gradient
        checkpointing) do not count as the backward's; a unit kept after forward (see
        ``FSDPState``) is not resharded by forward releases.
        """
        self._holders -= 1
        if phase is TrainingPhase.FORWARD and self.state.keeps_after_forward(self):
            return
        released = self._released[phase]
        released.add(id(layer))
        if self._holders == 0 and len(released) == len(self.layers):
            self.reshard()

    # ---------------------------------------------------------------- unit verbs
    @property
    def is_unsharded(self) -> bool:
        return self._full is not None

    def unshard(self, async_op: bool) -> PendingGather:
        """Start (or run) one all-gather per group; counted in the state's gathered bytes."""
        pending: PendingGather = []
        for group in self.groups:
            shards = [param.detach().reshape(-1) for param in group]
            flat = shards[0] if len(shards) == 1 else torch.cat(shards)  # (group_numel,)
            # Mixed precision: cast the shard, not the gathered tensor: half the bytes travel.
            flat = flat.to(self.state.gather_dtype(flat.dtype))
            out = flat.new_empty(self.state.world_size * flat.numel())  # (world * group_numel,)
            groups = self.state.groups  # in the shard group, [Note: hybrid sharding]
            handle = self.state.streams.issue(GATHER, _all_gather(out, flat, groups), async_op)
            self.state.track_gathered(_nbytes(out))
            pending.append((handle, out, flat))
        return pending

    def wait_for_unshard(self, pending: PendingGather) -> None:
        """Wait for the all-gathers; keep each parameter's full tensor (view or copy-out)."""
        world = self.state.world_size
        full: Dict[int, torch.Tensor] = {}
        full_bytes = 0
        for group, (handle, out, _) in zip(self.groups, pending):
            self.state.streams.wait(handle)
            if len(group) == 1:
                full[id(group[0])] = shard_info(group[0]).full_view(out)  # view: no copy
                full_bytes += _nbytes(out)
                continue
            infos: List[ShardedParam] = [shard_info(p) for p in group]
            grid = out.view(world, sum(i.shard_numel for i in infos))  # row r: rank r's shards
            offset = 0
            for param, info in zip(group, infos):
                tensor = out.new_empty(info.full_shape)
                info.copy_out(grid[:, offset : offset + info.shard_numel], tensor)
                self.state.track_gathered(_nbytes(tensor))
                full_bytes += _nbytes(tensor)
                full[id(param)] = tensor
                offset += info.shard_numel
            self.state.track_gathered(-_nbytes(out))  # the rank-major buffer dies here
        self._full, self._full_bytes = full, full_bytes
        self._clear_released()

    def discard(self, pending: PendingGather) -> None:
        """Forget a prefetch that will not be used, once its collective has finished."""
        for handle, out, _ in pending:
            self.state.streams.wait(handle)
            self.state.track_gathered(-_nbytes(out))

    def reshard(self) -> None:
        """Free the full parameters (back to shards only)."""
        if self._full is not None:
            self._full = None
            self.state.track_gathered(-self._full_bytes)
            self._full_bytes = 0
        self._clear_released()

    def _clear_released(self) -> None:
        for released in self._released.values():
            released.clear()


def unit_layers(
    root: nn.Module, unit: Union[str, Iterable[nn.Module]]
) -> List[Tuple[str, List[nn.Module]]]:
    """``(name, layers)`` of every gather unit, in module order ([Note: gather units])."""
    names = {id(m): path or "<root>" for path, m in root.named_modules()}
    layers = [m for m in root.modules() if is_layer(m)]
    if isinstance(unit, str) and unit == "auto":
        blocks = repeated_blocks(root)
        if blocks is None:
            return [(names[id(layer)], [layer]) for layer in layers]
        unit = blocks
    if isinstance(unit, str):
        if unit not in ("layer", "tensor"):
            raise ValueError(
                f"unit must be 'auto', 'layer', 'tensor' or a list of modules, got {unit!r}"
            )
        return [(names[id(layer)], [layer]) for layer in layers]
    owners: Dict[int, int] = {}  # id(layer) -> index of the listed module that holds it
    modules = list(unit)
    for index, module in enumerate(modules):
        if not isinstance(module, nn.Module) or id(module) not in names:
            raise ValueError(f"unit entry {index} is not a submodule of the wrapped model")
        for layer in module.modules():
            if is_layer(layer):
                if id(layer) in owners:
                    raise ValueError(
                        f"layer '{names[id(layer)]}' is inside two unit modules "
                        f"('{names[id(modules[owners[id(layer)]])]}' and '{names[id(module)]}')"
                    )
                owners[id(layer)] = index
    grouped: List[List[nn.Module]] = [[] for _ in range(len(modules) + 1)]  # last: the root
    for layer in layers:
        grouped[owners.get(id(layer), len(modules))].append(layer)
    named = [(names[id(m)], g) for m, g in zip(modules, grouped)] + [("<root>", grouped[-1])]
    return [(name, group) for name, group in named if group]


def repeated_blocks(root: nn.Module) -> Optional[List[nn.Module]]:
    """The children of the ``nn.ModuleList`` of >= 2 same-type modules holding the most
    parameter elements (a transformer's blocks), or None if the model has no such list."""
    best, best_numel = None, 0
    for module in root.modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        if len({type(child) for child in module}) != 1:
            continue
        numel = sum(p.numel() for p in module.parameters())
        if numel > best_numel:
            best, best_numel = list(module), numel
    return best


def _all_gather(out: torch.Tensor, flat: torch.Tensor, groups: Any) -> Launch:
    def launch(async_op: bool) -> Any:
        group, label = groups.shard_group, groups.shard_label
        return comm.all_gather(out, flat, group=group, async_op=async_op, label=label)

    return launch


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
