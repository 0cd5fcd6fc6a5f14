"""Specification: a copy of a wrapped model is an independent model on the same ranks, as a
copy of the module is under torch's DDP: a frozen teacher (``copy.deepcopy(model)``) keeps the
outputs it had when copied, an EMA (``torch.optim.swa_utils.AveragedModel(model)``) follows
the model's average, a teacher runs between the student's forward and backward
(self-distillation), and a copy trained on its own trains as the original, under every
wrapper ([Note: copying a wrapped model] in
``tiny_fsdp/core/wrapper.py``). Under FSDP / ZeRO-3 a copy of the inner model alone holds this
rank's parts without the strategy: its forward raises, on every rank, naming the fix.

The oracle: torch's DDP with the same copies of its module, the same SGD steps and data.
"""

import copy
import re
from typing import Dict, List

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from tests.harness import run_distributed
from tests.zoo import OwnRMSNorm, TinyBlocksLM

VOCAB, STEPS = 20, 3
# SGD and the same kernels: the strategies differ only in the summation order of the gradient
# average (measured: 0 on 2 ranks).
ATOL = 1e-6


def _outputs(model: nn.Module, optimizer, to_copy: nn.Module, rank: int) -> Dict[str, torch.Tensor]:
    """Train with a teacher and an EMA copied from ``to_copy``; every model's last outputs."""
    g = torch.Generator().manual_seed(rank)
    x, y = (torch.randint(0, VOCAB, (4, 7), generator=g) for _ in range(2))
    teacher = copy.deepcopy(to_copy)
    ema = AveragedModel(to_copy, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    for _ in range(STEPS):
        F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad()
        ema.update_parameters(to_copy)
    with torch.no_grad():
        return {"teacher": teacher(x), "ema": ema(x), "model": model(x)}


def _train_on(model: nn.Module, rank: int) -> List[float]:
    """Two steps with a new optimizer of the model's strategy; the losses."""
    from tiny_fsdp import core

    optimizer = getattr(core, type(model).__name__ + "SGD")(model.named_parameters(), lr=0.5)
    g = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(2):
        x = torch.randint(0, VOCAB, (4, 7), generator=g)
        loss = F.cross_entropy(model(x).reshape(-1, VOCAB), x.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _distill(student: nn.Module, teacher: nn.Module, optimizer, rank: int) -> List[float]:
    """A self-distillation loop (DINO's shape): the teacher's forward between the student's
    forward and backward, then the teacher moves toward the student."""
    g = torch.Generator().manual_seed(200 + rank)
    losses = []
    for _ in range(2):
        x = torch.randint(0, VOCAB, (4, 7), generator=g)
        logits = student(x)
        with torch.no_grad():
            target = teacher(x).softmax(-1)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1, VOCAB))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            for mine, theirs in zip(teacher.parameters(), student.parameters()):
                mine.lerp_(theirs, 0.1)
        losses.append(loss.item())
    return losses


def _reduce_scatters(model: nn.Module, x: torch.Tensor) -> int:
    """Reduce-scatters issued by one forward and backward of ``model``."""
    from tiny_fsdp.core.comm import LEDGER

    before = LEDGER.calls["reduce_scatter"]
    F.cross_entropy(model(x).reshape(-1, VOCAB), x.reshape(-1)).backward()
    model.zero_grad()
    return LEDGER.calls["reduce_scatter"] - before


