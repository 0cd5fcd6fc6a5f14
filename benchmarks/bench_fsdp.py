"""tiny_fsdp FSDP vs PyTorch FSDP2 (``fully_shard``): step time and peak memory, same run.

    torchrun --standalone --nproc_per_node=2 benchmarks/bench_fsdp.py [--units layer,blocks,tensor]

Every run trains the same GPT-2 (same initial weights, same per-rank batches) with AdamW, one
thread per rank: ours once per ``--units`` entry (``blocks``: the transformer blocks as units,
the rest as a root unit, FSDP2's layout) and FSDP2 (``fully_shard`` per block, then the root).
Steps alternate between the runs, rotating which goes first, so that all see the same machine
state; after ``--warmup`` steps each, ``--steps`` are measured each. Reported per rank:

- step time (forward + backward + optimizer step + zero_grad): median, min..max, the ratio of
  medians to FSDP2 and the median of per-iteration ratios (robust to load that drifts);
- collectives issued per step by ours (the communication ledger);
- RSS high-water mark during the step (``VmHWM``, reset before each step through
  ``/proc/self/clear_refs``) and how far it rose above the RSS at the step's start;
- bytes of tensors held between steps (parameters + gradients + optimizer state, local shards),
  and for ours also the peak bytes of gathered full parameters (the units' counter).

glibc is told to serve large blocks with mmap and to trim freed memory (``mallopt``), so that
RSS follows the live tensors instead of the allocator's high-water mark.
"""

import argparse
import copy
import ctypes
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root

from example.model import GPT2Model, GPTConfigs  # noqa: E402
from tiny_fsdp.core import comm  # noqa: E402
from tiny_fsdp.core.fsdp import FSDP, FSDPAdamW  # noqa: E402


def tune_malloc() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 64 * 1024)  # fixed: disables glibc's growing threshold
    libc.mallopt(m_trim_threshold, 128 * 1024)


def rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def reset_rss_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def held_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Local bytes of parameters, gradients and optimizer state (tied tensors counted once)."""
    seen, total = set(), 0
    tensors = []
    for p in model.parameters():
        tensors += [p, p.grad]
    for state in optimizer.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        if t is None or id(t) in seen:  # ids of the live originals, not of to_local() temps
            continue
        seen.add(id(t))
        local = t.to_local() if hasattr(t, "to_local") else t  # FSDP2 holds DTensors
        total += local.numel() * local.element_size()
    return total


def build(args: argparse.Namespace) -> Dict[str, Tuple[torch.nn.Module, torch.optim.Optimizer]]:
    """``{name: (model, optimizer)}``: ours once per ``--units`` entry, and FSDP2."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    base = GPT2Model(GPTConfigs.get(args.model))
    runs = {}
    for unit in args.units.split(","):
        model = copy.deepcopy(base)
        ours = FSDP(
            model,
            enable_async_communication=args.async_comm,
            prefetch_limit=args.prefetch_limit,
            unit=list(model.transformer.h) if unit == "blocks" else unit,
        )
        runs[f"ours-{unit}"] = (ours, FSDPAdamW(ours.named_parameters(), lr=1e-4))
    # FSDP2 as its docs recommend: one unit per transformer block, then the root.
    theirs = base
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in theirs.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(theirs, mesh=mesh)
    runs["fsdp2"] = (theirs, torch.optim.AdamW(theirs.parameters(), lr=1e-4))
    return runs


def make_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> Callable[[torch.Tensor, torch.Tensor], float]:
    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step


def measure(args: argparse.Namespace, rank: int) -> Dict[str, Dict[str, float]]:
    """Alternate steps of every run (rotating who goes first); return per-run figures."""
    runs = build(args)
    names = list(runs)
    steps = {name: make_step(*runs[name]) for name in names}
    samples: Dict[str, Dict[str, List[float]]] = {
        name: {"time": [], "hwm": [], "rise": [], "loss": [], "collectives": []} for name in names
    }
    vocab = GPTConfigs.get(args.model).vocab_size
    for i in range(args.warmup + args.steps):
        gen = torch.Generator().manual_seed(1000 * i + rank)
        tokens = torch.randint(vocab, (args.batch, args.seq + 1), generator=gen)
        x, y = tokens[:, :-1], tokens[:, 1:]
        for name in names[i % len(names) :] + names[: i % len(names)]:
            dist.barrier()
            reset_rss_peak()
            start_rss = rss_kib("VmRSS")
            comm.LEDGER.reset()
            t0 = time.perf_counter()
            loss = steps[name](x, y)
            elapsed = time.perf_counter() - t0
            s = samples[name]
            s["loss"].append(loss)
            if i >= args.warmup:
                s["time"].append(elapsed)
                s["hwm"].append(rss_kib("VmHWM") / 1024)
                s["rise"].append((rss_kib("VmHWM") - start_rss) / 1024)
                s["collectives"].append(sum(comm.LEDGER.calls.values()))
    report = {}
    for name in names:
        s = samples[name]
        paired = [a / b for a, b in zip(s["time"], samples["fsdp2"]["time"])]
        report[name] = dict(
            median_ms=1e3 * statistics.median(s["time"]),
            min_ms=1e3 * min(s["time"]),
            max_ms=1e3 * max(s["time"]),
            paired_ratio=statistics.median(paired),
            hwm_mib=max(s["hwm"]),
            rise_mib=max(s["rise"]),
            held_mib=held_bytes(*runs[name]) / 2**20,
            collectives=statistics.median(s["collectives"]),
            loss_diff=max(abs(a - b) for a, b in zip(s["loss"], samples["fsdp2"]["loss"])),
        )
        if name != "fsdp2":
            report[name]["gathered_mib"] = runs[name][0].memory_stats()["peak_gathered_bytes"]
            report[name]["gathered_mib"] /= 2**20
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt2_mini", choices=GPTConfigs.names())
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--units",
        default="layer,blocks",
        help="comma-separated units of ours: layer, tensor, blocks (transformer blocks + root)",
    )
    parser.add_argument("--no-async", dest="async_comm", action="store_false")
    parser.add_argument("--prefetch-limit", type=int, default=1)
    args = parser.parse_args()

    tune_malloc()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    report = measure(args, rank)
    reports: List[Dict] = [None] * world
    dist.all_gather_object(reports, report)
    if rank == 0:
        print(
            f"{args.model}, {world} ranks (gloo, 1 thread each), batch {args.batch} x {args.seq} "
            f"per rank, async={args.async_comm}, prefetch_limit={args.prefetch_limit}, "
            f"{args.warmup} warm-up + {args.steps} measured steps each, load average "
            f"{os.getloadavg()[0]:.1f}"
        )
        for r, rep in enumerate(reports):
            for name, m in rep.items():
                gathered = f", peak gathered {m['gathered_mib']:.1f}" if "gathered_mib" in m else ""
                print(
                    f"rank {r} {name:12s} step {m['median_ms']:7.1f} ms median "
                    f"({m['min_ms']:.0f}..{m['max_ms']:.0f}), ratio to fsdp2 "
                    f"{m['median_ms'] / rep['fsdp2']['median_ms']:.3f} (paired "
                    f"{m['paired_ratio']:.3f}); {m['collectives']:.0f} collectives; MiB: RSS "
                    f"peak {m['hwm_mib']:.0f} (+{m['rise_mib']:.0f} in step), tensors held "
                    f"{m['held_mib']:.1f}{gathered}; max loss diff {m['loss_diff']:.1e}"
                )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
