"""Specification: ``MixedPrecisionPolicy``'s FSDP2 fields ``output_dtype`` and
``cast_forward_inputs`` hold under every wrapper ([Note: mixed precision]).

``output_dtype``: the floating tensors the wrapped model returns come in that dtype (tensors
inside tuples, dicts and dataclasses; integer ones untouched), and gradients flow back through
the cast. ``cast_forward_inputs=False``: the model receives its floating inputs as given.
"""

from dataclasses import dataclass
from typing import List

import pytest
import torch
from torch import nn

from tests.build import build
from tests.harness import run_distributed
from tiny_fsdp.core import MixedPrecisionPolicy, Zero1Optimizer, Zero2Optimizer

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")


@dataclass
class Out:
    logits: torch.Tensor
    argmax: torch.Tensor


class Net(nn.Module):
    """Records the dtype of its input; returns a dataclass with a float and an integer tensor."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(4, 6), nn.Linear(6, 3)
        self.seen: List[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> Out:
        self.seen.append(x.dtype)
        logits = self.fc2(torch.tanh(self.fc1(x.to(self.fc1.weight.dtype))))
        return Out(logits, logits.argmax(-1))


def _sgd(strategy: str, model: nn.Module) -> torch.optim.Optimizer:
    if strategy in ("zero1", "zero2"):  # their gradients reach their own optimizers only
        cls = Zero1Optimizer if strategy == "zero1" else Zero2Optimizer
        return cls(model.named_parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
    return torch.optim.SGD(model.parameters(), lr=0.1)


def _worker(rank: int, world_size: int) -> List[str]:
    seen = []
    policies = {
        "defaults": MixedPrecisionPolicy(torch.bfloat16),
        "fp32 outputs": MixedPrecisionPolicy(torch.bfloat16, output_dtype=torch.float32),
        "inputs as given": MixedPrecisionPolicy(torch.bfloat16, cast_forward_inputs=False),
    }
    for strategy in STRATEGIES:
        for what, policy in policies.items():
            model, _ = build(strategy, Net(), None, mixed_precision=policy)
            optimizer = _sgd(strategy, model)
            inner = model.module
            before = [p.detach().clone() for p in model.parameters()]
            out = model(torch.randn(5, 4))
            want = torch.float32 if policy.output_dtype else torch.bfloat16
            assert out.logits.dtype == want, (strategy, what, out.logits.dtype)
            assert out.argmax.dtype == torch.int64, (strategy, what)
            given = torch.float32 if what == "inputs as given" else torch.bfloat16
            assert inner.seen == [given], (strategy, what, inner.seen)
            out.logits.float().square().mean().backward()
            optimizer.step()
            moved = any(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
            assert moved, (strategy, what, "no gradient reached the parameters")
            seen.append(f"{strategy} {what}")
    return seen


def test_output_dtype_and_cast_forward_inputs_under_every_wrapper() -> None:
    assert len(run_distributed(_worker, 2)[0]) == 3 * len(STRATEGIES)


def test_output_dtype_must_be_floating() -> None:
    with pytest.raises(ValueError, match="output_dtype must be a floating-point"):
        MixedPrecisionPolicy(torch.bfloat16, output_dtype=torch.int32)
