"""Specification: reentrant gradient checkpointing (``torch.utils.checkpoint(...,
use_reentrant=True)``, what ``gradient_checkpointing_enable()`` of older ``transformers``
versions and many PEFT scripts use) trains every wrapper as under torch's DDP, with one
reduction per backward.

A reentrant checkpoint runs its part of backward as a nested backward. When every trainable
parameter sits inside checkpoints (here: two of them; or a frozen model with adapters in its
checkpointed blocks), the first gradient of a backward is ready inside a nested one, whose end
is not the end of the backward ([Note: bucketed backward]). The oracle: torch's
``DistributedDataParallel`` + ``torch.optim.AdamW`` on the same per-rank batches; the
communication of a step is counted in the ledger against the same model without checkpoints.
"""

from typing import Dict, List, Tuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tests.build import adamw, build
from tests.harness import run_distributed
from tests.parity import assert_trains_alike
from tiny_fsdp.core.comm import LEDGER

STRATEGIES = ["ddp", "zero1", "zero2", "zero3", "fsdp"]
REPLICATED = ("ddp", "zero1", "zero2")  # reduce in buckets: one cycle per backward
STEPS = 3


class Adapted(nn.Module):
    """A frozen linear layer plus a trainable low-rank adapter (LoRA-like)."""

    def __init__(self, d: int, frozen: bool) -> None:
        super().__init__()
        self.base = nn.Linear(d, d)
        self.down = nn.Linear(d, 2, bias=False)
        self.up = nn.Linear(2, d, bias=False)
        self.base.requires_grad_(not frozen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.base(x) + self.up(self.down(x)))


class CheckpointedNet(nn.Module):
    """Blocks each run under a reentrant checkpoint; ``frozen``: only the adapters train, and
    the head is frozen, so every trainable parameter is inside a checkpoint."""

    def __init__(self, reentrant: bool, frozen: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Adapted(7, frozen) for _ in range(3))
        self.head = nn.Linear(7, 3)
        self.head.requires_grad_(not frozen)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.reentrant:
                x = checkpoint(block, x, use_reentrant=True)
            else:
                x = block(x)
        return self.head(x)


def _model(reentrant: bool, frozen: bool) -> nn.Module:
    torch.manual_seed(0)
    return CheckpointedNet(reentrant, frozen)


def _train(model: nn.Module, optimizer, rank: int) -> Tuple[List[float], List[Dict[str, int]]]:
    """Losses, and the collectives (kind -> calls) of each step."""
    gen = torch.Generator().manual_seed(rank)
    losses, calls = [], []
    for _ in range(STEPS):
        optimizer.zero_grad()
        # The input needs a gradient, as a reentrant checkpoint needs (HF's
        # enable_input_require_grads does it for frozen embeddings).
        x = torch.randn(4, 7, generator=gen).requires_grad_()
        LEDGER.reset()
        loss = model(x).square().mean()
        loss.backward()
        calls.append(dict(LEDGER.calls))
        optimizer.step()
        losses.append(loss.item())
    return losses, calls


def _worker(rank: int, world_size: int) -> List[str]:
    seen = []
    for frozen in (False, True):
        torch_ddp = nn.parallel.DistributedDataParallel(_model(True, frozen))
        reference = torch.optim.AdamW(
            [p for p in torch_ddp.parameters() if p.requires_grad], lr=1e-2
        )
        ref_losses, _ = _train(torch_ddp, reference, rank)
        ref_state = torch_ddp.module.state_dict()
        for strategy in STRATEGIES:
            what = f"{strategy} frozen={frozen}"
            model, optimizer = build(strategy, _model(True, frozen), adamw(lr=1e-2))
            losses, calls = _train(model, optimizer, rank)
            assert_trains_alike(what, losses, model.state_dict(), ref_losses, ref_state)
            if strategy in REPLICATED:
                plain, plain_optimizer = build(strategy, _model(False, frozen), adamw(lr=1e-2))
                _, plain_calls = _train(plain, plain_optimizer, rank)
                assert calls == plain_calls, f"{what}: {calls} vs without checkpoints {plain_calls}"
            seen.append(what)
    return seen


def test_reentrant_checkpoints_train_as_under_torch_ddp_with_one_reduction_per_backward():
    assert len(run_distributed(_worker, 2)[0]) == 2 * len(STRATEGIES)


def _input_gradient_worker(rank: int, world_size: int) -> Dict[str, int]:
    """``torch.autograd.grad`` on the input through a wrapper's output starts no reduction."""
    calls = {}
    for strategy in REPLICATED:
        model, _ = build(strategy, _model(False, False), None)
        x = torch.randn(4, 7).requires_grad_()
        LEDGER.reset()
        (grad,) = torch.autograd.grad(model(x).sum(), x)
        calls[strategy] = sum(LEDGER.calls.values())
        assert grad.shape == x.shape and all(p.grad is None for p in model.parameters())
    return calls


def test_input_gradients_through_the_output_start_no_reduction():
    for calls in run_distributed(_input_gradient_worker, 2):
        assert calls == {strategy: 0 for strategy in REPLICATED}
