"""The planner against measurement: every strategy on 1-4 CPU ranks, calibrated in the same run.

[Note: planner validation]
One distributed call per world size calibrates the machine *as used* (every rank computing and
communicating at once: on a 2-core machine 3 and 4 ranks share cores, and the calibration says
so) and then trains every strategy for a few steps, interleaved step by step so that load
changes hit them alike. The planner's prediction from that calibration is compared with:

- peak memory per rank, defined as the planner defines it ([Note: what the planner predicts]):
  the memory ledger's model states after the optimizer step (params + grads + optimizer state
  + buffers), plus the bytes of the distinct tensors autograd saves in the forward (saved-tensor
  hooks; parameters excluded), plus the strategy's transient buffers at their peak as its own
  meters report them (FSDP ``memory_stats()``: gathered units and reductions in flight; ZeRO-3
  ``fetch_stats`` and ``reduce_stats``; ZeRO-2 ``staging_stats``: its staging buffers; ZeRO-1
  ``receive_stats``: the buffers its reductions receive into on 2 gloo ranks); the
  largest rank. Within 10 %.
  The reduction meters count a reduced gradient until the end of backward even when it becomes
  ``.grad`` ([Note: asynchronous reduction]), which the ledger counts too; the planner predicts
  the inputs in flight only, so ZeRO-3 and FSDP measure up to one gradient shard more.
- the bytes and the number of every collective in a step, per kind, as the communication
  ledger counts them ([Note: communication ledger]): exactly, since both count the same
  tensors; and the tensors (or pieces) each rank's optimizer updates, by its AdamW states.
  HSDP's split into intra-group and inter-group bytes is checked in ``tests/test_hsdp.py``.
- step time: the median over the timed steps of the slowest rank's step. Within 25 %. A timing
  check depends on the machine's load, so it is marked ``timing`` and left out of the default
  run (the project keeps speed in benchmarks): ``pytest -m timing tests/test_plan.py`` runs it.
"""

import argparse
import copy
import dataclasses
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Callable, Set

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.harness import run_distributed
from tiny_fsdp.core.zero.grad_stores import FLAG_DTYPE
from tiny_fsdp.models.gpt2 import GPT2Model, GPTConfig, GPTConfigs
from tiny_fsdp.plan import STRATEGIES, gpt2_costs, load_calibration, plan
from tiny_fsdp.plan.measure import Calibrator, calibration_from

CONFIG = GPTConfig(block_size=64, vocab_size=256, n_layer=2, n_head=4, n_embd=64)
BATCH, SEQ, STEPS = 8, 64, 15
# Step time also on a model whose step is mostly matrix products and elementwise work.
COMPUTE_BOUND = (GPTConfigs.gpt2_bytes, 8, 128)  # (config, batch, seq_len)
MEMORY_TOLERANCE = 0.10  # the bound; memory is counted, not sampled
TIME_TOLERANCE = 0.25  # the bound; medians absorb the shared machine's noise


def _saved_bytes(loss_fn: Callable[[], torch.Tensor], params: Set[int]) -> int:
    """Bytes of the distinct storages autograd saves while ``loss_fn`` runs (and backward of
    its loss), the storages in ``params`` left out: what the planner's activations stand for."""
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and storage.nbytes():
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn()
    loss.backward()
    return sum(seen.values())


def _transient_bytes(name, model) -> int:
    if name == "fsdp":
        stats = model.memory_stats()
        return stats["peak_gathered_bytes"] + stats["peak_reduce_bytes"]
    if name == "zero3":
        return model.fetch_stats.peak_bytes + model.reduce_stats.peak_bytes
    if name == "zero2":
        return model.staging_stats.peak_bytes
    if name == "zero1":
        return model.receive_stats.peak_bytes
    return 0


