"""Specification: ``Zero1Optimizer`` / ``Zero2Optimizer`` step a ZeRO model with any
element-wise ``torch.optim`` class, as torch's ``ZeroRedundancyOptimizer(optimizer_class=...)``
does ([Note: torch.optim rules on pieces]).

The oracle: torch's ``DistributedDataParallel`` + ``ZeroRedundancyOptimizer`` with the same class,
hyper-parameters, param groups and LR scheduler on the same per-rank batches. Each rank updates
its flat share of the elements with the class's own ``step``, so the state is sharded as
ZeRO-1/2's, checkpoints round-trip (consolidated, and through ``tiny_fsdp.checkpoint`` into
another strategy), and rules that read whole tensors are refused.
"""

import warnings
from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from tests.harness import run_distributed
from tests.parity import assert_trains_alike
from tests.zoo import SignSGD
from tiny_fsdp.checkpoint import load_checkpoint, save_checkpoint
from tiny_fsdp.core import FSDP, Zero1, Zero1AdamW, Zero1Optimizer, Zero2, Zero2AdamW
from tiny_fsdp.core import Zero2Optimizer, Zero2SGD

STEPS = 4
# The same rule on the same values; only the gradient average rounds differently (reduce-scatter
# here, all-reduce in torch's DDP): float32 rounding.
ATOL = 1e-6
# Every element-wise torch.optim class but SparseAdam (sparse gradients only), with settings
# that exercise their state (momentum, AMSGrad, weight decay).
RULES: Dict[str, Dict[str, Any]] = {
    "SGD": dict(lr=0.1, momentum=0.9, nesterov=True),
    "Adam": dict(lr=1e-2, amsgrad=True),
    "AdamW": dict(lr=1e-2),
    "Adamax": dict(lr=1e-2),
    "NAdam": dict(lr=1e-2),
    "RAdam": dict(lr=1e-2),
    "RMSprop": dict(lr=1e-2, momentum=0.5),
    "Rprop": dict(lr=1e-2),
    "Adagrad": dict(lr=0.1),  # builds its state in the constructor
    "Adadelta": dict(lr=1.0),
    "ASGD": dict(lr=0.1),
}
WRAPPERS = {1: (Zero1, Zero1Optimizer), 2: (Zero2, Zero2Optimizer)}
# ZeRO-2 differs from ZeRO-1 only in where the reduced gradients wait, not in how a rule steps
# them: three rules (momentum, moments, state made in the constructor) cover it.
ZERO2_RULES = ("SGD", "Adam", "Adagrad")


