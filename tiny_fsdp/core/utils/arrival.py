"""Calls every rank must make: wait, outside the collectives, until every rank has made it.

[Note: arrival check]
Under FSDP and ZeRO-3, ``state_dict()`` gathers every tensor, so every rank must call it. The
torch DDP habit ``if rank == 0: torch.save(model.state_dict(), path)`` would start rank 0's
gathers while the other ranks run their next step or wait in a barrier: gloo stops with
"Received data size doesn't match", NCCL waits until its timeout, and collectives of equal size
(a gather of the state dict and a gather of the next forward) may pair up silently.

The same holds for a forward without gradients (evaluation, ``generate``) under FSDP and ZeRO-3,
which the torch DDP habit runs on rank 0 alone, for one under DDP and ZeRO-1/2 that broadcasts
the buffers (the first after a training step: [Note: replicated strategies]), and for the
checkpoint functions. So
``every_rank_arrives(what)`` runs before such a call's first collective: each rank adds one to
a counter in the rendezvous store, keyed by the call's name and by how many times this process
made it before (every rank makes the same calls, so the keys agree), and waits until all ranks
have added theirs. The gathers start only when every rank is in the call; no collective is
issued or paired before. A rank kept waiting warns after ``WARN_AFTER_S`` (what it waits for,
and the fix), and raises once the default group's collective timeout has passed, as the
collective would have, with the reason in the message. Ranks that are merely slower (one writes
a file the others do not) arrive a little later and nothing is said.

The habit's usual place is the end of the script, where the other ranks exit instead of waiting:
rank 0 would wait the whole timeout (30 minutes on gloo) for ranks that are gone. So every process
that wraps a model announces its exit in the store (``announce_exit``: an ``atexit`` handler
holding the store, which outlives ``destroy_process_group``), and a waiting rank that sees a
rank leave raises at once, naming it.

Cost: one store round trip per call and rank (no tensor, no collective); training forwards,
which every rank runs, are not checked.
"""

import atexit
import time
import warnings
from collections import Counter
from typing import Any, List

import torch.distributed as dist

from tiny_fsdp.core.utils.dist import get_collective_timeout

#: Seconds a rank waits for the others before it warns (tests lower it).
WARN_AFTER_S = 10.0
_MAX_PAUSE_S = 0.05  # between two looks at the store
_DEFAULT_TIMEOUT_S = 1800.0  # torch's default for gloo, when the group does not say

_calls: Counter = Counter()  # call name -> how many times this process made it
_EXITED = "tiny_fsdp/exited"  # "<rank>," for each process that has exited
_announcing: List[bool] = []  # the exit handler is registered (once per process)


def announce_exit() -> None:
    """Have this process tell the others, through the store, when it exits (once per process;
    [Note: arrival check])."""
    if _announcing or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    store, rank = dist.distributed_c10d._get_default_store(), dist.get_rank()
    atexit.register(_exiting, store, rank)
    _announcing.append(True)


def _exiting(store: Any, rank: int) -> None:
    try:
        store.append(_EXITED, f"{rank},")  # one message, no reply awaited
    except Exception:  # noqa: BLE001 - the store's server may be gone already; nothing to tell
        pass


def every_rank_arrives(what: str, fix: str) -> None:
    """Return once every rank of the default group has called this with ``what`` as often as
    this rank has ([Note: arrival check]). ``fix``: what to do, for the warning and the error.

    Raises RuntimeError if some rank has not arrived within the collective timeout.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1:
        return
    _calls[what] += 1
    key = f"tiny_fsdp/arrival/{what}/{_calls[what]}"
    store = dist.distributed_c10d._get_default_store()
    if int(store.add(key, 1)) == world:
        store.set(key + "/all", "1")  # the last rank in lets everyone go
        return
    timeout_s = get_collective_timeout() or _DEFAULT_TIMEOUT_S
    start = time.monotonic()
    pause, warned = 1e-4, False
    # store.check never blocks: a store.wait that times out has torch log a warning each time.
    while not store.check([key + "/all"]):
        time.sleep(pause)
        pause = min(2 * pause, _MAX_PAUSE_S)
        waited = time.monotonic() - start
        if store.check([_EXITED]):
            gone = sorted(int(r) for r in store.get(_EXITED).decode().split(",") if r)
            raise RuntimeError(
                f"rank {dist.get_rank()} waits in {what}, which every rank must call, but "
                f"rank(s) {gone} exited without calling it. {fix}"
            )
        if waited < timeout_s and (warned or waited < WARN_AFTER_S):
            continue
        message = (
            f"rank {dist.get_rank()} has waited {waited:.0f} s in {what}, which every rank must "
            f"call: {int(store.add(key, 0))} of {world} ranks are in it. {fix}"
        )
        if waited >= timeout_s:
            raise RuntimeError(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        warned = True
