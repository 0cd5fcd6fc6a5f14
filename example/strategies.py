"""How each example builds (model, optimizer) for a strategy: the only per-strategy code.

Weight decay follows GPT-2 practice: matrices (dim >= 2: linear and embedding weights) decay,
biases and LayerNorm parameters do not. The split is decided by name on the plain model, before
a strategy reshapes parameters into shards.
"""

import argparse
from typing import Callable, Dict, Iterable, List, Set, Tuple

import torch
from torch import nn

from tiny_fsdp.core.module import convert_module
from tiny_fsdp.core.precision import MixedPrecisionPolicy, apply_mixed_precision
from tiny_fsdp.core.utils.dist import DistEnv


def decayed_names(model: nn.Module) -> Set[str]:
    return {name for name, p in model.named_parameters() if p.dim() >= 2}


def param_groups(
    named_params: Iterable[Tuple[str, nn.Parameter]], decay: Set[str], weight_decay: float
) -> List[dict]:
    """Two AdamW groups by name; ``named_params`` may carry a ``module.`` prefix."""
    groups: Dict[bool, list] = {True: [], False: []}
    for name, p in named_params:
        plain = name[len("module.") :] if name.startswith("module.") else name
        groups[plain in decay].append((name, p))
    return [
        {"params": groups[True], "weight_decay": weight_decay},
        {"params": groups[False], "weight_decay": 0.0},
    ]


def _optimizer(adamw_cls, sgd_cls, named_params, decay, args, **extra) -> torch.optim.Optimizer:
    groups = param_groups(named_params, decay, args.weight_decay)
    if args.optimizer == "sgd":
        return sgd_cls(groups, lr=args.lr, momentum=args.momentum, **extra)
    return adamw_cls(groups, lr=args.lr, **extra)


def resolve_precision(name: str, device: torch.device) -> str:
    """``--precision auto``, the examples' default: ``"bf16"`` on a CUDA GPU that computes in
    bf16 natively (its tensor cores; fp32 master weights and optimizer state stay), ``"fp32"``
    anywhere else, also where torch would only emulate bf16 (before Ampere). Any other name is
    returned as given."""
    if name != "auto":
        return name
    on_bf16_gpu = torch.device(device).type == "cuda" and torch.cuda.is_bf16_supported(
        including_emulation=False
    )
    return "bf16" if on_bf16_gpu else "fp32"


def _precision(args: argparse.Namespace) -> dict:
    """``{"mixed_precision": policy}`` for ``--precision bf16``, ``{}`` for fp32."""
    policy = MixedPrecisionPolicy.from_name(getattr(args, "precision", "fp32"))
    return {} if policy is None else {"mixed_precision": policy}


def _comm(args: argparse.Namespace) -> dict:
    """``{"enable_async_communication": bool}`` for ``--async_comm on|off``; ``{}`` (the
    wrapper's default) when the flag is not given."""
    choice = getattr(args, "async_comm", None)
    return {} if choice is None else {"enable_async_communication": choice == "on"}


def _mesh(args: argparse.Namespace, env: DistEnv) -> dict:
    """``{"mesh": 2-D mesh}`` for ``--hsdp [R]`` ([Note: hybrid sharding]), else ``{}``. A bare
    ``--hsdp`` makes one replica group per node (torchrun's LOCAL_WORLD_SIZE) and checks that
    each shard group is one node; ``--hsdp R`` takes R as given."""
    replicas = getattr(args, "hsdp", None)
    if replicas is None:
        return {}
    from tiny_fsdp.core.fsdp import hsdp_mesh

    node_local = replicas == 0
    return {"mesh": hsdp_mesh(replicas or None, device_type=env.device.type, node_local=node_local)}


def _single_device(make_model, args, env):
    from tiny_fsdp.core.optim import SGD, AdamW

    model = convert_module(make_model()).to(env.device)
    policy = _precision(args).get("mixed_precision")
    if policy is not None:
        apply_mixed_precision(model, policy)  # layers compute in bf16, params stay fp32
    return model, _optimizer(AdamW, SGD, model.named_parameters(), decayed_names(model), args)


def no_comm(make_model, args, env):
    """The benchmark's floor, not a strategy: the plain model and our optimizer on this rank's
    batch alone, with no collective (the ranks' models drift apart)."""
    from tiny_fsdp.core.optim import SGD, AdamW

    plain = make_model().to(env.device)
    return plain, _optimizer(AdamW, SGD, plain.named_parameters(), decayed_names(plain), args)


def _ddp(make_model, args, env):
    from tiny_fsdp.core.ddp import DDP, DDPSGD, DDPAdamW

    plain = make_model().to(env.device)
    decay = decayed_names(plain)
    model = DDP(plain, **_comm(args), **_precision(args))
    return model, _optimizer(DDPAdamW, DDPSGD, model.named_parameters(), decay, args)


def _zero(stage: int):
    def build(make_model, args, env):
        from tiny_fsdp.core import zero

        plain = make_model().to(env.device)
        decay = decayed_names(plain)
        model = getattr(zero, f"Zero{stage}")(plain, **_comm(args), **_precision(args))
        adamw, sgd = getattr(zero, f"Zero{stage}AdamW"), getattr(zero, f"Zero{stage}SGD")
        return model, _optimizer(adamw, sgd, model.named_parameters(), decay, args)

    return build


def _meta_model(make_model) -> nn.Module:
    """The model on ``meta`` when it can initialise its tensors one by one (``init_parameter``,
    [Note: per-parameter init]): sharded strategies then build only what each rank keeps.
    Other models (``transformers``) are built normally and sharded at wrap time."""
    with torch.device("meta"):
        model = make_model()
    return model if hasattr(model, "init_parameter") else make_model()


def _zero3(make_model, args, env):
    from tiny_fsdp.core.zero3 import Zero3, Zero3AdamW, Zero3SGD, zero3_partition_tensors

    meta = _meta_model(make_model)
    decay = decayed_names(meta)
    ranks_map = [str(env.device.type)] * env.world_size
    parts, _ = zero3_partition_tensors(
        dict(meta.named_parameters()), ranks_map, evenness_priority=args.evenness_priority
    )
    model = Zero3(meta, parts, **_comm(args), **_precision(args))
    named = model.module.named_parameters()
    return model, _optimizer(Zero3AdamW, Zero3SGD, named, decay, args, param_part_table=parts)


def _fsdp(make_model, args, env):
    from tiny_fsdp.core.fsdp import FSDP, FSDPSGD, FSDPAdamW

    meta = _meta_model(make_model)
    decay = decayed_names(meta)
    # The library's default unit ("auto"): one gather unit per transformer block, plus the root
    # (embedding / head / final norm); [Note: gather units] says why.
    model = FSDP(
        meta,
        device=env.device,
        **_comm(args),
        **_precision(args),
        **_mesh(args, env),
    )
    return model, _optimizer(FSDPAdamW, FSDPSGD, model.named_parameters(), decay, args)


STRATEGIES: Dict[str, Callable] = {
    "single_device": _single_device,
    "ddp": _ddp,
    "zero1": _zero(1),
    "zero2": _zero(2),
    "zero3": _zero3,
    "fsdp": _fsdp,
}


def build_strategy(
    strategy: str, make_model: Callable[[], nn.Module], args: argparse.Namespace, env: DistEnv
) -> Tuple[nn.Module, torch.optim.Optimizer]:
    return STRATEGIES[strategy](make_model, args, env)