def _model() -> nn.Module:
    """Odd sizes: the ranks' shares split tensors at odd offsets."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5))


def _groups(model: nn.Module, named: bool, **hyper: Any) -> List[Dict[str, Any]]:
    """Weight decay on matrices only, as GPT-2 scripts do."""
    pairs = list(model.named_parameters())
    take = (lambda n, p: (n, p)) if named else (lambda n, p: p)
    return [
        {"params": [take(n, p) for n, p in pairs if p.dim() == 2], "weight_decay": 0.1, **hyper},
        {"params": [take(n, p) for n, p in pairs if p.dim() < 2], "weight_decay": 0.0, **hyper},
    ]


def _train(
    model: nn.Module, optimizer: Any, rank: int, steps: int = STEPS, first: int = 0
) -> List[float]:
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    losses = []
    for step in range(first, first + steps):
        x = torch.randn(4, 7, generator=torch.Generator().manual_seed(100 * step + rank))
        optimizer.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    return losses


def _reference(cls: type, hyper: Dict[str, Any], rank: int) -> Tuple[List[float], Dict]:
    torch_ddp = DistributedDataParallel(_model())
    groups = _groups(torch_ddp, named=False)
    optimizer = ZeroRedundancyOptimizer(groups, optimizer_class=cls, **hyper)
    return _train(torch_ddp, optimizer, rank), torch_ddp.module.state_dict()


def _assert_state_is_sharded(what: str, model: nn.Module, optimizer: Any) -> None:
    """The rule's state covers this rank's pieces only; the ranks' pieces cover every element
    once."""
    pieces = optimizer.state_pieces(saving=True)
    for piece in pieces:
        for key, value in optimizer.state[piece.local].items():
            if value.dim():  # a 0-d value (step) is per parameter
                assert value.shape == piece.local.shape, f"{what}: {key} {value.shape}"
    owned = torch.tensor(sum(piece.local.numel() for piece in pieces))
    dist.all_reduce(owned)
    assert owned.item() == sum(p.numel() for p in model.parameters()), what


def _rules_worker(rank: int, world_size: int) -> List[str]:
    seen = []
    for name, hyper in RULES.items():
        cls = getattr(torch.optim, name)
        ref_losses, ref_state = _reference(cls, hyper, rank)
        for stage, (wrapper, optimizer_cls) in WRAPPERS.items():
            if stage == 2 and name not in ZERO2_RULES:
                continue
            model = wrapper(_model())
            # Built as a ZeroRedundancyOptimizer is: the class positional, its own arguments.
            optimizer = optimizer_cls(
                _groups(model, named=True), cls, None, parameters_as_bucket_view=True, **hyper
            )
            losses = _train(model, optimizer, rank)
            what = f"ZeRO-{stage} {name}"
            assert_trains_alike(what, losses, model.state_dict(), ref_losses, ref_state, ATOL, ATOL)
            _assert_state_is_sharded(what, model, optimizer)
            seen.append(what)
    return seen


def test_every_elementwise_torch_rule_trains_as_zero_redundancy_optimizer() -> None:
    """2 ranks, 11 classes (3 of them under ZeRO-2 too), two param groups, StepLR."""
    seen = run_distributed(_rules_worker, 2)[0]
    assert len(seen) == len(RULES) + len(ZERO2_RULES), seen


def _clip_and_bf16_worker(rank: int, world_size: int) -> None:
    # Clipping: torch's clip_grad_norm_ on ZeRO-1's .grad, the optimizer's on ZeRO-2 (no .grad).
    torch_ddp = DistributedDataParallel(_model())
    ref = torch.optim.Adam(torch_ddp.parameters(), lr=1e-2)
    models = {stage: wrapper(_model()) for stage, (wrapper, _) in WRAPPERS.items()}
    optimizers = {
        stage: WRAPPERS[stage][1](m.named_parameters(), optimizer_class=torch.optim.Adam, lr=1e-2)
        for stage, m in models.items()
    }
    for step in range(STEPS):
        x = torch.randn(4, 7, generator=torch.Generator().manual_seed(step + 10 * rank))
        torch_ddp(x).square().mean().backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(torch_ddp.parameters(), 0.05)
        ref.step()
        ref.zero_grad()
        for stage, model in models.items():
            model(x).square().mean().backward()
            if stage == 1:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            else:
                norm = optimizers[stage].clip_grad_norm_(0.05)
            assert abs(norm.item() - ref_norm.item()) <= 1e-6, (stage, norm, ref_norm)
            assert ref_norm > 0.05  # the clip changes the update
            optimizers[stage].step()
            optimizers[stage].zero_grad()
    for stage, model in models.items():
        for key, value in torch_ddp.module.state_dict().items():
            gap = (model.state_dict()[key] - value).abs().max().item()
            assert gap <= ATOL, f"ZeRO-{stage} clipped: {key} differs by {gap:.2e}"
    # bf16 parameters: fp32 masters, bf16 gradients cast to fp32; the same numbers as the
    # project's own AdamW with torch.optim.AdamW's arithmetic (fused=False).
    results = []
    for make in (
        lambda m: Zero2Optimizer(m.named_parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2),
        lambda m: Zero2AdamW(m.named_parameters(), lr=1e-2, fused=False),
    ):
        model = Zero2(_model().to(torch.bfloat16))
        optimizer = make(model)
        for step in range(STEPS):
            x = torch.randn(4, 7, generator=torch.Generator().manual_seed(step + 10 * rank))
            model(x.bfloat16()).float().square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        masters = [s.master for s in optimizer.state_pieces(saving=True)]
        assert all(m.dtype == torch.float32 for m in masters)
        results.append((model.state_dict(), [m.clone() for m in masters]))
    (state, masters), (ref_state, ref_masters) = results
    for key, value in ref_state.items():
        assert value.dtype == torch.bfloat16 and torch.equal(state[key], value), key
    assert all(torch.equal(a, b) for a, b in zip(masters, ref_masters))


def test_clipping_and_bf16_masters() -> None:
    """Clipped steps equal torch DDP + clip_grad_norm_ + Adam; bf16 keeps fp32 masters."""
    run_distributed(_clip_and_bf16_worker, 2)


class Branchy(nn.Module):
    """The head ``b`` serves the first steps, ``c`` the later ones, on every rank."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(7, 13), nn.Linear(13, 5), nn.Linear(13, 5)

    def forward(self, x: torch.Tensor, use_c: bool) -> torch.Tensor:
        return (self.c if use_c else self.b)(torch.tanh(self.a(x)))


