"""Multi-process test harness: run a function on N ranks that share a live process group.

``run_distributed(fn, world_size, *args)`` calls ``fn(rank, world_size, *args)`` on every rank
and returns the per-rank results in rank order. Starting a process and importing torch costs
seconds, so the ranks live in persistent *worker pools*: one pool of ``world_size`` processes
per ``(world_size, backend)``, started on first use, with its default process group initialised
once, and reused by every later call for the rest of the pytest session. Workers fork from one
server process that imported torch once ([Note: workers fork from a preloaded server]).

Invariants the harness keeps:

* A call either returns one result per rank or raises; it never hangs. Past ``timeout`` seconds
  every worker of the pool is killed and :class:`DistributedTimeoutError` names the ranks that
  were still running, with their Python stacks at that moment.
* After any failure (an exception on some rank, a crash, a timeout, Ctrl-C) the pool is killed
  and a fresh one is started, so a half-finished collective can never leak into a later test.
* After ``fn`` returns, the ranks synchronise on a private gloo group and compare how many
  collectives each issued on the default group. Ranks that are out of step fail *this* call
  instead of silently pairing up with the next test's collectives.
* An exception Python could not raise in a worker (in a ``__del__``, a weak reference's
  callback, a finalizer: printed as "Exception ignored in ...") fails the call during which it
  was reported: garbage is collected when Python decides, so that may be the call after the one
  that dropped the object; the message names the object.
* Per-call global torch state that tests commonly change (grad mode, default dtype, thread
  count) is restored after every call. Nothing is reseeded: tests seed themselves.

Rules for ``fn``: it must be a module-level function (workers find it by its import path, e.g.
``tests.test_ddp._check_grads``), and its arguments and return value must be picklable; tensors
travel by value. Plain ``assert`` works and reports the compared values: modules of the
``tests`` package are imported in the workers with pytest's assertion rewriting.
"""

from __future__ import annotations

import ast
import atexit
import contextlib
import faulthandler
import importlib.abc
import importlib.machinery
import io
import multiprocessing
import multiprocessing.util  # noqa: F401  (imported before our atexit hook; see below)
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Dict, Iterator, Optional, Sequence

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Budget for spawning a pool, importing torch in each worker and the rendezvous. It is separate
# from the per-call timeout so that a short timeout in a test does not race a cold start.
STARTUP_TIMEOUT = 180.0
# After the first rank reports an error, how long to wait for the other ranks' reports. A rank
# that re-raises after its peers (tests/test_failure.py) can report a second or more later on a
# loaded 2-core machine, with asynchronous collectives still being torn down.
ERROR_GRACE = 3.0
# How long workers get to exit cleanly at shutdown before they are killed.
SHUTDOWN_GRACE = 5.0
# [Note: workers fork from a preloaded server]
# Importing torch, and torch._dynamo (which every torch.optim optimizer imports on first use),
# costs each new process about 4 s of CPU; a session starts some 40 workers (4 pool sizes, and a
# fresh pool after every failure test), which on 2 cores is over a minute. So the workers fork
# from multiprocessing's "forkserver", which imports these modules once: forking after
# ``import torch`` is safe (nothing has run yet: no thread pools, no CUDA context), as for
# DataLoader workers. Only imports are preloaded; each worker still gets its own process group
# and torch state. NCCL pools (CUDA) and platforms without a forkserver (Windows) spawn their
# workers: CUDA must never be touched before a fork, and those pools are few.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "tiny_fsdp.core"]
# A failed start is retried once: the free port we picked may have been taken in the meantime.
START_ATTEMPTS = 2
BACKENDS = ("gloo", "nccl")

# Workers unpickle ``tests.harness._worker_main``, so the repo root must be on the sys.path
# that spawned children inherit, whatever pytest import mode put us here.
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)


class DistributedRunError(RuntimeError):
    """Some rank failed. ``errors`` maps each failed rank to its formatted traceback."""

    def __init__(self, message: str, errors: Optional[dict[int, str]] = None) -> None:
        super().__init__(message)
        self.errors: dict[int, str] = dict(errors or {})

    @property
    def failed_ranks(self) -> list[int]:
        return sorted(self.errors)


