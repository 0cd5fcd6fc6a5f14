"""Which layers form a unit: the layers whose full parameters are fetched and freed together.

FSDP's gather units ([Note: gather units]) and ZeRO-3's broadcast units ([Note: zero3 tensor
life cycle]) are laid out by the same rule, ``unit_layers``:

- ``"auto"`` (the default of both): the children of every block list (an ``nn.ModuleList``,
  ``nn.Sequential`` or ``nn.ModuleDict`` of same-type modules: a transformer's blocks, every
  tower's of a model with several; ``repeated_blocks``) are units, the other layers one more
  unit, the root; a model without a block list gets one unit per layer. A layer module that
  several blocks hold (one norm shared by two blocks) belongs to none of them: it is in the
  root unit.
- ``"layer"`` and ``"tensor"``: one unit per layer (``"tensor"`` also issues one collective
  per tensor instead of one per group of tensors; the strategies read that themselves).
- a list of modules: all layers inside one listed module form a unit; the layers outside every
  listed module form the root unit (FSDP2's layout).
"""

from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from tiny_fsdp.core.module.layer import is_layer, local_param

UnitSpec = Union[str, Iterable[nn.Module]]


def unit_layers(
    root: nn.Module, unit: UnitSpec, numel: Callable[[torch.Tensor], int] = torch.numel
) -> List[Tuple[str, List[nn.Module]]]:
    """``(name, layers)`` of every unit, in module order (see the module docstring).

    ``numel``: elements of a parameter's *full* tensor. A wrapped model's local parameters are
    shards or empty placeholders, different on every rank; the layout must be the same on all
    ranks (their collectives pair up), so it is computed from full sizes."""
    names = {id(m): path or "<root>" for path, m in root.named_modules()}
    layers = [m for m in root.modules() if is_layer(m)]
    shared_to_root = isinstance(unit, str) and unit == "auto"
    if shared_to_root:
        blocks = repeated_blocks(root, numel)
        if blocks is None:
            return [(names[id(layer)], [layer]) for layer in layers]
        unit = blocks
    if isinstance(unit, str):
        if unit not in ("layer", "tensor"):
            raise ValueError(
                f"unit must be 'auto', 'layer', 'tensor' or a list of modules, got {unit!r}"
            )
        return [(names[id(layer)], [layer]) for layer in layers]
    modules = list(unit)
    for index, module in enumerate(modules):
        if not isinstance(module, nn.Module) or id(module) not in names:
            raise ValueError(f"unit entry {index} is not a submodule of the wrapped model")
    held = holders(modules)
    if not shared_to_root:
        for layer in layers:
            if len(held.get(id(layer), ())) > 1:
                first, second = (names[id(modules[i])] for i in held[id(layer)][:2])
                raise ValueError(
                    f"layer '{names[id(layer)]}' is inside two unit modules ('{first}' and "
                    f"'{second}'): list neither (it joins the root unit) or a module holding both"
                )
    grouped: List[List[nn.Module]] = [[] for _ in range(len(modules) + 1)]  # last: the root
    for layer in layers:
        grouped[unit_of(held, layer, root=len(modules))].append(layer)
    named = [(names[id(m)], g) for m, g in zip(modules, grouped)] + [("<root>", grouped[-1])]
    return [(name, group) for name, group in named if group]


def holders(modules: Sequence[nn.Module]) -> Dict[int, List[int]]:
    """``id(m)`` of every module inside ``modules`` -> the indices of those holding it."""
    held: Dict[int, List[int]] = {}
    for index, module in enumerate(modules):
        for inner in module.modules():
            held.setdefault(id(inner), []).append(index)
    return held


def unit_of(held: Dict[int, List[int]], layer: nn.Module, root: int) -> int:
    """The unit of ``layer`` given ``holders(modules)``: the one listed module holding it, else
    ``root`` (outside every listed module, or inside several: a layer blocks share)."""
    indices = held.get(id(layer), [])
    return indices[0] if len(indices) == 1 else root


def repeated_blocks(
    root: nn.Module, numel: Callable[[torch.Tensor], int] = torch.numel
) -> Optional[List[nn.Module]]:
    """The children of every block list of ``root``, in module order, or None if it has none.

    A block list is an ``nn.ModuleList``, ``nn.Sequential`` or ``nn.ModuleDict`` (torchtitan's
    Llama keeps its blocks in one) of >= 2 modules of one type that hold parameters: a
    transformer's blocks, each tower's of a model with several (an encoder and a decoder, a
    student and a frozen teacher). The outermost lists count: a list inside a block belongs to
    that block."""
    blocks: List[nn.Module] = []

    def visit(module: nn.Module) -> None:
        if _is_block_list(module, numel):
            blocks.extend(module.children())
            return
        for child in module.children():
            visit(child)

    visit(root)
    return blocks or None


def _is_block_list(module: nn.Module, numel: Callable[[torch.Tensor], int]) -> bool:
    if not isinstance(module, (nn.ModuleList, nn.Sequential, nn.ModuleDict)) or len(module) < 2:
        return False
    if len({type(child) for child in module.children()}) != 1:
        return False
    return sum(numel(p) for p in module.parameters()) > 0


def unit_params(layers: Sequence[nn.Module]) -> List[nn.Parameter]:
    """The local parameters of ``layers``, each once (a tied one too), in layer order."""
    params: Dict[int, nn.Parameter] = {}
    for layer in layers:
        for name in layer.param_names:
            param = local_param(layer, name)  # also while a generic layer computes
            if param is not None:
                params.setdefault(id(param), param)
    return list(params.values())


def grouped(
    params: Sequence[nn.Parameter], key: Callable[[nn.Parameter], object], per_tensor: bool
) -> List[List[nn.Parameter]]:
    """``params`` in groups of equal ``key`` (first-seen order); one tensor per group with
    ``per_tensor`` (``unit="tensor"``). A group is what one collective moves."""
    groups: Dict[object, List[nn.Parameter]] = {}
    for param in params:
        groups.setdefault(len(groups) if per_tensor else key(param), []).append(param)
    return list(groups.values())
