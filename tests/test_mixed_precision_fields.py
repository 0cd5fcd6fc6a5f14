"""Specification: ``MixedPrecisionPolicy``'s FSDP2 fields ``output_dtype`` and
``cast_forward_inputs`` hold under every wrapper ([Note: mixed precision]), and FSDP2's own
``torch.distributed.fsdp.MixedPrecisionPolicy`` means there what ours with the same fields means.

``output_dtype``: the floating tensors the wrapped model returns come in that dtype (tensors
inside tuples, dicts and dataclasses; integer ones untouched), and gradients flow back through
the cast. ``cast_forward_inputs=False``: the model receives its floating inputs as given.

A model with BatchNorm trains under a bf16 policy with every wrapper as PyTorch's DDP trains it
under ``torch.autocast`` ([Note: batch norm under a policy]; FSDP2 and a plain bf16 cast fail
there), its running statistics kept in fp32.
"""

import copy
from dataclasses import dataclass
from typing import List

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.build import adamw, build, sgd
from tests.harness import run_distributed
from tiny_fsdp.core import MixedPrecisionPolicy, Zero1Optimizer, Zero2Optimizer
from tiny_fsdp.core.precision import as_policy

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


class BatchNet(Net):
    """``Net`` called with one batch dict: ``{"x": float, "pair": [int ids, float]}``."""

    def forward(self, batch: dict) -> torch.Tensor:
        ids, y = batch["pair"]
        self.seen += [batch["x"].dtype, ids.dtype, y.dtype]
        return self.fc2(torch.tanh(self.fc1(batch["x"]) + self.fc1(y)))[ids]


