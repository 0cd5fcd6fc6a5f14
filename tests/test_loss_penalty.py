"""Specification: a penalty on the parameters added to the loss outside the model's forward
(``loss + lam * sum(p.pow(2).sum() for p in model.parameters())``) trains every wrapper as
under torch's DDP, when the penalty is a sum over the elements ([Note: parameters in the
loss]).

Outside the forward, ``model.parameters()`` are what this rank holds: under DDP and ZeRO-1/2 the
full tensors, under FSDP its dim-0 shards (padding rows zero), under ZeRO-3 the tensors it owns
whole and empty ones for the others. A sum over elements of those parts has, for each element
a rank holds, the same gradient as over the full tensor, and that gradient lands in ``.grad``
next to the reduced gradient of the data loss: what torch's DDP computes (the penalty is the
same on every rank, so its average over ranks is itself). Its *value* on one rank is this
rank's part; summed over ranks it is the whole. Since a function of a whole tensor would train
wrong that way, FSDP and ZeRO-3 warn, once, when autograd accumulates into a local parameter
(at the user's ``backward()`` line), and never in a training loop without such a term.

The oracle: torch's ``DistributedDataParallel`` + ``torch.optim.SGD`` on the same batches with
the same penalty. SGD with momentum: its steps are lr x gradient, so a wrong penalty gradient
shows at once. 2 and 3 ranks: rows 13 and 5 split unevenly (FSDP's padding rows).
"""

import warnings
from typing import Callable, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.build import build, sgd
from tests.harness import run_distributed
from tests.parity import assert_trains_alike

STRATEGIES = ["ddp", "zero1", "zero2", "zero3", "fsdp"]
SHARDED = ("zero3", "fsdp")  # a rank holds part of model.parameters()
STEPS = 3
SGD = dict(lr=0.1, momentum=0.9)
LAM = 0.05  # the penalty is about the size of the data loss: a wrong gradient moves far
PENALTIES: Dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "L2": lambda p: p.pow(2).sum(),
    "L1": lambda p: p.abs().sum(),
}
# SGD steps are lr x gradient: only the summation order of the gradients' average and of the
# penalty's parts differ (float32 rounding, ~1e-7).
ATOL = (1e-6, 1e-6)
VALUE_RTOL = 1e-6


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 13), nn.GELU(), nn.Linear(13, 5))


def _train(model, optimizer, rank: int, penalty) -> Tuple[List[float], List[float]]:
    """Data losses (this rank's batch) and penalty values (what this rank computes)."""
    gen = torch.Generator().manual_seed(rank)
    losses, values = [], []
    for _ in range(STEPS):
        optimizer.zero_grad()
        data_loss = model(torch.randn(4, 7, generator=gen)).square().mean()
        value = sum(penalty(p) for p in model.parameters())
        (data_loss + LAM * value).backward()
        optimizer.step()
        losses.append(data_loss.item())
        values.append(float(value))
    return losses, values


def _penalty_warnings(caught: List[warnings.WarningMessage]) -> int:
    """How many warnings of the watch; each names this file's ``backward()`` line, not
    autograd's engine."""
    ours = [w for w in caught if "[Note: parameters in the loss]" in str(w.message)]
    assert all(w.filename == __file__ for w in ours), [w.filename for w in ours]
    return len(ours)


def _worker(rank: int, world_size: int) -> List[str]:
    seen = []
    for name, penalty in PENALTIES.items():
        torch_ddp = nn.parallel.DistributedDataParallel(_model())
        reference = torch.optim.SGD(torch_ddp.parameters(), **SGD)
        ref_losses, ref_values = _train(torch_ddp, reference, rank, penalty)
        ref_state = torch_ddp.module.state_dict()
        for strategy in STRATEGIES:
            what = f"{strategy} {name} world={world_size}"
            model, optimizer = build(strategy, _model(), sgd(**SGD))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")  # not once per location: once per model
                losses, values = _train(model, optimizer, rank, penalty)
            assert _penalty_warnings(caught) == (strategy in SHARDED), what
            assert_trains_alike(what, losses, model.state_dict(), ref_losses, ref_state, *ATOL)
            if strategy in SHARDED:  # this rank's part; the parts add up to the whole
                whole = sum(p.numel() for p in _model().parameters())
                assert sum(p.numel() for p in model.parameters()) < whole
                parts = torch.tensor(values, dtype=torch.float64)
                dist.all_reduce(parts)
                values = parts.tolist()
            for ours, ref in zip(values, ref_values):
                assert abs(ours - ref) <= VALUE_RTOL * ref, f"{what}: value {ours} vs {ref}"
            seen.append(what)
    return seen


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_penalty_on_the_parameters_in_the_loss_trains_as_under_torch_ddp(
    world_size: int,
) -> None:
    seen = run_distributed(_worker, world_size)[0]
    assert len(seen) == len(PENALTIES) * len(STRATEGIES)


def _loop_without_penalty(rank: int, world_size: int) -> Dict[str, int]:
    """A training loop's own gradient writes are no penalty: backwards adding up before a
    step, ``no_sync``, a second backward through a kept graph, ``zero_grad`` with and without
    ``set_to_none``, clipping; under FSDP / ZeRO-3, none warns."""
    count = {}
    for strategy in SHARDED:
        model, optimizer = build(strategy, _model(), sgd(**SGD))
        x = torch.randn(4, 7, generator=torch.Generator().manual_seed(rank))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for set_to_none in (True, False):
                optimizer.zero_grad(set_to_none=set_to_none)
                with model.no_sync():
                    model(x).square().mean().backward()
                model(x).square().mean().backward()  # adds to the no_sync sum
                loss = model(x).square().mean()
                loss.backward(retain_graph=True)
                loss.backward()  # again, no forward in between
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
                optimizer.step()
        count[strategy] = _penalty_warnings(caught)
    return count


def _unfrozen_after_wrapping(rank: int, world_size: int) -> Dict[str, int]:
    """A parameter frozen at wrap time and unfrozen later is watched too."""
    count = {}
    for strategy in SHARDED:
        torch.manual_seed(0)
        inner = _model()
        inner[2].requires_grad_(False)
        model, optimizer = build(strategy, inner, sgd(**SGD))
        model.module[2].requires_grad_(True)
        x = torch.randn(4, 7, generator=torch.Generator().manual_seed(rank))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = model(x).square().mean()
            (loss + LAM * model.module[2].weight.pow(2).sum()).backward()
        count[strategy] = _penalty_warnings(caught)
    return count


def test_a_penalty_on_a_parameter_unfrozen_after_wrapping_warns_too() -> None:
    for count in run_distributed(_unfrozen_after_wrapping, 2):
        assert count == {strategy: 1 for strategy in SHARDED}


def test_a_training_loop_without_such_a_term_never_warns() -> None:
    for count in run_distributed(_loop_without_penalty, 2):
        assert count == {strategy: 0 for strategy in SHARDED}