def _build_all(rank, world, config=CONFIG, batch=BATCH, seq=SEQ):
    from example.strategies import STRATEGIES as BUILD
    from tiny_fsdp.core.utils.dist import DistEnv

    env = DistEnv(rank, rank, world, torch.device("cpu"))
    args = argparse.Namespace(
        optimizer="adamw", lr=1e-3, weight_decay=0.1, momentum=0.9, precision="fp32",
        evenness_priority=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    built = {name: BUILD[name](lambda: GPT2Model(config), args, env) for name in STRATEGIES}
    gen = torch.Generator().manual_seed(rank)
    x = torch.randint(0, config.vocab_size, (batch, seq), generator=gen)
    y = torch.randint(0, config.vocab_size, (batch, seq), generator=gen)
    return built, x, y


def _measure(rank, world):
    """Per strategy: ((model states, saved activations, transient peak), collective payload
    bytes per kind) of this rank's second step."""
    from tiny_fsdp.core import comm
    from tiny_fsdp.core.memory import memory_ledger

    built, x, y = _build_all(rank, world)
    memory = {}
    for name, (model, optimizer) in built.items():  # a warm step, then a counted one
        F.cross_entropy(model(x).reshape(-1, CONFIG.vocab_size), y.reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if name == "fsdp":
            model.reset_peak_memory_stats()
        meters = ()
        if name == "zero3":
            meters = (model.fetch_stats, model.reduce_stats)
        if name == "zero2":
            meters = (model.staging_stats,)
        if name == "zero1":
            meters = (model.receive_stats,)
        for meter in meters:  # peaks of the counted step
            meter.peak_bytes = meter.live_bytes
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        comm.LEDGER.reset()
        saved = _saved_bytes(
            lambda: F.cross_entropy(model(x).reshape(-1, CONFIG.vocab_size), y.reshape(-1)), params
        )
        optimizer.step()
        payload = dict(comm.LEDGER.payload_bytes), dict(comm.LEDGER.calls)
        states = memory_ledger(model, optimizer).total
        optimizer.zero_grad(set_to_none=True)
        pieces = len(optimizer.state)  # AdamW state per tensor (or piece) it updates
        memory[name] = ((states, saved, _transient_bytes(name, model)), payload, pieces)
    return memory


@functools.lru_cache(maxsize=None)
def _measured(world: int):
    """``_measure`` on ``world`` ranks, once per test session (two tests read it)."""
    return run_distributed(_measure, world, timeout=240)


def _calibrate_and_time(rank, world, config, batch, seq):
    """The calibration of this machine as used, and each strategy's median step (ms)."""
    shape = (batch * seq, config.n_embd, 4 * config.n_embd)  # the model's own matrix products
    calibrator = Calibrator(torch.device("cpu"), shape, sizes=(2**10, 2**19))
    built, x, y = _build_all(rank, world, config, batch, seq)
    times = {name: [] for name in built}
    calibrator.sample()  # warm-up
    calibrator.reset()
    for step in range(STEPS):  # calibrate between the steps: the same load for both
        calibrator.sample()
        order = list(built.items()) if step % 2 else list(built.items())[::-1]
        for name, (model, optimizer) in order:
            dist.barrier()
            start = time.perf_counter()
            F.cross_entropy(model(x).reshape(-1, config.vocab_size), y.reshape(-1)).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[name].append(elapsed.item())
    step_ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    return calibrator.result(), step_ms


def memory_rows(world_sizes=(1, 2, 3, 4)):
    """``[(world, strategy, predicted peak bytes, measured peak bytes)]``; the prediction does
    not depend on the calibration's rates, so a preset serves, with the backend the ranks use
    (ZeRO-1 receives into buffers of its own on 2 gloo ranks)."""
    rows = []
    costs = gpt2_costs(CONFIG, "test model")
    calibration = dataclasses.replace(load_calibration("a100_sxm"), backend="gloo")
    for world in world_sizes:
        results = _measured(world)
        predicted = plan(costs, calibration, world, BATCH, SEQ)
        for name in STRATEGIES:
            peak = max(sum(r[name][0]) for r in results)
            rows.append((world, name, predicted[name].peak_bytes, peak))
    return rows


def time_rows(world_sizes=(1, 2, 3, 4), config=CONFIG, batch=BATCH, seq=SEQ):
    """``[(world, strategy, predicted ms, measured ms)]`` from a calibration of the same run."""
    rows = []
    costs = gpt2_costs(config, "test model")
    for world in world_sizes:
        results = run_distributed(_calibrate_and_time, world, config, batch, seq, timeout=240)
        calibration = calibration_from({world: results[0][0]}, "gloo")
        predicted = plan(costs, calibration, world, batch, seq)
        for name in STRATEGIES:
            rows.append((world, name, predicted[name].step_ms, results[0][1][name]))
    return rows


def format_rows(rows, unit: str) -> str:
    """A markdown table of ``(world, strategy, predicted, measured)`` rows."""
    lines = [
        f"| ranks | strategy | predicted {unit} | measured {unit} | error |",
        "|---:|---|---:|---:|---:|",
    ]
    scale = 2**-20 if unit == "MiB" else 1.0
    for world, name, predicted, measured in rows:
        lines.append(
            f"| {world} | {name} | {predicted * scale:.3f} | {measured * scale:.3f} | "
            f"{predicted / measured - 1:+.1%} |"
        )
    return "\n".join(lines)


def test_planner_predicts_peak_memory_per_rank_within_10_percent():
    rows = memory_rows()
    print("\n" + format_rows(rows, "MiB"))
    misses = [r for r in rows if abs(r[2] / r[3] - 1) > MEMORY_TOLERANCE]
    assert not misses, "out of tolerance:\n" + format_rows(rows, "MiB")
    # DDP's and ZeRO-1/2's meters count what the planner counts (ZeRO-2's staging, ZeRO-1's
    # receive buffers on 2 ranks): their predictions are exact to a few hundred bytes (284-460
    # measured), where one bucket's chunk would be hundreds of KiB.
    loose = [r for r in rows if r[1] in ("ddp", "zero1", "zero2") and abs(r[2] - r[3]) > 1024]
    assert not loose, "not exact:\n" + format_rows(loose, "MiB")


WIDE_VOCAB = GPTConfig(block_size=64, vocab_size=2048, n_layer=3, n_head=2, n_embd=32)


def _gathered_peaks(rank, world):
    """FSDP's and ZeRO-3's peak bytes of gathered parameters in the third step of ``GPT2Model``
    with ``CONFIG`` and ``WIDE_VOCAB``: ``{(strategy, config index): bytes}``."""
    from tiny_fsdp.core import FSDP, FSDPAdamW, Zero3, Zero3AdamW

    wrappers = {"fsdp": (FSDP, FSDPAdamW), "zero3": (Zero3, Zero3AdamW)}
    peaks = {}
    for i, config in enumerate((CONFIG, WIDE_VOCAB)):
        for name, (Wrapper, AdamW) in wrappers.items():
            torch.manual_seed(0)
            model = Wrapper(GPT2Model(config))
            optimizer = AdamW(model.named_parameters(), lr=1e-3)
            x = torch.randint(0, config.vocab_size, (2, 16))
            for step in range(3):
                if name == "fsdp":
                    model.reset_peak_memory_stats()
                else:
                    model.fetch_stats.peak_bytes = model.fetch_stats.live_bytes
                F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            stats = model.memory_stats() if name == "fsdp" else None
            peaks[name, i] = stats["peak_gathered_bytes"] if stats else model.fetch_stats.peak_bytes
    return peaks


def _second_steps(rank, make_model, precision="fp32"):
    """Every strategy's second step of ``make_model()`` under ``precision``'s policy, AdamW:
    ``{strategy: (bytes the memory ledger counts after the step, payload bytes per kind, calls
    per kind)}`` of this rank."""
    import tiny_fsdp.core as core
    from tiny_fsdp.core.memory import memory_ledger

    policy = core.MixedPrecisionPolicy.from_name(precision)
    out = {}
    for name, cls in zip(STRATEGIES, ("DDP", "Zero1", "Zero2", "Zero3", "FSDP")):
        torch.manual_seed(0)
        model = getattr(core, cls)(make_model(), mixed_precision=policy)
        optimizer = getattr(core, cls + "AdamW")(model.named_parameters(), lr=1e-3)
        x = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(rank))
        for step in range(2):
            core.comm.LEDGER.reset()
            F.log_softmax(model(x).float(), -1).sum().backward()
            optimizer.step()
            held = memory_ledger(model, optimizer).total
            optimizer.zero_grad(set_to_none=True)
        out[name] = held, dict(core.comm.LEDGER.payload_bytes), dict(core.comm.LEDGER.calls)
    return out


def _as_planned(name: str, payload: dict, calls: dict) -> tuple:
    """A gloo run's ledger in NCCL's names, as the plan (an NCCL calibration) counts: ZeRO-1/2
    broadcast their all-gather there, one broadcast per rank of 2."""
    payload, calls = dict(payload), dict(calls)
    if name in ("zero1", "zero2"):
        payload["all_gather"] = payload.pop("broadcast")
        calls["all_gather"] = calls.pop("broadcast") // 2
    return payload, calls


def _assert_planned_as_measured(plans: dict, real: list, left_out_at_most: int) -> None:
    """Per strategy: the plan's model states are the busiest rank's ledger but for what the
    formulas leave out (0 to ``left_out_at_most`` bytes), and its collectives are the ledger's,
    bytes and calls, kind by kind (``real``: each rank's ``_second_steps``)."""
    for name in STRATEGIES:
        left_out = max(r[name][0] for r in real) - plans[name].model_state_bytes
        assert 0 <= left_out <= left_out_at_most, (name, left_out)
        payload, calls = _as_planned(name, *real[0][name][1:])
        assert {k: n for (_, k), n in plans[name].payload_bytes.items()} == payload, name
        assert {k: n for (_, k), n in plans[name].calls.items()} == calls, name


def _two_rank_steps(rank, world):
    """What several tests read of 2 ranks, measured in one run."""
    return {
        "gathered": _gathered_peaks(rank, world),
        "bf16": _second_steps(rank, lambda: GPT2Model(CONFIG), "bf16"),
        "experts": _second_steps(rank, _ThreeExperts),
        "frozen": _second_steps(rank, _LowRankLM),
    }


def _on_2_ranks(what: str) -> list:
    """Each rank's ``_two_rank_steps()[what]``; one run per test session."""
    return [r[what] for r in _two_rank_runs()]


@functools.lru_cache(maxsize=None)
def _two_rank_runs():
    return run_distributed(_two_rank_steps, 2)


def test_planner_predicts_the_gathered_parameters_exactly():
    """FSDP holds the root unit (embeddings, head) for the whole step and each block with the
    prefetched next; a unit of several tensors is copied out of its all-gather's output, both
    alive for a moment, so where the root is larger than a block (a real vocabulary) its
    copy-out at the forward's start, with the first block prefetched, is the peak. ZeRO-3
    receives whole tensors in place, on the busiest rank."""
    from tiny_fsdp.plan.schedules import StepSetup, plan_step

    calibration = load_calibration("a100_sxm")
    real = _on_2_ranks("gathered")
    for name, i in real[0]:
        config = (CONFIG, WIDE_VOCAB)[i]
        setup = StepSetup(gpt2_costs(config), calibration, 2, 32, 16, 4, 4)
        assert plan_step(name, setup).gathered_bytes == max(r[name, i] for r in real), (name, i)


def test_planner_plans_bf16_as_each_strategy_keeps_it():
    """Under ``--precision bf16`` (the policy ``MixedPrecisionPolicy.from_name("bf16")``) every
    strategy communicates bf16 (FSDP's reduce-scatters and ZeRO-3's reduces too): the plan's
    collectives are the ledger's, bytes and calls, kind by kind. Its model states are what the
    ledger counts, in each strategy's dtypes (DDP: fp32 parameters, gradients and moments and
    a bf16 copy to compute with, 18 bytes a parameter where the ZeRO formula's are 16), but for
    at most 8 bytes a tensor (AdamW's step counters, DDP's flags)."""
    planned = plan(gpt2_costs(CONFIG), load_calibration("a100_sxm"), 2, 2, 16, precision="bf16")
    tensors = len(list(GPT2Model(CONFIG).parameters()))
    _assert_planned_as_measured(planned, _on_2_ranks("bf16"), 8 * tensors)


def test_planner_predicts_the_bytes_and_calls_of_every_collective_exactly():
    """Per strategy and kind, the payload one rank's collectives carry in a step and their
    number, on gloo
    (ZeRO-1/2 broadcast there, and all-reduce beyond 2 ranks, [Note: ZeRO collectives on
    gloo]) and on NCCL (the formula without a run: reduce-scatter and all-gather of the same
    buckets)."""
    costs = gpt2_costs(CONFIG, "test model")
    gloo = dataclasses.replace(load_calibration("a100_sxm"), backend="gloo")
    for world in (1, 2, 3, 4):
        predicted = plan(costs, gloo, world, BATCH, SEQ)
        for name in STRATEGIES:
            expected = {kind: n for (group, kind), n in predicted[name].payload_bytes.items()}
            calls = {kind: n for (group, kind), n in predicted[name].calls.items()}
            assert {group for group, _ in predicted[name].payload_bytes} <= {"world"}
            assert predicted[name].inter_group_bytes == 0
            for rank, result in enumerate(_measured(world)):
                assert result[name][1] == (expected, calls), (world, name, rank)
    nccl = plan(costs, load_calibration("a100_sxm"), 4, BATCH, SEQ)
    flags = FLAG_DTYPE.itemsize * len(costs.tensors)  # ZeRO-1/2: who had a gradient
    for name in ("zero1", "zero2"):  # the same bucket bytes, as reduce-scatter + all-gather
        by_kind = {kind: n for (_, kind), n in nccl[name].payload_bytes.items()}
        on_gloo = _measured(4)[0][name][1][0]
        assert by_kind == {
            "reduce_scatter": on_gloo["all_reduce"] - flags,
            "all_gather": on_gloo["broadcast"],
            "all_reduce": flags,
        }


@pytest.mark.timing
def test_planner_predicts_step_time_within_25_percent():
    """A timing check, so not in the default run (``pytest -m timing tests/test_plan.py``):
    its outcome depends on the machine's load ([Note: planner validation])."""
    rows = time_rows() + time_rows((1, 2), *COMPUTE_BOUND)
    print("\n" + format_rows(rows, "ms"))
    misses = [r for r in rows if abs(r[2] / r[3] - 1) > TIME_TOLERANCE]
    assert not misses, "out of tolerance:\n" + format_rows(rows, "ms")


def test_cli_json_has_every_strategy_for_every_example_preset():
    """``--json`` keys; model states agree with the ZeRO formulas of ``tiny_fsdp.estimate``
    (fp32, every parameter trained, rows that need no padding)."""
    from example.models import model_names
    from tiny_fsdp.estimate import estimate_model
    from tiny_fsdp.models.gpt2 import GPTConfigs
    from tiny_fsdp.plan.__main__ import main

    names = [n for n in model_names() if not n.startswith("hf:")] + ["gpt2_mini"]
    for name in dict.fromkeys(names):
        out = json.loads(main(["--model", name, "--world_size", "4", "--seq_len", "32",
                               "--gpu_memory", "16GiB", "--hsdp", "2", "--json"]))  # fmt: skip
        assert list(out) == list(STRATEGIES) + ["hsdp"], name
        assert all(
            set(v) == {"peak_bytes", "step_ms", "tokens_per_s", "fits"} for v in out.values()
        )
        with torch.device("meta"):
            model = GPT2Model(GPTConfigs.get(name))
        states = estimate_model(model, 4)
        costs = gpt2_costs(GPTConfigs.get(name))
        act = costs.activation_bytes(8 * 32, 4)  # default --batch_size 8
        plans = plan(costs, load_calibration("h100_sxm"), 4, 8, 32)
        for strategy in STRATEGIES:
            exact = max(r.model_states for r in states[strategy]) + act
            assert plans[strategy].peak_bytes == exact + plans[strategy].transient_bytes
            assert out[strategy]["peak_bytes"] == plans[strategy].peak_bytes


def test_the_readme_s_plan_is_what_its_command_prints():
    """The README's planner example: its command, run as written, prints its table."""
    from tiny_fsdp.plan.__main__ import main

    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    section = readme.split("## Planner", 1)[1]
    command = section.split("python -m tiny_fsdp.plan ", 1)[1].split("#", 1)[0]
    shown = section.split("```\n", 2)[2].split("```", 1)[0]  # the block after the command's
    assert shown.startswith("gpt2_xl:")
    assert main(command.replace("\\\n", " ").split()).strip() == shown.strip()


def test_the_cli_plans_a_model_by_size_or_by_config_file(tmp_path):
    """``--num_params N --n_layer L``: a GPT-2 of about N parameters (its width rounded to whole
    heads); ``--config FILE``: the GPTConfig fields of a file, planned as the same preset."""
    from tiny_fsdp.plan.__main__ import config_for_count, main

    config = config_for_count(350e6, 24, 50304, 1024)
    assert config.n_layer == 24 and config.n_embd % config.n_head == 0
    assert gpt2_costs(config).num_params == pytest.approx(350e6, rel=0.03)
    by_size = json.loads(main(["--num_params", "350e6", "--n_layer", "24", "--json"]))
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dataclasses.asdict(config)))
    assert json.loads(main(["--config", str(path), "--json"])) == by_size
    preset = dataclasses.asdict(GPTConfigs.get("gpt2_mini"))
    path.write_text(json.dumps(preset))
    args = ["--seq_len", "64", "--json"]
    assert main(["--config", str(path), *args]) == main(["--model", "gpt2_mini", *args])


