"""The one training loop behind every ``example/<strategy>/train.py``.

    python example/single_device/train.py --model gpt2_bytes --steps 100 --lr 1e-3
    torchrun --standalone --nproc_per_node=2 example/fsdp/train.py --model gpt2_bytes

Every rank reads its own slice of each global batch (``example/data.py``), so N ranks with
``--batch_size b`` see exactly the tokens of one process with batch N x b. Rank 0 prints one line
per logged step with fixed fields (the logged loss is the mean over ranks) and, only when both
stdout and stderr are terminals, draws a progress bar under them: a log file or a pipe gets clean
lines, never carriage-return frames.
"""

import argparse
import contextlib
import math
import resource
import sys
import time
from typing import List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from example.data import TokenBatches, check_vocab, default_corpus_description, load_tokens
from example.models import logits_of, model_names, model_spec
from example.strategies import STRATEGIES, build_strategy, resolve_precision
from example.tokenizer import get_tokenizer
from tiny_fsdp.checkpoint import has_checkpoint, load_checkpoint, save_checkpoint
from tiny_fsdp.core.utils.dist import DistEnv, init_distributed
from tiny_fsdp.core.utils.recompute import set_gradient_checkpointing
from tiny_fsdp.core.utils.failure import (
    NonFiniteError,
    describe_nonfinite,
    fail_fast,
    nonfinite_ranks,
)
from tiny_fsdp.models.hf_gpt2 import hf_gpt2_to_ours, read_hf_state_dict
from tiny_fsdp.trace.session import StepTracer, parse_steps


def build_arg_parser(strategy: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=f"Train GPT-2 with the {strategy} strategy.")
    p.add_argument("--model", default="gpt2", choices=model_names())
    p.add_argument(
        "--init_from",
        default=None,
        help="start from GPT-2 weights that HuggingFace's save_pretrained() wrote to this "
        "directory (its config.json replaces --model)",
    )
    p.add_argument("--lr", type=float, default=1e-5, help="peak learning rate")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps")
    p.add_argument("--weight_decay", type=float, default=1e-1, help="AdamW decay (matrices)")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"])
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    p.add_argument("--batch_size", type=int, default=4, help="sequences per rank per micro-step")
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="cuda if present, else cpu")
    p.add_argument("--data", default=None, help="text file or uint16 .bin; default: embedded")
    p.add_argument("--tokenizer", default="auto", choices=["auto", "byte", "gpt2"])
    p.add_argument("--log_every", type=int, default=10, help="print a log line every N steps")
    p.add_argument("--eval_every", type=int, default=0, help="validation loss every N steps")
    p.add_argument("--eval_batches", type=int, default=4)
    p.add_argument("--warmup_steps", type=int, default=0, help="linear warmup, then cosine")
    p.add_argument("--min_lr_ratio", type=float, default=0.1, help="cosine floor / peak lr")
    p.add_argument("--grad_accum", type=int, default=1, help="micro-steps per optimizer step")
    p.add_argument("--grad_clip", type=float, default=0.0, help="clip global grad norm (0: off)")
    p.add_argument("--grad_ckpt", action="store_true", help="recompute blocks in backward")
    p.add_argument(
        "--async_comm",
        default=None,
        choices=["on", "off"],
        help="enable_async_communication (overlap communication with computation); default: "
        "the strategy's own default (on for every strategy)",
    )
    p.add_argument(
        "--precision",
        default="auto",
        choices=["auto", "fp32", "bf16"],
        help="bf16: compute and communicate in bf16, fp32 master weights and optimizer state; "
        "auto: bf16 on a CUDA GPU with native bf16 (Ampere or newer), else fp32",
    )
    p.add_argument(
        "--on_nonfinite",
        default="error",
        choices=["error", "skip"],
        help="inf/NaN loss or grads: stop, naming the step, or skip it on every rank",
    )
    p.add_argument(
        "--timeout_s",
        type=float,
        default=300.0,
        help="a collective waiting this long for the other ranks raises",
    )
    p.add_argument("--save_dir", default=None, help="checkpoint directory (replaced atomically)")
    p.add_argument(
        "--save_every",
        type=int,
        default=0,
        help="with --save_dir: also every N steps (0: at the end only)",
    )
    p.add_argument(
        "--resume",
        nargs="?",
        const="auto",
        default=None,
        help="resume from PATH; bare --resume: from --save_dir if it holds a checkpoint",
    )
    p.add_argument("--sharded_ckpt", action="store_true", help="each rank saves its own shard")
    p.add_argument(
        "--trace",
        default=None,
        metavar="DIR",
        help="write per-rank timelines of the traced steps: DIR/<strategy>.trace.json (Chrome "
        "trace, open in https://ui.perfetto.dev) and DIR/<strategy>.png",
    )
    p.add_argument(
        "--trace_steps", default="last", help="steps to trace: 'last' or indices, e.g. 3,4"
    )
    if strategy == "zero3":
        p.add_argument("--evenness_priority", type=float, default=0.0)
    if strategy == "fsdp":
        p.add_argument(
            "--hsdp",
            type=int,
            nargs="?",
            const=0,
            default=None,
            metavar="R",
            help="hybrid sharding: R replica groups of world_size / R ranks, shards within a "
            "group; bare --hsdp: one group per node (LOCAL_WORLD_SIZE ranks), checked",
        )
    return p


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warmup to ``args.lr`` over ``warmup_steps``, then cosine to ``min_lr_ratio * lr``."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
    floor = args.min_lr_ratio * args.lr
    return floor + 0.5 * (args.lr - floor) * (1 + math.cos(math.pi * min(progress, 1.0)))


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: max allocated by tensors; CPU: the process's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def mean_over_ranks(value: float, env: DistEnv) -> float:
    if env.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=env.device)
    dist.all_reduce(t)  # logging only: not part of the strategy's traffic
    return t.item() / env.world_size


