"""Fail fast: when one rank raises, every other rank raises too, naming it, instead of hanging.

[Note: fail fast]
Ranks meet in every collective, so a rank that raises between two collectives (a bad batch, a
bug, out of memory) leaves the others waiting in the next one: forever, or until the process
group's timeout (30 minutes by default). Inside ``with fail_fast():``

1. A rank whose exception leaves the block (and was not caused by a peer, see 2) records
   ``failed/<rank>`` = a one-line summary of it in the rendezvous store of the process group.
   Its exception then propagates; when it ends the process, the process's connections close
   and gloo peers blocked in a collective with it fail at once ("Connection closed by peer").
   Otherwise (the process lives on, or NCCL, whose collectives do not notice that a peer left)
   the peers' collectives fail at the collective timeout: ``timeout_s`` bounds the wait. (A
   live process cannot close its gloo connections: gloo has no abort, and
   ``destroy_process_group`` frees the group only if nothing else holds it; importing
   ``torch._dynamo`` does.)
2. A rank whose collective fails (a communication error) looks for such records. If a peer left
   one, it raises ``PeerFailureError`` naming that rank and its error, instead of the bare
   communication error. Its own exit closes its connections in turn, so the failure spreads
   around the ring. If no peer recorded anything (a rank crashed, was killed, or is stuck past
   the timeout), it records ``lost/<rank>``, waits up to ``grace_s`` for the others to do the
   same, and names the ranks that gave no sign of life.
3. Every rank that handled the failure adds 1 to ``handled``. The rank hosting the store (rank 0,
   unless torchrun's agent hosts it) waits until every live rank has (at most the collective
   timeout + ``grace_s``) before it lets its exception go: the store dies with its process.

Cost on the happy path: none. Entering only sets the timeout (if asked); there is no thread,
no store access, no extra collective, no per-step work. Records are keyed by a session number
(how many times this process handled a ``fail_fast`` block), the same on every rank of an SPMD
program.
"""

import contextlib
import itertools
import os
import socket
import time
import traceback
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from tiny_fsdp.core.utils.dist import get_collective_timeout, set_collective_timeout

PREFIX = "tiny_fsdp/fail_fast"
_HANDLED = "_tiny_fsdp_fail_fast_handled"  # set on an exception once a fail_fast block saw it
_SESSIONS = itertools.count()
_POLL_S = 0.05
# Substrings of the messages of exceptions that collectives raise (gloo: plain RuntimeError;
# an asynchronous one queued behind a timed-out one fails with "...timeout caused pair closure").
_COMM_MARKERS = ("gloo", "nccl", "c10d", "connection closed", "connection reset", "timed out")
_COMM_MARKERS += ("pair closure",)


class PeerFailureError(RuntimeError):
    """This rank stopped because another one failed.

    ``failed``: rank -> one-line summary of the exception it recorded. ``unresponsive``: ranks
    that neither recorded an error nor reported the broken collective (crashed, killed, stuck).
    """

    def __init__(
        self, rank: int, failed: Dict[int, str], unresponsive: Sequence[int], cause: str
    ) -> None:
        self.rank = rank
        self.failed = dict(failed)
        self.unresponsive = list(unresponsive)
        self.cause = cause
        parts = [f"rank {r} failed: {summary}" for r, summary in sorted(self.failed.items())]
        if self.unresponsive:
            parts.append(
                f"rank(s) {self.unresponsive} stopped responding without recording an error "
                "(crashed, killed e.g. for memory, or stuck longer than the collective timeout)"
            )
        super().__init__(
            f"rank {rank} stopped because {'; '.join(parts)}. Fix that rank's problem (its "
            f"traceback is in its log); this rank only saw its collective fail: {cause}"
        )

    def __reduce__(self) -> Tuple[Any, Tuple[Any, ...]]:
        # Pickled by value (multiprocessing, a job runner): rebuilt from the fields, not from
        # the message, which is all ``BaseException`` would pass back to ``__init__``.
        return type(self), (self.rank, self.failed, self.unresponsive, self.cause)

    @property
    def failed_ranks(self) -> List[int]:
        """Every rank blamed: those that recorded an error, then the unresponsive ones."""
        return sorted(self.failed) + [r for r in self.unresponsive if r not in self.failed]