def test_the_installed_planner_plans_the_hf_presets_outside_the_repository(tmp_path):
    """The library never imports ``example`` (#14): from another directory, without the
    repository on the path, ``python -m tiny_fsdp.plan --model hf:llama`` plans."""
    pytest.importorskip("transformers")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    cmd = [
        sys.executable,
        "-m",
        "tiny_fsdp.plan",
        "--model",
        "hf:llama",
        "--seq_len",
        "64",
        "--json",
    ]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert list(json.loads(done.stdout)) == list(STRATEGIES)


def test_plan_model_reads_any_module():
    """A model that is not GPT-2 (tests/zoo.py), as a user calls it: a preset's name, no
    example input. Its tensors and layers are read from the module, its activations from one
    forward on meta of the batch's token ids: the bytes a real forward of the batch saves (in
    fp32; in bf16, the loss's log-softmax in fp32 as the examples take it), the caller's model
    untouched; sharded strategies hold less than replicated ones."""
    from tests.zoo import VOCAB, ZooLM
    from tiny_fsdp.plan import plan_model

    model = ZooLM()
    plans = plan_model(model, "a100_sxm", 4, 2, 16)
    assert next(model.parameters()).device.type == "cpu"
    assert plans["fsdp"].model_state_bytes < plans["zero2"].model_state_bytes
    assert plans["zero2"].model_state_bytes < plans["ddp"].model_state_bytes
    batch = torch.randint(0, VOCAB, (2, 16))

    def saved(model: nn.Module) -> int:  # under the loss the planner assumes: a log-softmax
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}

        def loss() -> torch.Tensor:
            out = model(batch)
            return F.log_softmax(getattr(out, "logits", out).float(), -1).sum()

        return _saved_bytes(loss, params)

    for strategy in STRATEGIES:  # activations do not depend on the strategy
        assert plans[strategy].activation_bytes == saved(model)
    # In bf16 (ZooLM's rotary table is fp32, a buffer the planner leaves in its dtype while
    # .to(torch.bfloat16) casts it, so a plain language model here).
    lm = nn.Sequential(nn.Embedding(VOCAB, 16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, VOCAB))
    bf16, fp32 = (
        plan_model(lm, "a100_sxm", 4, 2, 16, precision=p)["ddp"].activation_bytes
        for p in ("bf16", "fp32")
    )
    assert fp32 == saved(lm)
    assert bf16 == saved(copy.deepcopy(lm).to(torch.bfloat16))