def lm_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = logits_of(model(x)).float()  # (B, T, vocab); the softmax in fp32 also in bf16
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


@torch.no_grad()
def evaluate(model, batches: TokenBatches, args, env: DistEnv, step: int) -> float:
    model.eval()
    losses = []
    for i in range(args.eval_batches):
        x, y = batches.get_batch(i, "val", args.batch_size, env.rank, env.world_size)
        losses.append(lm_loss(model, x.to(env.device), y.to(env.device)).item())
    model.train()
    return mean_over_ranks(sum(losses) / len(losses), env)


def setup(strategy: str, args: argparse.Namespace) -> DistEnv:
    if strategy == "single_device":
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        return DistEnv(0, 0, 1, device)
    return init_distributed(args.device, timeout_s=args.timeout_s)


@fail_fast()  # a rank that raises makes the others stop too, naming it (no hang)
def main(strategy: str, argv: Optional[List[str]] = None) -> List[float]:
    """Run training; return the logged (rank-mean) loss of every step."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {sorted(STRATEGIES)}")
    args = build_arg_parser(strategy).parse_args(argv)
    made_group = not dist.is_initialized()  # left at the end if we make it, kept if given
    env = setup(strategy, args)
    args.precision = resolve_precision(args.precision, env.device)
    master = env.is_master
    torch.manual_seed(args.seed)

    spec = model_spec(args.model, args.init_from)
    tokenizer = get_tokenizer(args.tokenizer, spec.vocab_size)
    tokens = load_tokens(args.data, tokenizer)
    check_vocab(tokens, spec.vocab_size, args.data or "the embedded corpus")
    if args.seq_len > spec.block_size:
        raise ValueError(f"--seq_len {args.seq_len} exceeds block_size {spec.block_size}")
    batches = TokenBatches(tokens, args.seq_len, args.seed, source=args.data or "embedded")

    model, optimizer = build_strategy(strategy, spec.make, args, env)
    if args.init_from:  # every strategy loads a plain-model state dict of full tensors
        model.load_state_dict(hf_gpt2_to_ours(read_hf_state_dict(args.init_from)))
    if args.grad_ckpt:  # our GPT-2's attribute or a transformers model's method
        set_gradient_checkpointing(model, True)
    if master:
        source = args.data or default_corpus_description()
        print(
            f"{strategy} | {env.world_size} rank(s) on {env.device} | {args.precision} | model "
            f"{args.init_from or args.model} "
            f"({spec.num_parameters() / 1e6:.2f}M params) | "
            f"{tokens.numel():,} tokens ({tokenizer.name}) from {source}"
        )

    start = _maybe_resume(model, optimizer, args, master)
    tokens_per_step = args.batch_size * args.seq_len * args.grad_accum * env.world_size
    losses: List[float] = []
    show_bar = master and sys.stdout.isatty() and sys.stderr.isatty()
    bar = tqdm(range(start, args.steps), disable=not show_bar, file=sys.stderr, dynamic_ncols=True)
    traced = parse_steps(args.trace_steps, args.steps)
    tracer = StepTracer(args.trace, strategy, traced, model, optimizer, env.rank)
    for step in bar:
        tracer.start(step)  # before the timing, as stop() after it: only recording is timed
        t0 = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        step_loss = 0.0
        for micro in range(args.grad_accum):
            x, y = batches.get_batch(
                step * args.grad_accum + micro, "train", args.batch_size, env.rank, env.world_size
            )
            sync = micro == args.grad_accum - 1
            with _maybe_no_sync(model, sync):
                loss = lm_loss(model, x.to(env.device), y.to(env.device)) / args.grad_accum
                loss.backward()
            step_loss += loss.item()
        # The norm is computed with clipping off too: it is how inf / NaN gradients show.
        grad_norm = optimizer.clip_grad_norm_(args.grad_clip if args.grad_clip > 0 else math.inf)
        # The same answer on every rank, so that all stop or all skip the step.
        nonfinite = nonfinite_ranks({"loss": step_loss, "grad norm": grad_norm}, env.device)
        if nonfinite and args.on_nonfinite == "error":
            raise NonFiniteError(
                f"step {step}: non-finite {describe_nonfinite(nonfinite)}; lower --lr, set "
                "--grad_clip, check the data, or pass --on_nonfinite skip to skip such steps"
            )
        if not nonfinite:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        periodic = args.save_every and (step + 1) % args.save_every == 0
        if args.save_dir and (periodic or step + 1 == args.steps):
            # step + 1 steps done: the data position to resume from ((seed, step) -> batch).
            save_checkpoint(
                args.save_dir, model, optimizer, step=step + 1, sharded=args.sharded_ckpt
            )
        if env.device.type == "cuda":
            torch.cuda.synchronize(env.device)
        ms = (time.perf_counter() - t0) * 1e3
        tracer.stop()
        losses.append(mean_over_ranks(step_loss, env))
        if master and (step % args.log_every == 0 or step == args.steps - 1 or nonfinite):
            mem = peak_memory_bytes(env.device) / 2**30
            line = (
                f"step {step:5d} | loss {losses[-1]:.4f} | lr {lr_at(step, args):.2e} | "
                f"{ms:8.1f} ms | {tokens_per_step / ms * 1e3:9.0f} tok/s | mem {mem:.2f} GiB"
            )
            if nonfinite:
                line += f" | step skipped: non-finite {describe_nonfinite(nonfinite)}"
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
            tqdm.write(line, file=sys.stdout)
        if args.eval_every and (step + 1) % args.eval_every == 0:
            val = evaluate(model, batches, args, env, step)
            if master:
                tqdm.write(f"step {step:5d} | val loss {val:.4f}", file=sys.stdout)
    written = tracer.finish()  # every rank: rank 0 gathers the events and writes the files
    if written:
        print("trace written: " + ", ".join(written))
    if made_group and dist.is_initialized():
        # Leave together; the abort a gloo rank could meet at exit is handled where every
        # collective is issued ([Note: leaving after collectives], tiny_fsdp/core/comm.py).
        if env.world_size > 1:
            dist.barrier()
        dist.destroy_process_group()
    return losses


def _maybe_resume(model, optimizer, args: argparse.Namespace, master: bool) -> int:
    """Load ``--resume`` (bare: ``--save_dir`` if it holds a checkpoint); the step to start at."""
    path = args.save_dir if args.resume == "auto" else args.resume
    if path is None or (args.resume == "auto" and not has_checkpoint(path)):
        return 0
    info = load_checkpoint(path, model, optimizer)
    if master:
        print(f"resumed from {path} at step {info['step']} ({info['kind']} checkpoint)")
    return info["step"]


def _maybe_no_sync(model: torch.nn.Module, sync: bool):
    """``model.no_sync()`` for a micro-step that must not communicate, else nothing."""
    if sync or not hasattr(model, "no_sync"):
        return contextlib.nullcontext()
    return model.no_sync()
