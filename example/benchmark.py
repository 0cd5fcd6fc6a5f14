"""Side by side: time, memory, traffic and loss of every strategy, ours and PyTorch's.

    torchrun --standalone --nproc_per_node=2 example/benchmark.py --model gpt2_mini --steps 20

Runs single device, DDP, ZeRO-1, ZeRO-2, ZeRO-3, FSDP (tiny_fsdp) and PyTorch's DDP,
DDP + ZeroRedundancyOptimizer and FSDP2 ``fully_shard`` on the same model (same seed), data,
global batch and world size, and writes ``results.md``, ``results.json`` and PNG plots to
``--out`` (default ``out/benchmark``).

[Note: benchmark method]
- Strategies run in *phases* of counterparts (single; DDP | torch DDP; ZeRO-1 | ZeRO-2 | torch
  ZeRO; ZeRO-3 | FSDP | torch FSDP2): the members of a phase live in the same processes and take
  turns step by step, the order flipping every round, so load changes on the machine hit them
  alike; a phase's models are freed before the next is built (memory). Single device trains the
  global batch on rank 0 alone.
- Every strategy trains ``warmup + steps + 1`` steps on the same batches. A timed step is forward,
  backward, optimizer step and zero_grad between a barrier and the slowest rank's end; reported:
  median and min-max over the ``steps`` measured ones, tokens/s of the global batch, and the
  median of the per-round ratios to the PyTorch counterpart (robust to drifting load).
- The last step is the memory probe (untimed). ``peak`` = bytes the strategy keeps (allocated
  from just before its build to after its first step) + the highest growth during the probe step:
  CUDA allocator statistics, or on CPU glibc's in-use heap (``mallinfo2``) sampled every 0.2 ms
  (may miss shorter spikes). ``RSS +``: growth of the process's peak RSS over the build and first
  step (freed heap is returned to the OS first, and the peak reset, so it is this strategy's).
  Parameters / gradients / optimizer / buffers come from the memory ledger after the probe's
  optimizer step; "activations + other" is the rest of the peak (for PyTorch's strategies it
  includes their internal buffers, e.g. DDP's buckets, which the ledger cannot see). For the
  peak RSS of one strategy alone in fresh processes, run it alone: ``--only fsdp``.
- "model states (formula)": the ledger's params + grads + optimizer, and in brackets the ZeRO
  formula's prediction (``tiny_fsdp.estimate``) for our strategies.
- Traffic per step and rank: our collectives from ``LEDGER`` (exact); PyTorch's FSDP2 and
  ZeroRedundancyOptimizer by counting the ``torch.distributed`` calls of the probe step;
  torch DDP's C++ reducer from its logging data (bucket sizes: one all-reduce each).
"""

import argparse
import contextlib
import gc
import json
import os
import re
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from example.data import TokenBatches, check_vocab, load_tokens  # noqa: E402
from example.model import GPT2Model, GPTConfigs  # noqa: E402
from example.strategies import STRATEGIES, decayed_names, param_groups  # noqa: E402
from example.tokenizer import get_tokenizer  # noqa: E402
from tiny_fsdp.core.comm import LEDGER  # noqa: E402
from tiny_fsdp.core.memory import (  # noqa: E402
    allocated_bytes,
    memory_ledger,
    peak_growth,
    trim_heap,
)
from tiny_fsdp.core.utils.dist import DistEnv, init_distributed  # noqa: E402
from tiny_fsdp.estimate import estimate_model  # noqa: E402