class _Outer(nn.Module):
    """Any module around a GPT2Model: the planner measures it instead of using the formula."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.inner(idx)


def test_a_module_s_measured_activations_agree_with_gpt2_s_formula():
    """Two derivations of the same numbers: the GPT-2 formula of [Note: model costs] and one
    forward on meta of the same model (through ``_Outer``), per token, in fp32 bytes: all
    activations, what gradient checkpointing keeps (outside the blocks and their inputs) and
    one block (recomputed), within 1 % (the meta forward counts the norms' fp32 statistics as
    elements and the loss's targets are not part of the model's forward); FLOPs exactly."""
    from tiny_fsdp.plan import module_costs

    config = GPTConfig(block_size=64, vocab_size=256, n_layer=3, n_head=4, n_embd=64)
    formula = gpt2_costs(config)
    with torch.device("meta"):
        measured = module_costs(_Outer(GPT2Model(config)), torch.zeros(8, 64, dtype=torch.long))
    for part in ("act_per_token", "ckpt_per_token", "block_per_token"):
        e, f = getattr(measured, part)
        want_e, want_f = getattr(formula, part)
        assert 4 * e + f == pytest.approx(4 * want_e + want_f, rel=0.01), part
    assert measured.activation_bytes(512, 4, grad_ckpt=True) < measured.activation_bytes(512, 4)
    # FLOPs: the weights' matrix products from the layers, attention's counted in the forward.
    assert measured.flops(8 * 64, 64) == pytest.approx(formula.flops(8 * 64, 64), rel=1e-9)


def test_the_cli_plans_gradient_checkpointing_of_a_transformers_model():
    """``--grad_ckpt`` with an ``hf:`` preset (its blocks found in the module, as FSDP's
    units are): every strategy's peak per rank is lower than without."""
    pytest.importorskip("transformers")
    from tiny_fsdp.plan.__main__ import main

    args = ["--model", "hf:llama", "--world_size", "4", "--seq_len", "64", "--json"]
    full, ckpt = (json.loads(main(args + extra)) for extra in ([], ["--grad_ckpt"]))
    for strategy in STRATEGIES:
        assert ckpt[strategy]["peak_bytes"] < full[strategy]["peak_bytes"]
    # As for our GPT-2 presets: no sequence longer than the model's positions (256).
    with pytest.raises(SystemExit, match="--seq_len 1024 > 256 positions of hf:gpt2"):
        main(["--model", "hf:gpt2", "--seq_len", "1024"])


