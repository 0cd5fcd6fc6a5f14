"""Every rank's records as one Chrome trace (``chrome://tracing``, https://ui.perfetto.dev).

[Note: chrome trace layout]
One process per rank (``pid`` = rank, named "rank r"). Threads (``tid``) are lanes: 0 is
"compute" (``cat`` "compute": a layer's forward / backward, ``optimizer.step``); then the
communication lanes (``cat`` "comm"), one per process group (and CUDA stream), split into
sub-lanes "#0", "#1", ... where collectives of one group are in flight at once, because a lane's
"X" events must not overlap. ``ts`` / ``dur`` are microseconds from the earliest event of any
rank. Memory is one "C" (counter) series per rank, "memory", whose fields stack: ``params``,
``grads``, ``optimizer``, ``buffers`` (the memory ledger, carried between its samples),
``gathered`` and ``reductions`` (the strategy's transient buffers) and ``activations``; the
allocator's count is a separate counter, "allocated". Every "X" event's ``args`` say what it
is: compute ``layer`` / ``phase`` / ``step``; comm ``kind`` / ``bytes`` (the ledger's payload
bytes, [Note: communication ledger]) / ``group`` / ``sync`` / ``step`` / ``completed`` (False:
still travelling when the traced step ended; drawn up to the trace's end).
"""

import json
from typing import Any, Dict, List

STACK = ("params", "grads", "optimizer", "buffers", "gathered", "reductions", "activations")
LEDGER_FIELDS = ("params", "grads", "optimizer", "buffers")


def _lanes(comms: List[Dict[str, Any]]) -> List[str]:
    """The lane name of every collective, sub-lanes so that none overlaps another (greedy)."""
    busy: Dict[str, List[int]] = {}  # group -> end of the last event of each sub-lane
    names = [""] * len(comms)
    for i in sorted(range(len(comms)), key=lambda i: comms[i]["begin"]):
        c = comms[i]
        ends = busy.setdefault(c["lane"], [])
        slot = next((k for k, end in enumerate(ends) if end <= c["begin"]), len(ends))
        if slot == len(ends):
            ends.append(0)
        ends[slot] = c["end"]
        names[i] = f"comm {c['lane']} #{slot}"
    return names


def chrome_trace(ranks: List[Dict[str, Any]], name: str) -> Dict[str, Any]:
    """The Chrome trace of ``ranks`` (``Recorder.records`` of each rank, in rank order)."""
    times = [e["begin"] for r in ranks for e in r["spans"] + r["comms"]]
    times += [s["t"] for r in ranks for s in r["samples"]]
    t0 = min(times, default=0)

    def us(ns: int) -> float:
        return (ns - t0) / 1e3

    events: List[Dict[str, Any]] = []
    for r in ranks:
        pid = r["rank"]
        events.append(dict(ph="M", name="process_name", pid=pid, args=dict(name=f"rank {pid}")))
        events.append(dict(ph="M", name="process_sort_index", pid=pid, args=dict(sort_index=pid)))
        tids = {"compute": 0}
        for s in r["spans"]:
            args = dict(layer=s["name"], phase=s["phase"], step=s["step"])
            events.append(dict(ph="X", cat="compute", name=f"{s['name']} {s['phase']}", pid=pid,
                               tid=0, ts=us(s["begin"]), dur=(s["end"] - s["begin"]) / 1e3,
                               args=args))  # fmt: skip
        for c, lane in zip(r["comms"], _lanes(r["comms"])):
            tid = tids.setdefault(lane, len(tids))
            events.append(dict(ph="X", cat="comm", name=c["kind"], pid=pid, tid=tid,
                               ts=us(c["begin"]), dur=(c["end"] - c["begin"]) / 1e3,
                               args=dict(kind=c["kind"], bytes=c["bytes"], group=c["lane"],
                                         sync=c["sync"], step=c["step"],
                                         completed=c["completed"])))  # fmt: skip
        for lane, tid in tids.items():
            events.append(dict(ph="M", name="thread_name", pid=pid, tid=tid, args=dict(name=lane)))
            events.append(dict(ph="M", name="thread_sort_index", pid=pid, tid=tid,
                               args=dict(sort_index=tid)))  # fmt: skip
        held = dict.fromkeys(LEDGER_FIELDS, 0)
        for s in sorted(r["samples"], key=lambda s: s["t"]):
            values = s["values"]
            held.update({k: values[k] for k in LEDGER_FIELDS if k in values})
            stack = {k: values.get(k, held.get(k, 0)) for k in STACK}
            events.append(dict(ph="C", name="memory", pid=pid, ts=us(s["t"]), args=stack))
            if values.get("allocated") is not None:
                events.append(dict(ph="C", name="allocated", pid=pid, ts=us(s["t"]),
                                   args=dict(allocated=values["allocated"])))  # fmt: skip
    return dict(traceEvents=events, displayTimeUnit="ms", otherData=dict(strategy=name))


def write_json(trace: Dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        json.dump(trace, f, separators=(",", ":"))