def _unused_worker(rank: int, world_size: int) -> None:
    torch_ddp = DistributedDataParallel(Branchy(), find_unused_parameters=True)
    hyper = dict(lr=1e-2, weight_decay=0.5)  # decay would move a parameter that is stepped
    runs = [(torch_ddp, torch.optim.AdamW(torch_ddp.parameters(), **hyper))]
    for wrapper, optimizer_cls in WRAPPERS.values():
        model = wrapper(Branchy())
        optimizer = optimizer_cls(
            model.named_parameters(), optimizer_class=torch.optim.AdamW, **hyper
        )
        runs.append((model, optimizer))
    for step in range(STEPS):
        x = torch.randn(4, 7, generator=torch.Generator().manual_seed(10 * step + rank))
        for model, optimizer in runs:
            optimizer.zero_grad()
            model(x, use_c=step >= STEPS // 2).square().mean().backward()
            optimizer.step()
    expected = torch_ddp.module.state_dict()
    for model, _ in runs[1:]:
        for key, value in model.state_dict().items():
            gap = (value - expected[key]).abs().max().item()
            assert gap <= ATOL, f"{type(model).__name__}: {key} differs by {gap:.2e}"


def test_parameters_no_rank_used_are_not_stepped() -> None:
    """As torch.optim skips a ``.grad`` of None: no weight decay, no moments for them."""
    run_distributed(_unused_worker, 2)


def _build(stage: int, seed: int) -> Tuple[nn.Module, Any]:
    wrapper, optimizer_cls = WRAPPERS[stage]
    torch.manual_seed(seed)
    model = wrapper(nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5)))
    groups = _groups(model, named=True)
    return model, optimizer_cls(groups, optimizer_class=torch.optim.Adam, lr=1e-2)


def _checkpoint_worker(rank: int, world_size: int, path: str) -> None:
    model, optimizer = _build(1, seed=0)
    _train(model, optimizer, rank, steps=2)
    optimizer.consolidate_state_dict(to=0)
    saved = [{"model": model.state_dict(), "optim": optimizer.state_dict()} if rank == 0 else None]
    dist.broadcast_object_list(saved, src=0)
    save_checkpoint(path, model, optimizer, step=2)
    # The consolidated state keeps Adam's keys, per parameter, world-size free.
    state = saved[0]["optim"]["state"]
    assert saved[0]["optim"]["optimizer"] == "torch.optim.Adam"
    assert set(state[0]) == {"master", "step", "exp_avg", "exp_avg_sq"}, set(state[0])
    assert state[0]["exp_avg"].shape == (13, 7)
    uninterrupted = _train(model, optimizer, rank, steps=2, first=2)
    # Into ZeRO-2 (another layout of the same elements), from another initialisation.
    resumed_model, resumed = _build(2, seed=1)
    resumed_model.load_state_dict(saved[0]["model"])
    resumed.load_state_dict(saved[0]["optim"])
    assert _train(resumed_model, resumed, rank, steps=2, first=2) == uninterrupted
    for key, value in model.state_dict().items():
        assert torch.equal(resumed_model.state_dict()[key], value), key
    # Into FSDP + torch.optim.Adam (dim-0 shards) through tiny_fsdp.checkpoint.
    torch.manual_seed(1)
    fsdp = FSDP(nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5)))
    fsdp_optimizer = torch.optim.Adam(_groups(fsdp, named=False, lr=1e-2))
    assert load_checkpoint(path, fsdp, fsdp_optimizer)["step"] == 2
    assert fsdp_optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.7**2)
    losses = _train(fsdp, fsdp_optimizer, rank, steps=2, first=2)
    # The scheduler restarts from the loaded lr; gradients are averaged by another collective.
    ref_state = model.state_dict()
    for key, value in fsdp.state_dict().items():
        gap = (value - ref_state[key]).abs().max().item()
        assert gap <= ATOL, f"FSDP resumed: {key} differs by {gap:.2e}"
    assert losses == pytest.approx(uninterrupted, abs=ATOL)


def test_state_resumes_in_another_stage_and_strategy(tmp_path: Any) -> None:
    """Consolidated state: ZeRO-1 -> ZeRO-2 bitwise; tiny_fsdp.checkpoint: ZeRO-1 -> FSDP."""
    run_distributed(_checkpoint_worker, 2, str(tmp_path / "ckpt"))