PHASES = [
    ["single_device"],
    ["ddp", "torch_ddp"],
    ["zero1", "zero2", "torch_zero"],
    ["zero3", "fsdp", "torch_fsdp2"],
]
COUNTERPART = {"ddp": "torch_ddp", "zero1": "torch_zero", "zero2": "torch_zero"}
COUNTERPART.update(zero3="torch_fsdp2", fsdp="torch_fsdp2")
KIND = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS", "broadcast": "BC"}
KIND["reduce"] = "R"
MiB = 2**20


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt2_mini", choices=GPTConfigs.names())
    p.add_argument("--steps", type=int, default=20, help="measured steps per strategy")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps first (>= 1)")
    p.add_argument("--batch_size", type=int, default=2, help="sequences per rank")
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"])
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight_decay", type=float, default=0.1)
    p.add_argument("--sync_comm", action="store_true", help="ours without async communication")
    p.add_argument("--evenness_priority", type=float, default=0.0, help="ZeRO-3 partition")
    p.add_argument("--only", default="", help="comma-separated subset of the strategies")
    p.add_argument("--data", default=None, help="text / .bin file, or 'random'; default: corpus")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--device", default=None, help="cuda if present, else cpu")
    p.add_argument("--out", default="out/benchmark")
    args = p.parse_args(argv)
    args.async_comm = "off" if args.sync_comm else "on"  # every strategy, ours: explicit
    if args.warmup < 1 or args.steps < 1:
        p.error("--warmup and --steps must be >= 1 (the first step creates optimizer state)")
    return args


# ------------------------------------------------------------------ memory meters


