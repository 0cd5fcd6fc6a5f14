"""End to end: the example scripts train to the numbers of single-device training with the
same global batch.

Every script is the shared trainer (``example/trainer.py``) with its own strategy (checked
below); the strategies the trainer builds are those of ``example/strategies.py``, which the
benchmark test runs one by one (``tests/test_ledgers.py``). Launches start real processes
(torchrun, 3 to 6 of them importing torch), so they are few and tiny: FSDP's script as a user
launches it, on one node and on two "nodes" with HSDP; DDP and ZeRO-3 (its own partition table)
run the same trainer on the test harness's two ranks. gpt2_bytes, 3 steps, the default corpus
read from a token file (``corpus_bin``). A launch's stdout and stderr go to one pipe, as with
``> log 2>&1`` or a job scheduler: the log holds whole step lines and no progress-bar frames.
"""

import json
import os
import re
import runpy
import socket
import subprocess
import sys
from typing import List

import pytest
import torch

from example import trainer
from example.strategies import resolve_precision
from tests.harness import as_a_launched_job, run_distributed
from tests.parity import LOSS_ATOL as PARITY_LOSS_ATOL

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMON = ["--model", "gpt2_bytes", "--steps", "3", "--seq_len", "32", "--lr", "1e-3",
          "--log_every", "1", "--seed", "3", "--device", "cpu"]  # fmt: skip
EXAMPLES = sorted(  # example/<strategy>/train.py
    d for d in os.listdir(os.path.join(ROOT, "example"))
    if os.path.isfile(os.path.join(ROOT, "example", d, "train.py"))
)  # fmt: skip
# The logged loss is printed with 4 decimals; strategies differ from one device only by float32
# summation order (~1e-6), so equal-to-the-printed-digit up to one unit of rounding.
LOSS_ATOL = 1.5e-4


def _losses(output: str) -> List[float]:
    return [float(m) for m in re.findall(r"step\s+\d+ \| loss ([0-9.]+)", output)]


def _run(cmd: List[str], timeout: float = 180) -> str:
    """stdout and stderr of ``cmd`` (one pipe), checked to be a clean log of 3 steps."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    proc = subprocess.run(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=timeout,
    )  # fmt: skip
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}"
    assert "\r" not in proc.stdout, proc.stdout  # no progress-bar frames in a log
    assert len(_losses(proc.stdout)) == 3, proc.stdout  # whole step lines, one per step
    return proc.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(nproc: int) -> List[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
    ]


@pytest.fixture(scope="module")
def common(corpus_bin: str) -> List[str]:
    return [*COMMON, "--data", corpus_bin]


@pytest.fixture(scope="module")
def single_device_losses(common) -> List[float]:
    """The trainer in this process with the global batch of 2 ranks x 2 sequences."""
    losses = trainer.main("single_device", [*common, "--batch_size", "4"])
    assert len(losses) == 3 and losses[-1] < losses[0]
    return losses


@pytest.mark.parametrize("strategy", EXAMPLES)
def test_each_script_is_the_trainer_with_its_strategy(strategy, monkeypatch):
    started = []
    monkeypatch.setattr(trainer, "main", lambda name, argv=None: started.append(name))
    runpy.run_path(os.path.join(ROOT, "example", strategy, "train.py"), run_name="__main__")
    assert started == [strategy]


def test_the_fsdp_example_launched_with_torchrun_matches_single_device(
    common, single_device_losses
):
    out = _run([*_torchrun(2), "example/fsdp/train.py", *common, "--batch_size", "2"])
    assert "2 rank(s) on cpu | fp32 |" in out  # --precision auto on the CPU
    losses = _losses(out)
    for ours, ref in zip(losses, single_device_losses):
        assert abs(ours - ref) <= LOSS_ATOL, (losses, single_device_losses)


def test_precision_defaults_to_bf16_on_a_gpu_with_bf16_and_to_fp32_elsewhere(monkeypatch):
    """``--precision auto``: the fast choice where the examples run, bf16 on a CUDA GPU that
    computes in it natively (its tensor cores), fp32 on the CPU and where bf16 would only be
    emulated; a precision asked for is kept."""
    assert trainer.build_arg_parser("fsdp").parse_args([]).precision == "auto"
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)

    def gpu_with(native: bool, emulated: bool):  # torch.cuda.is_bf16_supported's answers
        return lambda including_emulation=True: native or (including_emulation and emulated)

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", gpu_with(native=True, emulated=True))
    assert [resolve_precision("auto", gpu), resolve_precision("auto", cpu)] == ["bf16", "fp32"]
    assert [resolve_precision("fp32", gpu), resolve_precision("bf16", cpu)] == ["fp32", "bf16"]
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", gpu_with(native=False, emulated=True))
    assert resolve_precision("auto", gpu) == "fp32"  # a V100: bf16 only emulated, slow


def _trainer_on_the_ranks(rank: int, world_size: int, strategy: str, argv: List[str]) -> list:
    destroyed = []
    with as_a_launched_job():  # the pool's group stays whatever the trainer does
        torch.distributed.destroy_process_group = lambda *args, **kw: destroyed.append(args)
        losses = trainer.main(strategy, argv)
    assert not destroyed, "the trainer destroyed a process group it did not make"
    return losses


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_the_trainer_on_two_ranks_matches_single_device(strategy, common, single_device_losses):
    """The returned losses are not rounded for printing: parity.py's fp32 tolerance."""
    argv = [*common, "--batch_size", "2"]
    for losses in run_distributed(_trainer_on_the_ranks, 2, strategy, argv):  # every rank's
        assert len(losses) == 3, losses
        for ours, ref in zip(losses, single_device_losses):
            assert abs(ours - ref) <= PARITY_LOSS_ATOL, (strategy, losses, single_device_losses)