def _batch_worker(rank: int, world_size: int) -> List[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy as FSDP2Policy, fully_shard

    gen = torch.Generator().manual_seed(rank)
    batch = {"x": torch.randn(5, 4, generator=gen), "pair": [torch.arange(3), torch.randn(5, 4)]}
    theirs = BatchNet()
    mesh = init_device_mesh("cpu", (world_size,))
    fully_shard(theirs, mesh=mesh, mp_policy=FSDP2Policy(torch.bfloat16))
    want = theirs(batch)
    checked = []
    for strategy in STRATEGIES:
        model, _ = build(strategy, BatchNet(), None, mixed_precision=MixedPrecisionPolicy())
        got = model(batch)
        seen = model.module.seen
        assert seen == [torch.bfloat16, torch.int64, torch.bfloat16], (strategy, seen)
        # FSDP2 runs the same bf16 kernels on the same bf16 inputs and weights.
        assert got.dtype == want.dtype and torch.equal(got, want), (strategy, got, want)
        checked.append(strategy)
    return checked


def test_floating_inputs_inside_a_batch_dict_or_list_are_cast_as_fsdp2_casts_them() -> None:
    assert run_distributed(_batch_worker, 2)[0] == list(STRATEGIES)


def test_output_dtype_must_be_floating() -> None:
    with pytest.raises(ValueError, match="output_dtype must be a floating-point"):
        MixedPrecisionPolicy(torch.bfloat16, output_dtype=torch.int32)


# ------------------------------------------------------------- FSDP2's MixedPrecisionPolicy


def _steps(strategy: str, policy: object) -> List[torch.Tensor]:
    """Outputs of 3 SGD steps of ``Net`` under ``strategy`` with ``policy``, then its parameters."""
    model, _ = build(strategy, Net(), None, mixed_precision=policy)
    optimizer = _sgd(strategy, model)
    gen = torch.Generator().manual_seed(dist.get_rank())
    seen = []
    for _ in range(3):
        out = model(torch.randn(5, 4, generator=gen)).logits
        out.float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        seen.append(out.detach())
    return seen + [p.detach().clone() for p in model.parameters()]


def _fsdp2_policy_worker(rank: int, world_size: int) -> List[str]:
    from torch.distributed.fsdp import MixedPrecisionPolicy as FSDP2Policy

    pairs = {  # FSDP2's policy, and ours with the same fields (None: no policy)
        "bf16, fp32 reduce and outputs": (
            FSDP2Policy(torch.bfloat16, torch.float32, torch.float32),
            MixedPrecisionPolicy(torch.bfloat16, torch.float32, torch.float32),
        ),
        "bf16, inputs as given": (
            FSDP2Policy(torch.bfloat16, cast_forward_inputs=False),
            MixedPrecisionPolicy(torch.bfloat16, cast_forward_inputs=False),
        ),
        "FSDP2's default": (FSDP2Policy(), None),
    }
    checked = []
    for strategy in STRATEGIES:
        for what, (theirs, ours) in pairs.items():
            reduces_apart = ours is not None and ours.reduce_dtype != ours.param_dtype
            if strategy in ("zero1", "zero2") and reduces_apart:  # refused alike
                for policy in (theirs, ours):
                    with pytest.raises(ValueError, match="reduces gradients in the parameters'"):
                        build(strategy, Net(), None, mixed_precision=policy)
                continue
            got, want = _steps(strategy, theirs), _steps(strategy, ours)
            # The same fields mean the same casts, so the same numbers, bit for bit.
            for a, b in zip(got, want):
                assert a.dtype == b.dtype and torch.equal(a, b), (strategy, what)
            checked.append(f"{strategy} {what}")
    return checked


def test_fsdp2_policy_trains_as_ours_with_the_same_fields() -> None:
    # 5 wrappers x 3 policies, less ZeRO-1/2's refusal of an fp32 reduction under bf16 compute.
    assert len(run_distributed(_fsdp2_policy_worker, 2)[0]) == 5 * 3 - 2


def test_fsdp2_policy_on_one_device_is_ours_with_the_same_fields() -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy as FSDP2Policy

    def steps(policy: object) -> List[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
        model, optimizer = build("single", model, sgd(lr=0.1), mixed_precision=policy)
        outs = []
        for step in range(3):
            out = model(torch.randn(5, 4, generator=torch.Generator().manual_seed(step)))
            out.float().square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            outs.append(out.detach())
        return outs + [p.detach().clone() for p in model.parameters()]

    for theirs, ours in [
        (
            FSDP2Policy(torch.bfloat16, output_dtype=torch.float32),
            MixedPrecisionPolicy(torch.bfloat16, output_dtype=torch.float32),
        ),
        (FSDP2Policy(), None),
    ]:
        for a, b in zip(steps(theirs), steps(ours)):
            assert a.dtype == b.dtype and torch.equal(a, b), (theirs, a.dtype, b.dtype)


@pytest.mark.parametrize(
    "given, fix",
    [
        (torch.bfloat16, r"MixedPrecisionPolicy\(param_dtype=torch.bfloat16\)"),
        ("bf16", r"MixedPrecisionPolicy.from_name\('bf16'\)"),
    ],
)
def test_other_mixed_precision_values_are_refused_with_what_to_pass(
    given: object, fix: str
) -> None:
    with pytest.raises(TypeError, match=fix):
        as_policy(given)


def test_fsdp1_mixed_precision_and_a_partial_fsdp2_policy_are_refused() -> None:
    from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy as FSDP2Policy

    with pytest.raises(TypeError, match="FSDP1's MixedPrecision has no counterpart"):
        as_policy(MixedPrecision(param_dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="give param_dtype too"):
        as_policy(FSDP2Policy(reduce_dtype=torch.bfloat16))


class ConvBN(nn.Module):
    """An image classifier: convolutions, each followed by a BatchNorm2d, and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.c1(x)))
        x = F.relu(self.bn2(self.c2(x)))
        return self.head(x.mean((2, 3)))


# Ours computes BatchNorm from bf16-rounded weight and bias (the policy's copies), autocast from
# the fp32 ones: a relative 2^-8 apart (bf16's unit roundoff), the convolutions and the head
# alike in both. Losses (~2.3, computed in fp32 from the logits) measured within 2.9e-4; 2^-8
# bounds them. Adam moves a parameter by at most ~lr a step whatever its gradient's rounding (2
# lr a step between two runs; measured 2.9e-3), and ZeRO-1/2 store bf16 parameters (half a
# spacing of BatchNorm's weight near 1: 2^-8). Running statistics measured within 1.8e-4.
BN_LOSS_ATOL, BN_PARAM_ATOL = 2**-8, 2 * 1e-3 * 3 + 2**-8


def _images(step: int, rank: int) -> tuple:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g)


def _train_bn(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, autocast: bool):
    losses = []
    for step in range(3):
        x, y = _images(step, rank)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(x)
        loss = F.cross_entropy(logits.float(), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _batch_norm_worker(rank: int, world_size: int) -> List[str]:
    torch.manual_seed(0)
    base = ConvBN()
    refs = {}
    for broadcast in (True, False):  # DDP and ZeRO-1/2 broadcast buffers; FSDP, ZeRO-3 do not
        kw = {} if broadcast else {"broadcast_buffers": False}  # True: torch's default
        ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base), **kw)
        losses = _train_bn(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3), rank, True)
        refs[broadcast] = losses, ref.module.state_dict()
    seen = []
    for strategy in STRATEGIES:
        ref_losses, want = refs[strategy in ("ddp", "zero1", "zero2")]
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        model, opt = build(strategy, copy.deepcopy(base), adamw(lr=1e-3), mixed_precision=policy)
        losses = _train_bn(model, opt, rank, False)
        loss_gap = max(abs(a - b) for a, b in zip(losses, ref_losses))
        assert 0 < loss_gap <= BN_LOSS_ATOL, f"{strategy}: loss gap {loss_gap}"  # 0: not bf16
        got = model.state_dict()
        for key, value in want.items():
            if "running" in key:  # averages of the activations: fp32, as the model built them
                assert got[key].dtype == torch.float32, f"{strategy}: {key} in {got[key].dtype}"
            gap = (got[key].double() - value.double()).abs().max().item()
            assert gap <= BN_PARAM_ATOL, f"{strategy}: {key} differs by {gap:.2e}"
        if strategy == "ddp":  # a BatchNorm that raises leaves no cast behind
            with pytest.raises(RuntimeError):
                model.module.bn1(torch.randn(2, 5, 4, 4).bfloat16())  # 5 channels, not 8
            bn = model.module.bn1
            with pytest.raises(RuntimeError, match="BFloat16"):  # torch's own, outside
                x = torch.randn(2, 8, 4, 4).bfloat16()
                F.batch_norm(x, bn.running_mean, bn.running_var, bn.weight.bfloat16(), None)
        seen.append(strategy)
    return seen


def test_a_batch_norm_model_trains_under_a_bf16_policy_as_torch_under_autocast() -> None:
    assert run_distributed(_batch_norm_worker, 2)[0] == list(STRATEGIES)
