"""Specification: embeddings with options train under every wrapper as under torch's DDP.

- ``sparse=True`` ([Note: sparse gradients]): under DDP ``.grad`` stays sparse, the average over
  ranks, so ``torch.optim.SparseAdam`` / ``SGD`` run as in a torch DDP script; the other
  wrappers reduce the same values dense. A sparse gradient from a module's own
  ``F.embedding(..., sparse=True)`` is made dense under every wrapper.
- ``scale_grad_by_freq=True``: under FSDP / ZeRO-3 on the generic path.
- ``max_norm``: refused by every wrapper on every rank, with a fix that trains as under torch's
  DDP ([Note: embeddings with max_norm]).

The oracle: torch's ``DistributedDataParallel(find_unused_parameters=True)`` + ``torch.optim``
on the same per-rank batches; each step is two micro-batches, the first under ``no_sync()``
(sparse gradients add up locally), and under DDP, ZeRO-1 and ZeRO-2 one rank skips the
``EmbeddingBag`` in one micro-step (it sends no rows).
"""

import contextlib
from typing import Dict, List, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.build import build, sgd
from tests.harness import run_distributed
from tests.parity import assert_trains_alike

STRATEGIES = ["ddp", "zero1", "zero2", "zero3", "fsdp"]
VOCAB, DIM, STEPS = 23, 6, 3
SGD = dict(lr=0.5, momentum=0.9)
# SGD steps are lr x gradient: only the summation order of the average differs (float32
# rounding), amplified at most by lr / (1 - momentum) = 5 over three steps.
SGD_ATOL = 1e-6


class OwnLookup(nn.Module):
    """A raw parameter looked up with ``F.embedding(..., sparse=True)``: no module says its
    gradient is sparse (torch's DDP fails on it: its reference runs ``sparse=False``)."""

    def __init__(self, sparse: bool) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(VOCAB, DIM) * 0.3)
        self.sparse = sparse

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return F.embedding(idx, self.table, sparse=self.sparse)


class SparseNet(nn.Module):
    def __init__(self, own_sparse: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM, padding_idx=0, sparse=True)
        self.bag = nn.EmbeddingBag(VOCAB, DIM, mode="mean", sparse=True)
        self.freq = nn.Embedding(VOCAB, DIM, scale_grad_by_freq=True)
        self.own = OwnLookup(own_sparse)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor, use_bag: bool = True) -> torch.Tensor:
        h = self.emb(idx) + self.freq(idx) + self.own(idx)  # (B, T, DIM)
        if use_bag:
            h = h + self.bag(idx)[:, None, :]
        return self.head(torch.tanh(h))  # (B, T, VOCAB)


def _model(own_sparse: bool = True) -> nn.Module:
    torch.manual_seed(0)
    return SparseNet(own_sparse)


def _train(
    model: nn.Module, optimizers: List, rank: int, skip: bool = False
) -> Tuple[List[float], List[Dict]]:
    """Losses of every micro-step, and the gradients after each step's backward. ``skip``:
    rank 1 does not use the bag in one micro-step."""
    gen = torch.Generator().manual_seed(rank)
    losses, grads = [], []
    for step in range(STEPS):
        for optimizer in optimizers:
            optimizer.zero_grad()
        for micro in range(2):
            idx = torch.randint(0, VOCAB, (2, 5), generator=gen)
            use_bag = not (skip and rank == 1 and step == 1 and micro == 1)
            with model.no_sync() if micro == 0 else contextlib.nullcontext():
                loss = F.cross_entropy(model(idx, use_bag).flatten(0, 1), idx.roll(1).flatten())
                loss.backward()
            losses.append(loss.item())
        grads.append(
            {
                n.removeprefix("module."): p.grad.clone()
                for n, p in model.named_parameters()
                if p.grad is not None
            }
        )
        for optimizer in optimizers:
            optimizer.step()
    return losses, grads


def _sparse_worker(rank: int, world_size: int) -> List[str]:
    reference = {}
    for skip in (False, True):
        torch_ddp = nn.parallel.DistributedDataParallel(_model(False), find_unused_parameters=True)
        optimizer = torch.optim.SGD(torch_ddp.parameters(), **SGD)
        losses, grads = _train(torch_ddp, [optimizer], rank, skip)
        reference[skip] = losses, grads, torch_ddp.module.state_dict()
        assert grads[0]["emb.weight"].is_sparse and grads[0]["bag.weight"].is_sparse
    seen = []
    for strategy in STRATEGIES:
        what = f"{strategy} world={world_size}"
        # Under FSDP / ZeRO-3 every rank must use the modules outside the blocks alike.
        skip = strategy not in ("zero3", "fsdp")
        ref_losses, ref_grads, ref_state = reference[skip]
        if strategy == "ddp":  # a torch DDP script with only the wrapper changed
            model, _ = build(strategy, _model(), None)
            optimizer = torch.optim.SGD(model.parameters(), **SGD)
        else:
            model, optimizer = build(strategy, _model(), sgd(**SGD))
        losses, grads = _train(model, [optimizer], rank, skip)
        assert_trains_alike(
            what, losses, model.state_dict(), ref_losses, ref_state, SGD_ATOL, SGD_ATOL
        )
        if strategy == "ddp":
            for ours, ref in zip(grads, ref_grads):  # sparse, the rows any rank looked up
                for name in ("emb.weight", "bag.weight"):
                    assert ours[name].is_sparse, f"{what}: {name}"
                    got, want = ours[name].coalesce(), ref[name].coalesce()
                    assert torch.equal(got.indices(), want.indices()), f"{what}: {name} rows"
                    torch.testing.assert_close(got.values(), want.values(), atol=1e-7, rtol=0)
                assert not ours["own.table"].is_sparse, what  # no module declares it sparse
                torch.testing.assert_close(ours["own.table"], ref["own.table"], atol=1e-7, rtol=0)
        seen.append(what)
    return seen