class DistributedTimeoutError(DistributedRunError):
    """The call ran past its timeout. ``still_running`` lists ranks that had not returned."""

    def __init__(self, message: str, still_running: Sequence[int]) -> None:
        super().__init__(message)
        self.still_running: list[int] = list(still_running)


# --------------------------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------------------------

_POOLS: dict[tuple[int, str], _WorkerPool] = {}
# Pools are shared global state; a lock keeps concurrent callers (threads) from interleaving.
_LOCK = threading.RLock()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 120.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return results by rank.

    Each rank runs in a persistent worker process whose default process group (``backend``)
    is already initialised. With ``backend="nccl"`` rank ``r`` uses ``cuda:r`` and the calling
    test is skipped when fewer than ``world_size`` GPUs are present.

    Raises :class:`DistributedRunError` (message holds each failed rank and its traceback) if
    any rank raises or dies, :class:`DistributedTimeoutError` if the call takes longer than
    ``timeout`` seconds (pool start-up not included), and ``TypeError`` if ``fn`` or ``args``
    cannot be pickled (e.g. ``fn`` is a lambda or a nested function).
    """
    __tracebackhide__ = True  # pytest: the failure is in the ranks, not in this frame
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    if backend == "nccl":
        _skip_unless_enough_gpus(world_size)

    what = f"run_distributed({_describe(fn)}, world_size={world_size}, backend={backend!r})"
    try:
        payload = pickle.dumps((fn, args))
    except Exception as exc:
        raise TypeError(
            f"{what}: fn and args must be picklable, and fn must be a module-level function "
            f"(not a lambda, closure or nested function): {exc}"
        ) from exc

    key = (world_size, backend)
    with _LOCK:
        pool = _ready_pool(key)
        try:
            return pool.run(payload, timeout, what)
        except DistributedRunError:
            # The collective state of the survivors is unknown: replace the whole pool. The new
            # one starts now so that its start-up overlaps with whatever the caller does next.
            _discard_pool(key)
            _POOLS[key] = _WorkerPool(*key)
            raise
        except BaseException:
            # Interrupted (Ctrl-C, pytest-timeout, ...) while ranks were busy: kill them.
            _discard_pool(key)
            raise


def run_script_ranks(
    script: str, world_size: int, timeout: float = 120.0, env: Optional[Dict[str, str]] = None
) -> list[tuple[int, str]]:
    """Run ``python <script>`` (a path from the repository root) as ranks ``0..world_size-1`` of
    one gloo job (``RANK`` / ``WORLD_SIZE`` / ``MASTER_*`` set, as ``torchrun`` does, and ``env``
    added), for tests of what happens when processes exit or of settings read at start-up;
    returns each rank's (exit code, output)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO_ROOT, GLOO_SOCKET_IFNAME="lo",
               WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()), **(env or {}))  # fmt: skip
    procs = [
        subprocess.Popen(
            [sys.executable, script],
            cwd=REPO_ROOT,
            env=dict(env, RANK=str(rank)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world_size)
    ]
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [(p.returncode, out) for p, out in zip(procs, outs)]


@contextlib.contextmanager
def as_a_launched_job() -> Iterator[None]:
    """Inside ``fn``: run code written for a torchrun job (the example trainer sets the
    collective timeout; a script may destroy the default process group at its end) on a
    harness rank, leaving the pool's process group as it was."""
    import torch.distributed as dist

    from tiny_fsdp.core.utils.dist import get_collective_timeout, set_collective_timeout

    timeout, destroy = get_collective_timeout(), dist.destroy_process_group
    dist.destroy_process_group = lambda *args, **kwargs: None
    try:
        yield
    finally:
        dist.destroy_process_group = destroy
        if timeout is not None:
            set_collective_timeout(timeout)


def printed_by_a_launched_job(call: Callable[[], Any]) -> str:
    """Inside ``fn``: what ``call()`` prints to stdout, run ``as_a_launched_job``."""
    printed = io.StringIO()
    with as_a_launched_job(), contextlib.redirect_stdout(printed):
        call()
    return printed.getvalue()


def shutdown_pools() -> None:
    """Stop every worker pool. Idempotent; the next ``run_distributed`` starts new pools."""
    with _LOCK:
        pools = list(_POOLS.values())
        _POOLS.clear()
        for pool in pools:
            if pool.ready:
                pool.request_stop()
            else:  # still starting up (e.g. replacing a failed pool): nothing to wait for
                pool.kill()
        deadline = time.monotonic() + SHUTDOWN_GRACE
        for pool in pools:
            pool.join_or_kill(deadline)


# atexit runs hooks last-registered-first. multiprocessing registered its own hook (which joins
# non-daemon children, i.e. would wait forever for idle workers) when multiprocessing.util was
# imported above, so ours runs before it and the workers are already gone by then.
atexit.register(shutdown_pools)


def _ready_pool(key: tuple[int, str]) -> _WorkerPool:
    __tracebackhide__ = True
    for attempt in range(1, START_ATTEMPTS + 1):
        pool = _POOLS.get(key)
        if pool is None:
            pool = _POOLS[key] = _WorkerPool(*key)
        try:
            pool.wait_ready()
            return pool
        except _StartupError as exc:
            _discard_pool(key)
            if attempt == START_ATTEMPTS:
                raise DistributedRunError(
                    f"could not start a worker pool (world_size={key[0]}, backend={key[1]!r}) "
                    f"after {START_ATTEMPTS} attempts:\n{exc}"
                ) from None
    raise AssertionError("unreachable")


def _discard_pool(key: tuple[int, str]) -> None:
    pool = _POOLS.pop(key, None)
    if pool is not None:
        pool.kill()


def _skip_unless_enough_gpus(world_size: int) -> None:
    import torch
    import torch.distributed as dist

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not dist.is_nccl_available() or gpus < world_size:
        pytest.skip(
            f"backend 'nccl' with world_size={world_size} needs {world_size} GPUs; {gpus} found"
        )


def _describe(fn: Callable[..., Any]) -> str:
    qualname = getattr(fn, "__qualname__", None)
    return f"{fn.__module__}.{qualname}" if qualname else repr(fn)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_context(backend: str) -> multiprocessing.context.BaseContext:
    if backend != "gloo" or "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts, with the first pool
    return ctx


class _StartupError(Exception):
    pass


class _WorkerPool:
    """``world_size`` spawned workers, one per rank, each talking to us over its own pipe.

    Protocol (pickled tuples). Parent -> worker: pickled ``(fn, args)`` per call, or an empty
    message meaning "exit". Worker -> parent: ``("ready", pid)`` or ``("init_error", tb)`` once;
    per call ``("returned", result)`` then ``("synced", None)``, or ``("error", tb)`` at any point.
    """

    def __init__(self, world_size: int, backend: str) -> None:
        self.world_size = world_size
        self.backend = backend
        self.ready = False
        self.pids: list[int] = []
        # Stack dumps of stuck workers are written here (see _dump_stacks).
        self.dump_dir = tempfile.mkdtemp(prefix=f"tiny_fsdp_ws{world_size}_")
        ctx = _start_context(backend)
        port = _free_port()
        self.conns: list[Connection] = []
        self.procs: list[multiprocessing.process.BaseProcess] = []
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=_worker_main,
                args=(rank, world_size, backend, port, child_end, os.getpid(), self._dump(rank)),
                name=f"tiny_fsdp-{backend}-ws{world_size}-rank{rank}",
                # Not daemonic so that tests may start processes (e.g. DataLoader workers).
                daemon=False,
            )
            proc.start()
            child_end.close()  # so that a dead worker shows up as EOF on our end
            self.conns.append(parent_end)
            self.procs.append(proc)

    def _dump(self, rank: int) -> str:
        return os.path.join(self.dump_dir, f"rank{rank}.txt")

    def _recv(self, rank: int) -> tuple[str, Any]:
        try:
            return pickle.loads(self.conns[rank].recv_bytes())
        except (EOFError, OSError):
            proc = self.procs[rank]
            proc.join(timeout=1.0)
            return "died", (
                f"worker process of rank {rank} (pid {proc.pid}) died with exit code "
                f"{proc.exitcode}; its stderr (e.g. a faulthandler stack) is in the test output"
            )
        except Exception:
            return "error", "could not unpickle the message from the worker:\n" + (
                traceback.format_exc()
            )

    def wait_ready(self) -> None:
        if self.ready:
            return
        deadline = time.monotonic() + STARTUP_TIMEOUT
        pending = set(range(self.world_size))
        pids = [0] * self.world_size
        while pending:
            remaining = deadline - time.monotonic()
            conns = [self.conns[r] for r in sorted(pending)]
            if remaining <= 0 or not (ready := wait(conns, timeout=remaining)):
                raise _StartupError(
                    f"workers did not become ready within {STARTUP_TIMEOUT:.0f} s; "
                    f"ranks not ready: {sorted(pending)}"
                )
            for conn in ready:
                rank = self.conns.index(conn)
                kind, payload = self._recv(rank)
                if kind != "ready":
                    raise _StartupError(f"rank {rank} failed to start:\n{payload}")
                pids[rank] = payload
                pending.discard(rank)
        self.pids = pids
        self.ready = True

    def run(self, payload: bytes, timeout: float, what: str) -> list[Any]:
        __tracebackhide__ = True
        ws = self.world_size
        errors: dict[int, str] = {}
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(payload)
            except OSError:
                errors[rank] = self._recv(rank)[1]  # the worker died while idle
        if errors:
            raise DistributedRunError(_failure_message(what, errors, []), errors)
        deadline = time.monotonic() + timeout
        results: list[Any] = [None] * ws
        returned: set[int] = set()  # fn returned; the rank now waits in the harness sync
        pending = set(range(ws))  # neither synced nor failed
        give_up_at = deadline
        while pending:
            remaining = give_up_at - time.monotonic()
            if remaining <= 0:
                break
            for conn in wait([self.conns[r] for r in sorted(pending)], timeout=remaining):
                rank = self.conns.index(conn)
                kind, value = self._recv(rank)
                if kind == "returned":
                    results[rank] = value
                    returned.add(rank)
                    continue
                pending.discard(rank)
                if kind != "synced":
                    errors[rank] = value
                    # Ranks left waiting for the failed one would only hit the timeout; give
                    # them a moment to report their own errors, then stop listening.
                    give_up_at = min(give_up_at, time.monotonic() + ERROR_GRACE)

        if errors:
            raise DistributedRunError(_failure_message(what, errors, sorted(pending)), errors)
        if pending:
            still_running = sorted(pending - returned)
            # The stacks of ranks that wait in the harness sync say nothing new.
            stacks = self._dump_stacks(still_running or sorted(pending))
            raise DistributedTimeoutError(
                _timeout_message(what, timeout, still_running, sorted(pending & returned), stacks),
                still_running,
            )
        return results

    def _dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Ask stuck workers for their Python stacks (faulthandler, on SIGUSR1)."""
        if not hasattr(signal, "SIGUSR1"):
            return {}
        for rank in ranks:
            try:
                os.kill(self.procs[rank].pid, signal.SIGUSR1)
            except OSError:
                pass
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and not all(_non_empty(self._dump(r)) for r in ranks):
            time.sleep(0.02)
        time.sleep(0.05)  # let a dump that has started finish
        stacks = {}
        for rank in ranks:
            try:
                with open(self._dump(rank)) as f:
                    stacks[rank] = _clean_stack_dump(f.read())
            except OSError:
                pass
        return stacks

    def request_stop(self) -> None:
        for conn in self.conns:
            try:
                conn.send_bytes(b"")
            except OSError:
                pass

    def join_or_kill(self, deadline: float) -> None:
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(timeout=10.0)
        for conn in self.conns:
            conn.close()
        shutil.rmtree(self.dump_dir, ignore_errors=True)


def _failure_message(what: str, errors: dict[int, str], unfinished: list[int]) -> str:
    ranks = sorted(errors)
    where = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
    lines = [f"{what} failed on {where}."]
    if unfinished:
        lines.append(f"Ranks that had not finished (probably waiting for the others): {unfinished}")
    lines.append("The worker pool was killed; the next call starts a fresh one.")
    for rank in ranks:
        lines.append(f"\n----- rank {rank} -----\n{errors[rank].rstrip()}")
    return "\n".join(lines)


def _timeout_message(
    what: str,
    timeout: float,
    still_running: list[int],
    waiting: list[int],
    stacks: dict[int, str],
) -> str:
    lines = [f"{what} timed out after {timeout:.1f} s; ranks still running: {still_running}"]
    if waiting:
        lines.append(f"Ranks whose fn returned and that were waiting for the others: {waiting}")
    lines.append("All worker processes were killed; the next call starts a fresh pool.")
    for rank in sorted(stacks):
        state = "still running fn" if rank in still_running else "fn returned, waiting"
        lines.append(f"\n----- rank {rank} at timeout ({state}) -----\n{stacks[rank].rstrip()}")
    return "\n".join(lines)


def _non_empty(path: str) -> bool:
    return os.path.exists(path) and os.path.getsize(path) > 0


def _clean_stack_dump(dump: str) -> str:
    """Keep the threads that run test code, cut below the harness's ``_run_one`` frame."""
    threads = []
    for block in dump.strip().split("\n\n"):
        if f"in {_watch_parent.__name__}" in block:
            continue
        lines = block.splitlines()
        cut = [i for i, line in enumerate(lines) if line.endswith(f"in {_run_one.__name__}")]
        threads.append("\n".join(lines[: cut[0]] if cut else lines))
    return "\n\n".join(threads)


