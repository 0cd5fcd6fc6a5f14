"""Building, stepping and measuring the strategies ([Note: benchmark method] in
``example/benchmark.py``): ours from ``example/strategies.py``, PyTorch's from ``pytorch.py``."""

import argparse
import gc
import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from example.bench.pytorch import (
    build_torch,
    counting_torch_collectives,
    torch_ddp_traffic,
)
from example.data import TokenBatches
from example.model import GPT2Model, GPTConfigs
from example.models import logits_of
from example.strategies import STRATEGIES, no_comm
from tiny_fsdp.core.comm import LEDGER
from tiny_fsdp.core.memory import (
    allocated_bytes,
    memory_ledger,
    peak_growth,
    reset_peak_rss,
    rss_bytes,
)
from tiny_fsdp.core.utils import huge_pages
from tiny_fsdp.core.utils.dist import DistEnv
from tiny_fsdp.trace.chrome import chrome_trace
from tiny_fsdp.trace.session import gather_records, trace_step, write_trace

# Opt-in (never in the default set): ``no_comm``, each rank training its own copy on its own
# batch with our optimizer and no collective, the time no data-parallel strategy can beat under
# the same load ([Note: benchmark method]); its losses are the ranks' own.
NO_COMM = "no_comm"
# Counterparts share a phase: they live in the same processes and take turns step by step.
PHASES = [
    ["single_device"],
    ["ddp", "torch_ddp", NO_COMM],
    ["zero1", "zero2", "torch_zero"],
    ["zero3", "fsdp", "torch_fsdp2"],
]
# Opt-in variants of ours (never in the default set), each run next to the strategy it varies.
# ``fsdp_wrapped``: FSDP with wrappers registered for ``transformers``' layers (HF GPT-2's
# ``Conv1D``), which ``fsdp`` runs through the generic path; the same on other models.
VARIANTS = {"fsdp_wrapped": "fsdp"}
OPT_IN = set(VARIANTS) | {NO_COMM}
NAMES = [name for phase in PHASES for name in phase] + list(VARIANTS)
OURS = set(STRATEGIES) | set(VARIANTS)
COUNTERPART = {"ddp": "torch_ddp", "zero1": "torch_zero", "zero2": "torch_zero"}
COUNTERPART.update(zero3="torch_fsdp2", fsdp="torch_fsdp2", fsdp_wrapped="torch_fsdp2")


def select_phases(
    strategies: Sequence[str], compare: bool, one_phase: bool = False
) -> List[List[str]]:
    """The phases restricted to ``strategies`` (all if empty), plus each one's PyTorch
    counterpart if ``compare``; in the order of ``PHASES``. ``one_phase``: all of them in one
    phase, taking turns step by step (e.g. FSDP against our DDP, the floor)."""
    unknown = sorted(set(strategies) - set(NAMES))
    if unknown:
        raise ValueError(f"unknown strategies {unknown}; choose from {NAMES}")
    chosen = set(strategies or set(NAMES) - OPT_IN)
    if compare:
        chosen |= {COUNTERPART[s] for s in chosen if s in COUNTERPART}
    with_variants = [
        [n for name in phase for n in [name] + [v for v, b in VARIANTS.items() if b == name]]
        for phase in PHASES
    ]
    phases = [[name for name in phase if name in chosen] for phase in with_variants]
    if one_phase:
        phases = [[name for phase in phases for name in phase]]
    return [phase for phase in phases if phase]


def build(name: str, make_model: Callable[[], nn.Module], args: argparse.Namespace, env: DistEnv):
    """``(model, optimizer, optimizer the memory ledger reads)`` of strategy ``name``."""
    if name in VARIANTS:
        from example.bench.hf_wrappers import hf_wrappers_registered  # needs transformers

        with hf_wrappers_registered():  # our models convert their layers at wrap time
            model, optimizer = STRATEGIES[VARIANTS[name]](make_model, args, env)
        return model, optimizer, optimizer
    builders = {**STRATEGIES, NO_COMM: no_comm}
    if name in builders:
        model, optimizer = builders[name](make_model, args, env)
        return model, optimizer, optimizer
    return build_torch(name, make_model, args, env)