class _AttentionLM(nn.Module):
    """One causal self-attention through ``F.scaled_dot_product_attention``, of a ``kind``:
    ``"split"``, q, k, v views of (B, L, H, D) memory, as LLaMA's; ``"contiguous"``, made
    (B, H, L, D) contiguous first, as DeepSeek-V3's attention concatenates its rotary and plain
    parts; ``"one_kv_head"``, one key and value head for all query heads, broadcast, as
    Falcon's; ``"learned_bias"``, a learned additive mask, as T5's relative position bias."""

    def __init__(
        self,
        vocab: int = 50,
        width: int = 16,
        heads: int = 2,
        dropout: float = 0.0,
        kind: str = "split",
    ):
        super().__init__()
        self.heads, self.dropout, self.kind = heads, dropout, kind
        kv_width = width // heads if kind == "one_kv_head" else width
        self.wte, self.qkv = nn.Embedding(vocab, width), nn.Linear(width, width + 2 * kv_width)
        self.proj, self.head = nn.Linear(width, width), nn.Linear(width, vocab)
        self.bias = nn.Parameter(torch.zeros(1, heads, 64, 64)) if kind == "learned_bias" else None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        b, t, c = x.shape
        d = c // self.heads
        kv_width = (self.qkv.out_features - c) // 2
        q, k, v = (
            h.view(b, t, -1, d).transpose(1, 2)
            for h in self.qkv(x).split([c, kv_width, kv_width], dim=-1)
        )
        if self.kind == "contiguous":
            q, k, v = (h.contiguous() for h in (q, k, v))
        if self.bias is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, self.bias[..., :t, :t])
        return self.head(x + self.proj(y.transpose(1, 2).reshape(b, t, c)))


def test_plan_model_lays_units_out_as_the_strategies_do():
    """The planner's gather units are those ``unit="auto"`` gives FSDP and ZeRO-3, also for
    blocks that share a layer (in the root unit) and a weight (in each block using it)."""
    from tests.zoo import SharedBlocksLM
    from tiny_fsdp.core.module import convert_module
    from tiny_fsdp.core.unit_layout import unit_layers, unit_params
    from tiny_fsdp.plan import module_costs

    model = SharedBlocksLM()
    costs = module_costs(model)
    planned = sorted(sum(costs.tensors[i] for i in unit) for unit in costs.units)
    layout = unit_layers(convert_module(copy.deepcopy(model)), "auto")
    real = sorted(sum(p.numel() for p in unit_params(layers)) for _, layers in layout)
    assert len(layout) == 4 and planned == real


