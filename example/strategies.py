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


def _single_device(make_model, args, env):
    from tiny_fsdp.core.optim import SGD, AdamW

    model = convert_module(make_model()).to(env.device)
    return model, _optimizer(AdamW, SGD, model.named_parameters(), decayed_names(model), args)


STRATEGIES: Dict[str, Callable] = {"single_device": _single_device}


def build_strategy(
    strategy: str, make_model: Callable[[], nn.Module], args: argparse.Namespace, env: DistEnv
) -> Tuple[nn.Module, torch.optim.Optimizer]:
    return STRATEGIES[strategy](make_model, args, env)
