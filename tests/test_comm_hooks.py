"""Specification: ``DDP.register_comm_hook`` runs torch DDP's communication hooks with torch's
contract, and trains as torch's DDP with the same hook ([Note: DDP communication hooks]).

The oracle: torch's ``DistributedDataParallel`` with the same hook and state, ``torch.optim.SGD``,
the same per-rank batches; every step is two micro-batches, the first under ``no_sync()``. The
model has a parameter no forward uses (its ``.grad`` stays None under both; not with PowerSGD,
see ``_worker``) and fits in one bucket of either (torch's first bucket holds 1 MiB), so a hook
sees the same buckets. Hooks: ``allreduce_hook`` (what DDP does without one),
``fp16_compress_hook`` (torch's ``bf16_compress_hook`` needs NCCL), PowerSGD (rank 1,
compressed from the third step, error feedback and warm start) and a hook of the test's own
that checks what a bucket offers.
"""

import contextlib
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.build import build
from tests.harness import run_distributed
from tests.parity import assert_trains_alike
from tiny_fsdp.core.comm import LEDGER

STEPS = 4
SGD = dict(lr=0.1, momentum=0.9)
# SGD steps are lr x gradient: the same hook reduces the same values (float32 / fp16 / bf16
# rounding of the same numbers), up to the summation order of float32 all-reduces.
ATOL = 1e-6


class Net(nn.Module):
    def __init__(self, unused: bool) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 10)
        self.fc2 = nn.Linear(10, 4)
        self.unused = nn.Linear(3, 3) if unused else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def _model(unused: bool = True) -> nn.Module:
    torch.manual_seed(0)
    return Net(unused)


class CheckingState:
    """The state of ``checking_hook``: what the hook saw of each bucket."""

    def __init__(self) -> None:
        self.seen: List[Tuple[int, bool]] = []


def checking_hook(
    state: CheckingState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Asserts torch's bucket contract, then averages as ``allreduce_hook`` does (annotated
    as torch's DDP demands; ours gets a ``HookBucket`` with the same methods)."""
    buffer, grads, params = bucket.buffer(), bucket.gradients(), bucket.parameters()
    assert buffer.numel() == sum(p.numel() for p in params)
    assert [g.shape for g in grads] == [p.shape for p in params]
    assert all(g.data_ptr() >= buffer.data_ptr() for g in grads)
    state.seen.append((bucket.index(), bucket.is_last()))
    buffer.div_(dist.get_world_size())
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda f: f.value()[0])


def _hooks() -> Dict[str, Callable[[], Tuple[Any, Callable]]]:
    """name -> a function making a fresh (state, hook)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    hooks = {
        "allreduce": lambda: (None, default_hooks.allreduce_hook),
        "fp16": lambda: (None, default_hooks.fp16_compress_hook),
        "powersgd": lambda: (
            powersgd.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2),
            powersgd.powerSGD_hook,
        ),
        "checking": lambda: (CheckingState(), checking_hook),
    }
    if torch.cuda.is_available():
        # torch's PowerSGD hook calls torch.cuda.synchronize(bucket device) whenever CUDA is
        # present, which fails for these CPU buckets, under torch's DDP as under ours.
        del hooks["powersgd"]
    return hooks


def _train(model: nn.Module, optimizer, rank: int) -> Tuple[List[float], List[bool]]:
    """Micro-step losses; and whether the unused parameter had a gradient after each step."""
    gen = torch.Generator().manual_seed(rank)
    losses, unused_grads = [], []
    for _ in range(STEPS):
        optimizer.zero_grad()
        for micro in range(2):
            x = torch.randn(3, 6, generator=gen)
            with model.no_sync() if micro == 0 else contextlib.nullcontext():
                loss = model(x).square().mean()
                loss.backward()
            losses.append(loss.item())
        unused = model.module.unused
        unused_grads.append(unused is not None and unused.weight.grad is not None)
        optimizer.step()
    return losses, unused_grads


def _worker(rank: int, world_size: int) -> List[str]:
    seen = []
    for name, make in _hooks().items():
        # PowerSGD draws a random start per matrix in bucket order: ours (reversed model
        # order) is torch's from its second step on, when torch orders its buckets by gradient
        # arrival; with find_unused_parameters it keeps model order, so no unused parameter.
        unused = name != "powersgd"
        torch_ddp = nn.parallel.DistributedDataParallel(
            _model(unused), find_unused_parameters=unused
        )
        torch_ddp.register_comm_hook(*make())
        reference = torch.optim.SGD(torch_ddp.parameters(), **SGD)
        ref_losses, ref_unused = _train(torch_ddp, reference, rank)
        model, _ = build("ddp", _model(unused), None)
        state, hook = make()
        model.register_comm_hook(state, hook)
        losses, unused = _train(model, torch.optim.SGD(model.parameters(), **SGD), rank)
        ref_state = torch_ddp.module.state_dict()
        assert_trains_alike(name, losses, model.state_dict(), ref_losses, ref_state, ATOL, ATOL)
        assert unused == ref_unused == [False] * STEPS, name
        if name == "checking":  # one bucket, the last, once per synchronised backward
            assert state.seen == [(0, True)] * STEPS, state.seen
            # The ledger counts the flags' all-reduce (one element per parameter), not the
            # collectives the hook issues itself.
            LEDGER.reset()
            model(torch.randn(3, 6)).sum().backward()
            n_params = len(list(model.parameters()))
            assert dict(LEDGER.calls) == {"all_reduce": 1}, dict(LEDGER.calls)
            assert LEDGER.payload_bytes["all_reduce"] == 4 * n_params
        seen.append(name)
    return seen


def test_ddp_runs_torch_communication_hooks_as_torch_ddp_does() -> None:
    assert run_distributed(_worker, 2)[0] == list(_hooks())


def _refusals(rank: int, world_size: int) -> List[str]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    hook = default_hooks.fp16_compress_hook
    model, _ = build("ddp", _model(), None)
    model.register_comm_hook(None, hook)
    with pytest.raises(RuntimeError, match="only be called once"):
        model.register_comm_hook(None, hook)
    seen = []
    for strategy in ("zero1", "zero2", "fsdp", "zero3", "ddp"):
        model, _ = build(strategy, _model(), None)
        if strategy != "ddp":
            with pytest.raises(NotImplementedError, match="Use DDP for a hook.*MixedPrecision"):
                model.register_comm_hook(None, hook)
            with pytest.raises(NotImplementedError, match="DDP only.*DistributedSampler"):
                model.join()  # DDP's: tests/test_join.py
        seen.append(strategy)
    return seen


def test_other_wrappers_refuse_hooks_and_join() -> None:
    assert len(run_distributed(_refusals, 2)[0]) == 5
