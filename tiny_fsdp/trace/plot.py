"""PNG timelines drawn from Chrome traces ([Note: chrome trace layout]); needs matplotlib.

- ``plot_timeline``: one strategy: per rank a compute lane and its communication lanes, and
  under them each rank's memory, stacked by category;
- ``plot_strategies``: every strategy's step on one shared time axis, one panel each (lanes, and
  each rank's total memory).

    python -m tiny_fsdp.trace.plot out/trace/fsdp.trace.json   # -> out/trace/fsdp.png
"""

import sys
from collections import defaultdict
from typing import Any, Dict, List, Tuple

from tiny_fsdp.trace.chrome import STACK

PHASE_COLORS = {"forward": "tab:blue", "forward (recompute)": "lightskyblue",
                "backward": "tab:orange", "optimizer": "tab:green"}  # fmt: skip
COMM_COLORS = {"all_gather": "tab:red", "reduce_scatter": "tab:purple", "all_reduce": "tab:brown",
               "broadcast": "tab:pink", "reduce": "tab:olive"}  # fmt: skip
MEMORY_COLORS = dict(zip(STACK, ["#4c72b0", "#dd8452", "#55a868", "#8c8c8c", "#c44e52",
                                 "#8172b3", "#ccb974"]))  # fmt: skip
MIB = 2**20


def _lanes(events: List[dict]) -> Tuple[List[Tuple[int, int, str]], Dict[Tuple[int, int], int]]:
    """Rows (pid, tid, label) in rank then lane order, and (pid, tid) -> row index."""
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "thread_name"}  # fmt: skip
    rows = [(pid, tid, f"rank {pid} {name}") for (pid, tid), name in sorted(names.items())]
    return rows, {(pid, tid): i for i, (pid, tid, _) in enumerate(rows)}


def _bars(ax: Any, events: List[dict], offset: float = 0.0) -> List[str]:
    """Draw every "X" event on its lane (ms on x); the lane labels, top to bottom."""
    rows, index = _lanes(events)
    spans: Dict[Tuple[int, str], List[Tuple[float, float]]] = defaultdict(list)
    for e in events:
        if e["ph"] != "X":
            continue
        if e["cat"] == "compute":
            color = PHASE_COLORS.get(e["args"]["phase"], "tab:gray")
        else:
            color = COMM_COLORS.get(e["args"]["kind"], "tab:gray")
        row = index[(e["pid"], e["tid"])]
        spans[(row, color)].append(((e["ts"] - offset) / 1e3, max(e["dur"] / 1e3, 1e-3)))
    for (row, color), xs in spans.items():
        ax.broken_barh(xs, (len(rows) - 1 - row - 0.4, 0.8), facecolors=color, linewidth=0)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([label for _, _, label in reversed(rows)], fontsize=7)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    return [label for _, _, label in rows]


def _memory(events: List[dict], offset: float = 0.0) -> Dict[int, Tuple[List[float], dict]]:
    """Per rank: sample times (ms) and the stacked series (MiB) of the "memory" counter."""
    out: Dict[int, Tuple[List[float], dict]] = {}
    for e in events:
        if e["ph"] == "C" and e["name"] == "memory":
            times, series = out.setdefault(e["pid"], ([], {k: [] for k in STACK}))
            times.append((e["ts"] - offset) / 1e3)
            for k in STACK:
                series[k].append(e["args"].get(k, 0) / MIB)
    return out


def _legend(ax: Any, events: List[dict]) -> None:
    phases = {e["args"]["phase"] for e in events if e.get("cat") == "compute"}
    kinds = {e["args"]["kind"] for e in events if e.get("cat") == "comm"}
    from matplotlib.patches import Patch

    handles = [Patch(color=c, label=p) for p, c in PHASE_COLORS.items() if p in phases]
    handles += [Patch(color=c, label=k) for k, c in COMM_COLORS.items() if k in kinds]
    ax.legend(handles=handles, fontsize=7, ncol=len(handles), loc="lower right",
              bbox_to_anchor=(1.0, 1.0), frameon=False)  # fmt: skip


def _pyplot() -> Any:
    """matplotlib's pyplot on the file backend, imported when a figure is drawn: matplotlib is
    optional (a dev extra); without it the traces are written as JSON only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_timeline(trace: Dict[str, Any], path: str, title: str = "") -> str:
    """Lanes of every rank, and each rank's memory stacked under them; returns ``path``."""
    events = trace["traceEvents"]
    memory = _memory(events)
    n_lanes = len(_lanes(events)[0])
    ratios = [max(n_lanes, 2) * 0.35] + [1.6] * len(memory)
    plt = _pyplot()
    fig, axes = plt.subplots(len(ratios), 1, figsize=(12, sum(ratios) + 1.2), sharex=True,
                             gridspec_kw=dict(height_ratios=ratios), squeeze=False)  # fmt: skip
    axes = axes[:, 0]
    _bars(axes[0], events)
    _legend(axes[0], events)
    axes[0].set_title(title, loc="left", fontsize=10)
    for ax, (pid, (times, series)) in zip(axes[1:], sorted(memory.items())):
        ax.stackplot(times, *[series[k] for k in STACK], labels=STACK, step="post",
                     colors=[MEMORY_COLORS[k] for k in STACK])  # fmt: skip
        ax.set_ylabel(f"rank {pid}\nMiB", fontsize=8)
        ax.tick_params(labelsize=7)
    if len(axes) > 1:
        axes[1].legend(fontsize=7, ncol=len(STACK), loc="lower right", bbox_to_anchor=(1.0, 1.0),
                       frameon=False)  # fmt: skip
    axes[-1].set_xlabel("ms")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _start(events: List[dict]) -> float:
    return min((e["ts"] for e in events if e["ph"] in ("X", "C")), default=0.0)


def plot_strategies(traces: Dict[str, Dict[str, Any]], path: str) -> str:
    """Every strategy's traced step from its own start, on one time axis; returns ``path``."""
    names = list(traces)
    heights = [max(len(_lanes(traces[n]["traceEvents"])[0]), 2) * 0.3 for n in names]
    ratios = [h for h in heights for _ in (0, 1)]
    ratios[1::2] = [1.0] * len(names)
    plt = _pyplot()
    fig, axes = plt.subplots(len(ratios), 1, figsize=(12, sum(ratios) + 1.2), sharex=True,
                             gridspec_kw=dict(height_ratios=ratios), squeeze=False)  # fmt: skip
    axes = axes[:, 0]
    for i, name in enumerate(names):
        events = traces[name]["traceEvents"]
        start = _start(events)
        lanes, mem = axes[2 * i], axes[2 * i + 1]
        _bars(lanes, events, offset=start)
        lanes.set_title(name, loc="left", fontsize=9)
        if i == 0:
            _legend(lanes, [e for n in names for e in traces[n]["traceEvents"]])
        for pid, (times, series) in sorted(_memory(events, offset=start).items()):
            total = [sum(v) for v in zip(*series.values())]
            mem.step(times, total, where="post", label=f"rank {pid}", linewidth=1)
        mem.set_ylabel("MiB", fontsize=7)
        mem.tick_params(labelsize=7)
        mem.legend(fontsize=6, loc="upper right", frameon=False)
    axes[-1].set_xlabel("ms from the step's start")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def main(argv: List[str]) -> None:
    import json

    for path in argv:
        with open(path) as f:
            trace = json.load(f)
        out = path[: -len(".trace.json")] if path.endswith(".trace.json") else path
        print(plot_timeline(trace, out + ".png", title=trace.get("otherData", {}).get("strategy")))


if __name__ == "__main__":
    main(sys.argv[1:])
