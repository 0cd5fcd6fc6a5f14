"""The prefetcher FSDP and ZeRO-3 share: record the order of units, unshard the next ones early.

[Note: prefetch]
FSDP and ZeRO-3 make a *unit*'s parameters full just before one of its layers computes, in
forward and again in backward ([Note: glossary]). What differs is how: FSDP all-gathers dim-0
shards, ZeRO-3 broadcasts whole tensors from their owners. Each strategy's unit (FSDP's
``GatherUnit``, ZeRO-3's per-layer handler) plugs that in through one verb set (``Unit``):
``unshard(async_op)`` issues the collectives and returns a pending handle, ``wait_for_unshard``
waits for it (the unit is then full), ``discard`` waits for one nobody will use and frees it,
``reshard`` frees the full parameters. Everything else is written once, here.

A pass is a wrapper forward (the FORWARD part) and every fetch after it until the next one (the
BACKWARD part: the backward, with the forward fetches that gradient checkpointing runs inside
it). Only passes whose forward has grad enabled have a BACKWARD part.

- Order. The first wrapper forward records its units in fetch order (a unit fetched by several
  layers in a row counts once): the forward order. The first BACKWARD part records its own;
  until one has run, the backward order is guessed as the forward order by last fetch,
  reversed (backward visits layers in reverse, so a unit is first needed at its last forward
  use), without the units no backward fetches (``fetched_in_backward``: embeddings alone,
  [Note: full units]), and the fetches of a recomputation, which the guess does not know,
  prefetch nothing.
- Prefetch. With the wrapper's ``enable_async_communication``, a fetch of the unit at position
  i of its part's order unshards the units at i+1 .. i+``prefetch_limit`` asynchronously, at
  most ``prefetch_limit`` of them unconsumed at any time, so that they travel while unit i
  computes; the next fetch of such a unit waits for its pending unshard instead of issuing one.
  A unit nothing prefetched (the first of a forward) is unsharded asynchronously as well and
  waited for once its own prefetches are issued, so those travel while it does (its copy-out,
  [Note: buffers made once], then briefly coexists with their gather buffers).
  In a forward with grad enabled the backward order continues the forward one, so the last
  forward fetches already prefetch the first backward units. Every rank makes the same
  decisions from the same order, so the collectives stay matched.

Rules that keep results (and the collectives' count and bytes) identical with prefetch on and
off:

- A pending unshard is only consumed within the pass that issued it: the next forward first
  discards whatever is left (e.g. a unit whose backward never ran), because the optimizer step
  may have changed the parameters since.
- The position in the order is searched forward from the last position, so a unit that is
  skipped or repeated does not derail the pass, and one that runs out of order just gets no
  prefetch. A unit that is already full is not prefetched.

[Note: ranks out of step]
Collectives pair in the order the ranks issue them. If one rank skips a unit that another runs
(a LayerDrop of the model's own whose draws differ per rank, a branch on this rank's data), the
next unshards pair across different units: of other sizes or kinds, gloo stops or waits and
NCCL hangs ([Note: forwards in lockstep]: ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` names them); of the
same size (identical blocks), every rank computes with a mix of two blocks' parameters and
trains wrong without a sign (measured: 8.9e-3 off torch's DDP after three SGD steps, as under
FSDP2). So every unshard this prefetcher issues, on demand or ahead, folds the unit's index
into ``unshard_order`` (a running hash below 2**24, over the whole run), and every
synchronised backward compares it across the ranks in the all-reduce that already agrees on
overflow ([Note: agreeing on overflow]); where it differs, the gradients are made non-finite
there (the optimizer step is spoilt on every rank, not silently wrong) and every rank raises
(``UnitState.check_in_step``: on the CPU from that ``backward()``, on an accelerator, whose flag
travels to the host without a wait, from the next forward). Equal orders are what every correct
run has: the ranks make the same prefetch decisions from the same recorded orders.
"""

from typing import Any, Dict, List, Optional, Protocol

from tiny_fsdp.core.module.handler import TrainingPhase