@dataclass
class _Session:
    """One failure handled on this rank: where its records go in the store."""

    store: Any  # torch.distributed.Store
    key: str
    rank: int
    world_size: int
    hosts_store: bool  # the store's server runs in this process

    def put(self, kind: str, value: str) -> None:
        self.store.set(f"{self.key}/{kind}/{self.rank}", value)

    def records(self, kind: str) -> Dict[int, str]:
        """Rank -> value of every ``kind`` record present now (non-blocking)."""
        found = {}
        for r in range(self.world_size):
            k = f"{self.key}/{kind}/{r}"
            if self.store.check([k]):
                found[r] = self.store.get(k).decode("utf-8", "replace")
        return found

    def count_handled(self, increment: int) -> int:
        return int(self.store.add(f"{self.key}/handled", increment))


class fail_fast(contextlib.ContextDecorator):
    """Context manager / decorator: a failure on one rank stops every rank ([Note: fail fast]).

    Args:
        timeout_s: collective timeout of the default group inside the block (restored at exit);
            None keeps the group's own (see ``init_distributed(timeout_s=...)``).
        grace_s: on the failure path only, how long a rank waits for the others' records.
        store: the rendezvous store to record failures in (default: the default group's).

    Without a process group it does nothing (single-device runs); the block may create the
    group (e.g. a decorated ``main`` that calls ``init_distributed``; ``timeout_s`` then only
    applies if the group existed at entry). Use it on every rank around the same code (SPMD);
    nesting is fine (the innermost block handles a failure).
    """

    def __init__(
        self, timeout_s: Optional[float] = None, grace_s: float = 5.0, store: Any = None
    ) -> None:
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive or None, got {timeout_s}")
        if not grace_s >= 0:
            raise ValueError(f"grace_s must be >= 0, got {grace_s}")
        self.timeout_s = timeout_s
        self.grace_s = grace_s
        self.store = store
        self._stack: List[Optional[float]] = []  # per open block: the timeout to restore

    def __enter__(self) -> "fail_fast":
        previous = None
        if self.timeout_s is not None and _group_exists():
            previous = get_collective_timeout()
            set_collective_timeout(self.timeout_s)
        self._stack.append(previous)
        return self

    def __exit__(self, exc_type: Any, exc: Optional[BaseException], tb: Any) -> bool:
        previous = self._stack.pop()
        try:
            if exc is None or getattr(exc, _HANDLED, False) or not _group_exists():
                return False  # success, an inner block handled it, or no process group
            self._handle(exc)  # raises PeerFailureError if a peer's failure caused ``exc``
            return False  # our own exception propagates
        finally:
            if previous is not None and _group_exists():
                set_collective_timeout(previous)

    def _handle(self, exc: BaseException) -> None:
        _mark(exc)
        session = self._session()
        peer_error: Optional[PeerFailureError] = None
        try:
            if is_communication_error(exc):
                peer_error = self._explain(session, exc)
            if peer_error is None:  # our own failure (or a communication error with no culprit)
                session.put("failed", _summary(exc))
            session.count_handled(1)
            if session.hosts_store:
                lost = len(peer_error.unresponsive) if peer_error is not None else 0
                self._keep_store_alive(session, session.world_size - lost)
        except Exception as store_error:  # the store died with its host (rank 0 exited)
            if is_communication_error(exc):
                peer_error = PeerFailureError(
                    session.rank,
                    {},
                    [],
                    f"{_summary(exc, False)}; the failure records could not be read "
                    f"({_summary(store_error, False)}): the rank hosting the rendezvous store "
                    "(rank 0 without torchrun) has probably exited",
                )
        if peer_error is not None:
            raise _mark(peer_error) from exc

    def _session(self) -> _Session:
        store = self.store if self.store is not None else dist.distributed_c10d._get_default_store()
        rank = dist.get_rank()
        # Without torchrun's agent store, rank 0 runs the TCPStore server (env:// or tcp://).
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        hosts = self.store is None and rank == 0 and not agent
        return _Session(store, f"{PREFIX}/{next(_SESSIONS)}", rank, dist.get_world_size(), hosts)

    def _explain(self, s: _Session, exc: BaseException) -> Optional[PeerFailureError]:
        """The peer failure behind the communication error ``exc``; None if every rank is
        alive and none recorded an error."""
        failed = {r: v for r, v in s.records("failed").items() if r != s.rank}
        missing: List[int] = []
        if not failed:  # nobody recorded an error (yet): wait for a record, or find who is gone
            s.put("lost", str(os.getpid()))
            deadline = time.monotonic() + self.grace_s
            while True:
                failed = {r: v for r, v in s.records("failed").items() if r != s.rank}
                seen = set(failed) | set(s.records("lost"))
                if failed or len(seen) == s.world_size or time.monotonic() >= deadline:
                    break
                time.sleep(_POLL_S)
            missing = [] if failed else [r for r in range(s.world_size) if r not in seen]
        if not failed and not missing:
            return None
        return PeerFailureError(s.rank, failed, missing, _summary(exc, with_location=False))

    def _keep_store_alive(self, s: _Session, alive: int) -> None:
        """Wait until ``alive`` ranks handled the failure: at most the time a peer blocked in
        a collective needs to time out, plus ``grace_s``."""
        timeout = get_collective_timeout() if _group_exists() else None
        deadline = time.monotonic() + (timeout or 0.0) + self.grace_s
        while s.count_handled(0) < alive and time.monotonic() < deadline:
            time.sleep(_POLL_S)