def _save_then_resume(rank: int, world_size: int, strategy: str, argv: List[str], path: str):
    with as_a_launched_job():
        whole = trainer.main(strategy, argv)
        first = trainer.main(strategy, [*argv, "--steps", "2", "--save_dir", path])
        rest = trainer.main(strategy, [*argv, "--save_dir", path, "--resume"])
    return whole, first, rest


@pytest.mark.parametrize("strategy, sharded", [("zero1", False), ("fsdp", True)])
def test_the_trainer_saves_at_the_end_and_resumes_bit_for_bit(strategy, sharded, common, tmp_path):
    """``--save_dir`` alone saves after the last step (``--save_every`` adds more); ``--resume``
    continues from it (weights, optimizer, RNG and data position) to the losses of the run
    that never stopped, to the bit. A constant lr (``--min_lr_ratio 1``) makes a 2-step run
    the first two steps of a 3-step one."""
    argv = [*common, "--batch_size", "2", "--min_lr_ratio", "1"]
    argv += ["--sharded_ckpt"] if sharded else []
    path = str(tmp_path / "ckpt")
    for whole, first, rest in run_distributed(_save_then_resume, 2, strategy, argv, path):
        assert len(whole) == 3 and first == whole[:2] and rest == whole[2:], (whole, first, rest)


