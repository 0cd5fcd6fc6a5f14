"""Specification of failure handling: no rank ever waits forever for a rank that failed.

Inside ``fail_fast`` ([Note: fail fast]):

- a rank that raises in the middle of forward or backward makes every other rank raise
  ``PeerFailureError`` naming it and its error, whoever fails (rank 0 hosts the store);
- when the failed process exits (a real job), the others stop at once, long before the
  collective timeout; when it lives on (the test harness keeps its workers), at the timeout;
- a rank that is stuck (no exception) is named as unresponsive once the timeout passes;
- only communication errors are blamed on a peer: an error every rank raises stays its own.

The example trainer (``@fail_fast`` on ``main``), launched as N processes: every rank exits
non-zero naming the failed rank, in seconds. On the harness's ranks, with ``--on_nonfinite
skip`` a NaN on one rank skips that step on every rank; with ``error`` (the default) training
stops with a message naming the step.

Faults are injected by hooks on the GPT-2 blocks at forward number ``FAIL_STEP`` of one rank:
in block 1's forward, or in the backward reaching block 0's output (after the later layers
already reduced their gradients). This file is also the trainer tests' entry point (``__main__``).
"""

import contextlib
import os
import re
import socket
import subprocess
import sys
import time
import uuid
from typing import Callable, Iterator, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.build import adamw, build
from tests.harness import DistributedRunError, printed_by_a_launched_job, run_distributed
from tests.parity import global_batch, lm_loss, local_slice, make_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAIL_STEP = 2
ADAMW = adamw(lr=1e-2)  # every strategy's own AdamW
# Harness workers live on after a failure, so there the peers learn it at the collective timeout.
TIMEOUT_S = 2.0
GRACE_S = 2.0
# Slack on top of the expected wait, for the 3 training steps before the fault (< 1 s on an idle
# machine) and a few store round trips, on 2 cores that other jobs may share. Generous: the point
# is that the wait is bounded (the harness gives up at CALL_TIMEOUT_S and reports a hang).
SLACK_S = 40.0
CALL_TIMEOUT_S = 90.0
# The trainer runs with a collective timeout far above the bound it must meet: meeting the bound
# proves that the failure travelled through closed connections, not through the timeout.
TRAINER_TIMEOUT_S = 600.0
TRAINER_BOUND_S = 150.0  # 3 processes starting (torch import) and training 3 steps, on 2 cores


class InjectedFailure(RuntimeError):
    pass


def _install_fault(model: torch.nn.Module, fault: str, step: int) -> None:
    """At forward number ``step`` of ``model`` (wrapper or GPT2Model): ``forward`` raises in
    block 1's forward, ``hang`` sleeps there, ``backward`` raises when backward reaches block 0's
    output, ``nan`` makes block 1's output (hence loss and gradients) NaN."""
    blocks = getattr(model, "module", model).transformer.h
    calls = {"n": -1}

    def count(module, args):
        calls["n"] += 1

    def in_forward(module, args, output):
        if calls["n"] != step:
            return None
        if fault == "nan":
            return output * float("nan")
        if fault == "hang":
            time.sleep(60)  # stuck (e.g. a deadlock): longer than timeout + grace
        raise InjectedFailure(f"injected failure in forward of step {step}")

    def in_backward(module, args, output):
        if calls["n"] == step:

            def boom(grad):
                raise InjectedFailure(f"injected failure in backward of step {step}")

            output.register_hook(boom)

    blocks[0].register_forward_pre_hook(count)
    if fault == "backward":
        blocks[0].register_forward_hook(in_backward)
    else:
        blocks[1].register_forward_hook(in_forward)


# ------------------------------------------------------------------ rank side (harness)


