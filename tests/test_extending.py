"""Extending tiny_fsdp: new wrappers match torch, the generic path is exact, silent and runs
each forward once, the guide's code runs, and a model using all of them trains like one device
under every strategy.
"""

import copy
import re
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.build import adamw, build, sgd
from tests.harness import run_distributed
from tests.parity import LOSS_ATOL, PARAM_ATOL, global_batch, lm_loss, local_slice, mean_over_ranks
from tiny_fsdp.core.module import (
    ParamHandler,
    UnsupportedModuleError,
    convert_module,
    generic_layer,
    is_layer,
)
from tiny_fsdp.core.module.conv import Conv1d, Conv2d
from tiny_fsdp.core.module.registry import WRAPPERS
from tiny_fsdp.core.module.rmsnorm import RMSNorm

# float32. Conv calls the very kernels torch.nn's autograd calls (measured: bit-identical);
# RMSNorm's hand-written backward sums in another order (measured <= 2.4e-7 on values <= ~12);
# the generic path runs the module's own ops. 1e-6 is the task's bound and leaves that margin.
ATOL = 1e-6
GUIDE = Path(__file__).resolve().parents[1] / "docs" / "extending.md"


def _clone_inputs(inputs: Sequence[Any]) -> List[Any]:
    return [
        x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
        for x in inputs
    ]


def _assert_matches(
    reference: nn.Module,
    ours: nn.Module,
    inputs: Sequence[Any],
    kwargs: Optional[Dict[str, Any]] = None,
    atol: float = ATOL,
    seed: int = 0,
) -> None:
    """Same output, input gradients and parameter gradients (None where torch has None)."""
    ref_in, our_in = list(inputs), _clone_inputs(inputs)
    kwargs = kwargs or {}
    torch.manual_seed(seed)  # same draws for modules that use randomness (dropout)
    ref_out = reference(*ref_in, **kwargs)
    torch.manual_seed(seed)
    our_out = ours(*our_in, **kwargs)
    grad_out = torch.randn_like(ref_out)
    ref_out.backward(grad_out)
    our_out.backward(grad_out)
    assert (our_out - ref_out).abs().max().item() <= atol
    for i, (a, b) in enumerate(zip(ref_in, our_in)):
        if isinstance(a, torch.Tensor) and a.requires_grad:
            assert (a.grad - b.grad).abs().max().item() <= atol, f"grad of input {i}"
    ours_by_name = dict(ours.named_parameters())
    for name, p in reference.named_parameters():
        q = ours_by_name[name]
        assert (p.grad is None) == (q.grad is None), f"grad presence of {name}"
        if p.grad is not None:
            assert (p.grad - q.grad).abs().max().item() <= atol, f"grad of {name}"


# ------------------------------------------------------------------------------ Conv1d / Conv2d

CONV_CASES = [  # (torch class, constructor kwargs, input shape)
    (nn.Conv1d, dict(kernel_size=3), (2, 6, 11)),
    (nn.Conv1d, dict(kernel_size=3, stride=2, padding=2, dilation=2, groups=2), (2, 6, 13)),
    (nn.Conv1d, dict(kernel_size=4, padding="same", groups=3), (3, 6, 9)),  # uneven 'same'
    (nn.Conv1d, dict(kernel_size=3, padding="same", dilation=3, groups=6), (3, 6, 9)),
    (nn.Conv1d, dict(kernel_size=5, padding="valid"), (6, 9)),  # unbatched
    (nn.Conv1d, dict(kernel_size=1), (4, 6, 1)),
    (nn.Conv2d, dict(kernel_size=(2, 3), stride=(2, 1), padding=(1, 0), groups=2), (2, 6, 7, 8)),
    (nn.Conv2d, dict(kernel_size=(2, 4), padding="same", dilation=(1, 2)), (6, 7, 8)),
]


@pytest.mark.filterwarnings("ignore:Using padding='same'")  # torch's own note on uneven 'same'
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("torch_cls,kwargs,shape", CONV_CASES)
def test_conv_matches_torch(torch_cls, kwargs, shape, bias):
    torch.manual_seed(0)
    reference = torch_cls(6, 6, bias=bias, **kwargs)
    ours = convert_module(copy.deepcopy(reference))
    assert type(ours) is {nn.Conv1d: Conv1d, nn.Conv2d: Conv2d}[torch_cls]
    _assert_matches(reference, ours, [torch.randn(shape, requires_grad=True)])