def test_plan_model_counts_attention_as_the_device_s_fused_kernel_keeps_it():
    """[Note: attention on meta]: on meta, scaled_dot_product_attention keeps its (B, H, L, L)
    scores; the kernels real devices pick keep the inputs, output and log-sum-exp. The plan
    is, to the byte, what a CPU forward saves:
    - with the fused kernel without dropout (what CUDA uses with or without);
    - with the math kernel where the CPU takes it (gloo calibration): for dropout, for a mask
      that takes a gradient;
    - with the math kernel on either device for one key and value head broadcast to all;
    - with the output of the fused kernel laid out as the query is, so that contiguous
      (B, H, L, D) heads make the ``transpose(1, 2).reshape`` after it a copy, kept."""
    from tiny_fsdp.plan import plan_model

    batch = torch.randint(0, 50, (2, 64))
    gloo = dataclasses.replace(load_calibration("a100_sxm"), backend="gloo")
    for dropout, calibration, kind in (
        (0.0, "a100_sxm", "split"),
        (0.0, gloo, "split"),
        (0.1, gloo, "split"),
        (0.0, "a100_sxm", "contiguous"),
        (0.0, gloo, "contiguous"),
        (0.0, "a100_sxm", "one_kv_head"),
        (0.0, gloo, "one_kv_head"),
        (0.0, gloo, "learned_bias"),
    ):
        model = _AttentionLM(dropout=dropout, kind=kind)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        real = _saved_bytes(lambda: F.log_softmax(model(batch), -1).sum(), params)
        plans = plan_model(model, calibration, 2, 2, 64)
        assert plans["ddp"].activation_bytes == real, (dropout, kind)


class _UpcastNormLM(nn.Module):
    """Embeddings, an RMS norm computed in fp32 whatever the input's dtype (as LLaMA's), a
    head: under bf16 the norm keeps fp32 tensors for backward."""

    def __init__(self, vocab: int = 50, width: int = 16):
        super().__init__()
        self.wte, self.head = nn.Embedding(vocab, width), nn.Linear(width, vocab)
        self.norm_weight = nn.Parameter(torch.ones(width))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.head(self.norm_weight * h.to(x.dtype))


def test_plan_model_measures_bf16_activations_in_bf16():
    """Under ``precision="bf16"`` the meta forward computes in bf16, so what a model keeps in
    fp32 whatever its dtype (an upcast norm, the loss's fp32 log-softmax) counts 4 bytes, not
    2: the plan is, to the byte, what the bf16 model saves on a CPU."""
    from tiny_fsdp.plan import plan_model

    batch = torch.randint(0, 50, (2, 32))
    for make in (_UpcastNormLM, _AttentionLM):
        for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            model = make().to(dtype)
            params = {p.untyped_storage().data_ptr() for p in model.parameters()}
            real = _saved_bytes(lambda: F.log_softmax(model(batch).float(), -1).sum(), params)
            plans = plan_model(make(), "a100_sxm", 2, 2, 32, precision=precision)
            assert plans["ddp"].activation_bytes == real, (make.__name__, precision)


class _GroupedMoE(nn.Module):
    """A language model whose one layer of experts (top-1 routing, raw (E, C, H) weights) runs
    as one grouped matmul, as torchtitan's and transformers' MoE layers run theirs, and adds a
    bias to its output in place, as GPT-OSS's experts do."""

    def __init__(self, vocab: int = 50, width: int = 16, experts: int = 4, hidden: int = 32):
        super().__init__()
        self.wte, self.router = nn.Embedding(vocab, width), nn.Linear(width, experts)
        self.experts = nn.Parameter(torch.randn(experts, width, hidden) / width**0.5)
        self.shift, self.head = nn.Parameter(torch.zeros(hidden)), nn.Linear(hidden, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx).flatten(0, 1)  # (T, C)
        expert = self.router(x).argmax(-1)
        order = expert.argsort()
        count = torch.histc(
            expert.float(), bins=len(self.experts), min=0, max=len(self.experts) - 1
        )
        h = torch._grouped_mm(x[order], self.experts, offs=count.cumsum(0, dtype=torch.int32))
        h.add_(self.shift)
        h = torch.empty_like(h).index_copy(0, order, h)  # (T, H), back in token order
        return self.head(F.gelu(h)).unflatten(0, idx.shape)


def test_plan_model_counts_experts_run_as_one_grouped_matmul():
    """[Note: grouped matmul on meta]: torch's meta kernel of a grouped matmul takes bf16 only,
    so an fp32 MoE could not be planned. The plan keeps, to the byte, what a CPU forward saves,
    and counts the products a token makes: one expert's (C x H), not all E experts'."""
    from tiny_fsdp.plan import module_costs, plan_model

    model = _GroupedMoE()
    batch = torch.randint(0, 50, (2, 32))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    real = _saved_bytes(lambda: F.log_softmax(model(batch), -1).sum(), params)
    assert plan_model(model, "a100_sxm", 2, 2, 32)["ddp"].activation_bytes == real
    costs = module_costs(model, batch)
    assert costs.matmul_params == 16 * 4 + 16 * 32 + 32 * 50  # router, one expert, head
    assert costs.attention_flops_per_token == 0


class _ThreeExperts(nn.Module):
    """Token embeddings through 3 experts, raw (E, C, H) weights, averaged: a tensor of fewer
    rows than 4 ranks, and of rows not a multiple of 2."""

    def __init__(self, vocab: int = 50, width: int = 16, hidden: int = 32):
        super().__init__()
        self.wte, self.head = nn.Embedding(vocab, width), nn.Linear(hidden, vocab)
        self.experts = nn.Parameter(torch.randn(3, width, hidden) / width**0.5)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = torch.einsum("btc,ech->bth", self.wte(idx), self.experts) / len(self.experts)
        return self.head(F.gelu(h))


def test_plan_model_holds_fsdp_to_its_most_loaded_rank():
    """FSDP pads each tensor's rows to a multiple of the ranks, and a rank keeps optimizer
    state for the real rows of its shard: with 3 experts on 2 ranks, rank 0 for 2, rank 1 for
    1. The plan is rank 0's model states, but for AdamW's step counters (4 bytes a tensor),
    which the formulas leave out."""
    from tiny_fsdp.plan import plan_model

    real = [steps["fsdp"][0] for steps in _on_2_ranks("experts")]
    planned = plan_model(_ThreeExperts(), "a100_sxm", 2, 2, 8)["fsdp"].model_state_bytes
    counters = 4 * len(list(_ThreeExperts().parameters()))
    assert real[0] > real[1]
    assert real[0] - counters == planned, (real, planned)


