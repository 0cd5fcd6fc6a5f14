"""A two-lane timeline: one rank's compute and its communication, each a queue in issue order.

[Note: planned timeline]
A step is a list of operations issued in program order. An operation runs on the ``compute`` lane
or the ``comm`` lane (a process group runs ``comm_channels`` collectives at once: NCCL one per
stream, gloo one per worker thread, 2 by default), starts when its lane has a free channel and
every operation it ``waits_for`` has ended, and takes ``seconds``. Asynchronous
communication is a ``comm`` operation that no compute waits for until it must (the end of
backward, a prefetched layer's forward, an in-flight limit); synchronous communication is one
that the next compute operation waits for. The step ends when both lanes are idle. Issuing a
collective takes no time here: its cost is on the comm lane.
"""

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence


@dataclass
class Op:
    lane: str  # "compute" or "comm"
    seconds: float
    waits_for: Sequence[int] = ()
    after_start_of: Optional[int] = None  # issued when that op starts (prefetch), not ends
    label: str = ""


@dataclass
class Timeline:
    """Append operations in issue order; ``add`` returns the op's index for ``waits_for``."""

    ops: List[Op] = field(default_factory=list)
    start: List[float] = field(default_factory=list)
    end: List[float] = field(default_factory=list)
    comm_channels: int = 1  # collectives that can run at once (gloo: its worker threads)
    _free: Dict[str, List[float]] = field(default_factory=dict)
    _issued_at: float = 0.0  # program order: an op cannot be issued before the last compute op

    def add(
        self,
        lane: str,
        seconds: float,
        waits_for: Sequence[Optional[int]] = (),
        label: str = "",
        issue_at_start_of: Optional[int] = None,
    ) -> int:
        deps = [d for d in waits_for if d is not None]
        ready = max([self.end[d] for d in deps], default=0.0)
        issued = self._issued_at if issue_at_start_of is None else self.start[issue_at_start_of]
        free = self._free.setdefault(lane, [0.0] * (self.comm_channels if lane == "comm" else 1))
        channel = min(range(len(free)), key=free.__getitem__)
        begin = max(free[channel], ready, issued)
        self.ops.append(Op(lane, seconds, tuple(deps), issue_at_start_of, label))
        self.start.append(begin)
        self.end.append(begin + seconds)
        free[channel] = begin + seconds
        if lane == "compute":
            self._issued_at = begin + seconds
        return len(self.ops) - 1

    def wait(self, ops: Sequence[Optional[int]]) -> None:
        """The program blocks until ``ops`` end (a ``work.wait()``)."""
        self._issued_at = max([self._issued_at] + [self.end[o] for o in ops if o is not None])

    @property
    def seconds(self) -> float:
        return max([self._issued_at] + self.end)

    def busy(self, lane: str) -> float:
        """Seconds during which ``lane`` runs something (overlapping operations once)."""
        spans = sorted(
            (b, e) for op, b, e in zip(self.ops, self.start, self.end) if op.lane == lane
        )
        total, reach = 0.0, 0.0
        for b, e in spans:
            total += max(0.0, e - max(b, reach))
            reach = max(reach, e)
        return total