def test_conv_frozen_weight_and_input_without_grad():
    torch.manual_seed(0)
    reference = nn.Conv1d(4, 6, 3, groups=2)
    reference.weight.requires_grad_(False)
    ours = convert_module(copy.deepcopy(reference))
    _assert_matches(reference, ours, [torch.randn(2, 4, 7)])  # only the bias gets a gradient
    assert ours.weight.grad is None and ours.bias.grad is not None


@pytest.mark.parametrize("mode", ["reflect", "circular", "replicate"])
def test_conv_with_another_padding_mode_takes_the_generic_path(mode):
    torch.manual_seed(0)
    reference = nn.Conv2d(2, 3, 3, padding=1, padding_mode=mode)
    ours = convert_module(copy.deepcopy(reference))
    assert type(ours) is nn.Conv2d  # not swapped for the wrapper: hooked as written
    _assert_matches(reference, ours, [torch.randn(2, 2, 5, 5)])
    with pytest.raises(NotImplementedError, match=mode):  # the wrapper built directly
        Conv1d(2, 2, 3, padding=1, padding_mode=mode)(torch.randn(1, 2, 5))


# ------------------------------------------------------------------------------ RMSNorm

RMS_CASES = [  # (input shape, normalized_shape, eps)
    ((3, 6), 6, None),
    ((2, 5, 6), 6, 1e-5),
    ((2, 3, 4, 6), (4, 6), None),
    ((7,), 7, 0.1),  # unbatched: the weight gradient sums over no dimension
    ((4, 9, 64), 64, None),
]


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("shape,normalized_shape,eps", RMS_CASES)
def test_rmsnorm_matches_torch(shape, normalized_shape, eps, affine):
    torch.manual_seed(0)
    reference = nn.RMSNorm(normalized_shape, eps=eps, elementwise_affine=affine)
    if affine:  # a non-trivial weight so that its gradient and its use in grad_x matter
        nn.init.normal_(reference.weight)
    ours = convert_module(copy.deepcopy(reference))
    assert type(ours) is RMSNorm and set(ours.state_dict()) == set(reference.state_dict())
    _assert_matches(reference, ours, [(torch.randn(shape) * 3 + 1).requires_grad_()])


def test_rmsnorm_bfloat16_rounds_like_torch():
    # torch computes in float32 with float32's epsilon and rounds once; so does the wrapper.
    # Allow one bf16 rounding step (2^-8 relative) of values up to ~8 for the summation order.
    torch.manual_seed(0)
    reference = nn.RMSNorm(32).to(torch.bfloat16)
    nn.init.normal_(reference.weight)
    ours = convert_module(copy.deepcopy(reference))
    x = (torch.randn(4, 5, 32) * 3 + 1).to(torch.bfloat16).requires_grad_()
    _assert_matches(reference, ours, [x], atol=2**-5)


# ------------------------------------------------------------------------------ generic path


class ChannelAffine(nn.Module):
    """Learned per-channel scale and shift over the last dim; ``shift`` may be absent."""

    def __init__(self, dim: int, shift: bool = True) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(dim))
        self.shift = nn.Parameter(torch.randn(dim)) if shift else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * self.scale
        return y + self.shift if self.shift is not None else y


class BilinearGate(nn.Module):
    """Two tensor inputs, keyword and non-tensor arguments, and a child with parameters."""

    def __init__(self, a: int, b: int, out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out, a, b) / (a * b) ** 0.5)
        self.proj = nn.Linear(a, a)  # converted normally; its gradients flow through the gate

    def forward(
        self, x: torch.Tensor, y: torch.Tensor, *, mode: str = "plain", gate: Any = None
    ) -> torch.Tensor:
        out = torch.einsum("...a,oab,...b->...o", self.proj(x), self.weight, y)  # (..., out)
        if gate is not None:
            out = out * gate
        return torch.tanh(out) if mode == "tanh" else out