def _train_with_fault(
    rank: int, world_size: int, strategy: str, fault: str, failing_rank: int, call_id: str
) -> None:
    """Train until the fault; then every rank re-raises what it got, the failing rank last.

    The harness reports only the ranks that fail within ERROR_GRACE of the first one, so the failing
    rank (whose error comes first) waits until the others have theirs before re-raising.
    """
    from tiny_fsdp.core.utils.failure import PeerFailureError, fail_fast

    store = dist.distributed_c10d._get_default_store()
    peers_done = [f"{call_id}/{r}" for r in range(world_size) if r != failing_rank]
    try:
        with fail_fast(timeout_s=TIMEOUT_S, grace_s=GRACE_S):
            model, optimizer = build(strategy, make_model(), ADAMW)
            if rank == failing_rank:
                _install_fault(model, fault, FAIL_STEP)
            for step in range(FAIL_STEP + 1):
                x, y = global_batch(step, 2 * world_size, 8, model.module.config.vocab_size)
                x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
                lm_loss(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    except PeerFailureError:
        store.set(f"{call_id}/{rank}", "done")
        raise
    except InjectedFailure:
        if fault != "hang" and peers_done:
            store.wait(peers_done)
        raise


def _noop(rank: int, world_size: int) -> None:
    pass


def _failure_errors(fn: Callable, world_size: int, *args) -> Tuple[dict, float]:
    """Run ``fn``, expecting every rank to fail; return (rank -> traceback text, seconds)."""
    run_distributed(_noop, world_size)  # a warm pool: start-up is not part of the measure
    start = time.monotonic()
    with pytest.raises(DistributedRunError) as info:
        run_distributed(fn, world_size, *args, timeout=CALL_TIMEOUT_S)
    return info.value.errors, time.monotonic() - start


def _peer_message(rank: int, failed: int, fault: str) -> str:
    return (
        f"PeerFailureError: rank {rank} stopped because rank {failed} failed: InjectedFailure: "
        f"injected failure in {fault} of step {FAIL_STEP}"
    )


# ------------------------------------------------------------------ tests (harness)


@pytest.mark.parametrize(
    "strategy, fault, world_size, failing_rank",
    [
        ("fsdp", "backward", 3, 1),
        # 2 ranks: FSDP's reduce-scatters in flight are a send and a receive, which must wait
        # with the collective timeout too ([Note: collectives on gloo])
        ("fsdp", "backward", 2, 1),
        ("zero3", "forward", 2, 0),  # rank 0 hosts the store: it must outlive the others' reads
    ],
)
def test_a_rank_raising_mid_step_stops_every_rank_naming_it(
    strategy: str, fault: str, world_size: int, failing_rank: int
) -> None:
    call_id = f"test_failure/{uuid.uuid4().hex}"
    errors, elapsed = _failure_errors(
        _train_with_fault, world_size, strategy, fault, failing_rank, call_id
    )
    assert sorted(errors) == list(range(world_size)), errors.keys()  # nobody hangs or succeeds
    own = f"InjectedFailure: injected failure in {fault} of step {FAIL_STEP}"
    assert own in errors[failing_rank] and "PeerFailureError" not in errors[failing_rank]
    for rank in range(world_size):
        if rank != failing_rank:
            assert _peer_message(rank, failing_rank, fault) in errors[rank], errors[rank]
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + SLACK_S


def test_a_stuck_rank_is_named_as_unresponsive_after_the_timeout() -> None:
    errors, elapsed = _failure_errors(_train_with_fault, 3, "ddp", "hang", 1, "unused")
    assert 1 not in errors  # still sleeping when the others gave up (the harness kills it)
    for rank in (0, 2):
        assert re.search(
            rf"PeerFailureError: rank {rank} stopped because rank\(s\) \[1\] stopped responding",
            errors[rank],
        ), errors[rank]
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + GRACE_S + SLACK_S


def test_only_communication_errors_can_be_blamed_on_a_peer() -> None:
    from tiny_fsdp.core.utils.failure import PeerFailureError, is_communication_error

    # What gloo raises when a peer left, or at the timeout; NCCL raises DistBackendError.
    closed = "[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:5039"
    timed_out = "[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 2000ms for recv"
    assert is_communication_error(RuntimeError(closed))
    assert is_communication_error(RuntimeError(timed_out))
    assert is_communication_error(dist.DistBackendError("NCCL error: unhandled system error"))
    # A rank's own errors stay its own, even when every rank raises them at once.
    assert not is_communication_error(ValueError("sequence length 40 exceeds block_size 32"))
    assert not is_communication_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_communication_error(PeerFailureError(0, {1: "ValueError: x"}, [], closed))


def test_the_peer_failure_travels_between_processes_as_it_was() -> None:
    """A job runner (multiprocessing, a pool) pickles a worker's exception to its parent: the
    copy has the same message and fields (an exception class whose __init__ takes other
    arguments than its message fails to unpickle, and a pool's result thread dies on it)."""
    import pickle

    from tiny_fsdp.core.utils.failure import PeerFailureError

    error = PeerFailureError(2, {1: "ValueError: x"}, [3], "Connection closed by peer")
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is PeerFailureError and str(copy) == str(error)
    assert (copy.rank, copy.failed, copy.unresponsive, copy.cause) == (
        2, {1: "ValueError: x"}, [3], "Connection closed by peer"
    )  # fmt: skip
    assert copy.failed_ranks == [1, 3]


def _nonfinite(rank: int, world_size: int) -> List[dict]:
    from tiny_fsdp.core.utils.failure import nonfinite_ranks

    last = world_size - 1
    cases = [
        {"loss": 1.0, "grad norm": torch.tensor(2.0)},  # finite everywhere
        {"loss": float("nan") if rank == 1 else 1.0},  # NaN loss on rank 1 only
        {"loss": 1.0, "grad norm": torch.tensor([0.0, float("inf") if rank == last else 0.0])},
    ]
    return [nonfinite_ranks(values) for values in cases]


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_rank_agrees_on_which_ranks_saw_a_nonfinite_value(world_size: int) -> None:
    results = run_distributed(_nonfinite, world_size)
    assert results == [[{}, {"loss": [1]}, {"grad norm": [world_size - 1]}]] * world_size


def test_without_a_process_group_fail_fast_is_transparent() -> None:
    from tiny_fsdp.core.utils.failure import fail_fast, nonfinite_ranks

    if dist.is_initialized():
        pytest.skip("another test initialised a process group in the pytest process")
    with pytest.raises(KeyError, match="plain error"):
        with fail_fast(timeout_s=1.0):
            raise KeyError("plain error")
    assert nonfinite_ranks({"a": 1.0, "b": torch.tensor([0.5, float("nan")])}) == {"b": [0]}
    assert nonfinite_ranks({"a": 1.0, "b": torch.zeros(3)}) == {}


# ------------------------------------------------------------------ symmetric collectives
#
# A collective that one rank skips, or issues with another size, hangs the others. Every code
# path must therefore issue the same collectives, in the same order, with the same sizes, on
# every rank, including the corner cases below. Recorded by wrapping tiny_fsdp.core.comm.

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_gather_object")


class _Tiny(nn.Module):
    """2 -> 3 -> 2 MLP: tensors of 2 and 3 rows (fewer than 4 ranks: all-padding FSDP shards),
    a layer that forward never calls, and a head (``extra``) that ``use_extra`` switches off."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(2, 3)
        self.norm = nn.LayerNorm(3)
        self.down = nn.Linear(3, 2)
        self.unused = nn.Linear(2, 2)
        self.extra = nn.Linear(2, 2, bias=False)
        self.use_extra = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down(torch.tanh(self.norm(self.up(x))))
        return self.extra(y) if self.use_extra else y


class _Pair(nn.Module):
    """Two bias-free 2 x 2 layers: 2 tensors, so ZeRO-3 ranks 2 and 3 of 4 own nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2, bias=False)
        self.b = nn.Linear(2, 2, bias=False)
        self.use_extra = True  # unused: the interface of _Tiny

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _tiny_model(model: str, frozen: bool) -> nn.Module:
    torch.manual_seed(0)
    if model == "pair":
        return _Pair()
    tiny = _Tiny()
    if frozen:
        tiny.norm.weight.requires_grad_(False)
        tiny.up.bias.requires_grad_(False)
    return tiny


