"""Benchmark: tiny_fsdp ZeRO-3 inter-tensor against PyTorch FSDP2 (``fully_shard``).

    torchrun --standalone --nproc_per_node=2 benchmarks/bench_zero3.py

Both strategies train the same model (same seed, same batches) in the same processes, one step
each in turn (the order flips every round so neither always runs on a warmer cache). A step is
forward + backward + optimizer step + zero_grad, timed between barriers; the step time of a
round is the slowest rank's. Reported: median step time, spread (min - max), and peak memory
per rank.

[Note: CPU peak memory]
CPU tensors have no allocator statistics, so the peak of a step is measured as: resident bytes
at step start (parameters + optimizer state this rank holds, counted tensor by tensor) + the
largest growth of glibc's in-use heap (``mallinfo2``: small chunks + mmapped chunks) above its
value at step start, sampled every 0.2 ms by a thread during one extra, untimed step. It
includes every transient allocation (gathered or broadcast parameters, gradients,
activations, communication scratch), and may miss spikes shorter than the sampling period.
On CUDA ``torch.cuda.max_memory_allocated`` is used instead.
"""

import argparse
import ctypes
import os
import statistics
import sys
import threading
import time
from collections import OrderedDict
from typing import Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from example.model import GPT2Model, GPTConfigs  # noqa: E402
from tiny_fsdp.core.utils.dist import init_distributed  # noqa: E402
from tiny_fsdp.core.zero3 import Zero3, Zero3AdamW, zero3_partition_tensors  # noqa: E402

MiB = 2**20


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
        )
    ]


def _heap_in_use() -> int:
    info = _LIBC.mallinfo2()
    return info.uordblks + info.hblkhd


_LIBC = ctypes.CDLL("libc.so.6")
_LIBC.mallinfo2.restype = _MallInfo2


def _tensor_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t  # FSDP2 DTensor: this rank's shard
        total += t.numel() * t.element_size()
    return total


def build_zero3(config, evenness: float, async_on: bool, lr: float) -> Tuple:
    torch.manual_seed(0)
    model = GPT2Model(config)
    ranks = ["cpu"] * dist.get_world_size()
    parts, _ = zero3_partition_tensors(OrderedDict(model.named_parameters()), ranks, evenness)
    model = Zero3(model, parts, enable_async_communication=async_on)
    return model, Zero3AdamW(model.module.named_parameters(), lr=lr, param_part_table=parts)


def build_fsdp2(config, lr: float) -> Tuple:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = GPT2Model(config)
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


def train_step(model, optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    logits = model(x)
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def timed(step: Callable[[], None]) -> float:
    """Seconds of the slowest rank for one ``step``, started together after a barrier."""
    dist.barrier()
    start = time.perf_counter()
    step()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def peak_bytes(model, optimizer, step: Callable[[], None], device: torch.device) -> int:
    """Peak memory of one step on this rank ([Note: CPU peak memory])."""
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        step()
        return torch.cuda.max_memory_allocated(device)
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    resident = _tensor_bytes(list(model.parameters()) + state)
    base = _heap_in_use()
    peak, done = [base], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _heap_in_use())
            time.sleep(0.0002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    step()
    done.set()
    sampler.join()
    return resident + peak[0] - base


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt2_mini", choices=GPTConfigs.names())
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--evenness", type=float, default=0.0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    env = init_distributed(device="cpu")
    config = GPTConfigs.get(args.model)
    with torch.device("meta"):
        meta = GPT2Model(config)
    tensors = OrderedDict(meta.named_parameters())
    ranks = ["cpu"] * env.world_size
    if env.is_master:
        print(
            f"{args.model}: {sum(t.numel() for t in tensors.values()) / 1e6:.2f} M params, "
            f"{env.world_size} ranks, batch {args.batch} x {args.seq_len} per rank, "
            f"{torch.get_num_threads()} thread(s) per rank"
        )
        for evenness in (0.0, 1.0):
            _, rank_bytes = zero3_partition_tensors(tensors, ranks, evenness)
            shares = ", ".join(f"{b / MiB:.2f}" for b in rank_bytes)
            print(f"partition evenness={evenness}: per-rank MiB [{shares}]")

    strategies: Dict[str, Tuple] = {
        "zero3": build_zero3(config, args.evenness, False, 1e-4),
        "zero3_async": build_zero3(config, args.evenness, True, 1e-4),
        "fsdp2": build_fsdp2(config, 1e-4),
    }
    gen = torch.Generator().manual_seed(1000 + env.rank)
    times: Dict[str, List[float]] = {name: [] for name in strategies}
    for round_ in range(args.warmup + args.steps):
        tokens = torch.randint(config.vocab_size, (args.batch, args.seq_len + 1), generator=gen)
        x, y = tokens[:, :-1], tokens[:, 1:]
        names = list(strategies) if round_ % 2 == 0 else list(reversed(strategies))
        for name in names:
            model, opt = strategies[name]
            seconds = timed(lambda: train_step(model, opt, x, y))
            if round_ >= args.warmup:
                times[name].append(seconds)

    peaks = {}
    for name, (model, opt) in strategies.items():
        peak = peak_bytes(model, opt, lambda: train_step(model, opt, x, y), env.device)
        all_peaks = [None] * env.world_size
        dist.all_gather_object(all_peaks, peak)
        peaks[name] = all_peaks
    if env.is_master:
        reference = statistics.median(times["fsdp2"])
        print(
            f"{'strategy':12s} {'median s':>9s} {'min-max s':>15s} {'x fsdp2':>8s}  "
            "peak MiB per rank"
        )
        for name, ts in times.items():
            med = statistics.median(ts)
            spread = f"{min(ts):.3f}-{max(ts):.3f}"
            mem = ", ".join(f"{p / MiB:.1f}" for p in peaks[name])
            print(f"{name:12s} {med:9.3f} {spread:>15s} {med / reference:8.2f}  [{mem}]")
        stats = strategies["zero3"][0].fetch_stats
        print(f"zero3 fetched-parameter peak on rank 0: {stats.peak_bytes / MiB:.2f} MiB")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