def _worker(rank: int, world_size: int) -> List[str]:
    from torch.nn.parallel import DistributedDataParallel

    from tiny_fsdp import core

    torch.manual_seed(0)
    net = TinyBlocksLM(VOCAB)
    # A module on the generic path ([Note: generic layer]): copied after a step it crashed.
    net.out = nn.Sequential(OwnRMSNorm(8), net.out)
    reference = DistributedDataParallel(copy.deepcopy(net))
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    expected = _outputs(reference, optimizer, reference.module, rank)
    assert (expected["teacher"] - expected["model"]).abs().max() > 0.1  # the steps moved it
    student = DistributedDataParallel(copy.deepcopy(net))
    teacher = copy.deepcopy(student.module)
    optimizer = torch.optim.SGD(student.parameters(), lr=0.5)
    distilled = _distill(student, teacher, optimizer, rank)
    checked = []
    for name in ("DDP", "Zero1", "Zero2", "FSDP", "Zero3"):
        model = getattr(core, name)(copy.deepcopy(net))
        optimizer = getattr(core, name + "SGD")(model.named_parameters(), lr=0.5)
        outputs = _outputs(model, optimizer, model, rank)
        for what, ref in expected.items():
            gap = (outputs[what] - ref).abs().max().item()
            assert gap <= ATOL, f"{name}: the {what}'s outputs differ by {gap:.2e}"
        student = getattr(core, name)(copy.deepcopy(net))
        optimizer = getattr(core, name + "SGD")(student.named_parameters(), lr=0.5)
        losses = _distill(student, copy.deepcopy(student), optimizer, rank)
        assert max(abs(a - b) for a, b in zip(losses, distilled)) <= ATOL, f"{name}: distilled"
        # A copy made after steps trains as the original does (its own hooks and buckets).
        copied = copy.deepcopy(model)
        hooks = [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in (model, copied)]
        assert hooks[0] == hooks[1], f"{name}: the copy kept the original's hooks: {hooks}"
        assert _train_on(copied, rank) == _train_on(model, rank), f"{name}: the copy trains apart"
        state, copied_state = model.state_dict(), copied.state_dict()
        assert all(torch.equal(state[k], copied_state[k]) for k in state), name
        inner = copied.module.state_dict()  # torch DDP's idiom: the full tensors here too
        assert all(torch.equal(inner[k], copied_state[k]) for k in copied_state), name
        checked.append(name)
        if name == "FSDP":  # the copy's module events reach its own units, not the original's
            x = torch.randint(0, VOCAB, (4, 7))
            alone = _reduce_scatters(copied, x)
            with model.no_sync():  # the original now keeps sums for its next backward
                F.cross_entropy(model(x).reshape(-1, VOCAB), x.reshape(-1)).backward()
            assert _reduce_scatters(copied, x) == alone, f"{name}: the original's sums went too"
            model.zero_grad()
        if name in ("FSDP", "Zero3"):
            inner_copy = copy.deepcopy(model.module)
            with pytest.raises(RuntimeError, match=r"inner model was copied.*deepcopy\(model\)"):
                inner_copy(torch.zeros(1, 3, dtype=torch.long))
    return checked


def test_a_copied_wrapped_model_is_an_independent_model() -> None:
    # One rank too: there ZeRO-2 stages gradients into its shard through views made at wrap
    # time, which a copy must remake on its own shard.
    for world_size in (1, 2):
        for checked in run_distributed(_worker, world_size):
            assert checked == ["DDP", "Zero1", "Zero2", "FSDP", "Zero3"]


def _ddp_policy_copies(rank: int, world_size: int) -> Dict[str, str]:
    """Under DDP with a bf16 policy (parameters fp32 between forwards, [Note: DDP mixed
    precision]): what a copy of the inner model, the model after its wrapper is dropped, and a
    copy of the wrapper compute, against the plain model or the original wrapper."""
    import gc

    from tiny_fsdp import core

    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))

    torch.manual_seed(0)
    net = build()
    model = core.DDP(net, mixed_precision=core.MixedPrecisionPolicy(torch.bfloat16))
    optimizer = core.DDPSGD(model.named_parameters(), lr=0.5)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(rank))
    model(x).float().square().mean().backward()
    optimizer.step()
    plain = build()  # what the inner model is between steps: fp32, no policy
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        want, policy_out = plain(x), model(x)
        inner_copy = copy.deepcopy(model.module)
        wrapper_copy = copy.deepcopy(model)
        got = {
            "inner copy": inner_copy(x),
            "wrapper copy": wrapper_copy(x),
        }
        del model, optimizer, wrapper_copy
        gc.collect()
        got["inner, wrapper dropped"] = net(x)
    out = {}
    for what, value in got.items():
        ref = policy_out if what == "wrapper copy" else want
        out[what] = f"{value.dtype} {'equal' if torch.equal(value, ref) else 'differs'}"
    return out