@contextlib.contextmanager
def _recording(log: list) -> Iterator[None]:
    """Append (kind, shape, dtype) of every collective issued through ``comm`` to ``log``."""
    from tiny_fsdp.core import comm

    originals = {kind: getattr(comm, kind) for kind in KINDS}

    def recorder(kind: str, original: Callable) -> Callable:
        def call(*args, **kwargs):
            first = args[0]
            shape = tuple(first.shape) if isinstance(first, torch.Tensor) else type(first).__name__
            log.append((kind, shape, str(getattr(first, "dtype", ""))))
            return original(*args, **kwargs)

        return call

    try:
        for kind, original in originals.items():
            setattr(comm, kind, recorder(kind, original))
        yield
    finally:
        for kind, original in originals.items():
            setattr(comm, kind, original)


SYMMETRY_CASES = [  # (strategy, model, frozen, data-dependent head)
    *[
        (s, "tiny", frozen, False)
        for s in ("ddp", "zero1", "zero2", "zero3", "fsdp")
        for frozen in (0, 1)
    ],
    ("zero3", "pair", 0, False),
    ("fsdp", "pair", 0, False),
    # Only DDP and ZeRO-1/2 promise to work when ranks use different parameters (a rank
    # without a gradient sends zeros); ZeRO-3 / FSDP fetch per layer call by design.
    *[(s, "tiny", 1, True) for s in ("ddp", "zero1", "zero2")],
]


