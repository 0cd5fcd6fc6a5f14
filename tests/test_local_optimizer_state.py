"""Specification: the state dict of an FSDP or ZeRO-3 optimizer is this rank's part ([Note: local
optimizer state] in ``tiny_fsdp/core/optim/base.py``). Saved and loaded on every rank, each its
own, training resumes exactly; a state taken on another rank (the torch DDP habit: rank 0 saves
``optimizer.state_dict()``, every rank loads that file), at another world size, or without the
rank tag, is refused with the fix instead of giving every parameter another rank's moments.
"""

import copy
from typing import List

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.harness import run_distributed
from tiny_fsdp.core.optim.base import LOCAL_STATE_KEY


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))


def _train(model: nn.Module, optimizer, steps: range, rank: int) -> None:
    for step in steps:
        optimizer.zero_grad()
        model(_batch(step, rank)).square().mean().backward()
        optimizer.step()


def _worker(rank: int, world_size: int) -> List[str]:
    from tiny_fsdp import core

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 4))
    seen = []
    for wrapper in ("FSDP", "Zero3"):
        make = getattr(core, wrapper + "AdamW")
        model = getattr(core, wrapper)(copy.deepcopy(plain))
        optimizer = make(model.named_parameters(), lr=1e-2)
        _train(model, optimizer, range(2), rank)
        saved_model = copy.deepcopy(model.state_dict())  # its tensors may be the live ones
        saved_optim = copy.deepcopy(optimizer.state_dict())
        _train(model, optimizer, range(2, 4), rank)
        continuous = model.state_dict()

        resumed = getattr(core, wrapper)(copy.deepcopy(plain))
        resumed_optim = make(resumed.named_parameters(), lr=1e-2)
        resumed.load_state_dict(saved_model)
        # This rank's own part as if taken with one rank more (the same rank number): refused.
        other_world = {**saved_optim, LOCAL_STATE_KEY: {"rank": rank, "world_size": world_size + 1}}
        with pytest.raises(ValueError, match=rf"is rank {rank}'s part \(of {world_size + 1} ranks"):
            resumed_optim.load_state_dict(other_world)
        for state, loads in (([saved_optim], rank == 0), ([{"state": {}}], False)):
            dist.broadcast_object_list(state, src=0)  # rank 0's part, on every rank
            try:
                resumed_optim.load_state_dict(state[0])
                assert loads, f"{wrapper}: rank {rank} loaded rank 0's part"
            except ValueError as error:
                assert not loads, f"{wrapper}: {error}"
                assert "one file per rank" in str(error) and "load_checkpoint" in str(error)
        resumed_optim.load_state_dict(saved_optim)  # its own part
        _train(resumed, resumed_optim, range(2, 4), rank)
        for key, value in resumed.state_dict().items():
            assert torch.equal(value, continuous[key]), (wrapper, key)
        seen.append(wrapper)
    return seen


def test_a_sharded_optimizer_state_loads_only_on_the_rank_it_was_taken_on() -> None:
    assert run_distributed(_worker, 2) == [["FSDP", "Zero3"]] * 2
