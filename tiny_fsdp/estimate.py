"""Predicted per-rank memory (and traffic) of every strategy, from the ZeRO paper's formulas.

    python -m tiny_fsdp.estimate --model gpt2_xl --world_size 8 --precision bf16

[Note: ZeRO memory formulas]
With Psi parameters on N ranks, p bytes per parameter, g bytes per gradient and K bytes of
optimizer state per parameter, the model states one rank holds are (ZeRO, Rajbhandari et al.
2020, section 5)::

    strategy        parameters   gradients   optimizer state
    single, DDP     p Psi        g Psi       K Psi
    ZeRO-1          p Psi        g Psi       K Psi / N
    ZeRO-2          p Psi        g Psi / N   K Psi / N
    ZeRO-3, FSDP    p Psi / N    g Psi / N   K Psi / N

``fp32``: p = g = 4, AdamW K = 8 (two moments), SGD with momentum K = 4. ``bf16`` (mixed
precision): p = g = 2 and the optimizer keeps an fp32 master copy too: AdamW K = 12, SGD K = 8.
tiny_fsdp's ZeRO-3 is *inter-tensor*: a rank holds the whole tensors the partition table gives
it, so its Psi / N is replaced by the table's share for that rank (never less than the largest
tensor); ``estimate_model`` computes the table.

Traffic per step and rank (payload volume, ZeRO section 7): DDP all-reduces the gradients
(2 g Psi: a reduce-scatter plus an all-gather); ZeRO-1/2 reduce-scatter the gradients and
all-gather the parameters (g Psi + p Psi); ZeRO-3 / FSDP gather the parameters in forward and
again in backward and reduce the gradients (2 p Psi + g Psi). A ring sends (N-1)/N of it.

Not predicted: activations, temporaries (gathered parameters, buckets being reduced),
allocator overheads, padding and the few bytes of per-tensor optimizer counters. The memory
ledger (``tiny_fsdp.core.memory``) measures the real tensors; tests hold the two within 5%.
``python -m tiny_fsdp.plan`` adds activations, transient buffers and step time to these
formulas, and lays the model states out as each strategy keeps them: frozen tensors without
gradients or optimizer state, FSDP's padded rows, under bf16 each strategy's dtypes ([Note:
what the planner predicts]).
"""

import argparse
from collections import OrderedDict
from typing import Dict, List, Optional, Sequence, Tuple

from torch import nn

from tiny_fsdp.core.memory import MemoryReport

STRATEGIES = ("single_device", "ddp", "zero1", "zero2", "zero3", "fsdp")
PRECISIONS = ("fp32", "bf16")
OPTIMIZERS = ("adamw", "sgd")