class _LowRankLM(nn.Module):
    """Frozen embeddings and frozen base weights, each block adapted by a trainable low-rank
    pair (as LoRA adapts a pretrained model), a trainable head."""

    class Block(nn.Module):
        def __init__(self, width: int, rank: int = 2):
            super().__init__()
            self.base = nn.Linear(width, width).requires_grad_(False)
            self.down, self.up = nn.Linear(width, rank, bias=False), nn.Linear(rank, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.tanh(self.base(x) + self.up(self.down(x)))

    def __init__(self, vocab: int = 50, width: int = 16, layers: int = 2):
        super().__init__()
        self.wte = nn.Embedding(vocab, width).requires_grad_(False)
        self.blocks = nn.ModuleList(self.Block(width) for _ in range(layers))
        self.head = nn.Linear(width, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_plan_model_charges_frozen_parameters_no_gradients_nor_optimizer_state():
    """A frozen tensor (``requires_grad=False``: a LoRA model's base) is held and gathered, but
    has no gradient, optimizer state or reduction: the plan's model states are the busiest
    rank's ledger but for what the formulas leave out, at most 8 bytes a trained tensor (AdamW's
    step counter of each tensor or piece a rank steps, and DDP's flag in its bucket), where the
    frozen tensors' gradients and AdamW state would be 12 bytes an element; and its
    collectives are the ledger's, bytes and calls, kind by kind."""
    from tiny_fsdp.plan import plan_model

    plans = plan_model(_LowRankLM(), "a100_sxm", 2, 2, 8)
    trained = sum(p.requires_grad for p in _LowRankLM().parameters())
    _assert_planned_as_measured(plans, _on_2_ranks("frozen"), 8 * trained)


def test_a_frozen_weight_s_backward_is_planned_as_its_input_gradient_alone():
    """[Note: strategy schedules]: a layer's backward takes twice its forward (the input's and
    the weights' gradients), less the frozen share of its parameters, whose backward computes
    the input's gradient alone."""
    from tiny_fsdp.plan import plan_model

    calibration = dataclasses.replace(
        load_calibration("a100_sxm"), optimizer_s_per_param=0.0, optimizer_s_per_tensor=0.0
    )
    x = torch.randn(2, 16, 64)
    layer = nn.Linear(64, 64)
    trained = plan_model(layer, calibration, 1, 2, 16, example_input=x)["ddp"].compute_ms
    layer.weight.requires_grad_(False)
    adapted = plan_model(layer, calibration, 1, 2, 16, example_input=x)["ddp"].compute_ms
    frozen_share = layer.weight.numel() / (layer.weight.numel() + layer.bias.numel())
    # Within 0.1 %: the frozen weight's forward saves no input for its gradient, so the
    # elementwise term, charged per byte kept, is a little smaller too.
    assert adapted / trained == pytest.approx((1 + 2 - frozen_share) / 3, rel=1e-3)


def test_plan_model_takes_the_forward_s_keyword_arguments_or_says_what_to_pass():
    """An input that is not token ids is given as the example (a tensor, or the forward's
    keyword arguments): (B, T) ids, or B samples of seq_len tokens (features, images); a model
    that refuses token ids and has no example is a clear error, not activations of 0."""
    from tests.zoo import ZooLM
    from tiny_fsdp.plan import plan_model

    model = ZooLM()
    ids = torch.zeros(2, 16, dtype=torch.long)
    by_name = plan_model(model, "a100_sxm", 4, 2, 16, example_input={"idx": ids})
    assert by_name == plan_model(model, "a100_sxm", 4, 2, 16)
    # Features (B, T, C) instead of ids: B T tokens of C values each.
    features = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    x = torch.randn(2, 16, 8)
    params = {p.untyped_storage().data_ptr() for p in features.parameters()}
    real = _saved_bytes(lambda: F.log_softmax(features(x), -1).sum(), params)
    plans = plan_model(features, "a100_sxm", 4, 2, 16, example_input=x)
    assert plans["ddp"].activation_bytes == real
    conv = nn.Sequential(nn.Conv2d(3, 8, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2))
    with pytest.raises(ValueError, match=r"token ids of shape \(2, 16\).*Pass example_input="):
        plan_model(conv, "a100_sxm", 4, 2, 16)
    # Images (B, 3, H, W): B samples of seq_len tokens each, here 1 (a ViT's: its patches).
    images = torch.randn(2, 3, 8, 8)
    params = {p.untyped_storage().data_ptr() for p in conv.parameters()}
    real = _saved_bytes(lambda: F.log_softmax(conv(images), -1).sum(), params)
    plans = plan_model(conv, "a100_sxm", 4, 2, 1, example_input=images)
    assert plans["ddp"].activation_bytes == real
    with pytest.raises(TypeError, match="calibration must be a Calibration, a preset name"):
        plan_model(model, 3, 4, 2, 16)


def test_calibrate_measures_at_the_shape_of_the_model_it_is_given(monkeypatch, tmp_path):
    """The rates depend on the shape ([Note: calibration]), so ``--calibrate`` times the matrix
    products and the elementwise work at the planned model's: a rank's tokens by the widest
    matrix product of a block. The file keeps the shape, and a plan for a model of another
    shape says so."""
    from tiny_fsdp.plan import __main__ as cli
    from tiny_fsdp.plan import measure

    asked = []

    def fake_calibrate(world_sizes, shape):  # the machine is not measured here
        asked.append(tuple(shape))
        return dataclasses.replace(load_calibration("a100_sxm"), shape=tuple(shape))

    monkeypatch.setattr(measure, "calibrate", fake_calibrate)
    path = str(tmp_path / "machine.json")
    cli.main(["--calibrate", path, "--model", "gpt2_bytes", "--batch_size", "8",
              "--seq_len", "128"])  # fmt: skip
    assert asked == [(8 * 128, 128, 4 * 128)]  # (B T, C, 4 C): the MLP's c_fc
    assert load_calibration(path).shape == (1024, 128, 512)
    same = ["--calibration", path, "--model", "gpt2_bytes", "--batch_size", "8", "--seq_len"]
    assert "measured at" not in cli.main(same + ["128"])
    assert "measured at" not in cli.main(same + ["64"])  # half the rows: close enough
    other = cli.main(["--calibration", path, "--model", "gpt2", "--seq_len", "1024"])
    assert "measured at matrix products of (1024, 128, 512)" in other
    assert "this model's are (8192, 768, 3072)" in other


def test_the_calibration_shape_of_any_module_is_its_widest_block_product():
    """Inside the repeated blocks if there are any (not a vocabulary-wide head), else the widest
    non-embedding weight; ``(in, out)`` as (smaller, larger) dimension; rows capped at 8192."""
    from tiny_fsdp.plan import module_costs

    blocks = nn.ModuleList(
        nn.Sequential(nn.Linear(6, 20), nn.GELU(), nn.Linear(20, 6)) for _ in range(2)
    )
    with_blocks = nn.Sequential(nn.Embedding(500, 6), blocks, nn.Linear(6, 500))
    assert module_costs(with_blocks).calibration_shape(64) == (64, 6, 20)
    flat = nn.Sequential(nn.Embedding(500, 6), nn.Linear(6, 30), nn.Linear(30, 6))
    assert module_costs(flat).calibration_shape(10**6) == (8192, 6, 30)


def test_hsdp_step_time_follows_the_inter_node_link():
    """16 ranks, 8 a node: HSDP's all-reduce across the 2 replica groups runs at the inter-node
    bandwidth, so a slower link costs it time; FSDP's rings over all 16 ranks cross the link with
    every gather and reduction, so on a slow link HSDP is the faster one."""
    costs = gpt2_costs(GPTConfigs.get("gpt2"))
    steps = {}
    for gbps in (400, 25, 5):
        calibration = load_calibration("h100_sxm")
        calibration.collectives = {}  # the ring model, so the link speeds decide
        calibration.ranks_per_node = 8
        calibration.inter_node_bandwidth_bytes_per_s = gbps * 1e9
        steps[gbps] = plan(costs, calibration, 16, 4, 1024, hsdp_replicas=2)
    hsdp = [steps[g]["hsdp"].comm_ms for g in (400, 25, 5)]
    assert hsdp[0] < hsdp[1] < hsdp[2]
    assert steps[5]["hsdp"].step_ms < steps[5]["fsdp"].step_ms
    # The bytes do not depend on the link: one reduced shard per step crosses it.
    assert steps[5]["hsdp"].payload_bytes == steps[400]["hsdp"].payload_bytes
    assert steps[5]["hsdp"].inter_group_bytes > 0 == steps[5]["fsdp"].inter_group_bytes


def test_the_tensors_each_strategy_updates_are_the_planned_ones():
    """Measured: the AdamW states of the busiest rank (one per tensor or piece it updates) on
    1-4 ranks, against the count the planner charges the optimizer's per-tensor cost for."""
    costs = gpt2_costs(CONFIG, "test model")
    base = dataclasses.replace(
        load_calibration("a100_sxm"), optimizer_s_per_param=0.0, optimizer_s_per_tensor=0.0
    )
    per_tensor = dataclasses.replace(base, optimizer_s_per_tensor=1e-3)  # 1 ms a tensor
    for world in (1, 2, 3, 4):
        before, after = plan(costs, base, world, BATCH, SEQ), plan(
            costs, per_tensor, world, BATCH, SEQ
        )
        for name in STRATEGIES:
            planned = round(after[name].compute_ms - before[name].compute_ms)
            measured = max(result[name][2] for result in _measured(world))
            assert planned == measured, (world, name, planned, measured)


def test_wrapper_costs_are_fitted_so_the_planner_reproduces_the_probe_steps():
    """[Note: wrapper costs]: what each wrapper adds to the probe's plain step, made by the
    planner itself from known costs per layer and per unit, is turned back into those costs,
    on 2 and 4 ranks."""
    from tiny_fsdp.plan.model_costs import module_costs
    from tiny_fsdp.plan.probe import UNITS, WRAPPED, Probe, fit_wrapper_costs, wide_dims
    from tiny_fsdp.plan.schedules import StepSetup, plain_step_seconds, plan_step

    layer_s = {"ddp": 1e-4, "zero1": 2e-4, "zero2": 3e-4, "zero3": 1.5e-4, "fsdp": 2.5e-4}
    unit_s = {"zero3": 5e-4, "fsdp": 8e-4}
    rows, width = dims = wide_dims((BATCH * SEQ, CONFIG.n_embd, 4 * CONFIG.n_embd))
    with torch.device("meta"):
        costs = {k: module_costs(Probe(width=width, per_block=k)) for k in (1, 2)}
    for world in (2, 4):
        known = dataclasses.replace(
            load_calibration("a100_sxm"), backend="gloo", comm_channels=2, overlap=0.0,
            wrapper_layer_s=layer_s, wrapper_unit_s=unit_s,
        )  # fmt: skip
        plain = plain_step_seconds(StepSetup(costs[1], known, 1, rows, 1, 4, 4))
        extra_s = {}
        for name in WRAPPED:
            for k in (1, 2) if name in UNITS else (1,):
                setup = StepSetup(costs[k], known, world, rows, 1, 4, 4)
                extra_s[name if k == 1 else f"{name} x2"] = plan_step(name, setup).seconds - plain
        fitted = dataclasses.replace(known, wrapper_layer_s={}, wrapper_unit_s={})
        fit_wrapper_costs(fitted, extra_s, dims, world)
        assert fitted.wrapper_layer_s == pytest.approx(layer_s, rel=1e-6)
        assert fitted.wrapper_unit_s == pytest.approx(unit_s, rel=1e-6)