def is_communication_error(exc: BaseException) -> bool:
    """Whether ``exc`` looks raised by a collective (torch's DistError, or gloo/NCCL messages)."""
    if isinstance(exc, PeerFailureError):
        return False
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(m in text for m in _COMM_MARKERS)


class NonFiniteError(FloatingPointError):
    """A loss or gradient was inf or NaN; the message names the step and the ranks."""


def nonfinite_ranks(
    values: Dict[str, Union[float, torch.Tensor]], device: Optional[torch.device] = None
) -> Dict[str, List[int]]:
    """For each named value of this rank (its loss, its gradient norm...), the ranks on which it
    holds an inf or NaN; only the names with at least one such rank (``{}``: all finite).

    A collective when a process group is initialised (call it on every rank): one all-reduce of
    a (len(values), world_size) flag matrix, so every rank gets the same answer and takes the
    same decision (e.g. every rank skips the step). ``device``: where the flags go, the one the
    backend communicates (CUDA for NCCL). Without a process group this rank is rank 0.
    """
    names = list(values)
    flags = [0.0 if bool(torch.isfinite(torch.as_tensor(values[n])).all()) else 1.0 for n in names]
    if _group_exists():
        from tiny_fsdp.core import comm

        table = torch.zeros(len(names), dist.get_world_size(), device=device)  # (values, ranks)
        table[:, dist.get_rank()] = torch.tensor(flags, device=device)
        comm.all_reduce(table)
        rows = table.tolist()
    else:
        rows = [[flag] for flag in flags]
    bad = {n: [r for r, flag in enumerate(row) if flag > 0] for n, row in zip(names, rows)}
    return {n: ranks for n, ranks in bad.items() if ranks}


def describe_nonfinite(bad: Dict[str, List[int]]) -> str:
    """In words: ``loss on rank(s) [1], grad norm on rank(s) [0, 1]``."""
    return ", ".join(f"{name} on rank(s) {ranks}" for name, ranks in bad.items())


def _group_exists() -> bool:
    return dist.is_available() and dist.is_initialized()


def _mark(exc: BaseException) -> BaseException:
    try:
        setattr(exc, _HANDLED, True)
    except (AttributeError, TypeError):  # an exception type without attributes: seen twice
        pass
    return exc


def _summary(exc: BaseException, with_location: bool = True) -> str:
    """``Type: message`` on one line (at most 500 characters), plus where it was raised."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    text = text if len(text) <= 500 else text[:497] + "..."
    if not with_location:
        return text
    frames = traceback.extract_tb(exc.__traceback__)
    where = f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}, " if frames else ""
    return f"{text} ({where}pid {os.getpid()} on {socket.gethostname()})"
