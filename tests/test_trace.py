"""Per-rank timelines (``tiny_fsdp/trace``, ``--trace DIR``): what the Chrome trace holds.

Every ``_underscored`` function runs on every rank (``run_distributed``). The trace's facts are
checked against independent sources: collectives against the communication ledger (``LEDGER``,
[Note: communication ledger]), compute events against the model's layers, memory against the
memory ledger. Nothing here times anything: overlap is a fact of the event order (a collective
that completes while the rank computes), not a duration.
"""

import importlib.util
import json
import sys
from collections import Counter
from typing import Any, Dict, List

import pytest

from example.trainer import main as trainer_main
from tests.harness import run_distributed
from tests.parity import global_batch, lm_loss, local_slice, make_model
from tiny_fsdp.core.comm import LEDGER
from tiny_fsdp.core.ddp import DDP, DDPAdamW
from tiny_fsdp.core.fsdp import FSDP, FSDPAdamW
from tiny_fsdp.core.memory import memory_ledger
from tiny_fsdp.trace import recorder
from tiny_fsdp.trace.chrome import chrome_trace
from tiny_fsdp.trace.session import gather_records, trace_step, write_trace

BATCH, SEQ = 4, 32


def _build(strategy: str, async_comm: bool):
    model = make_model(0)
    if strategy == "fsdp":
        wrapped = FSDP(model, enable_async_communication=async_comm)
        return wrapped, FSDPAdamW(wrapped.named_parameters(), lr=1e-3)
    wrapped = DDP(model, enable_async_communication=async_comm)
    return wrapped, DDPAdamW(wrapped.named_parameters(), lr=1e-3)


def _traced_run(rank: int, world_size: int, strategy: str, async_comm: bool) -> Dict[str, Any]:
    """One untraced step (optimizer state exists), then one traced step; rank 0 returns the
    Chrome trace, every rank its ledgers of the traced step."""
    model, optimizer = _build(strategy, async_comm)
    vocab = model.module.config.vocab_size
    for step in range(2):
        x, y = global_batch(step, BATCH * world_size, SEQ, vocab)
        x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
        LEDGER.reset()
        context = trace_step(model, optimizer, step=step) if step == 1 else None
        rec = context.__enter__() if context is not None else None
        lm_loss(model(x), y).backward()
        optimizer.step()
        states = memory_ledger(model, optimizer).as_dict()  # before zero_grad: grads exist
        optimizer.zero_grad(set_to_none=True)
        if context is not None:
            context.__exit__(None, None, None)
    assert recorder.ACTIVE is None  # off again after the step
    ranks = gather_records(rec.records(rank))
    return dict(
        trace=None if ranks is None else chrome_trace(ranks, strategy),
        ledger={k: [LEDGER.calls[k], LEDGER.payload_bytes[k]] for k in LEDGER.calls},
        states=states,
        # The layers: modules that hold parameters of their own.
        layers=sorted(
            n
            for n, m in model.module.named_modules()
            if next(m.parameters(recurse=False), None) is not None
        ),
    )


def _overlaps(events: List[dict], pid: int) -> int:
    """Pairs (comm, compute) of rank ``pid`` whose [ts, ts + dur) intervals intersect."""
    compute = [e for e in events if e.get("cat") == "compute" and e["pid"] == pid]
    comm = [e for e in events if e.get("cat") == "comm" and e["pid"] == pid]
    return sum(
        c["ts"] < k["ts"] + k["dur"] and k["ts"] < c["ts"] + c["dur"] for c in comm for k in compute
    )


@pytest.fixture(scope="module")
def fsdp_runs() -> Dict[bool, List[Dict[str, Any]]]:
    """2-rank FSDP, gpt2_tiny: async communication on (the default) and off."""
    return {a: run_distributed(_traced_run, 2, "fsdp", a) for a in (True, False)}