def _misuse_worker(rank: int, world_size: int) -> None:
    model = Zero1(_model())
    named = list(model.named_parameters())
    for cls, reads in [
        (torch.optim.Adafactor, "whole tensors.*DDP or Zero3"),
        (torch.optim.Muon, "whole tensors"),
        (torch.optim.LBFGS, "all parameters at once.*DDP"),
    ]:
        with pytest.raises(ValueError, match=f"{cls.__name__}'s update reads {reads}"):
            Zero1Optimizer(named, optimizer_class=cls, lr=1e-2)
    with pytest.raises(TypeError, match="must be a torch.optim.Optimizer class"):
        Zero1Optimizer(named, optimizer_class=torch.optim.Adam(_model().parameters()))
    with pytest.raises(ValueError, match="Invalid learning rate"):  # torch's own check
        Zero1Optimizer(named, optimizer_class=torch.optim.Adam, lr=-1.0)
    with pytest.raises(ValueError, match="Invalid learning rate"):  # a group's too
        Zero1Optimizer(_groups(model, named=True, lr=-1.0), optimizer_class=torch.optim.Adam)
    with pytest.raises(ValueError, match=r"overlap_with_ddp=True\) is not supported"):
        Zero1Optimizer(named, torch.optim.Adam, overlap_with_ddp=True)
    alone = dist.new_group([0])  # every rank calls new_group
    with pytest.raises(ValueError, match="shards over every rank; leave process_group out"):
        Zero1Optimizer(named, torch.optim.Adam, process_group=alone)
    with pytest.raises(ValueError, match="belongs to a Zero1; use Zero1Optimizer"):
        Zero2Optimizer(named, optimizer_class=torch.optim.Adam)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer = Zero1Optimizer(named, optimizer_class=SignSGD, lr=1e-3)
    ours = [w for w in caught if "torch.optim rules on pieces" in str(w.message)]
    assert len(ours) == 1 and "SignSGD" in str(ours[0].message), [str(w) for w in caught]
    assert ours[0].filename == __file__, ours[0].filename  # the user's line
    _train(model, optimizer, rank, steps=1)  # an element-wise rule of its own: it steps
    # A torch.optim optimizer on a ZeRO model's parameters is refused, naming this class.
    with pytest.raises(RuntimeError, match=r"Zero1Optimizer\(model.named_parameters\(\), "):
        _train(model, torch.optim.Adam(model.parameters()), rank, steps=1)
    # A consolidated state of the project's AdamW is not Adam's (no decoupled decay): refused.
    own = Zero1AdamW(model.named_parameters(), lr=1e-2)
    own.consolidate_state_dict(to=0)
    state = [own.state_dict() if rank == 0 else None]
    dist.broadcast_object_list(state, src=0)
    adam = Zero1Optimizer(model.named_parameters(), optimizer_class=torch.optim.Adam)
    with pytest.raises(ValueError, match="cannot load the state of a AdamW optimizer"):
        adam.load_state_dict(state[0])


def _own_rules_worker(rank: int, world_size: int) -> None:
    for own_cls, torch_cls, hyper in [
        (Zero1AdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
        (Zero2SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
    ]:
        wrapper = Zero1 if own_cls is Zero1AdamW else Zero2
        optimizer_cls = Zero1Optimizer if wrapper is Zero1 else Zero2Optimizer
        model = wrapper(_model())
        own = own_cls(model.named_parameters(), **hyper, **_foreach_ops(own_cls))
        _train(model, own, rank, steps=2)
        own.consolidate_state_dict(to=0)
        saved = [{"model": model.state_dict(), "optim": own.state_dict()} if rank == 0 else None]
        dist.broadcast_object_list(saved, src=0)
        resumed_model = wrapper(_model())
        resumed_model.load_state_dict(saved[0]["model"])
        resumed = optimizer_cls(resumed_model.named_parameters(), torch_cls, **hyper)
        resumed.load_state_dict(saved[0]["optim"])
        # torch's class continues the project's rule: the same foreach ops on the same state.
        assert _train(resumed_model, resumed, rank, 2, 2) == _train(model, own, rank, 2, 2)
        for key, value in model.state_dict().items():
            assert torch.equal(resumed_model.state_dict()[key], value), key


def _foreach_ops(cls: type) -> Dict[str, Any]:
    """The project's AdamW on the CPU: torch's foreach ops, as torch.optim.AdamW's default."""
    return {"fused": False} if cls is Zero1AdamW else {}


def test_the_projects_adamw_and_sgd_state_resumes_in_torchs_class() -> None:
    """``Zero1AdamW`` / ``Zero2SGD`` keep torch.optim.AdamW's / SGD's state under its keys, so
    their consolidated state loads into ``Zero1Optimizer`` / ``Zero2Optimizer`` of that class."""
    run_distributed(_own_rules_worker, 2)


def test_misuse_raises_clear_errors() -> None:
    run_distributed(_misuse_worker, 2)