@pytest.mark.parametrize("world_size", [2, 3])
def test_sparse_embeddings_train_as_under_torch_ddp(world_size: int) -> None:
    assert len(run_distributed(_sparse_worker, world_size)[0]) == len(STRATEGIES)


def _sparse_adam_worker(rank: int, world_size: int) -> str:
    """DDP with SparseAdam for the sparse embeddings and AdamW for the rest, as a torch DDP
    script pairs them; our AdamW refuses a sparse gradient and names the fix."""
    from tiny_fsdp.core import DDP, DDPAdamW

    def optimizers(model: nn.Module, adamw: type) -> List:
        named = dict(model.named_parameters())
        sparse = [p for n, p in named.items() if n.endswith(("emb.weight", "bag.weight"))]
        dense = [(n, p) for n, p in named.items() if all(p is not q for q in sparse)]
        dense = dense if adamw is DDPAdamW else [p for _, p in dense]
        return [torch.optim.SparseAdam(sparse, lr=1e-2), adamw(dense, lr=1e-2)]

    torch_ddp = nn.parallel.DistributedDataParallel(_model(False), find_unused_parameters=True)
    ref_losses, _ = _train(torch_ddp, optimizers(torch_ddp, torch.optim.AdamW), rank, True)
    model = DDP(_model())
    losses, _ = _train(model, optimizers(model, DDPAdamW), rank, True)
    # AdamW's tolerance (tests/parity.py): float32 noise normalised by Adam into steps of ~lr.
    assert_trains_alike(
        "ddp SparseAdam", losses, model.state_dict(), ref_losses, torch_ddp.module.state_dict()
    )
    wrong = DDPAdamW(model.named_parameters(), lr=1e-2)
    model(torch.ones(1, 2, dtype=torch.long)).sum().backward()
    with pytest.raises(RuntimeError, match="SparseAdam"):
        wrong.step()

    # A batch of padding only: the embedding's sparse gradient has no rows on any rank.
    model = DDP(_model())
    model(torch.zeros(1, 3, dtype=torch.long)).sum().backward()
    grad = model.module.emb.weight.grad
    assert grad.is_sparse and grad._nnz() == 0 and grad.shape == (VOCAB, DIM)

    # A sparse embedding tied to a dense output layer gets a dense gradient: said, on every rank.
    tied = _model()
    tied.head.weight = tied.emb.weight
    model = DDP(tied)
    with pytest.raises(RuntimeError, match="got a dense gradient.*tied to an output layer"):
        model(torch.ones(1, 2, dtype=torch.long)).sum().backward()
    return "ok"


def test_ddp_keeps_gradients_sparse_for_torch_sparse_adam() -> None:
    assert run_distributed(_sparse_adam_worker, 2) == ["ok", "ok"]


MAX_NORM = 0.5


class NormedNet(nn.Module):
    def __init__(self, max_norm: float = None) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM, max_norm=max_norm)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(idx))


def _max_norm_worker(rank: int, world_size: int) -> List[str]:
    """Every wrapper refuses max_norm; the recipe its message gives (renorm every row after the
    step) trains as torch's DDP with the same recipe."""

    def train(model: nn.Module, optimizer) -> Tuple[List[float], Dict]:
        gen = torch.Generator().manual_seed(rank)
        losses = []
        for _ in range(STEPS):
            optimizer.zero_grad()
            idx = torch.randint(0, VOCAB, (2, 5), generator=gen)
            loss = F.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
            loss.backward()
            optimizer.step()
            with torch.no_grad():  # the recipe of the message
                w = model.module.emb.weight
                if w.numel():
                    w.renorm_(2, 0, MAX_NORM)
            losses.append(loss.item())
        return losses, model.module.state_dict()

    torch.manual_seed(0)
    torch_ddp = nn.parallel.DistributedDataParallel(NormedNet())
    ref_losses, ref_state = train(torch_ddp, torch.optim.SGD(torch_ddp.parameters(), **SGD))
    assert ref_state["emb.weight"].norm(dim=1).max() <= MAX_NORM + 1e-6
    seen = []
    for strategy in STRATEGIES:
        with pytest.raises(ValueError, match=r"'emb' is an Embedding with max_norm=0\.5.*renorm_"):
            build(strategy, NormedNet(MAX_NORM), None)
        torch.manual_seed(0)
        model, optimizer = build(strategy, NormedNet(), sgd(**SGD))
        losses, state = train(model, optimizer)
        assert_trains_alike(strategy, losses, state, ref_losses, ref_state, SGD_ATOL, SGD_ATOL)
        seen.append(strategy)
    return seen


def test_max_norm_is_refused_with_a_fix_that_trains_as_under_torch_ddp() -> None:
    assert run_distributed(_max_norm_worker, 2)[0] == STRATEGIES
