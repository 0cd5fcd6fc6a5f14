"""Single-GPU throughput of GPT-2 (124M) in bf16: every tiny_fsdp strategy vs PyTorch and FSDP2.

    torchrun --standalone --nproc_per_node=1 benchmarks/gpu_throughput.py  # or benchmarks/gpu.sh

World size 1 on NCCL, so what is measured is each strategy's own overhead (its copies, casts,
hooks and bookkeeping; a collective on one rank is the identity, done without NCCL: [Note:
collectives on one rank]) against plain PyTorch under ``torch.autocast(bf16)`` and FSDP2
``fully_shard`` per block with ``MixedPrecisionPolicy(bf16)``; the issue's target is within 5 %
of their tokens/s. Ours use ``MixedPrecisionPolicy.from_name("bf16")`` and every other argument
at its default. Per strategy: median step time of ``--steps`` after ``--warmup``, tokens/s and
MFU (model FLOPs per token 6 N + 12 L T C, nanoGPT's estimate, over the GPU's dense bf16 peak:
``--peak_tflops``, default 989 for an H100 SXM). The strategies step in turn, round after round
(all built at once), and each ratio is the median of the per-round ratios, so a drift of the
machine's speed falls on all of them; the peak is the strategy's own: its persistent tensors
plus the most a step allocated above them; "host ops": the ATen ops of one more step (after the
timed ones) that call no other (``host_ops``), what the host must issue whatever the GPU's
speed. ``benchmarks/gpu.sh`` also writes a timeline of
FSDP steps (``--trace``), whose communication lanes are named by the CUDA stream each collective
was issued on.
"""

import argparse
import contextlib
import os
import statistics
import sys
import time
from typing import Any, Dict, Tuple

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from example.model import GPT2Model, GPTConfigs  # noqa: E402
from example.strategies import STRATEGIES  # noqa: E402
from tiny_fsdp.core.utils.dist import init_distributed  # noqa: E402

OURS = ["single_device", "ddp", "zero1", "zero2", "zero3", "fsdp"]
THEIRS = ["torch", "torch_fsdp2"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt2", choices=GPTConfigs.names())
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--seq_len", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=30, help="rounds timed (each steps every one)")
    p.add_argument("--peak_tflops", type=float, default=989.0, help="dense bf16 peak of the GPU")
    p.add_argument("--only", default="", help="comma-separated subset")
    p.add_argument("--device", default="cuda", help="cpu: a smoke test of this script only")
    args = p.parse_args()
    # What example/strategies.py reads: library defaults except the bf16 policy.
    args.optimizer, args.lr, args.weight_decay, args.momentum = "adamw", 3e-4, 0.1, 0.9
    args.async_comm, args.precision, args.evenness_priority = True, "bf16", 0.0
    return args


def build(name: str, args: argparse.Namespace, env) -> Tuple[torch.nn.Module, object, Any]:
    """(model, optimizer, context of a forward) for one strategy."""
    config = getattr(GPTConfigs, args.model)

    def make_model() -> GPT2Model:
        torch.manual_seed(0)
        return GPT2Model(config)

    if name in STRATEGIES:
        model, opt = STRATEGIES[name](make_model, args, env)
        return model, opt, contextlib.nullcontext()
    model = make_model().to(env.device)
    if name == "torch_fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        for block in model.transformer.h:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        return model, torch.optim.AdamW(model.parameters(), lr=3e-4), contextlib.nullcontext()
    autocast = torch.autocast(env.device.type, dtype=torch.bfloat16)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-4), autocast


def step(model, opt, autocast, x: torch.Tensor, y: torch.Tensor) -> None:
    with autocast:
        logits = model(x)
    loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def host_ops(run_step: Any) -> int:
    """ATen ops one step runs that call no other: kernels (each a launch on a GPU) and view /
    metadata ops, all host work. In a host-bound step (a GPU faster than its host) this count,
    unlike time, is the same on every machine. Counted by the profiler (CPU side only)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run_step()
    aten = [e for e in prof.events() if e.name.startswith("aten::")]
    return sum(not any(c.name.startswith("aten::") for c in e.cpu_children) for e in aten)


def main() -> None:
    args = parse_args()
    env = init_distributed(args.device)
    on_gpu = env.device.type == "cuda"
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    allocated = (lambda: torch.cuda.memory_allocated(env.device)) if on_gpu else (lambda: 0)
    config = getattr(GPTConfigs, args.model)
    names = [n for n in THEIRS + OURS if not args.only or n in args.only.split(",")]
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, config.vocab_size, (args.batch_size, args.seq_len), generator=g)
    x, y = x.to(env.device), torch.roll(x, -1, 1).to(env.device)
    n_params = sum(p.numel() for p in GPT2Model(config).parameters())
    flops_per_token = 6 * n_params + 12 * config.n_layer * args.seq_len * config.n_embd
    # Every strategy is built at once and they step in turn, round by round, so that a drift
    # of the machine's speed (clocks, other load on the host) falls on all of them alike.
    runs: Dict[str, Any] = {}
    for name in names:
        before = allocated()
        runs[name] = build(name, args, env)
        sync()
        runs[name] += (allocated() - before,)  # its model, gradients and optimizer state
    times: Dict[str, list] = {name: [] for name in names}
    transient: Dict[str, int] = {name: 0 for name in names}
    for i in range(args.warmup + args.steps):
        for name in names:
            model, opt, autocast, _ = runs[name]
            sync()
            before = allocated()
            if on_gpu:
                torch.cuda.reset_peak_memory_stats(env.device)
            start = time.perf_counter()
            step(model, opt, autocast, x, y)
            sync()
            if i >= args.warmup:
                times[name].append(time.perf_counter() - start)
                if on_gpu:
                    peak = torch.cuda.max_memory_allocated(env.device) - before
                    transient[name] = max(transient[name], peak)
    ops = {name: host_ops(lambda: step(*runs[name][:3], x, y)) for name in names}
    ratios = {
        base: {name: _spread([b / t for t, b in zip(times[name], times[base])]) for name in names}
        for base in ("torch", "torch_fsdp2")
        if base in names
    }
    print(
        f"\n{args.model} bf16, batch {args.batch_size} x {args.seq_len}, 1 {env.device.type}, "
        f"{args.steps} rounds (median; 'vs': median of per-round tokens/s ratios, in brackets "
        "their middle half, from the first quartile to the third)"
    )
    print("| strategy | ms/step | tokens/s | MFU | peak GiB | host ops | vs torch | vs FSDP2 |")
    print("|---|---|---|---|---|---|---|---|")
    for name in names:
        ms = statistics.median(times[name]) * 1e3
        tokens = args.batch_size * args.seq_len / (ms / 1e3)
        mfu = tokens * flops_per_token / (args.peak_tflops * 1e12)
        peak = (runs[name][3] + transient[name]) / 2**30
        vs = [ratios[b][name] if b in ratios else "-" for b in ("torch", "torch_fsdp2")]
        row = f"| {name} | {ms:.1f} | {tokens:,.0f} | {mfu:.1%} | {peak:.2f} | {ops[name]:,} |"
        print(f"{row} {vs[0]} | {vs[1]} |")


def _spread(ratios: list) -> str:
    """``"median (q1-q3)"`` of per-round ratios: the brackets tell a gap from the machine's
    noise (one GPU's plain PyTorch step moved between 30 and 36 ms within minutes)."""
    median = f"{statistics.median(ratios):.3f}"
    if len(ratios) < 2:
        return median
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return f"{median} ({q1:.2f}-{q3:.2f})"


if __name__ == "__main__":
    main()