@pytest.fixture(scope="module")
def ddp_run() -> List[Dict[str, Any]]:
    """2-rank DDP: its modules are not converted, so spans come from module hooks."""
    return run_distributed(_traced_run, 2, "ddp", True)


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_chrome_trace_has_ranks_compute_comm_and_counters(strategy, fsdp_runs, ddp_run):
    results = fsdp_runs[True] if strategy == "fsdp" else ddp_run
    trace = json.loads(json.dumps(results[0]["trace"]))  # valid JSON, as written to disk
    events = trace["traceEvents"]
    assert results[1]["trace"] is None  # only rank 0 assembles the file
    for e in events:
        assert e["ph"] in ("X", "C", "M"), e
        if e["ph"] == "X":
            assert e["cat"] in ("compute", "comm") and e["dur"] >= 0 and e["ts"] >= 0, e
    for pid in (0, 1):
        mine = [e for e in events if e["pid"] == pid]
        names = {e["args"]["name"] for e in mine if e["name"] == "process_name"}
        assert names == {f"rank {pid}"}
        # Every layer of the model computed forward and backward on every rank.
        layers = results[pid]["layers"]
        for phase in ("forward", "backward"):
            seen = {e["args"]["layer"] for e in mine if e.get("args", {}).get("phase") == phase}
            assert seen == set(layers), (phase, seen ^ set(layers))
        assert any(e.get("cat") == "comm" for e in mine)
        counters = [e for e in mine if e["ph"] == "C" and e["name"] == "memory"]
        assert len(counters) >= 4 * len(layers)  # a sample at every compute boundary
        # After optimizer.step (before zero_grad) the memory curve holds what the memory
        # ledger, taken separately at that point, counts.
        states = {k: results[pid]["states"][k] for k in ("params", "grads", "optimizer")}
        assert states["grads"] > 0 and states["optimizer"] > 0
        assert any(all(c["args"][k] == v for k, v in states.items()) for c in counters)
        peak_activations = max(c["args"]["activations"] for c in counters)
        assert peak_activations > 0 and counters[-1]["args"]["activations"] == 0


def test_every_counted_collective_is_a_comm_event_with_its_bytes(fsdp_runs, ddp_run):
    for results in [*fsdp_runs.values(), ddp_run]:
        events = results[0]["trace"]["traceEvents"]
        for pid, result in enumerate(results):
            comm = [e["args"] for e in events if e.get("cat") == "comm" and e["pid"] == pid]
            calls, nbytes = Counter(a["kind"] for a in comm), Counter()
            for a in comm:
                nbytes[a["kind"]] += a["bytes"]
            ledger = result["ledger"]
            assert dict(calls) == {k: v[0] for k, v in ledger.items()}
            assert dict(nbytes) == {k: v[1] for k, v in ledger.items()}
            assert {"all_gather", "reduce_scatter"} <= set(calls) or "all_reduce" in calls


def test_async_run_overlaps_comm_with_compute_and_sync_run_does_not(fsdp_runs):
    async_events = fsdp_runs[True][0]["trace"]["traceEvents"]
    sync_events = fsdp_runs[False][0]["trace"]["traceEvents"]
    for pid in (0, 1):
        assert _overlaps(async_events, pid) > 0
        assert _overlaps(sync_events, pid) == 0


def test_example_trace_writes_the_chrome_trace_and_the_png(tmp_path):
    """``--trace DIR`` of the examples: the one loop of ``example/trainer.py``, here in this
    process with the single-device strategy (the 2-rank gathering is the tests above')."""
    text = tmp_path / "text.txt"
    text.write_text("Timelines show where the time of a training step goes.\n" * 40)
    out = tmp_path / "trace"
    argv = f"--model gpt2_bytes --steps 2 --seq_len 16 --batch_size 1 --device cpu --data {text}"
    trainer_main("single_device", argv.split() + ["--trace", str(out)])
    assert recorder.ACTIVE is None
    with open(out / "single_device.trace.json") as f:
        events = json.load(f)["traceEvents"]
    steps = {e["args"]["step"] for e in events if e.get("cat") == "compute"}
    assert steps == {1}  # the last step only (--trace_steps last)
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    assert (out / "single_device.png").exists() == has_matplotlib


def test_write_trace_without_matplotlib_writes_only_the_json(tmp_path, monkeypatch):
    """matplotlib is a dev extra: without it the JSON is still written."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    monkeypatch.delitem(sys.modules, "tiny_fsdp.trace.plot", raising=False)
    ranks = [dict(rank=0, spans=[], comms=[], samples=[])]
    paths = write_trace(ranks, str(tmp_path), "ddp")
    assert paths == [str(tmp_path / "ddp.trace.json")]
    assert json.loads((tmp_path / "ddp.trace.json").read_text())["traceEvents"][0]["pid"] == 0