FORWARD, BACKWARD = TrainingPhase.FORWARD, TrainingPhase.BACKWARD
_ORDER_MODULUS = 16_777_213  # the largest prime below 2**24: float32 holds the hash exactly


class Unit(Protocol):
    """What a strategy plugs into the prefetcher ([Note: prefetch]); hashable."""

    @property
    def is_unsharded(self) -> bool:
        """Whether the unit holds full parameters a fetch can use as they are."""

    @property
    def fetched_in_backward(self) -> bool:
        """Whether a backward fetches the unit (False: its layers' backward reads no value)."""

    def unshard(self, async_op: bool) -> Any:
        """Issue the collectives that make the parameters full; return the pending handle."""

    def wait_for_unshard(self, pending: Any) -> None:
        """Wait for ``pending``; afterwards the unit holds its full parameters."""

    def discard(self, pending: Any) -> None:
        """Wait for ``pending``, which no fetch will use, and free what it brought."""

    def reshard(self) -> None:
        """Free the full parameters the unit holds."""


class Prefetcher:
    """Order recording and bounded prefetch for the units of one model ([Note: prefetch]).

    Each strategy's per-model state subclasses it; the wrapper's forward calls ``pre_forward``
    and ``post_forward`` around the model, a unit's layer calls ``fetch`` before computing.

    Attributes:
        prefetch_limit: at most this many prefetched unshards unconsumed at once (>= 1).
        reshard_after_forward: False keeps every unit full from its forward to its backward.
        orders: part of the pass -> its recorded order of units (the backward one guessed
            until a backward has run).
    """

    def __init__(self, prefetch_limit: int) -> None:
        if prefetch_limit < 1:
            raise ValueError(f"prefetch_limit must be >= 1, got {prefetch_limit}")
        self.prefetch_limit = prefetch_limit
        self.reshard_after_forward = True
        self.units: List[Unit] = []  # every unit of the model, in module order
        self.orders: Dict[TrainingPhase, List[Unit]] = {}
        self._prefetch = False  # the wrapper's async switch, read at each forward
        self._in_forward = False
        self._grad_forward = False  # the last wrapper forward had grad enabled: backward follows
        self._recording: Dict[TrainingPhase, List[Unit]] = {}  # part -> its fetches so far
        self._backward_guessed = False  # orders[BACKWARD] is the forward's, reversed
        self._cursor = {FORWARD: 0, BACKWARD: 0}
        self._pending: Dict[Unit, Any] = {}  # unit -> its prefetched, unconsumed unshard
        self.unshard_order = 0  # hash of every unshard issued so far ([Note: ranks out of step])
        self._index: Dict[Unit, int] = {}  # unit -> its place in ``units``

    # ---------------------------------------------------------------- passes
    def pre_forward(self, prefetch: bool, grad_enabled: bool) -> None:
        """A wrapper forward starts: discard stale prefetches, close the last pass's recording."""
        self.drain()
        backward = self._recording.pop(BACKWARD, None)
        if backward:  # the first BACKWARD part that ran: its order replaces the guess
            self.orders[BACKWARD] = backward
            self._backward_guessed = False
        self._prefetch = prefetch
        self._in_forward = True
        self._grad_forward = grad_enabled
        self._cursor = {FORWARD: 0, BACKWARD: 0}
        if FORWARD not in self.orders:
            self._recording[FORWARD] = []

    def post_forward(self) -> None:
        """The wrapper forward is over (its backward may follow)."""
        self._in_forward = False
        forward = self._recording.pop(FORWARD, None)
        if forward is not None:
            self.orders[FORWARD] = forward
            last_first = dict.fromkeys(reversed(forward))  # by last fetch
            self.orders[BACKWARD] = [unit for unit in last_first if unit.fetched_in_backward]
            self._backward_guessed = True
        if self._backward_guessed and self._grad_forward:
            self._recording[BACKWARD] = []

    def keeps_after_forward(self, unit: Unit) -> bool:
        """Whether ``unit`` stays full after its forward releases: the unit that comes first in
        backward, after a forward with grad enabled (its backward follows at once, so
        resharding it would only mean unsharding it again; FSDP2 does the same for its root),
        or every unit with ``reshard_after_forward=False``."""
        if not self._grad_forward:
            return False
        backward = self.orders.get(BACKWARD)
        first_in_backward = bool(backward) and unit is backward[0]
        return first_in_backward or not self.reshard_after_forward

    @property
    def async_comm(self) -> bool:
        """The wrapper's async switch as read at the last forward: prefetch, async reductions."""
        return self._prefetch

    def drop_transients(self) -> None:
        """Discard unconsumed prefetches and reshard units kept full from an earlier pass."""
        self.drain()
        for unit in self.units:
            unit.reshard()

    def drain(self) -> None:
        """Wait for and discard every prefetched unshard not consumed yet."""
        for unit, pending in self._pending.items():
            unit.discard(pending)
        self._pending.clear()

    # ---------------------------------------------------------------- fetch
    def fetch(self, unit: Unit, phase: TrainingPhase) -> None:
        """Make ``unit`` full (its prefetch, or an unshard issued now), prefetch what follows.

        A prefetched unit is waited for first, then the next ones are prefetched (FSDP2's
        order). A unit nothing prefetched (the first of a forward) is unsharded asynchronously
        with prefetch on and waited for once the next ones are issued, so that they travel
        while it does; the same collectives in the same order either way."""
        issued = None  # an unshard issued here: waited for after the prefetches
        if not unit.is_unsharded:
            prefetched = self.take_prefetched(unit)
            if prefetched is None:
                issued = self._unshard(unit, self._prefetch)
            else:
                unit.wait_for_unshard(prefetched)
        if self._in_forward:
            self._after_fetch(unit, FORWARD)
        elif self._grad_forward:  # backward, or a recomputation inside it
            guessed = self._backward_guessed and phase is FORWARD
            self._after_fetch(unit, BACKWARD, prefetch=not guessed)
        if issued is not None:
            unit.wait_for_unshard(issued)

    def take_prefetched(self, unit: Unit) -> Optional[Any]:
        """The pending unshard of ``unit`` issued by a prefetch (now consumed), or None."""
        return self._pending.pop(unit, None)

    def _after_fetch(self, unit: Unit, part: TrainingPhase, prefetch: bool = True) -> None:
        """Record ``unit`` in ``part``'s order if it is being recorded; prefetch what follows."""
        recording = self._recording.get(part)
        if recording is not None and (not recording or recording[-1] is not unit):
            recording.append(unit)
        order = self.orders.get(part)
        if not (self._prefetch and prefetch) or order is None:
            return
        cursor = self._cursor[part]
        if cursor and order[cursor - 1] is unit:
            return  # another layer of the unit at the current position
        position = _find(order, unit, cursor)
        if position is None:
            return  # not a new unit of this pass (or out of order): nothing to prefetch
        self._cursor[part] = position + 1
        ahead = order[position + 1 : position + 1 + self.prefetch_limit]
        if part is FORWARD and self._grad_forward:  # the backward comes next: its first units
            ahead += self.orders[BACKWARD][: self.prefetch_limit - len(ahead)]
        for upcoming in ahead:
            if len(self._pending) >= self.prefetch_limit:
                break
            if upcoming is unit or upcoming.is_unsharded or upcoming in self._pending:
                continue  # ``unit`` itself may still be on its way (``fetch``)
            self._pending[upcoming] = self._unshard(upcoming, True)

    def _unshard(self, unit: Unit, async_op: bool) -> Any:
        """Issue ``unit``'s unshard, folding it into ``unshard_order`` ([Note: ranks out of
        step])."""
        if unit not in self._index:
            self._index = {known: i for i, known in enumerate(self.units)}
        index = self._index.get(unit, len(self.units))
        self.unshard_order = (self.unshard_order * 31 + index + 1) % _ORDER_MODULUS
        return unit.unshard(async_op=async_op)


def _find(order: List[Unit], unit: Unit, start: int) -> Optional[int]:
    """Index of ``unit`` in ``order[start:]``, or None (never earlier: no prefetching twice)."""
    for index in range(start, len(order)):
        if order[index] is unit:
            return index
    return None
