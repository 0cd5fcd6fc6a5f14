"""Step time of tiny_fsdp ZeRO-1 / ZeRO-2 vs tiny_fsdp DDP and torch DDP + ZeroRedundancyOptimizer.

    torchrun --standalone --nproc_per_node=2 benchmarks/bench_zero12.py [--bucket-mb 25]

Every strategy trains its own copy of the same GPT-2 (same initial weights, same per-rank
batches) with AdamW, one thread per rank, gloo. Steps alternate between the strategies
(zero1, zero2, ddp, torch, zero1, ...) so that all of them see the same machine state; after
``--warmup`` steps each, ``--steps`` are measured each. A step is forward + backward + optimizer
step + zero_grad, timed between two barriers. Printed: median step time and spread (min..max);
the ratios the targets are stated in (ours / torch ZeRO <= 1.0, ZeRO-2 / our DDP <= 1.05), both
as the ratio of the medians and as the median of the ratios of neighbouring steps (which share
the machine's load when other processes compete for the cores); the bytes of tensors each
strategy holds per rank; how far the strategies' losses drift apart (float rounding only).
"""

import argparse
import copy
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root

from example.model import GPT2Model, GPTConfigs  # noqa: E402
from tiny_fsdp.core.zero import Zero1, Zero1AdamW, Zero2, Zero2AdamW  # noqa: E402

LR = 1e-4


def tensor_bytes(model: torch.nn.Module, optimizer: Any) -> int:
    """Bytes of the distinct storages behind params, grads, optimizer state and ZeRO buffers."""
    tensors = [t for p in model.parameters() for t in (p, p.grad)]
    for name in ("param_buffer", "grad_buffer"):
        buffer = getattr(model, name, None)
        tensors.append(getattr(buffer, "data", None))
    tensors.append(getattr(model, "grad_shard", None))
    tensors.append(getattr(optimizer, "_master_shard", None))
    # ZeroRedundancyOptimizer keeps its shard's state in the local optimizer it wraps.
    for state in getattr(optimizer, "optim", optimizer).state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    storages = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel():
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def build(args: argparse.Namespace) -> Dict[str, Tuple[torch.nn.Module, Any]]:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    base = GPT2Model(GPTConfigs.get(args.model))
    runs: Dict[str, Tuple[torch.nn.Module, Any]] = {}
    kw = dict(bucket_cap_mb=args.bucket_mb, enable_async_communication=args.async_comm)
    zero1 = Zero1(copy.deepcopy(base), **kw)
    runs["zero1"] = (zero1, Zero1AdamW(zero1.named_parameters(), lr=LR))
    zero2 = Zero2(copy.deepcopy(base), **kw)
    runs["zero2"] = (zero2, Zero2AdamW(zero2.named_parameters(), lr=LR))
    try:
        from tiny_fsdp.core.ddp import DDP, DDPAdamW
    except ImportError:  # written by another engineer; benchmark without it
        (
            print("tiny_fsdp.core.ddp not available: skipping our DDP")
            if dist.get_rank() == 0
            else None
        )
    else:
        ddp = DDP(copy.deepcopy(base), **kw)
        runs["ddp"] = (ddp, DDPAdamW(ddp.named_parameters(), lr=LR))
    torch_ddp = DistributedDataParallel(base, bucket_cap_mb=args.bucket_mb)
    runs["torch"] = (
        torch_ddp,
        ZeroRedundancyOptimizer(torch_ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=LR),
    )
    return runs


def train_step(model: torch.nn.Module, optimizer: Any, x: torch.Tensor, y: torch.Tensor) -> float:
    logits = model(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt2_mini", choices=GPTConfigs.names())
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="every strategy's bucket")
    parser.add_argument("--no-async", dest="async_comm", action="store_false")
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    runs = build(args)
    times: Dict[str, List[float]] = {name: [] for name in runs}
    losses: Dict[str, List[float]] = {name: [] for name in runs}
    vocab = GPTConfigs.get(args.model).vocab_size
    for i in range(args.warmup + args.steps):
        gen = torch.Generator().manual_seed(1000 * i + rank)
        tokens = torch.randint(vocab, (args.batch, args.seq + 1), generator=gen)
        for name, (model, optimizer) in runs.items():
            dist.barrier()
            start = time.perf_counter()
            losses[name].append(train_step(model, optimizer, tokens[:, :-1], tokens[:, 1:]))
            dist.barrier()  # a step ends when the slowest rank is done
            if i >= args.warmup:
                times[name].append(time.perf_counter() - start)
    held = {name: tensor_bytes(*pair) for name, pair in runs.items()}
    all_held: List[Any] = [None] * world
    dist.all_gather_object(all_held, held)
    if rank == 0:
        print(
            f"{args.model}, {world} ranks (gloo, 1 thread each), batch {args.batch} x {args.seq} "
            f"per rank, bucket {args.bucket_mb} MiB, async={args.async_comm}, "
            f"{args.warmup} warm-up + {args.steps} measured steps each, alternating"
        )
        median = {name: statistics.median(t) for name, t in times.items()}
        for name, t in times.items():
            per_rank = ", ".join(f"{h[name] / 2**20:.1f}" for h in all_held)
            print(
                f"{name:6s} step {median[name] * 1e3:8.1f} ms median ({min(t) * 1e3:.1f}.."
                f"{max(t) * 1e3:.1f}); tensors held per rank: {per_rank} MiB"
            )
        pairs = [("zero1", "torch", 1.0), ("zero2", "torch", 1.0), ("zero2", "ddp", 1.05)]
        for ours, base, target in pairs:
            if base not in median:
                continue
            # Also the median of per-step ratios: neighbouring steps share the machine's load.
            paired = statistics.median(a / b for a, b in zip(times[ours], times[base]))
            print(
                f"ratio {ours}/{base} = {median[ours] / median[base]:.3f} of medians, "
                f"{paired:.3f} median of paired steps (target <= {target})"
            )
        drift = max(abs(a - b) for name in runs for a, b in zip(losses[name], losses["torch"]))
        print(f"max |loss - torch loss| over all steps and strategies: {drift:.2e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