# --------------------------------------------------------------------------------------------
# Worker side (runs in the spawned processes)
# --------------------------------------------------------------------------------------------


def _worker_main(
    rank: int,
    world_size: int,
    backend: str,
    port: int,
    conn: Connection,
    parent_pid: int,
    dump_path: str,
) -> None:
    # Ctrl-C reaches the whole process group; the parent handles it and kills us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    faulthandler.enable()  # a crash prints the Python stack to stderr
    dump_file = open(dump_path, "w")  # stays open: faulthandler writes to its descriptor
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=dump_file, all_threads=True)
    try:
        sync_group = _init_process_group(rank, world_size, backend, port)
        _install_assert_rewriting()
    except BaseException:
        _send(conn, ("init_error", traceback.format_exc()))
        return
    sys.unraisablehook = _record_unraisable
    _send(conn, ("ready", os.getpid()))

    while True:
        try:
            payload = conn.recv_bytes()
        except (EOFError, OSError):  # the parent is gone
            break
        if not payload:  # shutdown request
            break
        _run_one(rank, world_size, payload, conn, sync_group)
    # Exit without interpreter teardown (a large share of a second per torch process, times
    # up to 10 workers on 2 cores) and without destroy_process_group, which could block on
    # peers that are exiting too. Sockets and memory go back to the OS either way.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _watch_parent(parent_pid: int) -> None:
    # If the parent dies while we are stuck in a collective, nobody would ever kill us. (Our
    # parent process is the fork server, so ask whether the test process is still there.)
    while True:
        try:
            os.kill(parent_pid, 0)
        except OSError:  # no such process (or a reused pid of another user's): it is gone
            os._exit(1)
        time.sleep(1.0)


