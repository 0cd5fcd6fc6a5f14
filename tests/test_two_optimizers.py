"""Specification: a model stepped by two optimizers (AdamW for the matrices, SGD with momentum
for the vectors) trains as under torch's DDP with torch.optim, whatever the order of their
steps and ``zero_grad`` calls ([Note: one optimizer of several] for ZeRO-1/2, whose
gradients live in one store: an optimizer's ``zero_grad`` used to clear the other's too).
"""

import copy
from typing import Callable, Dict, List

import torch
from torch import nn

from tests.harness import run_distributed
from tests.parity import assert_trains_alike

STRATEGIES = {"ddp": "DDP", "zero1": "Zero1", "zero2": "Zero2", "zero3": "Zero3", "fsdp": "FSDP"}
ADAMW = dict(lr=1e-2, weight_decay=0.1)
SGD = dict(lr=0.1, momentum=0.9)
# Only the summation order of the gradient average differs (measured: tensors within 1.5e-8,
# losses equal); this MLP has no gradient that is analytically zero, which AdamW would turn
# into lr-sized noise (tests/parity.py).
ATOL = (1e-6, 1e-6)


def _step_all_then_clear_all(model, a, b, x) -> float:
    loss = model(x[0]).square().mean()
    loss.backward()
    a.step(), b.step()
    a.zero_grad(), b.zero_grad()
    return loss.item()


def _step_and_clear_each(model, a, b, x) -> float:
    loss = model(x[0]).square().mean()
    loss.backward()
    a.step(), a.zero_grad()
    b.step(), b.zero_grad()
    return loss.item()


def _clear_to_zeros_each(model, a, b, x) -> float:
    loss = model(x[0]).square().mean()
    loss.backward()
    a.step(), a.zero_grad(set_to_none=False)  # b still steps on its gradients, a on zeros next
    b.step(), b.zero_grad(set_to_none=False)
    return loss.item()


def _backward_between(model, a, b, x) -> float:
    """a steps on batch 0; b on the sum of batches 0 and 1 (its gradients were not cleared)."""
    loss = model(x[0]).square().mean()
    loss.backward()
    a.step(), a.zero_grad()
    model(x[1]).square().mean().backward()
    b.step(), a.step()
    a.zero_grad(), b.zero_grad()
    return loss.item()


ORDERS: Dict[str, Callable] = {
    "step all, then clear all": _step_all_then_clear_all,
    "step and clear each": _step_and_clear_each,
    "clear each to zeros": _clear_to_zeros_each,
    "a backward between the steps": _backward_between,
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(7, 13), nn.GELU(), nn.Linear(13, 13), nn.GELU(), nn.Linear(13, 5)
    )


def _train(model: nn.Module, make, order: Callable, rank: int) -> List[float]:
    named = list(model.named_parameters())
    a = make("AdamW", [(n, p) for n, p in named if p.ndim == 2], ADAMW)
    b = make("SGD", [(n, p) for n, p in named if p.ndim == 1], SGD)
    gen = torch.Generator().manual_seed(rank)
    return [order(model, a, b, torch.randn(2, 4, 7, generator=gen)) for _ in range(3)]


def _worker(rank: int, world_size: int) -> List[str]:
    from tiny_fsdp import core

    seen = []
    for name, order in ORDERS.items():
        torch_ddp = nn.parallel.DistributedDataParallel(_model())

        def torch_optim(kind, named, hyper):
            return getattr(torch.optim, kind)([p for _, p in named], **hyper)

        ref_losses = _train(torch_ddp, torch_optim, order, rank)
        ref_state = torch_ddp.module.state_dict()
        for strategy, wrapper in STRATEGIES.items():
            what = f"{strategy}, {name}"
            model = getattr(core, wrapper)(copy.deepcopy(_model()))

            def own(kind, named, hyper):
                return getattr(core, wrapper + kind)(named, **hyper)

            losses = _train(model, own, order, rank)
            state = model.state_dict()
            assert_trains_alike(what, losses, state, ref_losses, ref_state, *ATOL)
            seen.append(what)
    return seen


def test_two_optimizers_train_as_under_torch_ddp_in_any_order() -> None:
    assert len(run_distributed(_worker, 2)[0]) == len(ORDERS) * len(STRATEGIES)


def _bf16_split(rank: int, world_size: int) -> Dict[str, List[bool]]:
    """ZeRO-1/2 under bf16, per wrapper: [the state after 3 steps by two optimizers equals that
    by one with two groups, every tensor moved, ``_others_kept``]."""
    from tiny_fsdp import core

    seen = {}
    for wrapper in ("Zero1", "Zero2"):
        states = []
        for split in (False, True):
            policy = core.MixedPrecisionPolicy.from_name("bf16")
            model = getattr(core, wrapper)(_model(), mixed_precision=policy)
            named = list(model.named_parameters())
            mats = [(n, p) for n, p in named if p.ndim == 2]
            vecs = [(n, p) for n, p in named if p.ndim == 1]
            adamw = getattr(core, wrapper + "AdamW")
            if split:
                optimizers = [adamw(mats, **ADAMW), adamw(vecs, **ADAMW)]
            else:
                optimizers = [adamw([{"params": mats}, {"params": vecs}], **ADAMW)]
            states.append(copy.deepcopy(model.state_dict()))
            gen = torch.Generator().manual_seed(rank)
            for _ in range(3):
                model(torch.randn(4, 7, generator=gen)).float().square().mean().backward()
                for optimizer in optimizers:
                    optimizer.step()
                    optimizer.zero_grad()
            states.append(model.state_dict())
        same = [torch.equal(states[1][k], states[3][k]) for k in states[1]]
        moved = [not torch.equal(states[0][k], states[1][k]) for k in states[1]]
        seen[wrapper] = [all(same), all(moved), _others_kept(wrapper, rank)]
    return seen


def _others_kept(wrapper: str, rank: int) -> bool:
    """The vectors, in no optimizer and set from outside, keep their values over steps of an
    optimizer of the matrices (whose pieces lie between theirs)."""
    from tiny_fsdp import core

    model = getattr(core, wrapper)(
        _model(), mixed_precision=core.MixedPrecisionPolicy.from_name("bf16")
    )
    mats = [(n, p) for n, p in model.named_parameters() if p.ndim == 2]
    optimizer = getattr(core, wrapper + "AdamW")(mats, **ADAMW)
    vectors = [p for p in model.parameters() if p.ndim == 1]
    with torch.no_grad():
        for p in vectors:
            p.fill_(0.25)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(2):
        model(torch.randn(4, 7, generator=gen)).float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return all(bool((p == 0.25).all()) for p in vectors)


def test_two_optimizers_under_bf16_write_back_only_their_own_pieces() -> None:
    # With bf16 parameters each optimizer keeps fp32 masters of its own pieces and writes them
    # back rounded, one copy per run of adjacent pieces. The matrices' and the vectors' pieces
    # alternate in the flat buffer, so a run that crossed into pieces not its own would
    # write masters over them. And the second optimizer's masters start from the exact fp32
    # values of wrap time, as the first's: the same updates as one optimizer with two groups.
    for per_rank in run_distributed(_bf16_split, 2):
        assert per_rank == {"Zero1": [True] * 3, "Zero2": [True] * 3}, per_rank