class Runner:
    """One strategy: its model, its optimizer, and what was measured."""

    def __init__(self, name: str, args, env: DistEnv, batches: TokenBatches, make_model) -> None:
        self.name, self.args, self.env, self.batches = name, args, env, batches
        self.active = name != "single_device" or env.rank == 0  # single: rank 0 alone
        self.times: List[float] = []
        self.losses: List[float] = []
        self.comm: Dict[str, Any] = {}
        self.memory: Dict[str, Any] = {}
        # --trace: our strategies' last timed step ([Note: trace recorder]); records per rank.
        traced = getattr(args, "trace", None) and name in OURS
        self.trace_index = last_timed_index(args) if traced else None
        self.trace_records: Dict[str, Any] = dict(rank=env.rank, spans=[], comms=[], samples=[])
        base_rss = None
        huge_pages.release_free()  # the CPU blocks other strategies left: not this one's
        if env.device.type == "cpu":
            gc.collect()  # then freed heap goes back to the OS and the peak RSS restarts
            base_rss = rss_bytes() if reset_peak_rss() else None
        base = allocated_bytes(env.device)
        if self.active:
            self.model, self.optimizer, self.ledger_optimizer = build(name, make_model, args, env)
        self.step(0)  # creates the optimizer state: part of what the strategy keeps
        now, peak_rss = allocated_bytes(env.device), rss_bytes(peak=True)
        # Free cached blocks are the step's transient buffers, counted at the probe.
        kept = now - huge_pages.free_bytes()
        self.memory["kept"] = None if base is None else kept - base
        no_rss = base_rss is None or peak_rss is None
        self.memory["rss_increase"] = None if no_rss else peak_rss - base_rss

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
            logits = logits_of(self.model(x))  # (B, T, vocab)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            loss.backward()
            self.optimizer.step()
            if probe:
                self.memory.update(memory_ledger(self.model, self.ledger_optimizer).as_dict())
            self.optimizer.zero_grad(set_to_none=True)

        LEDGER.reset()
        dist.barrier()
        start = time.perf_counter()
        if index == self.trace_index and self.active:
            with trace_step(self.model, self.optimizer, step=index) as recorder:
                run()
        elif probe:
            # The blocks its last step left reserved: in use again in this one, and counted
            # in its peak as in a run of this strategy alone ([Note: benchmark method]).
            self.memory["reserved"] = huge_pages.free_bytes()
            torch_counts: Dict[str, List[int]] = {}
            with counting_torch_collectives(torch_counts):
                self.memory["step_growth"] = peak_growth(env.device, run)
            ours = {k: [LEDGER.calls[k], LEDGER.payload_bytes[k]] for k in LEDGER.calls}
            self.comm = ours if self.name in OURS else torch_counts
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
        if index == self.trace_index and self.active:
            self.trace_records = recorder.records(rank)
        self.losses.append(loss_sum.item() / (1 if single else world))

    def result(self) -> Dict[str, Any]:
        peak = None
        if self.memory.get("kept") is not None and self.memory.get("step_growth") is not None:
            peak = self.memory["kept"] + self.memory["reserved"] + self.memory["step_growth"]
        return dict(times=self.times, losses=self.losses, comm=self.comm, memory=self.memory,
                    peak=peak, active=self.active)  # fmt: skip


def last_timed_index(args: argparse.Namespace) -> int:
    """Index of every runner's last timed step: step 0 (its build), then ``warmup + steps - 1``
    rounds of ``settle + 1`` steps each ([Note: benchmark method])."""
    return (args.warmup + args.steps - 1) * (args.settle + 1)


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
    args: argparse.Namespace,
    env: DistEnv,
    batches: TokenBatches,
    make_model: Callable,
    traces: Optional[Dict[str, Any]] = None,
) -> Tuple[Dict[str, List[dict]], List[float]]:
    """Results per strategy (``[rank 0's, rank 1's, ...]``) ([Note: benchmark method]), and the
    1-minute load average of the machine at every round. With ``--trace DIR`` rank 0 writes
    each traced strategy's files there and puts its Chrome trace in ``traces``."""
    from tqdm import tqdm

    warm_up_libraries(env)
    phases = select_phases(args.strategies, args.compare, args.one_phase)
    total = sum(len(phase) for phase in phases) * (last_timed_index(args) + 2)
    show_bar = env.is_master and sys.stdout.isatty() and sys.stderr.isatty()  # no frames in logs
    bar = tqdm(total=total, disable=not show_bar, file=sys.stderr, dynamic_ncols=True)
    results: Dict[str, List[dict]] = {}
    loads: List[float] = []
    for phase in phases:
        runners = []
        for name in phase:
            bar.set_description(f"build {name}")
            runners.append(Runner(name, args, env, batches, make_model))
            bar.update(1)
        for round_ in range(1, args.warmup + args.steps):
            loads.append(os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan"))
            order = runners if round_ % 2 else runners[::-1]
            first = (round_ - 1) * (args.settle + 1) + 1  # step 0 was each runner's build
            for runner in order:
                bar.set_description(runner.name)
                for index in range(first, first + args.settle + 1):
                    timed = round_ >= args.warmup and index == first + args.settle
                    runner.step(index, timed=timed)
                    bar.update(1)
        for runner in runners:
            bar.set_description(f"probe {runner.name}")
            huge_pages.release_free()  # then the probe's reserved blocks are its own
            runner.step(last_timed_index(args) + 1)
            runner.step(last_timed_index(args) + 2, probe=True)
            bar.update(1)
        for runner in runners:
            gathered: List[Any] = [None] * env.world_size
            dist.all_gather_object(gathered, runner.result())
            results[runner.name] = gathered
            if runner.trace_index is not None:
                ranks = gather_records(runner.trace_records)
                if ranks is not None:
                    write_trace(ranks, args.trace, runner.name)
                    if traces is not None:
                        traces[runner.name] = chrome_trace(ranks, runner.name)
        del runners
        gc.collect()
    bar.close()
    return results, loads
