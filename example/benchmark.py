"""Side by side: time, memory, traffic and loss of every strategy, ours and PyTorch's.

    torchrun --standalone --nproc_per_node=2 example/benchmark.py --model gpt2_mini --steps 20
    torchrun --standalone --nproc_per_node=2 example/benchmark.py --strategies fsdp,zero3 --compare
    torchrun --standalone --nproc_per_node=2 example/benchmark.py --strategies fsdp
    torchrun --standalone --nproc_per_node=2 example/benchmark.py --steps 3 --trace out/trace
    torchrun --standalone --nproc_per_node=2 example/benchmark.py --model hf:gpt2 \
        --strategies fsdp,fsdp_wrapped --compare --data random

The first runs single device, DDP, ZeRO-1, ZeRO-2, ZeRO-3, FSDP (tiny_fsdp) and PyTorch's DDP,
DDP + ZeroRedundancyOptimizer and FSDP2 ``fully_shard`` on the same model (same seed), data,
global batch and world size; ``--strategies`` picks some, ``--compare`` adds their PyTorch
counterparts (DDP: torch DDP; ZeRO-1/2: ZeroRedundancyOptimizer; ZeRO-3 / FSDP: FSDP2). ``--model``
is a GPT-2 preset or a ``transformers`` model (``hf:gpt2``, ``hf:llama``: ``example/models.py``);
the opt-in ``fsdp_wrapped`` is our FSDP with a wrapper registered for HF GPT-2's ``Conv1D``
(``example/bench/hf_wrappers.py``) where ``fsdp`` takes the generic path: the last command
measures the generic path against FSDP2 and against the wrapper. Writes
``results.md``, ``results.json`` and PNG plots to ``--out`` (default ``out/benchmark``); with
``--trace DIR`` also per-rank timelines of our strategies' last timed step (``tiny_fsdp/trace``):
``DIR/<strategy>.trace.json`` (Perfetto), ``DIR/<strategy>.png`` and ``DIR/strategies.png``. The
parts live in ``example/bench/``.

[Note: benchmark method]
- Strategies run in *phases* of counterparts (single; DDP | torch DDP; ZeRO-1 | ZeRO-2 | torch
  ZeRO; ZeRO-3 | FSDP | torch FSDP2): the members of a phase live in the same processes and take
  turns step by step, the order flipping every round, so load changes on the machine hit them
  alike; a phase's models are freed before the next is built (memory). Single device trains the
  global batch on rank 0 alone. ``--one_phase`` puts every selected strategy in one phase and
  adds each one's paired ratio to our DDP (the floor a sharded strategy can reach: its extra
  collectives hidden behind compute).
- ``no_comm`` (opt-in: ``--strategies no_comm,...``, measured in DDP's phase) is the floor below
  that: each rank trains the plain model on its own batch with our optimizer and no collective,
  under the same load, so every other strategy of its phase gets its ratio to it (what its
  communication costs). Its losses are the ranks' own, not the global batch's: not compared.
  The README's Benchmark section gives one run's ratios on the 2-core development machine.
- A round gives every strategy of the phase its turn: ``settle`` untimed steps (default 1), then
  one step, timed from round ``warmup`` on (round 0 is each strategy's first step, taken when it
  is built, which creates its optimizer state). So a timed step follows a step of the same
  strategy, as every step of a training run does. Timed right after another strategy's step,
  a step pays for the other's traces (caches, the freed heap, transparent huge pages to
  defragment): on the 2-core development machine (gpt2_mini, 2 ranks) FSDP's first unit, the
  embedding's all-gather and copy-out, took 135-138 ms after our DDP's step and 31-38 ms after
  its own. And with the order flipping every round, the first and last strategy of a phase
  follow themselves every other round, the others never: ``--settle 0`` measured FSDP / our
  DDP 1.08 where the default measured 1.03 (FSDP / FSDP2 0.92 and 0.91), one run each.
- Every strategy trains ``1 + (warmup + steps - 1) * (settle + 1) + 2`` steps on the same
  batches. A timed step is forward, backward, optimizer step and zero_grad between a barrier
  and the slowest rank's end; reported: median and min-max over the ``steps`` measured ones,
  tokens/s of the global batch, and the median of the per-round ratios to the PyTorch
  counterpart (robust to drifting load).
- The last step is the memory probe (untimed), right after an untimed step of the same strategy.
  All meters are ``tiny_fsdp.core.memory``'s ([Note: allocation meters]). ``peak`` = bytes the
  strategy keeps (``allocated_bytes`` from just before its build to after its first step, less the
  free blocks of the CPU block cache) + the cache's blocks reserved when the probe starts + the
  highest growth during the probe step (``peak_growth``). The strategies of a phase share one
  process, so its CPU block cache ([Note: reusing large CPU blocks] in
  ``tiny_fsdp/core/utils/huge_pages.py``): it is emptied before each build and before the step
  that precedes each probe, so that the blocks a peak counts are the strategy's own, reserved
  between its steps as in a run of it alone (without this, FSDP's peak in the README's run of
  f7174ff read 995 MiB, blocks being shared with other strategies; run alone it was 1,097).
  ``RSS +``: growth of the process's peak RSS over the build and first step (``reset_peak_rss``
  first, so it is this strategy's). Parameters / gradients / optimizer / buffers come from the
  memory ledger after the probe's optimizer step; "activations + other" is the rest of the peak
  (for PyTorch's strategies it includes their internal buffers, e.g. DDP's buckets, which the
  ledger cannot see). For the peak RSS of one strategy alone in fresh processes, run it alone:
  ``--strategies fsdp``.
- "model states (formula)": the ledger's params + grads + optimizer, and in brackets the ZeRO
  formula's prediction (``tiny_fsdp.estimate``) for our strategies.
- Traffic per step and rank: our collectives from ``LEDGER`` (exact); PyTorch's FSDP2 and
  ZeroRedundancyOptimizer by counting the ``torch.distributed`` calls of the probe step;
  torch DDP's C++ reducer from its logging data (bucket sizes: one all-reduce each).
- The generic path's cost ([Note: generic layer]): ``--model hf:gpt2 --strategies
  fsdp,fsdp_wrapped --compare --steps 20 --warmup 2 --batch_size 4 --seq_len 128`` (HF GPT-2,
  0.86 M parameters, its ``Conv1D`` generic in ``fsdp``, wrapped in ``fsdp_wrapped``; 2 CPU
  ranks, gloo) measured ``fsdp`` at 0.94 x FSDP2's step time and 1.02 x ``fsdp_wrapped``'s
  (``fsdp_wrapped``: 0.99 x FSDP2; medians of per-round ratios), same losses to 4 decimals, on
  a machine whose load average was 9-10 on 2 cores: step times spread by 3-4x, so rough.
"""