def bytes_per_param(precision: str = "fp32", optimizer: str = "adamw") -> Tuple[int, int, int]:
    """``(p, g, K)``: bytes of a parameter, its gradient and its optimizer state."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    moments = 4 * (2 if optimizer == "adamw" else 1)  # fp32 exp_avg (+ exp_avg_sq) or momentum
    if precision == "fp32":
        return 4, 4, moments  # the parameters are their own master
    return 2, 2, 4 + moments  # fp32 master + fp32 moments


def estimate_memory(
    num_params: int,
    world_size: int,
    precision: str = "fp32",
    optimizer: str = "adamw",
    zero3_owned: Optional[Sequence[int]] = None,
) -> Dict[str, List[MemoryReport]]:
    """Predicted model-state bytes of every rank, per strategy ([Note: ZeRO memory formulas]).

    ``zero3_owned``: elements each rank owns under tiny_fsdp's inter-tensor ZeRO-3 (length
    ``world_size``); default ``num_params / world_size`` each (the paper's ZeRO-3).
    Returns ``{strategy: [MemoryReport of rank 0, rank 1, ...]}`` (``buffers`` is 0).
    """
    if world_size < 1 or num_params < 0:
        raise ValueError(
            f"need world_size >= 1 and num_params >= 0, got {world_size}, {num_params}"
        )
    if zero3_owned is not None and len(zero3_owned) != world_size:
        raise ValueError(f"zero3_owned has {len(zero3_owned)} entries for {world_size} ranks")
    p, g, k = bytes_per_param(precision, optimizer)
    psi, shard = num_params, num_params / world_size
    owned = list(zero3_owned) if zero3_owned is not None else [shard] * world_size

    def report(params: float, grads: float, optim: float) -> MemoryReport:
        return MemoryReport(round(params), round(grads), round(optim))

    replicated = report(p * psi, g * psi, k * psi)
    out = {
        "single_device": [replicated],
        "ddp": [replicated] * world_size,
        "zero1": [report(p * psi, g * psi, k * shard)] * world_size,
        "zero2": [report(p * psi, g * shard, k * shard)] * world_size,
        "zero3": [report(p * n, g * n, k * n) for n in owned],
        "fsdp": [report(p * shard, g * shard, k * shard)] * world_size,
    }
    return out


def traffic_per_step(num_params: int, world_size: int, precision: str = "fp32") -> Dict[str, float]:
    """Bytes one rank sends per step under the ring model, per strategy ([Note: ZeRO memory
    formulas]); equal to ``LEDGER.traffic_bytes`` summed over kinds, padding aside."""
    p, g, _ = bytes_per_param(precision)
    ring = (world_size - 1) / world_size
    volume = {
        "single_device": 0.0,
        "ddp": 2 * g * num_params,
        "zero1": (g + p) * num_params,
        "zero2": (g + p) * num_params,
        "zero3": (2 * p + g) * num_params,
        "fsdp": (2 * p + g) * num_params,
    }
    return {name: v * ring for name, v in volume.items()}


def estimate_model(
    model: nn.Module, world_size: int, precision: str = "fp32", optimizer: str = "adamw"
) -> Dict[str, List[MemoryReport]]:
    """``estimate_memory`` for ``model`` (may be on ``meta``), ZeRO-3 shares from its table."""
    from tiny_fsdp.core.zero3 import zero3_partition_tensors

    named = OrderedDict(model.named_parameters())  # a tied parameter once
    num_params = sum(t.numel() for t in named.values())
    _, rank_bytes = zero3_partition_tensors(named, ["cpu"] * world_size)
    sizes = {t.element_size() for t in named.values()}
    if len(sizes) > 1:  # the table balances bytes; elements are what the formulas need
        raise ValueError(f"estimate_model needs one parameter dtype, got sizes {sorted(sizes)}")
    owned = [b // (sizes.pop() if sizes else 4) for b in rank_bytes]
    return estimate_memory(num_params, world_size, precision, optimizer, zero3_owned=owned)


def _human(nbytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


def format_table(
    estimates: Dict[str, List[MemoryReport]], traffic: Optional[Dict[str, float]] = None
) -> str:
    """A markdown table: the largest rank's bytes per strategy (and traffic if given)."""
    head = "| strategy | params | grads | optimizer | model states / rank |"
    rule = "|---|---:|---:|---:|---:|"
    if traffic is not None:
        head, rule = head + " traffic / step / rank |", rule + "---:|"
    lines = [head, rule]
    for name, per_rank in estimates.items():
        worst = max(per_rank, key=lambda r: r.model_states)
        cells = [name, *(_human(v) for v in (worst.params, worst.grads, worst.optimizer))]
        cells.append(_human(worst.model_states))
        if traffic is not None:
            cells.append(_human(traffic[name]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> str:
    """Print (and return) the table for a GPT-2 preset or a given parameter count."""
    from tiny_fsdp.models.gpt2 import GPT2Model, GPTConfigs

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2", choices=GPTConfigs.names())
    parser.add_argument("--num_params", type=float, default=None, help="overrides --model")
    parser.add_argument("--world_size", type=int, default=8)
    parser.add_argument("--precision", default="fp32", choices=PRECISIONS)
    parser.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
    args = parser.parse_args(argv)
    if args.num_params is not None:
        num_params = int(args.num_params)
        estimates = estimate_memory(num_params, args.world_size, args.precision, args.optimizer)
        what = f"{num_params / 1e6:,.2f} M parameters (ZeRO-3: Psi / N)"
    else:
        import torch

        with torch.device("meta"):
            model = GPT2Model(GPTConfigs.get(args.model))
        num_params = model.num_parameters()
        estimates = estimate_model(model, args.world_size, args.precision, args.optimizer)
        what = f"{args.model} ({num_params / 1e6:,.2f} M parameters; ZeRO-3 from its table)"
    traffic = traffic_per_step(num_params, args.world_size, args.precision)
    text = (
        f"{what}, {args.world_size} ranks, {args.precision}, {args.optimizer}: predicted "
        "model states of the largest rank (ZeRO formulas)\n\n" + format_table(estimates, traffic)
    )
    print(text)
    return text


if __name__ == "__main__":
    main()
