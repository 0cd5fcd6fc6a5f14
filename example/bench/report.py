"""The benchmark's figures per strategy and its markdown table ([Note: benchmark method])."""

import argparse
import statistics
from typing import Dict, List, Optional, Tuple

from example.bench.runner import COUNTERPART, NO_COMM, VARIANTS

KIND = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS", "broadcast": "BC"}
KIND["reduce"] = "R"
MiB = 2**20


STATES = ("params", "grads", "optimizer")


def summarize(
    results: Dict[str, List[dict]],
    tokens_per_step: int,
    predicted: Optional[dict] = None,
    floors: Optional[Dict[str, List[str]]] = None,
) -> Dict[str, dict]:
    """Per strategy: the figures of the table (memory of the rank with the highest peak).
    ``predicted``: strategy -> model-state bytes from ``tiny_fsdp.estimate`` (largest rank).
    ``vs_torch``: the median over rounds of (our step time / the PyTorch counterpart's);
    ``vs_variants``: variant -> the same median of (this strategy's / the variant's);
    ``floors``: floor -> the strategies measured in its phase, each of whose rows gets
    ``vs_floor``, a list of (floor, the same median of this strategy's / the floor's)."""
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
        row["predicted"] = (predicted or {}).get(VARIANTS.get(name, name))
        # Model states of the rank holding the most (ranks differ under ZeRO-3's partition),
        # which is what ``predicted`` gives; the worst peak may be another rank's.
        row["model_states"] = max(sum(r["memory"].get(k, 0) for k in STATES) for r in ranks)
        other = results.get(COUNTERPART.get(name, ""))
        if other is not None:
            row["vs_torch"] = _paired_median(times, other[0]["times"])
        variants = {v: results[v] for v, base in VARIANTS.items() if base == name and v in results}
        if variants:
            row["vs_variants"] = {
                v: _paired_median(times, r[0]["times"]) for v, r in variants.items()
            }
        row["vs_floor"] = [
            (floor, _paired_median(times, results[floor][0]["times"]))
            for floor, mates in (floors or {}).items()
            if floor in results and name in mates and name != floor
        ]
        rows[name] = row
    return rows


def _paired_median(times: List[float], others: List[float]) -> float:
    return statistics.median(a / b for a, b in zip(times, others))


def ratio_lines(rows: Dict[str, dict]) -> str:
    """One line per (strategy, variant) measured together: the paired median step-time ratio."""
    pairs = [
        (name, variant, ratio)
        for name, row in rows.items()
        for variant, ratio in row.get("vs_variants", {}).items()
    ]
    pairs += [(name, *vs) for name, row in rows.items() for vs in row.get("vs_floor", [])]
    return "\n".join(
        f"{name} / {other}: {ratio:.2f} x step time (median of per-round ratios)"
        for name, other, ratio in pairs
    )


def header_line(
    args: argparse.Namespace, n_params: int, world_size: int, device: str, backend: str,
    loads: List[float],
) -> str:  # fmt: skip
    """What was run, on what, and how loaded the machine was (``loads``: 1-minute averages)."""
    optimizer = args.optimizer + (" (PyTorch's: fused)" if args.torch_fused else "")
    return (
        f"{args.model} ({n_params / 1e6:.2f} M parameters), {world_size} ranks on {device} "
        f"({backend}, {args.threads} thread(s) each), batch {args.batch_size} x {args.seq_len} "
        f"per rank, {optimizer}, {args.steps} measured steps after {args.warmup} warm-up round(s), "
        f"each right after {args.settle} untimed step(s) of the same strategy, "
        f"async_comm={args.async_comm}; machine load average (1 min) during the rounds: median "
        f"{statistics.median(loads):.1f}, range {min(loads):.1f}-{max(loads):.1f}"
    )


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
        measured = r["model_states"]
        formula = "" if r["predicted"] is None else f" ({_fmt(r['predicted'], unit)})"
        own = name in ("single_device", NO_COMM)  # no_comm: the mean of the ranks' own losses
        gap = "-" if r["loss_gap"] is None or own else f"{r['loss_gap']:.1e}"
        lines.append(
            f"| {name} | {r['median'] * 1e3:,.0f} ({r['min'] * 1e3:,.0f}-{r['max'] * 1e3:,.0f}) "
            f"| {r['tokens_per_s']:,.0f} | {ratio} | {_fmt(r['peak'], unit)} | "
            f"{_fmt(m.get('rss_increase'), unit)} | {states} | {_fmt(measured, unit)}{formula} | "
            f"{_comm_cell(r['comm'], unit)} | "
            f"{r['losses'][-1]:.4f} ({gap}) |"
        )
    return "\n".join(lines)