import argparse
import json
import os
import sys
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from example.bench.plots import plot  # noqa: E402
from example.bench.report import header_line, markdown_table, ratio_lines, summarize  # noqa: E402
from example.bench.runner import NAMES, NO_COMM, run_phases, select_phases  # noqa: E402
from example.data import TokenBatches, check_vocab, load_tokens  # noqa: E402
from example.model import GPTConfigs  # noqa: E402
from example.models import model_names, model_spec  # noqa: E402
from example.tokenizer import get_tokenizer  # noqa: E402
from tiny_fsdp.core.utils.dist import init_distributed  # noqa: E402
from tiny_fsdp.estimate import estimate_model  # noqa: E402


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    gpt2 = GPTConfigs.names()  # all presets: gpt2_tiny is the smoke test's
    models = gpt2 + [name for name in model_names() if name not in gpt2]
    p.add_argument("--model", default="gpt2_mini", choices=models)
    p.add_argument("--strategies", default="", help=f"comma-separated, of {','.join(NAMES)}")
    p.add_argument("--compare", action="store_true", help="add each one's PyTorch counterpart")
    p.add_argument(
        "--one_phase",
        action="store_true",
        help="all strategies interleaved in one phase; adds each one's ratio to our ddp "
        "(and to no_comm, if chosen)",
    )
    p.add_argument("--steps", type=int, default=20, help="measured steps per strategy")
    p.add_argument(
        "--warmup", type=int, default=2, help="unmeasured rounds first, the build's step one (>= 1)"
    )
    p.add_argument(
        "--settle",
        type=int,
        default=1,
        help="untimed steps a strategy takes right before each timed one, so that it is timed "
        "after its own step, as in training (0: after another strategy's)",
    )
    p.add_argument("--batch_size", type=int, default=2, help="sequences per rank")
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"])
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight_decay", type=float, default=0.1)
    p.add_argument("--sync_comm", action="store_true", help="ours without async communication")
    p.add_argument(
        "--torch_fused",
        action="store_true",
        help="PyTorch's side with AdamW(fused=True), the one-pass kernel our AdamW uses on the CPU "
        "([Note: fused AdamW on the CPU]): strategies compared without the optimizer's kernel",
    )
    p.add_argument("--evenness_priority", type=float, default=0.0, help="ZeRO-3 partition")
    p.add_argument("--data", default=None, help="text / .bin file, or 'random'; default: corpus")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--device", default=None, help="cuda if present, else cpu")
    p.add_argument("--out", default="out/benchmark")
    p.add_argument(
        "--trace",
        default=None,
        metavar="DIR",
        help="timelines of our strategies' last timed step: DIR/<strategy>.trace.json (Perfetto), "
        "DIR/<strategy>.png and DIR/strategies.png (all side by side)",
    )
    args = p.parse_args(argv)
    args.async_comm = "off" if args.sync_comm else "on"  # every strategy, ours: explicit
    args.strategies = [s for s in args.strategies.split(",") if s]
    if args.warmup < 1 or args.steps < 1:
        p.error("--warmup and --steps must be >= 1 (the first step creates optimizer state)")
    if args.settle < 0:
        p.error("--settle must be >= 0")
    try:
        select_phases(args.strategies, args.compare, args.one_phase)
    except ValueError as e:
        p.error(str(e))
    if args.data != "random" and args.model not in model_names():  # gpt2_tiny: 67 ids
        p.error(
            f"--model {args.model} has {GPTConfigs.get(args.model).vocab_size} token ids, fewer "
            "than text needs (256 bytes): run it on --data random, or pick another --model"
        )
    return args