def _init_process_group(rank: int, world_size: int, backend: str, port: int) -> Any:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    if sys.platform.startswith("linux"):
        # Everything is on one machine; do not let gloo pick an interface from the hostname.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

    import torch
    import torch.distributed as dist

    # Up to 4 ranks share 2 cores: more threads per rank only adds contention.
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size)
    # The harness synchronises on its own gloo group: on the default group its barrier could
    # pair up with a collective that a test left pending and hide the mismatch.
    return dist.new_group(backend="gloo")


def _run_one(rank: int, world_size: int, payload: bytes, conn: Connection, sync_group: Any) -> None:
    issued_before = _collectives_issued()
    try:
        try:
            fn, args = pickle.loads(payload)
            result = fn(rank, world_size, *args)
            _raise_unraisables(rank)
            try:
                message = pickle.dumps(("returned", result))
            except Exception as exc:
                raise TypeError(f"the return value of fn on rank {rank} is not picklable") from exc
        finally:
            _reset_worker_state()
    except BaseException as exc:
        _send(conn, ("error", _format_exception(exc)))
        return
    _send_raw(conn, message)
    try:
        _check_ranks_in_step(world_size, sync_group, _collectives_issued() - issued_before)
    except BaseException as exc:
        _send(conn, ("error", _format_exception(exc)))
        return
    _send(conn, ("synced", None))


