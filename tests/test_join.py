"""Specification: ``with model.join():`` lets DDP ranks run different numbers of iterations, as
torch's ``DistributedDataParallel.join`` does ([Note: DDP join]).

The oracle: torch's DDP under its own ``join()`` with the same model (BatchNorm: buffers are
broadcast from an active rank), ``torch.optim.SGD`` and the same per-rank batches; rank r runs
``2 + r`` iterations of 3 ranks, so ranks join at different iterations and the last iterations
run with one active rank.
"""

import contextlib
import functools
from typing import Any, Callable, Dict, List

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel

from tests.harness import run_distributed
from tiny_fsdp.core import DDP, MixedPrecisionPolicy

# The same SGD steps on gradients averaged by all-reduces of the same values: float32 rounding.
ATOL = 1e-6
# fp16 sums of 3 ranks' values: torch's bucket lists the parameters in another order, so gloo's
# ring adds an element's 3 values in another order, and fp16 rounds each sum (1.7e-5 after 3
# steps without join, 2.1e-5 with it, measured).
FP16_ATOL = 5e-5


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 13), nn.BatchNorm1d(13), nn.Tanh(), nn.Linear(13, 5))


def _train(
    model: nn.Module, join: Callable[[], Any], rank: int, accumulate: bool
) -> Dict[str, torch.Tensor]:
    """``2 + rank`` iterations; with ``accumulate`` every other one under ``no_sync()`` (rank
    1's last one too: its replica would skip the next buffer broadcast); then one step of every
    rank together, after the join. Returns the model as the join left it."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with join():
        for step in range(2 + rank):
            x = torch.randn(4, 7, generator=torch.Generator().manual_seed(10 * step + rank))
            local = accumulate and step % 2 == 0
            with model.no_sync() if local else contextlib.nullcontext():
                model(x).square().mean().backward()
            if not local:
                optimizer.step()
                optimizer.zero_grad()
    after_join = {k: v.clone() for k, v in model.module.state_dict().items()}
    optimizer.zero_grad()
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(rank))
    model(x).square().mean().backward()
    optimizer.step()  # a joined rank's momentum is stale, as under torch's DDP: replicas differ
    return after_join


CASES: Dict[str, Dict[str, Any]] = {
    "default": {},
    "average over active ranks": dict(divide_by_initial_world_size=False),
    "no_sync accumulation": dict(accumulate=True),
    "fp16 communication hook": dict(hook=default_hooks.fp16_compress_hook),
    "Join([model])": dict(generic_join=True),  # torch's context manager over Joinables
}


def _worker(rank: int, world_size: int) -> Dict[str, Dict[str, torch.Tensor]]:
    results = {}
    for case, spec in CASES.items():
        kwargs = {k: v for k, v in spec.items() if k == "divide_by_initial_world_size"}
        states = []
        for wrap in (DistributedDataParallel, DDP):
            model = wrap(_model())
            if "hook" in spec:
                model.register_comm_hook(None, spec["hook"])
            join = functools.partial(model.join, **kwargs)
            if spec.get("generic_join"):
                join = functools.partial(Join, [model])
            after_join = _train(model, join, rank, spec.get("accumulate", False))
            states.append(model.module.state_dict())
        for key, expected in states[0].items():
            gap = (states[1][key].double() - expected.double()).abs().max().item()
            tol = FP16_ATOL if "hook" in spec else ATOL
            assert gap <= tol, f"{case}: {key} differs from torch's DDP by {gap:.2e}"
        results[case] = after_join  # ours
    return results


def test_uneven_inputs_train_as_under_torch_ddp_join() -> None:
    results = run_distributed(_worker, 3)
    for case in CASES:  # the last joiner's model is every rank's
        for key, value in results[0][case].items():
            assert all(torch.equal(r[case][key], value) for r in results[1:]), (case, key)
    default, active = results[0]["default"], results[0]["average over active ranks"]
    assert not torch.equal(default["0.weight"], active["0.weight"])  # the flag changes the mean


class SparseBranchy(nn.Module):
    """A sparse embedding and two heads, one per iteration parity: each iteration leaves a
    head unused on every rank."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(11, 6, sparse=True)
        self.odd, self.even = nn.Linear(6, 4), nn.Linear(6, 4)

    def forward(self, tokens: torch.Tensor, step: int) -> torch.Tensor:
        return (self.odd if step % 2 else self.even)(self.embed(tokens).mean(1))


def _sparse_worker(rank: int, world_size: int) -> None:
    states = []
    for model in (
        DistributedDataParallel(SparseBranchy(), find_unused_parameters=True),
        DDP(SparseBranchy()),
    ):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with model.join():
            for step in range(2 + rank):
                g = torch.Generator().manual_seed(7 * step + rank)
                model(torch.randint(0, 11, (3, 4), generator=g), step).square().mean().backward()
                optimizer.step()
                optimizer.zero_grad()
        states.append(model.module.state_dict())
    for key, expected in states[0].items():
        gap = (states[1][key] - expected).abs().max().item()
        assert gap <= ATOL, f"{key} differs from torch's DDP by {gap:.2e}"


def test_sparse_gradients_and_unused_heads_under_join() -> None:
    """A joined rank's shadow sends no embedding rows and no head gradient."""
    run_distributed(_sparse_worker, 3)


def _mixed_precision_worker(rank: int, world_size: int) -> Dict[str, torch.Tensor]:
    torch.manual_seed(0)  # no BatchNorm: on the CPU its fp32 statistics refuse bf16 inputs
    plain = nn.Sequential(nn.Linear(7, 13), nn.LayerNorm(13), nn.Tanh(), nn.Linear(13, 5))
    model = DDP(plain, mixed_precision=MixedPrecisionPolicy(torch.bfloat16))
    after_join = _train(model, model.join, rank, accumulate=False)
    return {k: v for k, v in after_join.items() if v.is_floating_point()}


def test_mixed_precision_replicas_agree_after_join() -> None:
    """bf16 compute copies and fp32 masters: the joined ranks' shadow backward and the final
    broadcast leave every rank with the same fp32 parameters."""
    states = run_distributed(_mixed_precision_worker, 3)
    for key, value in states[0].items():
        assert value.dtype == torch.float32 and torch.isfinite(value).all(), key
        assert all(torch.equal(s[key], value) for s in states[1:]), key


def _throw_worker(rank: int, world_size: int) -> List[str]:
    model = DDP(_model())
    with pytest.raises(RuntimeError, match="exhausted"):
        _train(model, lambda: model.join(throw_on_early_termination=True), rank, False)
    dist.barrier()
    return ["raised"]


def test_throw_on_early_termination_raises_on_every_rank() -> None:
    assert run_distributed(_throw_worker, 2) == [["raised"], ["raised"]]


def _misuse_worker(rank: int, world_size: int) -> None:
    model = DDP(_model())
    model.register_comm_hook(None, default_hooks.allreduce_hook)
    with pytest.raises(ValueError, match="hook divides the gradients itself"):
        model.join(divide_by_initial_world_size=False)


def test_a_hook_keeps_the_world_size_divisor() -> None:
    run_distributed(_misuse_worker, 2)
