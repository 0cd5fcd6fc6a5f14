"""Specification of the ledgers: what each strategy sends and holds, pinned against theory.

Communication: per training step (forward, backward, optimizer step) and rank, the calls and
payload bytes of each collective kind ([Note: communication ledger]) equal, EXACTLY, what the
strategy's design implies for the model's parameter sizes (padding included). In volume
(all-reduce counted twice: a reduce-scatter plus an all-gather) that is about 2 x the parameter
bytes for DDP and ZeRO-1/2, and about 3 x for ZeRO-3 / FSDP with reshard-after-forward.

Memory: the ledger's parameters / gradients / optimizer bytes ([Note: memory ledger]) equal the
strategy's formula exactly, and the estimator ([Note: ZeRO memory formulas]) is within 5%.

All distributed measurements of one world size come from one ``run_distributed`` call
(``_measure``), cached for the module; the tests only compare.
"""

import contextlib
import functools
import io
import json
import math
import os
import time
from collections import OrderedDict
from typing import Any, Dict, List, Sequence, Tuple, Union

import pytest
import torch
from torch import nn

from example.bench.runner import OPT_IN, PHASES
from tests.build import adamw, build
from tests.harness import run_distributed
from tests.parity import global_batch, lm_loss, local_slice, make_model
from tiny_fsdp.core.comm import LEDGER
from tiny_fsdp.core.memory import MemoryReport, allocated_bytes, memory_ledger, peak_growth
from tiny_fsdp.core.module import CallbackModule, convert_module
from tiny_fsdp.core.zero.grad_stores import FLAG_DTYPE
from tiny_fsdp.core.optim import AdamW
from tiny_fsdp.core.overflow import AGREEMENT_BYTES
from tiny_fsdp.core.zero3 import zero3_partition_tensors
from tiny_fsdp.estimate import estimate_memory, estimate_model

WORLD_SIZES = [2, 3]
FP32 = 4
# Smaller than any gpt2_tiny parameter: every parameter gets a bucket of its own.
ONE_PARAM_BUCKET_MB = 1e-7
# The estimator ignores padding and the 4-byte step counter of each optimizer tensor: on
# gpt2_tiny (10k parameters) these are < 2% of the model states; 5% is the bound.
ESTIMATE_RTOL = 0.05
VARIANTS = [
    "ddp",
    "ddp_buckets",
    "zero1",
    "zero1_buckets",
    "zero2",
    "zero2_buckets",
    "zero3",
    "zero3_async",
    "fsdp",
    "fsdp_async",
    "fsdp_keep",
]
BF16_VARIANTS = ["zero1_bf16", "zero2_bf16"]  # fp32 master + fp32 moments: the mixed formula


# ------------------------------------------------------------------ rank side


@functools.lru_cache(maxsize=None)
def _parts(world_size: int) -> Dict[str, int]:
    with torch.device("meta"):
        meta = make_model()
    return zero3_partition_tensors(OrderedDict(meta.named_parameters()), ["cpu"] * world_size)[0]


def _build(variant: str, world_size: int) -> Tuple[nn.Module, torch.optim.Optimizer]:
    """``<strategy>[_<option>]``: buckets (one per parameter), async, keep (no reshard), bf16."""
    name, _, option = variant.partition("_")
    model = make_model()
    if option == "bf16":
        model = model.to(torch.bfloat16)
    if name in ("ddp", "zero1", "zero2"):
        kw = dict(bucket_cap_mb=ONE_PARAM_BUCKET_MB if option == "buckets" else 25.0)
    elif name == "zero3":
        kw = dict(
            parts=_parts(world_size),
            enable_async_communication=option == "async",
            unit="tensor",  # the figures below are per tensor (the default unit is per block)
        )
    elif name == "fsdp":
        kw = dict(
            enable_async_communication=option == "async",
            reshard_after_forward=option != "keep",
            unit="layer",  # the figures below are per layer (the default unit is per block)
        )
    else:
        raise ValueError(variant)
    return build(name, model, adamw(lr=1e-3), **kw)