def test_the_trainer_leaves_the_process_group_it_made(common, monkeypatch):
    """Launched alone (torchrun with one process) it destroys the group it made at its end
    (NCCL warns at exit of one left behind); a group made before it (a harness rank's) stays
    the caller's: ``_trainer_on_the_ranks``."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # set here: restored after the test
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    trainer.main("fsdp", [*common, "--steps", "1", "--batch_size", "2"])
    assert not torch.distributed.is_initialized()


BF16 = "--precision bf16 --grad_ckpt"


def _hf_llama_everywhere(rank: int, world_size: int, argv: List[str]) -> dict:
    with as_a_launched_job():
        return {
            (strategy, flags): trainer.main(strategy, [*argv, *flags.split()])
            for strategy in ["ddp", "zero1", "zero2", "zero3", "fsdp"]
            for flags in ["", BF16]
        }


def test_a_transformers_model_trains_with_every_strategy_and_the_same_flags(common):
    """``--model hf:llama`` (a ``transformers`` model used as it is, or through the generic
    path) with every strategy, also with ``--precision bf16 --grad_ckpt``: fp32 as one device
    with the global batch; bf16 as DDP in bf16, and near fp32 (measured 2.5e-4: bf16 compute)."""
    pytest.importorskip("transformers")
    argv = [*common, "--model", "hf:llama", "--steps", "2", "--seq_len", "16"]
    single = trainer.main("single_device", [*argv, "--batch_size", "4"])
    for runs in run_distributed(_hf_llama_everywhere, 2, [*argv, "--batch_size", "2"]):
        for (strategy, flags), losses in runs.items():
            assert len(losses) == 2, (strategy, flags)
            want = runs["ddp", BF16] if flags else single
            for ours, ref, fp32 in zip(losses, want, single):
                assert abs(ours - ref) <= PARITY_LOSS_ATOL, (strategy, flags, losses, want)
                assert abs(ours - fp32) <= 2e-3, (strategy, flags, losses, single)


def test_fsdp_hsdp_across_two_torchrun_nodes_of_two_ranks(common, single_device_losses, tmp_path):
    """``--hsdp 2`` on two torchrun "nodes" of 2 ranks (each node one shard group, [Note: hybrid
    sharding]), 1 sequence per rank: the global batch of the single-device run. Two steps: the
    learning rate of the first step, and so the second loss, do not depend on ``--steps``. Only
    global rank 0 prints, although node 1's first rank has LOCAL_RANK 0 too."""
    port = str(_free_port())
    args = [*common[:3], "2", *common[4:], "--batch_size", "1", "--hsdp", "2"]  # --steps 2
    procs = []
    # Output to files, not pipes: a node blocked writing to a full pipe that nobody reads
    # (we wait for the other node first) would never reach the launchers' exit barrier.
    logs = [(tmp_path / f"node{n}.out", tmp_path / f"node{n}.err") for n in range(2)]
    for node, (out, err) in enumerate(logs):
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
                    "--nproc_per_node=2", f"--node_rank={node}", "--master_addr=127.0.0.1",
                    f"--master_port={port}"]  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
        with open(out, "w") as stdout, open(err, "w") as stderr:
            procs.append(
                subprocess.Popen(
                    [*launcher, "example/fsdp/train.py", *args], cwd=ROOT, env=env,
                    stdout=stdout, stderr=stderr, text=True,
                )  # fmt: skip
            )
    for p in procs:
        p.wait(timeout=180)
    outs = [(out.read_text(), err.read_text()) for out, err in logs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    losses = _losses(outs[0][0])  # node 0 hosts global rank 0
    assert len(losses) == 2, outs[0][0]
    assert _losses(outs[1][0]) == [], outs[1][0]  # global ranks 2 and 3
    for ours, ref in zip(losses, single_device_losses):
        assert abs(ours - ref) <= LOSS_ATOL, (losses, single_device_losses)


def _gpu_check_script(name: str, nproc: int, *extra: str) -> str:
    """stdout of ``benchmarks/<name>`` on ``nproc`` CPU ranks with a tiny GPT-2 (the GPU
    check's scripts take ``--device cpu`` as a smoke test), checked to exit cleanly."""
    script = os.path.join(ROOT, "benchmarks", name)
    args = ["--device", "cpu", "--model", "gpt2_tiny", "--batch_size", "2", "--seq_len", "16"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    cmd = [*_torchrun(nproc), script, *args, *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout


def test_the_gpu_throughput_benchmark_runs_every_strategy_on_the_cpu() -> None:
    """``benchmarks/gpu_throughput.py --device cpu``: the GPU check's benchmark, its table a row
    per strategy with tokens/s, the host ops of a step and both ratios (its GPU run is
    ``benchmarks/gpu.sh``)."""
    stdout = _gpu_check_script("gpu_throughput.py", 1, "--steps", "2", "--warmup", "1")
    rows = {
        cells[0]: cells[1:]
        for line in stdout.splitlines()
        if line.startswith("| ") and not line.startswith("| strategy")
        for cells in [[c.strip() for c in line.strip("|").split("|")]]
    }
    names = ["torch", "torch_fsdp2", "single_device", "ddp", "zero1", "zero2", "zero3", "fsdp"]
    assert list(rows) == names, stdout
    for name, (ms, tokens, _, _, ops, vs_torch, vs_fsdp2) in rows.items():
        assert float(ms) > 0 and float(tokens.replace(",", "")) > 0, (name, rows[name])
        assert int(ops.replace(",", "")) > 100, (name, rows[name])  # a step's ops, counted
        for vs in (vs_torch, vs_fsdp2):  # "median (first quartile-third quartile)"
            median, spread = vs.split(" ")
            low, high = (float(q) for q in spread.strip("()").split("-"))
            assert 0 < low <= high and low - 0.005 <= float(median) <= high + 0.005, (name, vs)
    assert rows["torch"][5] == "1.000 (1.00-1.00)" and rows["torch_fsdp2"][6].startswith("1.000 ")


def test_the_two_rank_gpu_trace_writes_each_rank_s_compute_and_collectives(tmp_path) -> None:
    """``benchmarks/gpu_trace.py --device cpu``: the GPU check's 2-rank FSDP timeline (ranks
    sharing one GPU through gloo on CUDA; here on the CPU), a compute lane per rank and its
    collectives, all-gathers and reductions, in communication lanes."""
    _gpu_check_script("gpu_trace.py", 2, "--steps", "2", "--out", str(tmp_path))
    with open(tmp_path / "fsdp_2ranks.trace.json") as f:
        events = json.load(f)["traceEvents"]
    for rank in (0, 1):
        lanes = {
            e["args"]["name"] for e in events if e.get("name") == "thread_name" and e["pid"] == rank
        }
        kinds = {e["args"]["kind"] for e in events if e.get("cat") == "comm" and e["pid"] == rank}
        assert "compute" in lanes and any(lane.startswith("comm ") for lane in lanes), lanes
        assert "all_gather" in kinds and kinds & {"reduce_scatter", "all_reduce"}, kinds
