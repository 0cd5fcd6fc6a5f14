"""Predict peak memory per rank, step time and tokens/s of every strategy, or calibrate.

    python -m tiny_fsdp.plan --model gpt2_xl --world_size 64 --gpu_memory 80GiB --batch_size 8 \\
        --seq_len 1024 --precision bf16 [--grad_ckpt] [--calibration FILE] [--json]
    python -m tiny_fsdp.plan --num_params 7e9 --n_layer 32 --world_size 16 ...
    python -m tiny_fsdp.plan --calibrate my_machine.json --model gpt2 --batch_size 8 \\
        --seq_len 1024 [--calibrate_world_sizes 1 2]

``--batch_size`` is per rank; ``--calibration`` is a preset name (``h100_sxm``, ``a100_sxm``) or
a file written by ``--calibrate``, which measures at the shape of the model, batch and sequence
length it is given ([Note: calibration]); ``--hsdp R`` adds HSDP with ``R`` replica groups.
"""

import argparse
import json
import re
from typing import Dict, Optional, Sequence

import torch

from tiny_fsdp.estimate import OPTIMIZERS, PRECISIONS
from tiny_fsdp.models.gpt2 import GPTConfig, GPTConfigs
from tiny_fsdp.models.hf_presets import HF_PRESETS, hf_preset
from tiny_fsdp.plan.calibration import load_calibration, preset_names, save_calibration
from tiny_fsdp.plan.model_costs import gpt2_costs
from tiny_fsdp.plan.planner import Prediction, batch_costs, device_type, plan

_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10,
          "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


def parse_bytes(text: str) -> float:
    """``"80GiB"``, ``"80 GB"``, ``"8e10"`` -> bytes."""
    match = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 80GiB, 40GB, 8e10)")
    return float(match.group(1)) * _UNITS[match.group(2).lower()]


def config_for_count(num_params: float, n_layer: int, vocab_size: int, seq_len: int) -> GPTConfig:
    """A GPT-2-shaped config of about ``num_params`` parameters: ``12 L C^2 + V C = N``."""
    a, b = 12 * n_layer, vocab_size + seq_len
    width = (-b + (b * b + 4 * a * num_params) ** 0.5) / (2 * a)
    n_head = max(1, round(width / 128))
    n_embd = max(n_head, round(width / n_head) * n_head)
    return GPTConfig(block_size=seq_len, vocab_size=vocab_size, n_layer=n_layer, n_head=n_head,
                     n_embd=n_embd)  # fmt: skip


def _model(args, device: str):
    """``ModelCosts`` of the model the arguments name, its activations as ``device``'s kernels
    keep them."""
    if args.config is not None:
        with open(args.config) as f:
            config = GPTConfig(**json.load(f))
        name = args.config
    elif args.num_params is not None:
        config = config_for_count(args.num_params, args.n_layer, args.vocab_size, args.seq_len)
        name = f"{args.num_params / 1e6:,.0f} M parameters as GPT-2 ({config})"
    elif args.model in HF_PRESETS:
        make, _, block_size = hf_preset(args.model)
        if args.seq_len > block_size:
            raise SystemExit(f"--seq_len {args.seq_len} > {block_size} positions of {args.model}")
        with torch.device("meta"):
            module = make()
        return batch_costs(
            module, args.batch_size, args.seq_len, device, name=args.model, precision=args.precision
        )
    else:
        config, name = GPTConfigs.get(args.model), args.model
    if args.seq_len > config.block_size:
        raise SystemExit(f"--seq_len {args.seq_len} > block_size {config.block_size} of {name}")
    return gpt2_costs(config, name)