def _collectives(rank: int, world_size: int) -> List[Tuple[list, dict]]:
    from tiny_fsdp.core.comm import LEDGER
    from tiny_fsdp.core.utils.failure import fail_fast

    seen = []
    for strategy, model_name, frozen, data_dependent in SYMMETRY_CASES:
        log: list = []
        with fail_fast(timeout_s=20.0), _recording(log):  # a mismatch fails, never hangs
            LEDGER.reset()
            plain = _tiny_model(model_name, bool(frozen))
            model, optimizer = build(strategy, plain, ADAMW)
            for step in range(2):
                model.module.use_extra = not data_dependent or (rank + step) % 2 == 0
                x = torch.randn(3, 2, generator=torch.Generator().manual_seed(rank))
                model(x).square().mean().backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            full = model.state_dict()
        seen.append((log, dict(LEDGER.calls), {k: tuple(v.shape) for k, v in full.items()}))
    return seen


def test_every_rank_issues_the_same_collectives_in_the_same_order() -> None:
    """4 ranks. The tiny model's 2- and 3-row tensors leave FSDP ranks 2-3 (or 3) with all-padding
    shards; the pair model leaves ZeRO-3 ranks 2-3 owning nothing; frozen parameters, a layer
    never called, and a head that only some ranks use in some steps."""
    expected_shapes = {
        name: {k: tuple(v.shape) for k, v in _tiny_model(name, False).state_dict().items()}
        for name in ("tiny", "pair")
    }
    per_rank = run_distributed(_collectives, 4)
    for case, observed in zip(SYMMETRY_CASES, zip(*per_rank)):
        logs, ledgers, shapes = zip(*observed)
        assert logs[0], case  # it communicated at all
        assert all(log == logs[0] for log in logs), (case, [len(log) for log in logs])
        assert all(ledger == ledgers[0] for ledger in ledgers), (case, ledgers)
        # state_dict (itself a collective) gives every rank the full model
        assert all(s == expected_shapes[case[1]] for s in shapes), case


# ------------------------------------------------------------------ the example trainer


def _trainer_args(data: str, *extra: str) -> List[str]:
    return ["--model", "gpt2_bytes", "--data", data, "--tokenizer", "byte", "--seq_len", "16",
            "--batch_size", "2", "--steps", "4", "--lr", "1e-3", "--log_every", "1",
            "--device", "cpu", "--timeout_s", str(TRAINER_TIMEOUT_S), *extra]  # fmt: skip


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> str:
    """~40 KB of English (this file's source): enough windows for a few steps."""
    path = tmp_path_factory.mktemp("data") / "text.txt"
    with open(__file__) as f:
        path.write_text(f.read() * 2)
    return str(path)


