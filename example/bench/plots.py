"""The benchmark's plots: memory per rank (stacked), step time, loss curves and their gaps."""

import os
from typing import Dict, List

from example.bench.report import pick_unit
from example.bench.runner import NO_COMM

STATE_PARTS = ["params", "grads", "optimizer", "buffers"]


def plot(rows: Dict[str, dict], out: str) -> List[str]:
    """memory.png, step_time.png, loss.png of ``summarize``'s rows in ``out``; their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = [os.path.join(out, f) for f in ("memory.png", "step_time.png", "loss.png")]
    for path, draw in zip(paths, (_memory, _step_time, _loss)):
        fig = draw(plt, rows)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    plt.close("all")
    return paths


def _memory(plt, rows: Dict[str, dict]):
    names = list(rows)
    unit_name, unit = pick_unit(rows)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    bottom = [0.0] * len(names)
    for part in STATE_PARTS + ["activations + other"]:
        if part in STATE_PARTS:
            values = [(rows[n]["memory"].get(part) or 0) / unit for n in names]
        else:
            states = [sum((rows[n]["memory"].get(k) or 0) for k in STATE_PARTS) for n in names]
            values = [max((rows[n]["peak"] or 0) - s, 0) / unit for n, s in zip(names, states)]
        ax.bar(names, values, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set(ylabel=f"{unit_name} (rank with the highest peak)", title="Peak memory per rank")
    ax.legend()
    fig.autofmt_xdate(rotation=30)
    return fig


def _step_time(plt, rows: Dict[str, dict]):
    names = list(rows)
    colors = ["tab:blue" if n.startswith("torch") else "tab:orange" for n in names]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    med = [rows[n]["median"] * 1e3 for n in names]
    err = [[m - rows[n]["min"] * 1e3 for n, m in zip(names, med)],
           [rows[n]["max"] * 1e3 - m for n, m in zip(names, med)]]  # fmt: skip
    ax.bar(names, med, yerr=err, color=colors, capsize=4)
    ax.set(ylabel="ms per step (median, min-max)", title="Step time (orange: tiny_fsdp)")
    fig.autofmt_xdate(rotation=30)
    return fig


def _loss(plt, rows: Dict[str, dict]):
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    single = rows.get("single_device", {}).get("losses")
    for name in (n for n in rows if n != NO_COMM):  # no_comm: no global batch, no loss to show
        style = "--" if name.startswith("torch") else "-"
        top.plot(rows[name]["losses"], style, label=name)
        if single is not None and name != "single_device":
            gaps = [max(abs(a - b), 1e-9) for a, b in zip(rows[name]["losses"], single)]
            bottom.semilogy(gaps, style, label=name)
    top.set(ylabel="training loss (global batch)", title="Loss")
    top.legend(fontsize=8)
    bottom.set(xlabel="step", ylabel="|loss - single device| (floor 1e-9)")
    return fig