def _human(nbytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


def format_plan(plans: Dict[str, Prediction]) -> str:
    """A markdown table of the predictions."""
    lines = [
        "| strategy | peak / rank | fits | step ms | tokens/s | model states | activations "
        "| transient | compute ms | comm ms | sent in group | sent across groups |",
        "|---|---:|:---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, p in plans.items():
        fits = "" if p.fits is None else ("yes" if p.fits else "NO")
        lines.append(
            f"| {name} | {_human(p.peak_bytes)} | {fits} | {p.step_ms:,.1f} | "
            f"{p.tokens_per_s:,.0f} | {_human(p.model_state_bytes)} | "
            f"{_human(p.activation_bytes)} | {_human(p.transient_bytes)} | {p.compute_ms:,.1f} | "
            f"{p.comm_ms:,.1f} | {_human(p.sent_bytes['intra'])} | "
            f"{_human(p.sent_bytes['inter'])} |"
        )
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2", choices=GPTConfigs.names() + list(HF_PRESETS))
    parser.add_argument("--num_params", type=float, default=None, help="overrides --model")
    parser.add_argument("--n_layer", type=int, default=12, help="with --num_params")
    parser.add_argument("--vocab_size", type=int, default=50304, help="with --num_params")
    parser.add_argument("--config", default=None, help="JSON file of GPTConfig fields")
    parser.add_argument("--world_size", type=int, default=8)
    parser.add_argument("--gpu_memory", type=parse_bytes, default=None, help="e.g. 80GiB")
    parser.add_argument("--batch_size", type=int, default=8, help="sequences per rank")
    parser.add_argument("--seq_len", type=int, default=1024)
    parser.add_argument("--precision", default="fp32", choices=PRECISIONS)
    parser.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
    parser.add_argument("--grad_ckpt", action="store_true")
    parser.add_argument("--calibration", default="h100_sxm", help=f"file or {preset_names()}")
    parser.add_argument("--hsdp", type=int, default=None, metavar="R", help="replica groups")
    parser.add_argument("--inter_node_bandwidth", type=float, default=None, help="GB/s")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--calibrate", default=None, metavar="FILE", help="measure, write FILE")
    parser.add_argument("--calibrate_world_sizes", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args(argv)
    calibration = None if args.calibrate is not None else load_calibration(args.calibration)
    costs = _model(args, device_type(calibration))
    shape = costs.calibration_shape(args.batch_size * args.seq_len)
    if args.calibrate is not None:
        from tiny_fsdp.plan.measure import calibrate

        calibration = calibrate(args.calibrate_world_sizes, shape=shape)
        save_calibration(calibration, args.calibrate)
        text = f"wrote {args.calibrate}:\n{json.dumps(calibration.to_dict(), indent=2)}"
        print(text)
        return text
    if args.inter_node_bandwidth is not None:
        calibration.inter_node_bandwidth_bytes_per_s = args.inter_node_bandwidth * 1e9
    plans = plan(
        costs, calibration, args.world_size, args.batch_size, args.seq_len, args.precision,
        args.optimizer, args.grad_ckpt, args.gpu_memory, args.hsdp,
    )  # fmt: skip
    if args.json:
        text = json.dumps({name: p.summary() for name, p in plans.items()}, indent=2)
    else:
        text = (
            f"{costs.name}: {costs.num_params / 1e6:,.1f} M parameters, {args.world_size} ranks x "
            f"{args.batch_size} x {args.seq_len} tokens, {args.precision}, {args.optimizer}"
            f"{', gradient checkpointing' if args.grad_ckpt else ''}; calibration "
            f"{calibration.name}\n\n" + format_plan(plans)
        )
        measured_at = calibration.shape or shape  # a preset: no shape
        if any(max(a, b) > 2 * min(a, b) for a, b in zip(shape, measured_at)):
            text += (
                f"\n\nThe calibration was measured at matrix products of {calibration.shape} "
                f"(rows, in, out); this model's are {shape}, and the rates depend on the shape: "
                f"--calibrate FILE with this --model, --batch_size and --seq_len measures them."
            )
    print(text)
    return text


if __name__ == "__main__":
    main()
