"""Specification: under FSDP and ZeRO-3, whose ``state_dict()`` gathers, a rank that calls it
alone (the torch DDP habit ``if rank == 0: torch.save(model.state_dict(), path)``) issues no
collective: it waits for the other ranks, warns what it waits for and how to fix the call, and
raises once the collective timeout has passed; a rank that merely arrives later is waited for in
silence. A forward without gradients (evaluation, generation) under FSDP / ZeRO-3, one under
DDP / ZeRO-1/2 that broadcasts the buffers (the first after a training step, on a model with
BatchNorm), and ``save_checkpoint`` / ``load_checkpoint``, which every rank calls under every
strategy, do the same ([Note: arrival check] in ``tiny_fsdp/core/utils/arrival.py``).
"""

import os
import tempfile
import time
import warnings
from typing import Callable, List

import torch
import torch.distributed as dist
from torch import nn

from tests.harness import run_distributed, run_script_ranks

WARN_AFTER_S, TIMEOUT_S, LATE_S = 0.2, 1.2, 0.2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def _on_rank0_alone(rank: int, what: str, call: Callable[[], object]) -> str:
    """Rank 0 makes ``call`` while rank 1 sleeps in no collective: rank 0 must issue no
    collective, warn once, then raise at the timeout; returns its message ('' on rank 1). Rank 1
    then makes its side of the arrival, so that the next keys agree again."""
    from tiny_fsdp.core import comm
    from tiny_fsdp.core.utils import arrival

    message = ""
    if rank == 0:
        calls = sum(comm.LEDGER.calls.values())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                call()
                raise AssertionError(f"{what} on rank 0 alone returned")
            except RuntimeError as error:
                message = str(error)
        assert sum(comm.LEDGER.calls.values()) == calls, f"{what}: a collective was issued"
        assert f"in {what}, which every rank must call: 1 of 2 ranks" in message, message
        warned = [str(w.message) for w in caught if w.category is RuntimeWarning]
        assert len(warned) == 1 and "1 of 2 ranks are in it" in warned[0], warned
    else:
        time.sleep(TIMEOUT_S + LATE_S)  # in no collective, which would time out too
    dist.barrier()  # rank 0 gave up
    if rank == 1:
        arrival.every_rank_arrives(what, "")
    return message


def _worker(rank: int, world_size: int) -> List[str]:
    from tiny_fsdp import core
    from tiny_fsdp.checkpoint import load_checkpoint, save_checkpoint
    from tiny_fsdp.core.utils import arrival
    from tiny_fsdp.core.utils.dist import get_collective_timeout, set_collective_timeout

    seen = []
    previous = get_collective_timeout(), arrival.WARN_AFTER_S
    set_collective_timeout(TIMEOUT_S)
    arrival.WARN_AFTER_S = WARN_AFTER_S
    try:
        for wrapper in ("FSDP", "Zero3"):
            model = getattr(core, wrapper)(_model())
            message = _on_rank0_alone(rank, f"{wrapper}.state_dict()", model.state_dict)
            assert rank or "call it on every rank, then save on rank 0 only" in message
            # Every rank calls it, rank 1 later: waited for in silence, full tensors on both.
            arrival.WARN_AFTER_S = 10 * LATE_S
            if rank == 1:
                time.sleep(LATE_S)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                state = model.state_dict()
            assert not [w for w in caught if w.category is RuntimeWarning]
            assert {k: tuple(v.shape) for k, v in state.items()} == {
                k: tuple(v.shape) for k, v in _model().state_dict().items()
            }
            total = torch.cat([v.reshape(-1) for v in state.values()])
            first = total.clone()
            dist.broadcast(first, src=0)
            assert torch.equal(first, total), "the ranks' state dicts differ"
            arrival.WARN_AFTER_S = WARN_AFTER_S
            # An evaluation forward (no gradients) on rank 0 alone: the same wait and error.
            with torch.no_grad():
                forward = f"{wrapper} forward without gradients"
                message = _on_rank0_alone(rank, forward, lambda: model(torch.randn(2, 4)))
                assert rank or "evaluate and generate on every rank" in message
                model(torch.randn(2, 4))  # on every rank: fine
            seen.append(wrapper)
        for wrapper in ("DDP", "Zero2"):  # ZeRO-1's forward is ZeRO-2's (ReplicatedWrapper)
            torch.manual_seed(0)
            model = getattr(core, wrapper)(nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6)))
            model(torch.randn(3, 4)).sum().backward()  # a training step: buffers due
            with torch.no_grad():
                forward = f"{wrapper} forward without gradients"
                message = _on_rank0_alone(rank, forward, lambda: model(torch.randn(2, 4)))
                assert rank or "model.module(...), on one rank alone" in message
                if rank == 0:
                    model.module(torch.randn(2, 4))  # the plain model: no collective
                model(torch.randn(2, 4))  # on every rank: fine
            seen.append(wrapper)
        # save_checkpoint gathers under every strategy: on rank 0 alone it raises alike.
        model = core.DDP(_model())
        shared = [os.path.join(tempfile.mkdtemp(), "ckpt")]
        dist.broadcast_object_list(shared, src=0)  # one directory for every rank
        path = shared[0]
        _on_rank0_alone(rank, "save_checkpoint()", lambda: save_checkpoint(path, model))
        seen.append("save_checkpoint")
        # load_checkpoint too (it reads on every rank and agrees on what it read).
        save_checkpoint(path, model)
        _on_rank0_alone(rank, "load_checkpoint()", lambda: load_checkpoint(path, model))
        load_checkpoint(path, model)  # on every rank: fine
        seen.append("load_checkpoint")
    finally:
        set_collective_timeout(previous[0])
        arrival.WARN_AFTER_S = previous[1]
    return seen


def test_a_rank_alone_in_a_gathering_state_dict_waits_warns_and_raises() -> None:
    seen = ["FSDP", "Zero3", "DDP", "Zero2", "save_checkpoint", "load_checkpoint"]
    assert run_distributed(_worker, 2) == [seen] * 2


def test_a_rank_alone_in_state_dict_raises_at_once_when_the_others_have_exited() -> None:
    """The habit at the end of a script: rank 1 ends (after destroy_process_group), rank 0 calls
    FSDP's ``state_dict()`` alone. It raises naming rank 1 instead of waiting out gloo's 30
    minutes (the call's own timeout here is 120 s)."""
    results = run_script_ranks(os.path.join("tests", "test_state_dict_arrival.py"), 2)
    (code, out), (other_code, other_out) = results
    assert other_code == 0, other_out[-2000:]
    assert code == 0 and "raised: rank 0 waits in FSDP.state_dict()" in out, out[-2000:]
    assert "rank(s) [1] exited without calling it" in out, out[-2000:]


def _script_main() -> None:
    from tiny_fsdp import core

    dist.init_process_group("gloo")
    model = core.FSDP(_model())
    model(torch.randn(2, 4)).sum().backward()
    if dist.get_rank() == 1:
        dist.destroy_process_group()
        return
    try:
        torch.save(model.state_dict(), os.devnull)
    except RuntimeError as error:
        print(f"raised: {error}")


if __name__ == "__main__":
    _script_main()
