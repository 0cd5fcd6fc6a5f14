"""Specification: an optimizer of another library (``torch.optim``) on a wrapped model's
``model.parameters()`` trains as under torch's DDP where its rule is right on what a rank holds,
and is refused, saying what to use, where it would silently train wrong ([Note: optimizers of
other libraries]).

The oracle: torch's ``DistributedDataParallel`` with the same optimizer on the same per-rank
batches. FSDP holds dim-0 shards: element-wise rules are right (every torch.optim one of that
kind is run here), Adafactor / Muon (a whole tensor) and LBFGS (every parameter) are refused.
ZeRO-3 holds whole tensors: element-wise and per-tensor rules are right (Muon given this
rank's tensors), LBFGS is refused. An optimizer class of another library steps with one
warning per class and strategy. DDP takes anything. (ZeRO-1/2 refuse every optimizer but
their own, which take a torch.optim class: ``tests/test_zero_torch_optimizers.py``.)
"""

import warnings
from typing import Callable, Dict, List

import pytest
import torch
from torch import nn

from tests.build import build
from tests.harness import run_distributed
from tests.parity import assert_trains_alike
from tests.zoo import SignSGD

STEPS = 3
# The same update rule on the same values: float32 rounding of the averaged gradients only.
ATOL = 1e-6
Make = Callable[[List[nn.Parameter]], torch.optim.Optimizer]

ELEMENTWISE: Dict[str, Make] = {
    "SGD": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
    "Adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=1e-2),
    "Adamax": lambda p: torch.optim.Adamax(p, lr=1e-2),
    "NAdam": lambda p: torch.optim.NAdam(p, lr=1e-2),
    "RAdam": lambda p: torch.optim.RAdam(p, lr=1e-2),
    "RMSprop": lambda p: torch.optim.RMSprop(p, lr=1e-2),
    "Rprop": lambda p: torch.optim.Rprop(p, lr=1e-2),
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
    "Adadelta": lambda p: torch.optim.Adadelta(p, lr=1.0),
    "ASGD": lambda p: torch.optim.ASGD(p, lr=0.1),
}
# Muon takes 2-D tensors only; under ZeRO-3 a rank gives it the tensors it holds.
PER_TENSOR: Dict[str, Make] = {
    "Adafactor": lambda p: torch.optim.Adafactor(p, lr=1e-2),
    "Muon": lambda p: torch.optim.Muon([q for q in p if q.numel()], lr=0.02),
}


# Reads every parameter at once and re-evaluates the loss (a closure) several times a step.
LBFGS: Make = lambda p: torch.optim.LBFGS(p, lr=0.5, max_iter=4)  # noqa: E731


def _model() -> nn.Module:
    """Matrices only (Muon's domain), odd row counts: FSDP's shards are uneven."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 13, bias=False), nn.Tanh(), nn.Linear(13, 5, bias=False))


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int) -> List[float]:
    gen = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(STEPS):
        x = torch.randn(4, 7, generator=gen)

        def closure() -> torch.Tensor:
            optimizer.zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            return loss

        if isinstance(optimizer, torch.optim.LBFGS):  # evaluates the loss as often as it needs
            losses.append(optimizer.step(closure).item())
        else:
            losses.append(closure().item())
            optimizer.step()
    return losses


def _trains_alike(strategy: str, name: str, make: Make, rank: int) -> None:
    torch_ddp = nn.parallel.DistributedDataParallel(_model())
    ref_losses = _train(torch_ddp, make(list(torch_ddp.parameters())), rank)
    model, _ = build(strategy, _model(), None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a known rule steps without a warning
        losses = _train(model, make(list(model.parameters())), rank)
    state, ref_state = model.state_dict(), torch_ddp.module.state_dict()
    assert_trains_alike(f"{strategy} {name}", losses, state, ref_losses, ref_state, ATOL, ATOL)


def _worker(rank: int, world_size: int) -> List[str]:
    seen = []
    right = {
        "ddp": {**ELEMENTWISE, **PER_TENSOR, "LBFGS": LBFGS},
        "fsdp": ELEMENTWISE,
        "zero3": {**ELEMENTWISE, **PER_TENSOR},
    }
    for strategy, makes in right.items():
        for name, make in makes.items():
            _trains_alike(strategy, name, make, rank)
            seen.append(f"{strategy} {name}")
    refused = {
        "fsdp": {"Adafactor": "whole tensors", "Muon": "whole tensors", "LBFGS": "all param"},
        "zero3": {"LBFGS": "all parameters at once"},
    }
    for strategy, names in refused.items():
        for name, reads in names.items():
            model, _ = build(strategy, _model(), None)
            params = list(model.parameters())
            optimizer = getattr(torch.optim, name)(params, lr=1e-2)
            with pytest.raises(RuntimeError, match=f"{name} steps .* reads {reads}.*Use"):
                _train(model, optimizer, rank)
            seen.append(f"{strategy} refuses {name}")
    for strategy in ("fsdp", "zero3"):  # another library's class: right here, warned once
        model, _ = build(strategy, _model(), None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):  # a second optimizer of the class: no second warning
                _train(model, SignSGD(list(model.parameters()), lr=1e-3), rank)
        ours = [w for w in caught if "optimizers of other libraries" in str(w.message)]
        assert len(ours) == 1 and "SignSGD" in str(ours[0].message), [str(w) for w in ours]
        assert ours[0].filename == __file__, ours[0].filename  # the user's step() line
        seen.append(f"{strategy} warns SignSGD")
    return seen


def test_optimizers_of_other_libraries_train_right_or_are_refused() -> None:
    seen = run_distributed(_worker, 2)[0]
    # Element-wise rules under DDP, FSDP and ZeRO-3; per-tensor ones under DDP and ZeRO-3;
    # LBFGS under DDP; four refusals; the warning under FSDP and ZeRO-3.
    assert len(seen) == 3 * len(ELEMENTWISE) + 2 * len(PER_TENSOR) + 1 + 4 + 2, seen