def _status_kib(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            return int(re.search(field + r":\s+(\d+)", f.read()).group(1))
    except (OSError, AttributeError):
        return None


def _fresh_rss_baseline() -> Optional[int]:
    """Return freed heap to the OS, reset the peak RSS to the current RSS; current RSS (KiB)."""
    gc.collect()
    trim_heap()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux >= 4.0: VmHWM := VmRSS
    except OSError:
        return None
    return _status_kib("VmRSS")


# ------------------------------------------------------------------ strategies


def build(name: str, make_model: Callable, args: argparse.Namespace, env: DistEnv):
    """``(model, optimizer, optimizer the memory ledger reads)`` of strategy ``name``."""
    if name in STRATEGIES:
        model, optimizer = STRATEGIES[name](make_model, args, env)
        return model, optimizer, optimizer
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    plain = make_model().to(env.device)
    decay = decayed_names(plain)
    cls, hyper = torch.optim.AdamW, dict(lr=args.lr)
    if args.optimizer == "sgd":
        cls, hyper = torch.optim.SGD, dict(lr=args.lr, momentum=args.momentum)

    def groups(model: torch.nn.Module) -> List[dict]:
        named = param_groups(model.named_parameters(), decay, args.weight_decay)
        return [{**g, "params": [p for _, p in g["params"]]} for g in named]

    if name == "torch_fsdp2":
        for block in plain.transformer.h:
            fully_shard(block)
        fully_shard(plain)
        optimizer = cls(groups(plain), **hyper)
        return plain, optimizer, optimizer
    ids = [env.device.index] if env.device.type == "cuda" else None
    model = DistributedDataParallel(plain, device_ids=ids)
    if name == "torch_ddp":
        optimizer = cls(groups(model), **hyper)
        return model, optimizer, optimizer
    optimizer = ZeroRedundancyOptimizer(groups(model), optimizer_class=cls, **hyper)
    return model, optimizer, optimizer.optim


@contextlib.contextmanager
def counting_torch_collectives(counts: Dict[str, List[int]]):
    """Count calls and payload bytes ([Note: communication ledger]) of torch.distributed."""
    payload = {  # kind, function names, which argument is the payload
        "all_reduce": (("all_reduce",), 0, "tensor"),
        "broadcast": (("broadcast",), 0, "tensor"),
        "reduce": (("reduce",), 0, "tensor"),
        "all_gather": (("all_gather_single", "all_gather_into_tensor"), 0, "output"),
        "reduce_scatter": (("reduce_scatter_single", "reduce_scatter_tensor"), 1, "input"),
    }
    saved = {}

    def wrap(kind: str, fn: Callable, index: int, key: str) -> Callable:
        def counted(*a: Any, **kw: Any) -> Any:
            t = a[index] if len(a) > index else kw.get(key, kw.get(key + "_tensor"))
            entry = counts.setdefault(kind, [0, 0])
            entry[0] += 1
            entry[1] += t.numel() * t.element_size()
            return fn(*a, **kw)

        return counted

    for kind, (names, index, key) in payload.items():
        for fname in names:
            if hasattr(dist, fname):
                saved[fname] = getattr(dist, fname)
                setattr(dist, fname, wrap(kind, saved[fname], index, key))
    try:
        yield counts
    finally:
        for fname, fn in saved.items():
            setattr(dist, fname, fn)


def torch_ddp_traffic(model: torch.nn.Module) -> Optional[Dict[str, List[int]]]:
    """One all-reduce per bucket of torch DDP's reducer, from its logging data."""
    module = model if hasattr(model, "_get_ddp_logging_data") else None
    sizes = module._get_ddp_logging_data().get("bucket_sizes") if module else None
    if not sizes:
        return None
    sizes = [int(s) for s in str(sizes).split(",")] if not isinstance(sizes, list) else sizes
    return {"all_reduce": [len(sizes), sum(sizes)]}


class Runner:
    """One strategy: its model, its optimizer, and what was measured."""

    def __init__(self, name: str, args, env: DistEnv, batches: TokenBatches, make_model) -> None:
        self.name, self.args, self.env, self.batches = name, args, env, batches
        self.active = name != "single_device" or env.rank == 0  # single: rank 0 alone
        self.times: List[float] = []
        self.losses: List[float] = []
        self.comm: Dict[str, List[int]] = {}
        self.memory: Dict[str, Optional[int]] = {}
        base_rss = _fresh_rss_baseline() if env.device.type == "cpu" else None
        base = allocated_bytes(env.device)
        if self.active:
            self.model, self.optimizer, self.ledger_optimizer = build(name, make_model, args, env)
        self.step(0)  # creates the optimizer state: part of what the strategy keeps
        now, hwm = allocated_bytes(env.device), _status_kib("VmHWM")
        self.memory["kept"] = None if base is None else now - base
        self.memory["rss_increase"] = None if base_rss is None else (hwm - base_rss) * 1024

    def step(self, index: int, timed: bool = False, probe: bool = False) -> None:
        """Training step ``index`` on every rank; records loss (and time, traffic, memory)."""
        env, args = self.env, self.args
        single = self.name == "single_device"
        rows, rank, world = args.batch_size, env.rank, env.world_size
        if single:
            rows, rank, world = args.batch_size * env.world_size, 0, 1
        x, y = self.batches.get_batch(index, "train", rows, rank, world)
        x, y = x.to(env.device), y.to(env.device)
        loss = torch.zeros((), device=env.device)

        def run() -> None:
            nonlocal loss
            if not self.active:
                return
            logits = self.model(x)  # (B, T, vocab)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            loss.backward()
            self.optimizer.step()
            if probe:
                self.memory.update(memory_ledger(self.model, self.ledger_optimizer).as_dict())
            self.optimizer.zero_grad(set_to_none=True)

        LEDGER.reset()
        dist.barrier()
        start = time.perf_counter()
        if probe:
            torch_counts: Dict[str, List[int]] = {}
            with counting_torch_collectives(torch_counts):
                self.memory["step_growth"] = peak_growth(env.device, run)
            ours = {k: [LEDGER.calls[k], LEDGER.payload_bytes[k]] for k in LEDGER.calls}
            self.comm = ours if self.name in STRATEGIES else torch_counts
            if self.name in ("torch_ddp", "torch_zero"):
                self.comm.update(torch_ddp_traffic(self.model) or {"all_reduce": None})
        else:
            run()
        if env.device.type == "cuda":
            torch.cuda.synchronize(env.device)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        loss_sum = loss.detach().double().cpu().reshape(1)
        # Raw dist, not tiny_fsdp.core.comm: the benchmark's own traffic stays out of LEDGER.
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        dist.all_reduce(loss_sum)  # single device: only rank 0's is non-zero
        if timed:
            self.times.append(elapsed.item())
        self.losses.append(loss_sum.item() / (1 if single else world))

    def result(self) -> Dict[str, Any]:
        peak = None
        if self.memory.get("kept") is not None and self.memory.get("step_growth") is not None:
            peak = self.memory["kept"] + self.memory["step_growth"]
        return dict(times=self.times, losses=self.losses, comm=self.comm, memory=self.memory,
                    peak=peak, active=self.active)  # fmt: skip


# ------------------------------------------------------------------ main


def warm_up_libraries(env: DistEnv) -> None:
    """One throwaway step of a tiny model, plain and wrapped: lazy initialisations (autograd
    threads, kernels, allocator pools) then do not count as the first strategy's memory."""
    from tiny_fsdp.core.module import convert_module
    from tiny_fsdp.core.optim import AdamW

    for model in (GPT2Model(GPTConfigs.gpt2_tiny), convert_module(GPT2Model(GPTConfigs.gpt2_tiny))):
        model.to(env.device)
        optimizer = AdamW(model.parameters())
        model(torch.zeros(1, 8, dtype=torch.long, device=env.device)).sum().backward()
        optimizer.step()
    dist.barrier()


def run_phases(
    args, env: DistEnv, batches: TokenBatches, make_model
) -> Tuple[Dict[str, List[dict]], List[float]]:
    """Results per strategy (``[rank 0's, rank 1's, ...]``) ([Note: benchmark method]), and the
    1-minute load average of the machine at every round."""
    from tqdm import tqdm

    warm_up_libraries(env)
    only = [s for s in args.only.split(",") if s]
    phases = [[n for n in phase if not only or n in only] for phase in PHASES]
    phases = [phase for phase in phases if phase]
    total = sum(len(phase) for phase in phases) * (args.warmup + args.steps + 1)
    bar = tqdm(total=total, disable=not env.is_master, file=sys.stderr, dynamic_ncols=True)
    results: Dict[str, List[dict]] = {}
    loads: List[float] = []
    for phase in phases:
        runners = []
        for name in phase:
            bar.set_description(f"build {name}")
            runners.append(Runner(name, args, env, batches, make_model))
            bar.update(1)
        for index in range(1, args.warmup + args.steps):
            loads.append(os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan"))
            order = runners if index % 2 else runners[::-1]
            for runner in order:
                bar.set_description(runner.name)
                runner.step(index, timed=index >= args.warmup)
                bar.update(1)
        for runner in runners:
            bar.set_description(f"probe {runner.name}")
            runner.step(args.warmup + args.steps, probe=True)
            bar.update(1)
        for runner in runners:
            gathered: List[Any] = [None] * env.world_size
            dist.all_gather_object(gathered, runner.result())
            results[runner.name] = gathered
        del runners
        gc.collect()
    bar.close()
    return results, loads


def summarize(
    results: Dict[str, List[dict]], tokens_per_step: int, predicted: Optional[dict] = None
) -> Dict[str, dict]:
    """Per strategy: the figures of the table (memory of the rank with the highest peak).
    ``predicted``: strategy -> model-state bytes from ``tiny_fsdp.estimate`` (largest rank)."""
    rows: Dict[str, dict] = {}
    single = results.get("single_device", [{}])[0].get("losses")
    for name, per_rank in results.items():
        ranks = [r for r in per_rank if r["active"]]
        worst = max(ranks, key=lambda r: r["peak"] or 0)
        times = per_rank[0]["times"]
        row = dict(median=statistics.median(times), min=min(times), max=max(times))
        row.update(tokens_per_s=tokens_per_step / row["median"], peak=worst["peak"])
        row.update(memory=worst["memory"], comm=per_rank[0]["comm"], losses=per_rank[0]["losses"])
        row["loss_gap"] = None if single is None else abs(row["losses"][-1] - single[-1])
        row["predicted"] = (predicted or {}).get(name)
        other = results.get(COUNTERPART.get(name, ""))
        if other is not None:
            paired = [a / b for a, b in zip(times, other[0]["times"])]
            row["vs_torch"] = statistics.median(paired)
        rows[name] = row
    return rows


def pick_unit(rows: Dict[str, dict]) -> Tuple[str, int]:
    """MiB, or KiB for a model too small to show in MiB (e.g. gpt2_tiny)."""
    biggest = max((r["memory"].get("params") or 0) for r in rows.values())
    return ("MiB", MiB) if biggest >= MiB else ("KiB", 1024)


def _fmt(n: Optional[float], unit: int) -> str:
    return "n/a" if n is None else f"{n / unit:,.1f}"


def _comm_cell(comm: Dict[str, Optional[List[int]]], unit: int) -> str:
    cells = [
        f"{KIND[kind]} " + ("n/a" if v is None else f"{_fmt(v[1], unit)} x{v[0]}")
        for kind, v in sorted(comm.items())
    ]
    return ", ".join(cells) or "-"


def markdown_table(rows: Dict[str, dict]) -> str:
    u, unit = pick_unit(rows)
    head = (f"| strategy | step ms: median (min-max) | tokens/s | x PyTorch | peak {u}/rank | "
            f"RSS + {u} | params / grads / optim / buffers {u} | model states {u} (formula) | "
            f"comm {u}/step/rank (calls) | final loss (gap to single) |")  # fmt: skip
    lines = [head, "|" + "---|" * 10]
    for name, r in rows.items():
        m = r["memory"]
        states = " / ".join(
            _fmt(m.get(k), unit) for k in ("params", "grads", "optimizer", "buffers")
        )
        ratio = f"{r['vs_torch']:.2f}" if "vs_torch" in r else "-"
        measured = sum(m.get(k) or 0 for k in ("params", "grads", "optimizer"))
        formula = "" if r["predicted"] is None else f" ({_fmt(r['predicted'], unit)})"
        gap = "-" if r["loss_gap"] is None or name == "single_device" else f"{r['loss_gap']:.1e}"
        lines.append(
            f"| {name} | {r['median'] * 1e3:,.0f} ({r['min'] * 1e3:,.0f}-{r['max'] * 1e3:,.0f}) "
            f"| {r['tokens_per_s']:,.0f} | {ratio} | {_fmt(r['peak'], unit)} | "
            f"{_fmt(m.get('rss_increase'), unit)} | {states} | {_fmt(measured, unit)}{formula} | "
            f"{_comm_cell(r['comm'], unit)} | "
            f"{r['losses'][-1]:.4f} ({gap}) |"
        )
    return "\n".join(lines)


def plot(rows: Dict[str, dict], out: str) -> List[str]:
    """memory.png (stacked per strategy), step_time.png, loss.png; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows)
    unit_name, unit = pick_unit(rows)
    colors = ["tab:blue" if n.startswith("torch") else "tab:orange" for n in names]
    paths = [os.path.join(out, f) for f in ("memory.png", "step_time.png", "loss.png")]

    fig, ax = plt.subplots(figsize=(10, 4.5))
    bottom = [0.0] * len(names)
    parts = ["params", "grads", "optimizer", "buffers"]
    for part in parts + ["activations + other"]:
        if part in parts:
            values = [(rows[n]["memory"].get(part) or 0) / unit for n in names]
        else:
            states = [sum((rows[n]["memory"].get(k) or 0) for k in parts) for n in names]
            values = [max((rows[n]["peak"] or 0) - s, 0) / unit for n, s in zip(names, states)]
        ax.bar(names, values, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set(ylabel=f"{unit_name} (rank with the highest peak)", title="Peak memory per rank")
    ax.legend()
    fig.autofmt_xdate(rotation=30)
    fig.tight_layout()
    fig.savefig(paths[0], dpi=120)

    fig, ax = plt.subplots(figsize=(10, 4.5))
    med = [rows[n]["median"] * 1e3 for n in names]
    err = [[m - rows[n]["min"] * 1e3 for n, m in zip(names, med)],
           [rows[n]["max"] * 1e3 - m for n, m in zip(names, med)]]  # fmt: skip
    ax.bar(names, med, yerr=err, color=colors, capsize=4)
    ax.set(ylabel="ms per step (median, min-max)", title="Step time (orange: tiny_fsdp)")
    fig.autofmt_xdate(rotation=30)
    fig.tight_layout()
    fig.savefig(paths[1], dpi=120)

    fig, (top, bottom_ax) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    single = rows.get("single_device", {}).get("losses")
    for name in names:
        style = "--" if name.startswith("torch") else "-"
        top.plot(rows[name]["losses"], style, label=name)
        if single is not None and name != "single_device":
            gaps = [max(abs(a - b), 1e-9) for a, b in zip(rows[name]["losses"], single)]
            bottom_ax.semilogy(gaps, style, label=name)
    top.set(ylabel="training loss (global batch)", title="Loss")
    top.legend(fontsize=8)
    bottom_ax.set(xlabel="step", ylabel="|loss - single device| (floor 1e-9)")
    fig.tight_layout()
    fig.savefig(paths[2], dpi=120)
    plt.close("all")
    return paths


def load_batches(args: argparse.Namespace, vocab_size: int) -> TokenBatches:
    if args.data == "random":
        gen = torch.Generator().manual_seed(args.seed)
        tokens = torch.randint(vocab_size, (100 * args.seq_len,), generator=gen)
        return TokenBatches(tokens, args.seq_len, args.seed, source="random")
    tokens = load_tokens(args.data, get_tokenizer("auto"))
    check_vocab(tokens, vocab_size, args.data or "the embedded corpus")
    return TokenBatches(tokens, args.seq_len, args.seed, source=args.data or "embedded")


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    env = init_distributed(args.device)
    config = GPTConfigs.get(args.model)
    batches = load_batches(args, config.vocab_size)

    def make_model() -> GPT2Model:
        torch.manual_seed(args.seed)  # same weights for every strategy
        return GPT2Model(config)

    results, loads = run_phases(args, env, batches, make_model)
    if env.is_master:
        tokens = args.batch_size * args.seq_len * env.world_size
        with torch.device("meta"):
            meta = GPT2Model(config)
        n_params = meta.num_parameters()
        estimates = estimate_model(meta, env.world_size, "fp32", args.optimizer)
        predicted = {k: max(r.model_states for r in v) for k, v in estimates.items()}
        rows = summarize(results, tokens, predicted)
        os.makedirs(args.out, exist_ok=True)
        header = (
            f"{args.model} ({n_params / 1e6:.2f} M parameters), {env.world_size} ranks on "
            f"{env.device.type} ({dist.get_backend()}, {args.threads} thread(s) each), "
            f"batch {args.batch_size} x {args.seq_len} per rank, {args.optimizer}, "
            f"{args.steps} measured steps after {args.warmup} warm-up, async_comm="
            f"{args.async_comm}; machine load average (1 min) during the rounds: median "
            f"{statistics.median(loads):.1f}, range {min(loads):.1f}-{max(loads):.1f}"
        )
        table = markdown_table(rows)
        with open(os.path.join(args.out, "results.md"), "w") as f:
            f.write(f"{header}\n\n{table}\n")
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(dict(args=vars(args), header=header, rows=rows), f, indent=1)
        paths = plot(rows, args.out)
        print(f"{header}\n\n{table}\n\nwritten: {args.out}/results.md, results.json, "
              + ", ".join(os.path.basename(p) for p in paths))  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
