"""Specification: every wrapper starts from rank 0's parameters and buffers (README, "Using it").

Each rank builds its model from its own seed and gives its BatchNorm running statistics its own
values, as ranks seeded differently or a checkpoint loaded on rank 0 alone would. The oracle is
torch's DDP over rank 0's model built on every rank: after two SGD steps on each rank's own
batch, every parameter and buffer of every wrapper equals it, on every rank. DDP and ZeRO-1/2
also give every rank rank 0's buffers before each forward, as torch's DDP does by default; FSDP
and ZeRO-3, as FSDP2, only at wrap time (each rank's BatchNorm then follows its own batches), so
their oracle has ``broadcast_buffers=False``. ``tests/zoo.py``'s ZooLM: a raw and a 0-d
parameter, a tied head, BatchNorm buffers.
"""

from typing import Dict

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from tests.build import WRAPPERS, build, sgd
from tests.harness import run_distributed
from tests.zoo import VOCAB, ZooLM, zoo_loss

STEPS = 2
# SGD and the same kernels; the strategies differ from torch's DDP only in the summation order of
# the gradient average (measured: 0 on 2 ranks).
ATOL = 1e-6
ORACLE = {True: "torch_ddp", False: "torch_ddp_broadcast_buffers_false"}
BROADCASTS_BUFFERS = {"ddp": True, "zero1": True, "zero2": True, "zero3": False, "fsdp": False}


def _own_model(rank: int) -> ZooLM:
    """This rank's model: its own initial weights and running statistics."""
    torch.manual_seed(100 + rank)
    model = ZooLM()
    model.bn.running_mean.fill_(float(rank))
    model.bn.running_var.fill_(1.0 + rank)
    return model


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int) -> None:
    g = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        x, y = (torch.randint(0, VOCAB, (2, 6), generator=g) for _ in range(2))
        zoo_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


def _states(rank: int, world_size: int) -> Dict[str, Dict[str, torch.Tensor]]:
    """Every strategy's full state dict (parameters and buffers) after training."""
    states = {}
    for broadcast_buffers in (True, False):
        reference = DistributedDataParallel(_own_model(0), broadcast_buffers=broadcast_buffers)
        _train(reference, sgd(lr=0.1).reference(reference.parameters()), rank)
        states[ORACLE[broadcast_buffers]] = reference.module.state_dict()
    for strategy in WRAPPERS:
        model, optimizer = build(strategy, _own_model(rank), sgd(lr=0.1))
        _train(model, optimizer, rank)
        states[strategy] = model.state_dict()
    return states


@pytest.fixture(scope="module")
def states():
    return run_distributed(_states, 2)


@pytest.mark.parametrize("strategy", list(WRAPPERS))
def test_every_wrapper_starts_from_rank_0s_parameters_and_buffers(strategy, states) -> None:
    for rank, on_rank in enumerate(states):
        want, got = on_rank[ORACLE[BROADCASTS_BUFFERS[strategy]]], on_rank[strategy]
        assert got.keys() == want.keys()
        for name, value in want.items():
            diff = (got[name].double() - value.double()).abs().max().item()
            assert diff <= ATOL, (strategy, rank, name, diff)
