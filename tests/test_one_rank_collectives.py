"""On a group of one rank every collective is the identity, done without the backend ([Note:
collectives on one rank]): the same results, the same ledger, a complete work when asynchronous.
"""

from typing import List

import torch
import torch.distributed as dist

from tests.harness import run_distributed


def _identity_worker(rank: int, world_size: int) -> List[str]:
    from tiny_fsdp.core import comm

    def refuse(*args, **kwargs):
        raise AssertionError("the backend was called on a group of one rank")

    names = ["all_reduce", "broadcast", "reduce", "all_gather_into_tensor"]
    names += ["reduce_scatter_tensor"]
    saved = {name: getattr(dist, name) for name in names}
    for name in names:
        setattr(dist, name, refuse)
    saved_torch = (comm._torch_all_gather, comm._torch_reduce_scatter)
    comm._torch_all_gather = comm._torch_reduce_scatter = refuse
    seen = []
    try:
        comm.LEDGER.reset()
        for async_op in (False, True):
            x = torch.arange(6.0)
            works = [
                comm.all_reduce(x, async_op=async_op),
                comm.broadcast(x, src=0, async_op=async_op),
                comm.reduce(x, dst=0, async_op=async_op),
            ]
            assert torch.equal(x, torch.arange(6.0))
            out = torch.full((6,), -1.0)
            works.append(comm.all_gather(out, torch.arange(6.0), async_op=async_op))
            assert torch.equal(out, torch.arange(6.0))  # a copy: another tensor
            grads, shard = torch.arange(6.0), torch.zeros(6)
            works.append(comm.reduce_scatter(shard, grads, async_op=async_op))
            assert torch.equal(shard, torch.arange(6.0))
            in_place = torch.arange(6.0)  # output is the input (FSDP's in-place all-gather)
            works.append(comm.all_gather(in_place, in_place, async_op=async_op))
            assert torch.equal(in_place, torch.arange(6.0))
            if async_op:
                assert all(w.is_completed() and w.wait() for w in works)
                assert all(w.get_future().done() for w in works)
            else:
                assert works == [None] * len(works)
            seen.append(f"async={async_op}")
        kinds = ["all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter"]
        assert dict(comm.LEDGER.calls) == {k: 2 * (2 if k == "all_gather" else 1) for k in kinds}
        assert comm.LEDGER.payload_bytes["reduce_scatter"] == 2 * 6 * 4
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
        comm._torch_all_gather, comm._torch_reduce_scatter = saved_torch
    return seen


def test_collectives_on_one_rank_are_the_identity_without_the_backend() -> None:
    assert run_distributed(_identity_worker, 1)[0] == ["async=False", "async=True"]