# "Exception ignored in ..." reports of this worker since its last call (the module docstring).
_UNRAISABLE: list[str] = []


def _record_unraisable(unraisable: Any) -> None:
    sys.__unraisablehook__(unraisable)  # still printed, as Python does
    exc = unraisable.exc_value
    _UNRAISABLE.append(
        f"{unraisable.err_msg or 'Exception ignored in'}: {unraisable.object!r}\n"
        + "".join(traceback.format_exception(type(exc), exc, unraisable.exc_traceback))
    )


def _raise_unraisables(rank: int) -> None:
    if _UNRAISABLE:
        reports = "\n".join(_UNRAISABLE)
        _UNRAISABLE.clear()
        raise AssertionError(
            f"rank {rank}: Python reported exceptions it could not raise (in a __del__, a weak "
            f"reference's callback or a finalizer), during this call or since the last one:\n"
            + reports
        )


def _format_exception(exc: BaseException) -> str:
    """Format like ``traceback.format_exc()`` without the harness's own leading frames."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _reset_worker_state() -> None:
    import torch

    # Flush now so that output lands in the captured output of the test that produced it.
    sys.stdout.flush()
    sys.stderr.flush()
    torch.set_grad_enabled(True)
    torch.set_default_dtype(torch.float32)
    torch.set_num_threads(1)


def _check_ranks_in_step(world_size: int, sync_group: Any, issued: int) -> None:
    """Barrier on the harness group that also fails if ranks issued unequal collectives."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("fn destroyed the default process group; the pool cannot be reused")
    mine = torch.tensor([issued], dtype=torch.int64)
    gathered = [torch.zeros_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine, group=sync_group)
    per_rank = [int(count) for count in gathered]
    if len(set(per_rank)) > 1:
        raise RuntimeError(
            "ranks are out of step: they issued different numbers of collectives and "
            f"point-to-point ops on the default process group (per rank: {per_rank})"
        )