class NoisyScale(nn.Module):
    """Uses randomness: the backward recomputation must replay the same dropout mask."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x * self.gain, p=0.5, training=True)


class EmbedScale(nn.Module):
    """Takes an integer tensor (no gradient) next to a float one."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(vocab, dim))

    def forward(self, idx: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.table[idx] * x


class CopyingHandler(ParamHandler):
    """One-device handler that fetches *copies*: the generic path's full tensors, refills,
    frees and gradient hand-back all run, as under a strategy, with nothing to communicate."""

    def fetch(self, module: nn.Module, phase: Any) -> Tuple[Optional[torch.Tensor], ...]:
        return tuple(p.detach().clone() for p in super().fetch(module, phase))


def _generic_convert(module: nn.Module) -> nn.Module:
    """A converted copy of ``module`` whose layers all fetch copies (``CopyingHandler``)."""
    ours = convert_module(copy.deepcopy(module))
    for layer in ours.modules():
        if is_layer(layer):
            layer.param_handler = CopyingHandler()
    return ours


GENERIC_CASES = {  # name -> (module factory, inputs factory, kwargs)
    "affine": (lambda: ChannelAffine(6), lambda: [torch.randn(2, 3, 6, requires_grad=True)], {}),
    "affine_no_shift": (lambda: ChannelAffine(6, shift=False), lambda: [torch.randn(4, 6)], {}),
    "bilinear": (
        lambda: BilinearGate(4, 5, 3),
        lambda: [
            torch.randn(2, 7, 4, requires_grad=True),
            torch.randn(2, 7, 5, requires_grad=True),
        ],
        dict(mode="tanh", gate=torch.randn(3)),
    ),
    "bilinear_one_input_grad": (
        lambda: BilinearGate(4, 5, 3),
        lambda: [torch.randn(2, 4), torch.randn(2, 5, requires_grad=True)],
        dict(gate=0.5),
    ),
    "dropout": (lambda: NoisyScale(8), lambda: [torch.randn(5, 8, requires_grad=True)], {}),
    "int_input": (
        lambda: EmbedScale(5, 3),
        lambda: [torch.tensor([[0, 4], [4, 2]]), torch.randn(2, 2, 3, requires_grad=True)],
        {},
    ),
}


@pytest.mark.parametrize("case", list(GENERIC_CASES))
def test_generic_path_matches_torch(case):
    make_module, make_inputs, kwargs = GENERIC_CASES[case]
    torch.manual_seed(0)
    reference = make_module()
    ours = _generic_convert(reference)
    assert type(ours) is type(reference) and generic_layer(ours) is not None
    _assert_matches(reference, ours, make_inputs(), kwargs)


class GatedNoise(nn.Module):
    """No parameters of its own (not a layer); its children are a generic layer with a
    converted child, and a module drawing random numbers."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gate = BilinearGate(dim, dim, dim)
        self.noise = NoisyScale(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.noise(self.gate(x, x))


def test_generic_path_takes_only_direct_params_and_keeps_the_rng_stream():
    torch.manual_seed(0)
    reference = GatedNoise(4)
    reference.gate.proj.bias.requires_grad_(False)  # a frozen child parameter gets no gradient
    ours = _generic_convert(reference)
    assert not is_layer(ours)
    assert ours.gate.param_names == ("weight",) and type(ours.gate.proj).__name__ == "Linear"
    assert set(ours.state_dict()) == set(reference.state_dict())
    x = torch.randn(3, 4, requires_grad=True)
    _assert_matches(reference, ours, [x], seed=1)
    # No recomputation: after a step the global generator is where one plain forward leaves it.
    draws = []
    for model in (reference, ours):
        torch.manual_seed(1)
        model(x).sum().backward()
        draws.append(torch.rand(4))
    assert torch.equal(draws[0], draws[1])


def test_generic_path_is_the_default_and_silent():
    model = nn.Sequential(nn.Linear(3, 3), nn.Sequential(ChannelAffine(3)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        converted = convert_module(model)
    affine = converted[1][0]
    assert type(affine) is ChannelAffine and affine.param_names == ("scale", "shift")
    no_shift = convert_module(ChannelAffine(2, shift=False))
    assert no_shift.param_names == ("scale",) and not is_layer(convert_module(nn.ReLU()))


class Counting(ChannelAffine):
    """Counts its forward calls and returns a structured output."""

    calls = 0

    def forward(self, x: torch.Tensor) -> Any:
        Counting.calls += 1
        y = super().forward(x)
        return {"y": y, "pair": (y * 2, x)}


def test_generic_path_runs_forward_once_and_takes_structured_outputs():
    torch.manual_seed(0)
    reference = Counting(3)
    ours = _generic_convert(reference)
    x = torch.randn(2, 3, requires_grad=True)
    Counting.calls = 0
    out = ours(x.detach().clone().requires_grad_())
    (out["y"].sum() + out["pair"][0].pow(2).sum()).backward()
    assert Counting.calls == 1  # forward and backward: one call
    ref = reference(x)
    (ref["y"].sum() + ref["pair"][0].pow(2).sum()).backward()
    for name, param in reference.named_parameters():
        assert torch.allclose(param.grad, getattr(ours, name).grad, atol=ATOL), name


def test_module_returning_its_parameter_is_refused_with_the_fix():
    class Table(ChannelAffine):
        def forward(self, x: torch.Tensor) -> Any:
            return self.scale  # the parameter itself leaves the forward

    ours = _generic_convert(Table(2))
    with pytest.raises(
        UnsupportedModuleError, match=r"Table.forward returns its parameter 'scale'"
    ):
        ours(torch.randn(2))


# ------------------------------------------------------------------------------ the guide


def _guide_blocks() -> List[str]:
    return re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)


def _run_guide(blocks: Sequence[str]) -> None:
    """Execute the blocks in order in one namespace, as a reader pasting them would."""
    namespace: Dict[str, Any] = {"__name__": "extending_guide"}
    registered = dict(WRAPPERS)
    try:
        for block in blocks:
            exec(compile(block, str(GUIDE), "exec"), namespace)
    finally:  # the guide's registration must not outlive the test
        WRAPPERS.clear()
        WRAPPERS.update(registered)


def test_guide_main_example_runs_on_one_device():
    blocks = _guide_blocks()
    assert len(blocks) == 3 and "register_wrapper(ScaleShift, ScaleShiftWrapper)" in blocks[0]
    _run_guide(blocks[:1])  # the block asserts its own outputs and gradients against torch


def _guide_worker(rank: int, world_size: int) -> None:
    _run_guide(_guide_blocks())


def test_guide_code_blocks_all_run_under_a_process_group():
    run_distributed(_guide_worker, 2)  # the FSDP block needs one


# ------------------------------------------------------------------------------ every strategy

VOCAB, WIDTH, SEQ_LEN, STEPS = 67, 9, 8, 4  # odd width: no tensor divides 2 ranks evenly


class ConvLM(nn.Module):
    """Tiny token model on Conv1d + RMSNorm + two generic layers (one with a child Linear)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.conv = nn.Conv1d(WIDTH, WIDTH, kernel_size=3, padding=1, groups=3)
        self.norm = nn.RMSNorm(WIDTH)
        self.affine = ChannelAffine(WIDTH)
        self.gate = BilinearGate(WIDTH, WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, VOCAB)
        h = self.emb(idx)
        c = self.conv(h.transpose(1, 2)).transpose(1, 2)  # convolve along the sequence
        h = self.norm(h + c)
        h = h + self.gate(self.affine(h), c, mode="tanh")
        return self.head(h)


# SGD is not invariant to the gradient's scale, so it catches a wrong average; AdamW exercises
# state. lr=1e-3 for AdamW keeps float32 rounding noise amplified by 1/sqrt(v) within
# PARAM_ATOL (tests/parity.py) over STEPS steps.
OPTIMIZERS = {"sgd": sgd(lr=0.2, momentum=0.9), "adamw": adamw(lr=1e-3, weight_decay=0.1)}


def _parity_worker(rank: int, world_size: int, strategy: str) -> List[Tuple[str, float]]:
    """Train ConvLM under ``strategy`` (each optimizer, async communication off and on) next
    to one-device torch on the global batch; assert equal losses and final parameters."""
    seen = []
    for optim in OPTIMIZERS:
        for async_comm in (False, True):
            what = f"{strategy} {optim} async={async_comm}"
            torch.manual_seed(0)
            reference = ConvLM()
            model, optimizer = build(
                strategy,
                copy.deepcopy(reference),
                OPTIMIZERS[optim],
                enable_async_communication=async_comm,
            )
            reference_optimizer = OPTIMIZERS[optim].reference(reference.parameters())
            for step in range(STEPS):
                x, y = global_batch(step, 2 * world_size, SEQ_LEN, VOCAB)
                ref_loss = lm_loss(reference(x), y)
                ref_loss.backward()
                reference_optimizer.step()
                reference_optimizer.zero_grad()
                loss = lm_loss(
                    model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)
                )
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                mean_loss = mean_over_ranks(loss)
                assert abs(mean_loss - ref_loss.item()) <= LOSS_ATOL, f"{what} step {step}"
            full = model.state_dict()
            expected = reference.state_dict()
            assert set(full) == set(expected), f"{what}: keys differ"
            worst = max((full[k] - v).abs().max().item() for k, v in expected.items())
            assert worst <= PARAM_ATOL, f"{what}: parameters differ by {worst:.2e}"
            seen.append((what, worst))
    return seen


STRATEGIES = ["ddp", "zero1", "zero2", "zero3", "fsdp"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_conv_rmsnorm_and_generic_layers_train_like_one_device(strategy):
    results = run_distributed(_parity_worker, 2, strategy)
    assert len(results[0]) == 4  # 2 optimizers x async off / on, all checked on every rank