def _measure(rank: int, world_size: int, variants: List[str]) -> Dict[str, Dict[str, Any]]:
    """Per variant: the ledger of step 2 (step 1 warms up: FSDP and ZeRO-3 record their
    layer order in it) and the memory ledger after its optimizer step."""
    out = {}
    for variant in variants:
        model, optimizer = _build(variant, world_size)
        for step in range(2):
            x, y = global_batch(step, 2 * world_size, 8, model.module.config.vocab_size)
            LEDGER.reset()
            lm_loss(
                model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)
            ).backward()
            optimizer.step()
            traffic = {k: (LEDGER.calls[k], LEDGER.payload_bytes[k]) for k in LEDGER.calls}
            memory = memory_ledger(model, optimizer)
            optimizer.zero_grad(set_to_none=True)
        out[variant] = dict(traffic=traffic, memory=memory, n_state=len(optimizer.state))
    return out


_CACHE: Dict[Tuple[int, bool], List[Dict[str, Dict[str, Any]]]] = {}


def measured(world_size: int, bf16: bool = False) -> List[Dict[str, Dict[str, Any]]]:
    """``_measure`` of every rank (one ``run_distributed`` call per world size and dtype)."""
    key = (world_size, bf16)
    if key not in _CACHE:
        variants = BF16_VARIANTS if bf16 else VARIANTS
        _CACHE[key] = run_distributed(_measure, world_size, variants)
    return _CACHE[key]


# ------------------------------------------------------------------ theory, from the plain model


@functools.lru_cache(maxsize=None)
def _layers() -> List[List[torch.Size]]:
    """Full shapes of each layer's parameters, layers in module order (= forward order)."""
    model = convert_module(make_model())
    return [
        [p.shape for p in (getattr(m, n) for n in m.param_names) if p is not None]
        for m in model.modules()
        if isinstance(m, CallbackModule)
    ]


@functools.lru_cache(maxsize=None)
def _read_in_backward() -> List[bool]:
    """Per layer of ``_layers``: whether its backward reads its parameters' values, so fetches
    them again (an embedding's reads only their shape: [Note: full units])."""
    model = convert_module(make_model())
    return [m.backward_reads_params for m in model.modules() if isinstance(m, CallbackModule)]


@functools.lru_cache(maxsize=None)
def _unique_shapes() -> List[torch.Size]:
    return [p.shape for p in make_model().parameters()]  # the tied weight once


def _rows(shape: torch.Size) -> Tuple[int, int]:
    """(rows, elements per row) of a dim-0 shard's geometry."""
    return (shape[0], math.prod(shape[1:])) if len(shape) else (1, 1)


# FSDP and ZeRO-3 end each synchronised backward with one small all-reduce ([Note: agreeing on
# overflow]).
AGREEMENT = (1, AGREEMENT_BYTES)