def _collectives_issued() -> int:
    import torch.distributed as dist

    try:
        # Counts collectives and point-to-point ops issued on the default group, per process.
        return int(dist.distributed_c10d._get_default_group()._get_sequence_number_for_group())
    except Exception:  # private API gone, or no default group: the check becomes a barrier
        return -1


def _send(conn: Connection, message: tuple[str, Any]) -> None:
    _send_raw(conn, pickle.dumps(message))


def _send_raw(conn: Connection, data: bytes) -> None:
    try:
        conn.send_bytes(data)
    except OSError:  # the parent is gone: nobody is left to report to
        os._exit(1)


def _install_assert_rewriting() -> None:
    """Import this package's modules with pytest's assertion rewriting, as pytest would."""
    package = __name__.rpartition(".")[0]
    if package and not any(isinstance(f, _AssertRewritingFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _AssertRewritingFinder(package))


class _AssertRewritingFinder(importlib.abc.MetaPathFinder):
    # Without this, a failing ``assert a == b`` in a worker reports a bare AssertionError.

    def __init__(self, package: str) -> None:
        self.prefix = package + "."

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if not fullname.startswith(self.prefix):
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or not (spec.origin or "").endswith(".py"):
            return None
        spec.loader = _AssertRewritingLoader(fullname, spec.origin)
        return spec


class _AssertRewritingLoader(importlib.machinery.SourceFileLoader):
    def get_code(self, fullname: str) -> Any:
        # Compiled fresh each time and never cached: a .pyc of rewritten code would otherwise
        # be picked up by ordinary imports.
        try:
            from _pytest.assertion.rewrite import rewrite_asserts

            source = self.get_data(self.path)
            tree = ast.parse(source, filename=self.path)
            rewrite_asserts(tree, source, self.path)
            return compile(tree, self.path, "exec", dont_inherit=True)
        except Exception:  # pytest internals changed: plain asserts are still correct
            return super().get_code(fullname)
