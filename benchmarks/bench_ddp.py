"""Step time of tiny_fsdp DDP against torch.nn.parallel.DistributedDataParallel.

    torchrun --standalone --nproc_per_node=2 benchmarks/bench_ddp.py [--steps 10] [--warmup 3]

Both wrap GPT-2 ``gpt2_mini`` (4 layers, width 256, vocabulary 50304) built from the same seed,
train on the same per-rank batches (4 x 256 tokens) and alternate step by step in one run (the
first of the pair alternates too), so load changes on the machine hit both alike. A step is
forward + backward + optimizer step + zero_grad. Both use the same AdamW code (tiny_fsdp's
``AdamW``; ``DDPAdamW`` on our side) so the difference is DDP and the layer wrappers. Step time is
the slowest rank's (barrier before, max over ranks after). Prints median and spread per strategy,
the ratio of medians and the median of per-step ratios (robust to load changes on the machine).
"""

import argparse
import os
import statistics
import sys
import time
from typing import Callable, Dict, List

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

# Run as a script from a checkout: make the repository root importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from example.model import GPT2Model, GPTConfigs  # noqa: E402
from tiny_fsdp.core.comm import LEDGER  # noqa: E402
from tiny_fsdp.core.ddp import DDP, DDPAdamW  # noqa: E402
from tiny_fsdp.core.optim import AdamW  # noqa: E402
from tiny_fsdp.core.utils.dist import init_distributed  # noqa: E402


def make_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> Callable:
    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        logits = model(x)  # (B, T, vocab)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def timed(step: Callable, x: torch.Tensor, y: torch.Tensor) -> float:
    """Seconds of one step on the slowest rank."""
    dist.barrier()
    start = time.perf_counter()
    step(x, y)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # not via comm: keep it out of the ledger
    return elapsed.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="measured steps per strategy")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured steps per strategy")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--bucket_cap_mb", type=float, default=25.0)
    args = parser.parse_args()

    torch.set_num_threads(1)
    env = init_distributed("cpu")
    config = GPTConfigs.gpt2_mini
    lr = 1e-4
    torch.manual_seed(0)
    ours_model = DDP(GPT2Model(config), args.bucket_cap_mb, enable_async_communication=True)
    torch.manual_seed(0)
    torch_model = nn.parallel.DistributedDataParallel(
        GPT2Model(config), bucket_cap_mb=args.bucket_cap_mb
    )
    steps: Dict[str, Callable] = {
        "tiny_fsdp DDP": make_step(ours_model, DDPAdamW(ours_model.named_parameters(), lr=lr)),
        "torch DDP": make_step(torch_model, AdamW(torch_model.parameters(), lr=lr)),
    }
    times: Dict[str, List[float]] = {name: [] for name in steps}
    gen = torch.Generator().manual_seed(1000 + env.rank)
    for i in range(args.warmup + args.steps):
        tokens = torch.randint(config.vocab_size, (args.batch, args.seq_len + 1), generator=gen)
        x, y = tokens[:, :-1], tokens[:, 1:]
        order = list(steps) if i % 2 == 0 else list(reversed(steps))
        for name in order:
            LEDGER.reset()
            elapsed = timed(steps[name], x, y)
            if i >= args.warmup:
                times[name].append(elapsed)
            if name == "tiny_fsdp DDP":
                all_reduce_mib = LEDGER.payload_bytes["all_reduce"] / 2**20

    if env.is_master:
        print(
            f"gpt2_mini ({ours_model.module.num_parameters() / 1e6:.1f} M parameters), "
            f"{env.world_size} ranks (gloo, 1 thread each), batch {args.batch} x {args.seq_len} "
            f"per rank, {args.steps} measured steps after {args.warmup} warm-up"
        )
        print(
            f"tiny_fsdp DDP: {len(ours_model.buckets)} buckets of <= {args.bucket_cap_mb} MiB, "
            f"{all_reduce_mib:.1f} MiB all-reduced per step"
        )
        medians = {}
        for name, values in times.items():
            medians[name] = statistics.median(values)
            print(
                f"{name:14s} median {medians[name] * 1e3:8.1f} ms   "
                f"min {min(values) * 1e3:8.1f}   max {max(values) * 1e3:8.1f} ms"
            )
        ratio = medians["tiny_fsdp DDP"] / medians["torch DDP"]
        # Steps of one iteration run back to back, so their ratio cancels slow load drift.
        paired = statistics.median(a / b for a, b in zip(*times.values()))
        print(
            f"ratio tiny_fsdp / torch: {ratio:.3f} of medians, {paired:.3f} median of per-step "
            "ratios (target <= 1.05)"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