def _launch(nproc: int, argv: List[str]) -> Tuple[List[Tuple[int, str, str]], float]:
    """Run ``python tests/test_failure.py argv`` as ranks 0..nproc-1 of one job, launched the
    way torchrun does (environment variables) but without torchrun, which would kill the other
    ranks on the first failure before they can say anything. Returns ([(returncode, stdout,
    stderr)] per rank, wall seconds)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, GLOO_SOCKET_IFNAME="lo",
               WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)  # fmt: skip
    cmd = [sys.executable, os.path.join("tests", "test_failure.py"), *argv]
    start = time.monotonic()
    procs = [
        subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(nproc)
    ]
    try:
        outs = [p.communicate(timeout=TRAINER_BOUND_S) for p in procs]
    finally:
        for p in procs:
            p.kill()
    results = [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]
    return results, time.monotonic() - start


def test_trainer_every_rank_exits_naming_the_failed_rank_in_seconds(text_file: str) -> None:
    argv = ["fsdp", "backward", "1", str(FAIL_STEP), *_trainer_args(text_file)]
    results, elapsed = _launch(3, argv)
    codes = [code for code, _, _ in results]
    assert codes[1] != 0 and f"injected failure in backward of step {FAIL_STEP}" in results[1][2]
    for rank in (0, 2):
        assert codes[rank] != 0, results[rank]
        assert _peer_message(rank, 1, "backward") in results[rank][2], results[rank][2][-3000:]
    assert elapsed < TRAINER_BOUND_S


def _logged(out: str) -> List[Tuple[int, float, str]]:
    """(step, loss, rest of the line) of every step line the trainer printed."""
    lines = re.findall(r"step\s+(\d+) \| loss ([0-9.a-z]+) \|(.*)", out)
    return [(int(step), float(loss), rest) for step, loss, rest in lines]


def _printed_by_the_trainer(rank: int, world_size: int, argv: List[str]) -> str:
    return printed_by_a_launched_job(lambda: _trainer_with_fault(argv))


def test_trainer_skips_a_nonfinite_step_on_every_rank(text_file: str) -> None:
    argv = ["zero2", "nan", "1", "1", *_trainer_args(text_file, "--on_nonfinite", "skip")]
    logged = _logged(run_distributed(_printed_by_the_trainer, 2, argv)[0])
    assert [step for step, _, _ in logged] == [0, 1, 2, 3]
    # Rank 0's loss was finite; its averaged gradients were not (rank 1's NaNs are in the
    # average). ZeRO-2's step all-gathers parameters: a rank stepping alone would hang.
    assert "step skipped: non-finite loss on rank(s) [1], grad norm on rank(s) [0, 1]" in (
        logged[1][2]
    )
    assert all("skipped" not in rest for step, _, rest in logged if step != 1)
    assert all(loss == loss and loss < 10 for step, loss, _ in logged if step != 1)


def test_trainer_stops_at_a_nonfinite_step_by_default(text_file: str, capsys) -> None:
    from tiny_fsdp.core.utils.failure import NonFiniteError

    argv = ["single_device", "nan", "0", "1", *_trainer_args(text_file)]
    with pytest.raises(NonFiniteError, match=r"step 1: non-finite loss on rank\(s\) \[0\], grad "
                       r"norm on rank\(s\) \[0\]; .*--on_nonfinite skip"):  # fmt: skip
        _trainer_with_fault(argv)
    assert len(_logged(capsys.readouterr().out)) == 1  # step 0 only: step 1 stopped training


def _trainer_with_fault(argv: List[str]) -> Optional[List[float]]:
    """``<strategy> <fault> <rank> <step> <trainer args...>``: the trainer, with a fault."""
    strategy, fault, failing_rank, step, *trainer_argv = argv
    from example import trainer

    build = trainer.build_strategy

    def build_with_fault(name, make_model, args, env):
        model, optimizer = build(name, make_model, args, env)
        if env.rank == int(failing_rank):
            _install_fault(model, fault, int(step))
        return model, optimizer

    trainer.build_strategy = build_with_fault
    try:
        return trainer.main(strategy, trainer_argv)
    finally:
        trainer.build_strategy = build


if __name__ == "__main__":
    _trainer_with_fault(sys.argv[1:])