def load_batches(args: argparse.Namespace, vocab_size: int) -> TokenBatches:
    if args.data == "random":
        gen = torch.Generator().manual_seed(args.seed)
        tokens = torch.randint(vocab_size, (100 * args.seq_len,), generator=gen)
        return TokenBatches(tokens, args.seq_len, args.seed, source="random")
    tokens = load_tokens(args.data, get_tokenizer("auto", vocab_size))  # ids the model embeds
    check_vocab(tokens, vocab_size, args.data or "the embedded corpus")
    return TokenBatches(tokens, args.seq_len, args.seed, source=args.data or "embedded")


def floors(args: argparse.Namespace) -> Dict[str, List[str]]:
    """floor -> the strategies of its phase, which the ratio lines divide by it: our DDP with
    ``--one_phase``, and ``no_comm`` where chosen ([Note: benchmark method])."""
    names = ["ddp", NO_COMM] if args.one_phase else [NO_COMM]
    phases = select_phases(args.strategies, args.compare, args.one_phase)
    return {floor: phase for phase in phases for floor in phase if floor in names}


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    env = init_distributed(args.device)
    spec = model_spec(args.model)
    batches = load_batches(args, spec.vocab_size)

    def make_model() -> torch.nn.Module:
        torch.manual_seed(args.seed)  # same weights for every strategy
        return spec.make()

    traces: dict = {}
    results, loads = run_phases(args, env, batches, make_model, traces)
    if env.is_master:
        tokens = args.batch_size * args.seq_len * env.world_size
        with torch.device("meta"):
            meta = spec.make()
        estimates = estimate_model(meta, env.world_size, "fp32", args.optimizer)
        predicted = {k: max(r.model_states for r in v) for k, v in estimates.items()}
        rows = summarize(results, tokens, predicted, floors(args))
        os.makedirs(args.out, exist_ok=True)
        header = header_line(
            args, spec.num_parameters(), env.world_size, env.device.type, dist.get_backend(), loads
        )
        table = markdown_table(rows)
        ratios = ratio_lines(rows)
        table += f"\n\n{ratios}" if ratios else ""
        with open(os.path.join(args.out, "results.md"), "w") as f:
            f.write(f"{header}\n\n{table}\n")
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(dict(args=vars(args), header=header, rows=rows), f, indent=1)
        paths = plot(rows, args.out)
        print(f"{header}\n\n{table}\n\nwritten: {args.out}/results.md, results.json, "
              + ", ".join(os.path.basename(p) for p in paths))  # fmt: skip
        if traces:
            print(f"timelines written: {args.trace}/<strategy>.trace.json and .png")
            from tiny_fsdp.trace.plot import plot_strategies  # matplotlib: already needed above

            print(plot_strategies(traces, os.path.join(args.trace, "strategies.png")))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
