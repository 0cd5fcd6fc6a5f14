"""PyTorch's counterparts of our strategies, built like ours, and their traffic per step.

``torch_ddp``: ``DistributedDataParallel``; ``torch_zero``: DDP + ``ZeroRedundancyOptimizer``
(ZeRO-1); ``torch_fsdp2``: ``fully_shard`` per transformer block, then the root (FSDP2's
recommended layout, the same units as our FSDP's default ``unit="auto"``, found the same way:
``repeated_blocks``, so any model works). Same optimizer kind, hyper-parameters
and weight-decay groups as ``example/strategies.py``.
"""

import argparse
import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from example.strategies import decayed_names, param_groups
from tiny_fsdp.core.unit_layout import repeated_blocks
from tiny_fsdp.core.utils.dist import DistEnv

TORCH_STRATEGIES = ("torch_ddp", "torch_zero", "torch_fsdp2")


def build_torch(
    name: str, make_model: Callable[[], nn.Module], args: argparse.Namespace, env: DistEnv
) -> Tuple[nn.Module, torch.optim.Optimizer, torch.optim.Optimizer]:
    """``(model, optimizer, optimizer the memory ledger reads)`` of PyTorch strategy ``name``:
    ZeroRedundancyOptimizer keeps its shard's state in a local optimizer (``.optim``)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    plain = make_model().to(env.device)
    decay = decayed_names(plain)
    cls, hyper = torch.optim.AdamW, dict(lr=args.lr)
    if args.torch_fused:
        hyper["fused"] = True
    if args.optimizer == "sgd":
        cls, hyper = torch.optim.SGD, dict(lr=args.lr, momentum=args.momentum)

    def groups(model: nn.Module) -> List[dict]:
        named = param_groups(model.named_parameters(), decay, args.weight_decay)
        return [{**g, "params": [p for _, p in g["params"]]} for g in named]

    if name == "torch_fsdp2":
        from torch.distributed.device_mesh import init_device_mesh

        # On this run's device (FSDP2's default mesh is CUDA's wherever a GPU is visible).
        mesh = init_device_mesh(env.device.type, (env.world_size,))
        for block in repeated_blocks(plain) or []:
            fully_shard(block, mesh=mesh)
        fully_shard(plain, mesh=mesh)
        optimizer = cls(groups(plain), **hyper)
        return plain, optimizer, optimizer
    ids = [env.device.index] if env.device.type == "cuda" else None
    model = DistributedDataParallel(plain, device_ids=ids)
    if name == "torch_ddp":
        optimizer = cls(groups(model), **hyper)
        return model, optimizer, optimizer
    if name != "torch_zero":
        raise ValueError(f"unknown PyTorch strategy {name!r}; one of {TORCH_STRATEGIES}")
    optimizer = ZeroRedundancyOptimizer(groups(model), optimizer_class=cls, **hyper)
    return model, optimizer, optimizer.optim


# kind -> (torch.distributed functions, position and name of the payload argument)
_PAYLOAD = {
    "all_reduce": (("all_reduce",), 0, "tensor"),
    "broadcast": (("broadcast",), 0, "tensor"),
    "reduce": (("reduce",), 0, "tensor"),
    "all_gather": (("all_gather_single", "all_gather_into_tensor"), 0, "output"),
    "reduce_scatter": (("reduce_scatter_single", "reduce_scatter_tensor"), 1, "input"),
}


@contextlib.contextmanager
def counting_torch_collectives(counts: Dict[str, List[int]]) -> Iterator[Dict[str, List[int]]]:
    """Count calls and payload bytes ([Note: communication ledger]) of the ``torch.distributed``
    functions called from Python meanwhile: ``counts[kind] = [calls, bytes]``."""
    saved = {}

    def wrap(kind: str, fn: Callable, index: int, key: str) -> Callable:
        def counted(*a: Any, **kw: Any) -> Any:
            t = a[index] if len(a) > index else kw.get(key, kw.get(key + "_tensor"))
            entry = counts.setdefault(kind, [0, 0])
            entry[0] += 1
            entry[1] += t.numel() * t.element_size()
            return fn(*a, **kw)

        return counted

    for kind, (names, index, key) in _PAYLOAD.items():
        for fname in names:
            if hasattr(dist, fname):
                saved[fname] = getattr(dist, fname)
                setattr(dist, fname, wrap(kind, saved[fname], index, key))
    try:
        yield counts
    finally:
        for fname, fn in saved.items():
            setattr(dist, fname, fn)


def torch_ddp_traffic(model: nn.Module) -> Optional[Dict[str, List[int]]]:
    """One all-reduce per bucket of torch DDP's C++ reducer (invisible to Python), from its
    logging data; None if it does not say."""
    module = model if hasattr(model, "_get_ddp_logging_data") else None
    sizes = module._get_ddp_logging_data().get("bucket_sizes") if module else None
    if not sizes:
        return None
    sizes = [int(s) for s in str(sizes).split(",")] if not isinstance(sizes, list) else sizes
    return {"all_reduce": [len(sizes), sum(sizes)]}