def _padded(numel: int, n: int) -> int:
    return -(-numel // n) * n


def _fsdp_gather(shapes: List[torch.Size], n: int) -> int:
    """Elements all-gathered for these tensors: N shards of ceil(rows / N) rows each."""
    return sum(n * -(-_rows(s)[0] // n) * _rows(s)[1] for s in shapes)


def _zero_buckets(per_param: bool) -> List[int]:
    sizes = [s.numel() for s in _unique_shapes()]
    return sizes if per_param else [sum(sizes)]


def expected_traffic(variant: str, n: int, backend: str = "gloo") -> Dict[str, Tuple[int, int]]:
    """{kind: (calls, payload bytes)} of one fp32 step, from the strategy's design."""
    name, _, option = variant.partition("_")
    layers = _layers()
    shapes = _unique_shapes()
    psi, tensors = sum(s.numel() for s in shapes), len(shapes)
    if name == "ddp":
        # Every gradient plus one flag element per parameter, in 1 bucket or 1 per parameter.
        return {"all_reduce": (tensors if option == "buckets" else 1, FP32 * (psi + tensors))}
    if name in ("zero1", "zero2"):
        buckets = _zero_buckets(option == "buckets")
        padded = FP32 * sum(_padded(b, n) for b in buckets)
        flags = (1, FLAG_DTYPE.itemsize * tensors)  # ([Note: ZeRO gradient stores])
        if backend == "gloo" and n != 2:
            # [Note: ZeRO collectives on gloo]: all-reduce each bucket (keep the own chunk),
            # broadcast each rank's chunk from its owner (same payload as the all-gather).
            reduce = (len(buckets) + flags[0], padded + flags[1])
            return {"all_reduce": reduce, "broadcast": (n * len(buckets), padded)}
        # Reduce-scatter each bucket (on 2 gloo ranks a send and a receive), all-gather it
        # (gloo: broadcast each rank's chunk from its owner, the same payload).
        if backend == "gloo":
            gather = {"broadcast": (n * len(buckets), padded)}
        else:
            gather = {"all_gather": (len(buckets), padded)}
        return {"reduce_scatter": (len(buckets), padded), **gather, "all_reduce": flags}
    if name == "zero3":
        # Per use of a layer: broadcast each tensor in forward and (where the backward reads
        # it) in backward, reduce its grad; the last layer of forward stays full for its
        # backward, which comes next.
        uses = sum(len(layer) for layer in layers)
        used_bytes = FP32 * sum(s.numel() for layer in layers for s in layer)
        read = [layer for layer, reads in zip(layers, _read_in_backward()) if reads]
        read_uses = sum(map(len, read))
        read_bytes = FP32 * sum(s.numel() for layer in read for s in layer)
        kept, kept_bytes = len(layers[-1]), FP32 * sum(s.numel() for s in layers[-1])
        return {
            "broadcast": (uses + read_uses - kept, used_bytes + read_bytes - kept_bytes),
            "reduce": (uses, used_bytes),
            "all_reduce": AGREEMENT,
        }
    if name == "fsdp":
        gathers = [FP32 * _fsdp_gather(layer, n) for layer in layers]
        # Gathered in forward, and again in backward unless kept (reshard_after_forward=False)
        # or not read there; the last layer of forward stays gathered for its backward, which
        # comes next.
        read = [g for g, reads in zip(gathers[:-1], _read_in_backward()) if reads]
        backward = [] if option == "keep" else read
        return {
            "all_gather": (len(gathers) + len(backward), sum(gathers) + sum(backward)),
            "reduce_scatter": (len(gathers), sum(gathers)),
            "all_reduce": AGREEMENT,
        }
    raise ValueError(variant)


def _zero_owned(rank: int, n: int, per_param: bool) -> int:
    """Real (non-padding) elements in ``rank``'s chunk of every bucket."""
    return sum(min(max(b - rank * -(-b // n), 0), -(-b // n)) for b in _zero_buckets(per_param))


def expected_memory(variant: str, n: int, rank: int, n_state: int) -> MemoryReport:
    """Bytes the strategy holds on ``rank`` after a step; ``n_state``: tensors with optimizer
    state on that rank (each has a 4-byte step counter besides its moments)."""
    name, _, option = variant.partition("_")
    shapes = _unique_shapes()
    psi, tensors = sum(s.numel() for s in shapes), len(shapes)
    counters = FP32 * n_state
    if name == "ddp":  # replicated; the gradients are views of the all-reduce buckets
        # ([Note: gradient bucket layout]), so the buckets (gradients + one flag per tensor)
        # count as gradients and no separate buffer remains.
        full = FP32 * psi
        return MemoryReport(full, FP32 * (psi + tensors), 2 * full + counters, 0)
    if name in ("zero1", "zero2"):
        buckets = _zero_buckets(option == "buckets")
        flat = FP32 * sum(_padded(b, n) for b in buckets)  # whole flat buffer, padding included
        grads = flat if name == "zero1" else flat // n
        owned = _zero_owned(rank, n, option == "buckets")
        return MemoryReport(flat, grads, 2 * FP32 * owned + counters)
    if name == "zero3":  # whole tensors, on their owner only
        sizes = {name: p.numel() for name, p in make_model().named_parameters()}
        owned = FP32 * sum(sizes[k] for k, owner in _parts(n).items() if owner == rank)
        return MemoryReport(owned, owned, 2 * owned + counters)
    if name == "fsdp":  # padded dim-0 shards; optimizer state for the real rows only
        shard = FP32 * _fsdp_gather(shapes, n) // n
        real = 0
        for s in shapes:
            rows, per_row = _rows(s)
            shard_rows = -(-rows // n)
            real += min(max(rows - rank * shard_rows, 0), shard_rows) * per_row
        return MemoryReport(shard, shard, 2 * FP32 * real + counters)
    raise ValueError(variant)


# ------------------------------------------------------------------ communication ledger


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_traffic_per_step_is_exactly_the_theory(variant: str, world_size: int) -> None:
    expected = expected_traffic(variant, world_size)
    for rank, result in enumerate(measured(world_size)):
        assert result[variant]["traffic"] == expected, f"rank {rank}"


# ZeRO-1/2's volume on gloo by world size ([Note: ZeRO collectives on gloo]).
ZERO_ON_GLOO = {2: 2.0, 3: 3.0}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize(
    "variant, volume, tolerance",
    [
        # Padding and DDP's flags: < 1% of gpt2_tiny's parameter bytes.
        ("ddp", 2.0, 0.01),
        # ZeRO-1/2 reduce-scatter the gradients and all-gather the parameters: 2 x, as DDP;
        # on gloo beyond 2 ranks they all-reduce the gradients ([Note: ZeRO collectives on
        # gloo]): 3 x (ZERO_ON_GLOO).
        ("zero1", ZERO_ON_GLOO, 0.01),
        ("zero2_buckets", ZERO_ON_GLOO, 0.01),
        # The tied wte / lm_head weight (f = 12% of gpt2_tiny's bytes) travels for each of its
        # two layers, except for lm_head's backward (the last layer of forward stays full for
        # it) and the embeddings' (wte, wpe: e = 6%; their backward reads no value, [Note:
        # full units]): both send 3 + f - e = 3.06 x. "About 3 x": within 0.4.
        ("zero3", 3.0, 0.4),
        ("fsdp", 3.0, 0.4),
        ("fsdp_keep", 2.0, 0.3),  # no re-gather in backward
    ],
)
def test_volume_is_about_the_zero_paper(
    variant: str, volume: Union[float, Dict[int, float]], tolerance: float, world_size: int
) -> None:
    """All-reduce counts twice (reduce-scatter + all-gather), as in the ZeRO paper."""
    if isinstance(volume, dict):
        volume = volume[world_size]
    traffic = measured(world_size)[0][variant]["traffic"]
    sent = sum(b * (2 if kind == "all_reduce" else 1) for kind, (_, b) in traffic.items())
    param_bytes = FP32 * sum(s.numel() for s in _unique_shapes())
    assert abs(sent / param_bytes - volume) <= tolerance, sent / param_bytes


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ring_traffic_is_volume_times_n_minus_1_over_n(world_size: int) -> None:
    LEDGER.reset()
    LEDGER.record("all_reduce", torch.empty(10))
    LEDGER.record("all_gather", torch.empty(6))
    try:
        scale = (world_size - 1) / world_size
        assert LEDGER.traffic_bytes(world_size) == {
            "all_reduce": 2 * 40 * scale,
            "all_gather": 24 * scale,
        }
    finally:
        LEDGER.reset()


# ------------------------------------------------------------------ memory ledger


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_memory_ledger_is_exactly_the_formula(variant: str, world_size: int) -> None:
    for rank, result in enumerate(measured(world_size)):
        got = result[variant]
        assert got["memory"] == expected_memory(variant, world_size, rank, got["n_state"]), rank


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("variant", ["ddp", "zero1", "zero2", "fsdp"])
def test_every_trainable_tensor_has_optimizer_state_where_expected(
    variant: str, world_size: int
) -> None:
    """Replicated and FSDP: every tensor on every rank; ZeRO-1/2: only pieces this rank owns."""
    tensors = len(_unique_shapes())
    counts = [r[variant]["n_state"] for r in measured(world_size)]
    if variant.startswith("zero"):
        assert all(0 < c < tensors for c in counts) and sum(counts) >= tensors, counts
    else:
        assert counts == [tensors] * world_size


def test_single_device_ledger_and_estimate() -> None:
    model = convert_module(make_model())
    optimizer = AdamW(model.parameters(), lr=1e-3)
    x, y = global_batch(0, 2, 8, model.config.vocab_size)
    lm_loss(model(x), y).backward()
    optimizer.step()
    psi = sum(s.numel() for s in _unique_shapes())
    counters = FP32 * len(_unique_shapes())
    got = memory_ledger(model, optimizer)
    assert got == MemoryReport(FP32 * psi, FP32 * psi, 2 * FP32 * psi + counters)
    predicted = estimate_memory(psi, 1)["single_device"][0]
    assert got.model_states == pytest.approx(predicted.model_states, rel=ESTIMATE_RTOL)


def test_peak_growth_sees_a_transient_allocation() -> None:
    cpu = torch.device("cpu")
    if allocated_bytes(cpu) is None:
        pytest.skip("no glibc mallinfo2 on this platform")

    def transient() -> None:
        t = torch.ones(10_000_000)  # 40 MB, alive for >= 20 ms: 100x the sampling period
        time.sleep(0.02)
        del t

    # Slack: the interpreter and the sampling thread allocate a little too.
    assert 40_000_000 <= peak_growth(cpu, transient) < 40_000_000 + 4 * 2**20


def test_views_of_one_buffer_count_once_and_hooks_add_categories() -> None:
    flat = torch.zeros(10)
    model = nn.Module()
    model.a = nn.Parameter(flat[:4])  # two parameters viewing one storage of 10 floats
    model.b = nn.Parameter(flat[4:])
    model.b.grad = torch.zeros(6)
    model.extra_state_tensors = lambda: {"buffers": [torch.zeros(3), flat], "grads": [None]}
    assert memory_ledger(model) == MemoryReport(params=40, grads=24, buffers=12)
    model.extra_state_tensors = lambda: {"activations": [torch.zeros(1)]}
    with pytest.raises(ValueError, match="activations"):
        memory_ledger(model)


# ------------------------------------------------------------------ estimator vs ledger

FP32_STRATEGIES = ["ddp", "zero1", "zero2", "zero3", "fsdp"]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize(
    "variant, precision",
    [(v, "fp32") for v in FP32_STRATEGIES] + [(v, "bf16") for v in BF16_VARIANTS],
)
def test_estimate_is_within_5_percent_of_the_ledger(
    variant: str, precision: str, world_size: int
) -> None:
    with torch.device("meta"):
        predicted = estimate_model(make_model(), world_size, precision)
    results = measured(world_size, bf16=precision == "bf16")
    strategy = variant.partition("_")[0]
    for rank, result in enumerate(results):
        got = result[variant]["memory"].model_states
        want = predicted[strategy][rank].model_states
        assert got == pytest.approx(want, rel=ESTIMATE_RTOL), f"rank {rank}"


def test_estimator_reproduces_the_zero_paper_figure_1() -> None:
    """7.5 B parameters, 64 ranks, mixed precision Adam (K = 12): 120 / 31.4 / 16.6 / 1.9 GB."""
    got = estimate_memory(7_500_000_000, 64, precision="bf16")
    gb = {name: reports[0].model_states / 1e9 for name, reports in got.items()}
    assert gb["ddp"] == pytest.approx(120.0)
    assert gb["zero1"] == pytest.approx(31.4, abs=0.05)
    assert gb["zero2"] == pytest.approx(16.6, abs=0.05)
    assert gb["fsdp"] == pytest.approx(1.875) and gb["zero3"] == gb["fsdp"]


def test_estimator_cli_prints_every_strategy(capsys: pytest.CaptureFixture) -> None:
    from tiny_fsdp import estimate

    estimate.main(["--model", "gpt2_xl", "--world_size", "8", "--precision", "bf16"])
    out = capsys.readouterr().out
    for name in estimate.STRATEGIES:
        assert f"| {name} |" in out
    assert "1,557.69 M parameters" in out


# ------------------------------------------------------------------ benchmark smoke test


def _benchmark(
    rank: int, world_size: int, out: str, extra: Sequence[str] = (), model: str = "gpt2_tiny"
) -> Any:
    """``example/benchmark.py`` minus torchrun: the build's step (the one warm-up round), 1
    measured round (a settling step, then the timed one) and the probe step."""
    from example import benchmark
    from example.models import model_spec
    from tiny_fsdp.core.utils.dist import DistEnv

    args = benchmark.parse_args(
        ["--model", model, "--steps", "1", "--warmup", "1", "--seq_len", "8"]
        + ["--data", "random", "--out", out, *extra]
    )
    spec = model_spec(model)

    def make() -> torch.nn.Module:
        torch.manual_seed(args.seed)  # as the benchmark's main: the same weights everywhere
        return spec.make()

    env = DistEnv(rank, rank, world_size, torch.device("cpu"))
    batches = benchmark.load_batches(args, spec.vocab_size)
    traces: Dict[str, Any] = {}
    results, _ = benchmark.run_phases(args, env, batches, make, traces)
    if traces:  # --trace: as the benchmark's main, every strategy's step on one time axis
        from tiny_fsdp.trace.plot import plot_strategies

        plot_strategies(traces, os.path.join(args.trace, "strategies.png"))
    if rank != 0:
        return None
    with torch.device("meta"):
        estimates = estimate_model(spec.make(), world_size)
    predicted = {k: max(r.model_states for r in v) for k, v in estimates.items()}
    rows = benchmark.summarize(results, 2 * 8 * world_size, predicted, benchmark.floors(args))
    table = benchmark.markdown_table(rows) + "\n" + benchmark.ratio_lines(rows)
    return rows, table, benchmark.plot(rows, out)


def test_benchmark_runs_every_strategy_and_reports(tmp_path) -> None:
    rows, table, plots = run_distributed(_benchmark, 2, str(tmp_path))[0]
    assert list(rows) == [name for phase in PHASES for name in phase if name not in OPT_IN]
    single = rows["single_device"]["losses"]
    for name, row in rows.items():
        assert f"| {name} |" in table
        # The build's step, the rounds', the probe's step before and the probe ([Note:
        # benchmark method]).
        assert len(row["losses"]) == 5 and row["median"] > 0
        # Same batches and initial weights: every strategy follows one device to float32
        # summation-order noise (see tests/parity.py), 5 steps of Adam at lr 3e-4.
        assert max(abs(a - b) for a, b in zip(row["losses"], single)) < 1e-4, name
        assert row["peak"] is not None and row["peak"] > 0
        if row["predicted"] is not None:  # our strategies: ledger within 5% of the formula
            states = row["model_states"]  # of the rank holding the most, as predicted
            assert states == pytest.approx(row["predicted"], rel=ESTIMATE_RTOL), name
    # Our traffic is the exact ledger; PyTorch's is counted where Python can see it.
    assert rows["ddp"]["comm"]["all_reduce"][0] == 1
    assert set(rows["torch_fsdp2"]["comm"]) == {"all_gather", "reduce_scatter"}
    assert rows["torch_zero"]["comm"]["broadcast"][0] > 0
    for path in plots:
        assert path.endswith(".png") and (tmp_path / path.split("/")[-1]).stat().st_size > 0


def test_benchmark_no_comm_is_the_floor_every_strategy_of_its_phase_is_divided_by(tmp_path):
    """``no_comm``: each rank steps its own model, so it starts no collective at all; with
    ``--one_phase`` every strategy's line gives its step time over no_comm's and over our
    DDP's."""
    extra = ["--strategies", "no_comm,ddp,fsdp", "--one_phase"]
    rows, table, _ = run_distributed(_benchmark, 2, str(tmp_path), extra)[0]
    assert list(rows) == ["ddp", "no_comm", "fsdp"]  # in the order of PHASES
    assert rows["no_comm"]["comm"] == {}
    assert "| no_comm |" in table and "-) |" in table.split("| no_comm |")[1].split("\n")[0]
    for name in ("ddp", "fsdp"):
        assert f"{name} / no_comm: " in table
    assert "no_comm / ddp: " in table and "fsdp / ddp: " in table
    # Step 0: the same initial weights on every rank, so the mean of the ranks' own losses
    # is the global batch's loss. After one step each rank's model has seen only its batch.
    assert rows["no_comm"]["losses"][0] == pytest.approx(rows["ddp"]["losses"][0], abs=1e-6)
    assert abs(rows["no_comm"]["losses"][-1] - rows["ddp"]["losses"][-1]) > 1e-5


def test_benchmark_compare_adds_each_counterpart_and_trace_writes_timelines(tmp_path):
    """``--strategies zero3,fsdp --compare``: FSDP2 joins as their PyTorch counterpart, each
    line gets its ratio to it; ``--trace DIR``: our strategies' timelines (Chrome trace and
    PNG) and all of them on one axis."""
    trace = tmp_path / "trace"
    extra = ["--strategies", "zero3,fsdp", "--compare", "--trace", str(trace)]
    rows, table, _ = run_distributed(_benchmark, 2, str(tmp_path), extra)[0]
    assert list(rows) == ["zero3", "fsdp", "torch_fsdp2"]
    for name in ("zero3", "fsdp"):
        ratio = table.split(f"| {name} |")[1].split("|")[2].strip()  # the "x PyTorch" column
        assert float(ratio) > 0, table
        events = json.loads((trace / f"{name}.trace.json").read_text())["traceEvents"]
        kinds = {e["args"]["kind"] for e in events if e.get("cat") == "comm"}
        assert {"all_gather" if name == "fsdp" else "broadcast"} <= kinds, kinds
        assert (trace / f"{name}.png").stat().st_size > 0
    assert not (trace / "torch_fsdp2.trace.json").exists()  # PyTorch's are not recorded
    assert (trace / "strategies.png").stat().st_size > 0


def _hf_wrapped_benchmark(rank: int, world_size: int, out: str) -> Any:
    """The benchmark's ``fsdp`` and ``fsdp_wrapped`` on ``hf:gpt2``; the rows and how often the
    registered ``Conv1D`` wrapper computed."""
    from example.bench.hf_wrappers import HFConv1D

    calls, callback = [], HFConv1D.forward_callback
    HFConv1D.forward_callback = lambda self, *a: calls.append(1) or callback(self, *a)
    try:
        extra = ["--strategies", "fsdp,fsdp_wrapped", "--one_phase"]
        report = _benchmark(rank, world_size, out, extra, model="hf:gpt2")
    finally:
        HFConv1D.forward_callback = callback
    return report and (report[0], len(calls))


def test_benchmark_fsdp_wrapped_runs_transformers_conv1d_through_a_registered_wrapper(tmp_path):
    """``fsdp_wrapped``: HF GPT-2's ``Conv1D`` through a registered wrapper (the explicit path)
    instead of the generic one; the same model, data and collectives, the same losses."""
    pytest.importorskip("transformers")
    rows, wrapper_calls = run_distributed(_hf_wrapped_benchmark, 2, str(tmp_path))[0]
    assert list(rows) == ["fsdp", "fsdp_wrapped"] and wrapper_calls > 0
    generic, wrapped = rows["fsdp"], rows["fsdp_wrapped"]
    assert wrapped["comm"] == generic["comm"]
    assert wrapped["losses"] == pytest.approx(generic["losses"], abs=1e-5)  # float32 order


def test_benchmark_reads_the_default_text_with_ids_its_model_embeds(monkeypatch) -> None:
    """As the trainer: where GPT-2's BPE is cached, a model of byte vocabulary still reads
    bytes; a preset too small for text (gpt2_tiny, the smoke test's) is refused at parse time
    with the fix."""
    from example import benchmark
    from example import tokenizer as tokenizers

    class CachedBPE:  # what "auto" would find on a machine with tiktoken's GPT-2 files
        name, vocab_size = "gpt2", tokenizers.GPT2_VOCAB_SIZE

        def encode(self, text: str) -> List[int]:
            return [1000 + b for b in text.encode()]

    monkeypatch.setattr(tokenizers, "_load_gpt2", CachedBPE)
    args = benchmark.parse_args(["--model", "gpt2_bytes", "--seq_len", "16"])
    assert all(int(t.max()) < 256 for t in benchmark.load_batches(args, 256).splits.values())
    with pytest.raises(SystemExit):
        benchmark.parse_args(["--model", "gpt2_tiny"])
    assert benchmark.parse_args(["--model", "gpt2_tiny", "--data", "random"]).data == "random"


def _benchmark_log(rank: int, world_size: int, out: str) -> str:
    """What the benchmark writes to stderr when it goes to a log file (not a terminal)."""
    log = io.StringIO()
    with contextlib.redirect_stderr(log):
        _benchmark(rank, world_size, out, ["--strategies", "ddp"])
    return log.getvalue()


def test_benchmark_draws_no_progress_frames_into_a_log(tmp_path) -> None:
    for log in run_distributed(_benchmark_log, 2, str(tmp_path)):
        assert "\r" not in log and "it/s" not in log, log[-500:]


def _torch_fused(rank: int, world_size: int) -> Dict[str, Any]:
    """PyTorch's three optimizers built by the benchmark with ``--torch_fused``, after a step."""
    from example import benchmark
    from example.bench.pytorch import build_torch
    from tiny_fsdp.core.utils.dist import DistEnv

    args = benchmark.parse_args(["--model", "gpt2_tiny", "--data", "random", "--torch_fused"])
    env = DistEnv(rank, rank, world_size, torch.device("cpu"))
    fused = {}
    for name in ("torch_ddp", "torch_zero", "torch_fsdp2"):
        model, optimizer, local = build_torch(name, make_model, args, env)
        x, y = global_batch(0, 2 * world_size, 8, make_model().config.vocab_size)
        lm_loss(
            model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)
        ).backward()
        optimizer.step()
        fused[name] = [group["fused"] for group in local.param_groups]
    return fused


def test_benchmark_can_give_pytorch_the_fused_adamw_kernel() -> None:
    """``--torch_fused``: PyTorch's side steps with ``AdamW(fused=True)``, the kernel our AdamW
    runs on the CPU ([Note: fused AdamW on the CPU]), so strategies compare without it."""
    fused = run_distributed(_torch_fused, 2)[0]
    assert fused == {name: [True, True] for name in ("torch_ddp", "torch_zero", "torch_fsdp2")}
