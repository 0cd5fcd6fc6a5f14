"""The prefetcher's order of unshards and waits ([Note: prefetch]), on units that log them."""

from typing import List, Tuple

from tiny_fsdp.core.prefetch import BACKWARD, FORWARD, Prefetcher


class LoggedUnit:
    """A unit whose unshards are tokens; every verb is appended to a shared log."""

    def __init__(self, name: str, log: List[Tuple[str, ...]]) -> None:
        self.name, self.log, self.is_unsharded = name, log, False
        self.fetched_in_backward = True

    def unshard(self, async_op: bool) -> str:
        self.log.append(("unshard", self.name, "async" if async_op else "sync"))
        return self.name

    def wait_for_unshard(self, pending: str) -> None:
        assert pending == self.name, "a unit waited for another unit's unshard"
        self.log.append(("wait", self.name))
        self.is_unsharded = True

    def discard(self, pending: str) -> None:
        self.log.append(("discard", self.name))

    def reshard(self) -> None:
        self.is_unsharded = False


def _model(n_units: int):
    log: List[Tuple[str, ...]] = []
    units = [LoggedUnit(f"u{i}", log) for i in range(n_units)]
    prefetcher = Prefetcher(prefetch_limit=1)
    prefetcher.units = list(units)
    return prefetcher, units, log


def _second_forward_log(prefetch: bool) -> List[Tuple[str, ...]]:
    """The log of a forward over u0, u1, u2 after one forward recorded their order."""
    prefetcher, units, log = _model(3)
    for _ in range(2):
        log.clear()
        prefetcher.drain()
        prefetcher.pre_forward(prefetch, grad_enabled=True)
        for unit in units:
            prefetcher.fetch(unit, FORWARD)
            unit.reshard()
        prefetcher.post_forward()
    return log


def test_first_unit_of_a_forward_travels_with_the_next_one():
    # Nothing prefetched u0: its unshard is issued asynchronously and u1's is issued before
    # u0 is waited for, instead of u0 travelling alone while the host waits.
    log = _second_forward_log(prefetch=True)
    assert log[:3] == [("unshard", "u0", "async"), ("unshard", "u1", "async"), ("wait", "u0")]


def test_a_prefetched_unit_is_waited_for_before_the_next_is_prefetched():
    # FSDP2's order: at most prefetch_limit gathers in flight beyond the one being consumed.
    log = _second_forward_log(prefetch=True)
    assert log[3:] == [("wait", "u1"), ("unshard", "u2", "async"), ("wait", "u2")]


def test_without_prefetch_every_unshard_is_synchronous_and_waited_at_once():
    log = _second_forward_log(prefetch=False)
    expected = []
    for name in ("u0", "u1", "u2"):
        expected += [("unshard", name, "sync"), ("wait", name)]
    assert log == expected


def test_a_unit_first_in_forward_and_in_backward_is_unsharded_once():
    # One unit: the forward's last fetch would prefetch the backward's first unit, itself,
    # while its own unshard is still on the way.
    prefetcher, (unit,), log = _model(1)
    for _ in range(2):
        log.clear()
        prefetcher.pre_forward(True, grad_enabled=True)
        prefetcher.fetch(unit, FORWARD)
        prefetcher.post_forward()
        prefetcher.fetch(unit, BACKWARD)  # kept full after its forward: nothing to unshard
        unit.reshard()
        assert [entry[0] for entry in log] == ["unshard", "wait"]