def test_under_ddp_s_bf16_policy_a_copy_of_the_inner_model_is_the_plain_model() -> None:
    """DDP's policy is the wrapper's (it casts the parameters per forward), so a copy of
    ``model.module`` (an EMA, an export) or the model once DDP is dropped computes as the
    plain fp32 model; a copy of the wrapper computes under the policy, as the original."""
    for out in run_distributed(_ddp_policy_copies, 2):
        assert out == {
            "inner copy": "torch.float32 equal",
            "wrapper copy": "torch.bfloat16 equal",
            "inner, wrapper dropped": "torch.float32 equal",
        }


class _Scaled(nn.Module):
    """Floating inputs, a raw parameter on the root (FSDP / ZeRO-3's generic path)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((3,), 2.0))
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 4) -> (B, 3)
        return self.body(x) * self.scale


def _pickled(rank: int, world_size: int) -> Dict[str, str]:
    """``torch.save(model.module)`` and ``torch.save(model)`` after a step, fp32 and bf16 policy,
    every strategy: what loading gave, or what was raised."""
    import io

    from tiny_fsdp import core

    out = {}
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(rank))
    for precision in ("fp32", "bf16"):
        policy = core.MixedPrecisionPolicy.from_name(precision)
        for name in ("DDP", "Zero1", "Zero2", "FSDP", "Zero3"):
            torch.manual_seed(0)
            model = getattr(core, name)(_Scaled(), mixed_precision=policy)
            optimizer = getattr(core, name + "SGD")(model.named_parameters(), lr=0.5)
            model(x).float().square().mean().backward()
            optimizer.step()
            with torch.no_grad():
                wrapped = model(x)
            plain = _Scaled()  # the trained values, without any policy
            plain.load_state_dict(model.state_dict())
            for what, obj in (("module", model.module), ("wrapper", model)):
                case = f"{name} {precision} {what}"
                buffer = io.BytesIO()
                try:
                    torch.save(obj, buffer)
                except TypeError as exc:
                    out[case] = "refused: " + str(exc)
                    continue
                buffer.seek(0)
                loaded = torch.load(buffer, weights_only=False)
                with torch.no_grad():
                    y = loaded(x)
                    as_plain, as_wrapped = torch.equal(y, plain(x)), torch.equal(y, wrapped)
                again = getattr(core, name)(loaded)  # no policy: the loaded model is plain
                out[case] = (
                    f"{y.dtype} plain={as_plain} wrapped={as_wrapped} {type(again).__name__}"
                )
    return out


def test_torch_save_of_the_inner_model_gives_the_plain_model_where_it_is_whole() -> None:
    """[Note: pickling a wrapped model]: under DDP and ZeRO-1/2 ``torch.save(model.module)``
    saves the plain model, which loads and wraps again (under a bf16 policy: DDP's is the plain
    fp32 model, ZeRO-1/2's the bf16 model they store, casting its inputs); under FSDP / ZeRO-3,
    and for a wrapper itself, pickling raises, saying what to save instead."""
    state_dict_fix = r"instead use torch\.save\(model\.state_dict\(\)\) \(full tensors"
    for out in run_distributed(_pickled, 2):
        for precision in ("fp32", "bf16"):
            low = precision == "bf16"
            assert out[f"DDP {precision} module"] == (
                f"torch.float32 plain=True wrapped={not low} DDP"
            )
            for name in ("Zero1", "Zero2"):
                case = f"{name} {precision} module"
                # A model of bf16 parameters takes no policy: wrapped again without one.
                dtype = "torch.bfloat16" if low else "torch.float32"
                assert out[case] == f"{dtype} plain={not low} wrapped=True {name}", case
            for name in ("DDP", "Zero1", "Zero2"):
                assert re.fullmatch(
                    rf"refused: an? {name} wrapper cannot be pickled .*instead use "
                    r"torch\.save\(model\.module\) \(the plain model\).*",
                    out[f"{name} {precision} wrapper"],
                ), out[f"{name} {precision} wrapper"]
            for name in ("FSDP", "Zero3"):
                for what in ("module", "wrapper"):
                    case = f"{name} {precision} {what}"
                    assert out[case].startswith("refused: "), case
                    assert re.search(state_dict_fix, out[case]), case
                assert "this rank's parts" in out[f"{name} {precision} module"]
