"""The layer wrappers match torch.nn exactly, and conversion keeps weights and tying."""

import copy
import warnings

import pytest
import torch
from torch import nn

from tests.devices import CPU_AND_CUDA
from tiny_fsdp.core.module import (
    CallbackModule,
    Embedding,
    LayerNorm,
    Linear,
    convert_module,
    generic_layer,
    is_layer,
    register_wrapper,
)
from tiny_fsdp.core.module.registry import WRAPPERS

# float32: the wrappers call the same kernels in the same order as torch.nn's autograd formulas;
# 1e-6 leaves room for a different but equally valid summation order (e.g. index_add in
# Embedding's backward). bfloat16 keeps 8 mantissa bits: one rounding step is 2^-8 relative, so
# results within 2 roundings of values of size ~4 agree to 1/32.
TOLERANCES = {torch.float32: 1e-6, torch.bfloat16: 2**-5}


def _compare(ref: nn.Module, make_input, dtype: torch.dtype) -> None:
    """Forward + backward through ``ref`` and its converted copy; compare outputs and all grads."""
    ref = ref.to(dtype)
    ours = convert_module(copy.deepcopy(ref))
    assert isinstance(ours, CallbackModule)
    x_ref = make_input()
    x_ours = x_ref.detach().clone().requires_grad_(x_ref.requires_grad)
    out_ref, out_ours = ref(x_ref), ours(x_ours)
    grad_out = torch.randn_like(out_ref)
    out_ref.backward(grad_out)
    out_ours.backward(grad_out)
    tol = TOLERANCES[dtype]
    assert (out_ref - out_ours).abs().max().item() <= tol
    if x_ref.requires_grad:
        assert (x_ref.grad - x_ours.grad).abs().max().item() <= tol
    for (name, p_ref), p_ours in zip(ref.named_parameters(), ours.parameters()):
        if p_ref.requires_grad:
            diff = (p_ref.grad - p_ours.grad).abs().max().item()
            assert diff <= tol, f"grad of {name} differs by {diff}"
        else:
            assert p_ours.grad is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 7), (2, 5, 7), (2, 3, 4, 7)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_matches_torch(dtype, shape, bias):
    torch.manual_seed(0)
    _compare(
        nn.Linear(7, 5, bias=bias),
        lambda: (torch.randn(shape, dtype=dtype) * 2).requires_grad_(),
        dtype,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 6), (2, 5, 6), (2, 3, 4, 6)])
@pytest.mark.parametrize("affine,bias", [(True, True), (True, False), (False, False)])
def test_layernorm_matches_torch(dtype, shape, affine, bias):
    torch.manual_seed(0)
    ln = nn.LayerNorm(6, elementwise_affine=affine, bias=bias)
    if affine:  # non-trivial affine parameters so their gradients matter
        with torch.no_grad():
            ln.weight.normal_()
            if bias:
                ln.bias.normal_()
    _compare(ln, lambda: (torch.randn(shape, dtype=dtype) * 3 + 1).requires_grad_(), dtype)


def test_layernorm_over_two_dims():
    torch.manual_seed(0)
    _compare(nn.LayerNorm((4, 6)), lambda: torch.randn(2, 4, 6, requires_grad=True), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(9,), (3, 5), (2, 3, 4)])
@pytest.mark.parametrize("padding_idx", [None, 2, -1])
def test_embedding_matches_torch(dtype, shape, padding_idx):
    torch.manual_seed(0)
    emb = nn.Embedding(6, 5, padding_idx=padding_idx)
    idx = torch.randint(6, shape)
    idx.view(-1)[0] = 5  # the padding row (2 or 5) is looked up at least once
    idx.view(-1)[-1] = 2
    _compare(emb, lambda: idx, dtype)
    if padding_idx is not None:
        ours = convert_module(copy.deepcopy(emb).to(dtype))
        ours(idx).sum().backward()
        assert ours.weight.grad[emb.padding_idx].abs().sum().item() == 0.0


@pytest.mark.parametrize("device", CPU_AND_CUDA)
def test_embedding_sums_a_frequent_rows_gradient_as_precisely_as_one_rounding(device):
    """A bf16 row looked up 4096 times (a frequent token) gets the sum of its 4096 gradient
    rows rounded once: within 2^-8 (one bf16 rounding) of the float64 sum. Summed in bf16, as
    torch.nn.Embedding's own CPU backward does, it was 13% off on this input (torch 2.13)."""
    torch.manual_seed(0)
    ours = convert_module(nn.Embedding(8, 4)).to(device, torch.bfloat16)
    idx = torch.zeros(4096, dtype=torch.long, device=device)
    grad_out = torch.randn(4096, 4, device=device).bfloat16()
    ours(idx).backward(grad_out)
    exact = grad_out.double().sum(0)
    error = ((ours.weight.grad[0].double() - exact).abs() / exact.abs()).max().item()
    assert error <= 2**-8, error
    assert ours.weight.grad[1:].abs().sum().item() == 0.0  # rows never looked up


def test_frozen_parameter_gets_no_grad_but_input_does():
    torch.manual_seed(0)
    lin = nn.Linear(4, 3)
    lin.weight.requires_grad_(False)
    _compare(lin, lambda: torch.randn(2, 4, requires_grad=True), torch.float32)


def test_wrappers_keep_constructor_and_state_dict_keys():
    assert set(Linear(3, 4).state_dict()) == set(nn.Linear(3, 4).state_dict())
    assert set(LayerNorm(5).state_dict()) == {"weight", "bias"}
    assert set(Embedding(7, 2, padding_idx=0).state_dict()) == {"weight"}
    assert Embedding(7, 2, padding_idx=0).padding_idx == 0


def test_one_function_class_per_wrapper_class():
    assert Linear.function is Linear(2, 2).function
    assert len({Linear.function, LayerNorm.function, Embedding.function}) == 3
    assert Linear.function.__name__ == "LinearFunction"


def test_convert_keeps_weights_and_tying():
    from example.model import GPT2Model, GPTConfigs

    torch.manual_seed(0)
    model = GPT2Model(GPTConfigs.gpt2_tiny)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params_before = list(model.parameters())
    convert_module(model)
    assert isinstance(model.lm_head, Linear) and isinstance(model.transformer.wte, Embedding)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert all(a is b for a, b in zip(params_before, model.parameters()))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


class _Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


def test_module_without_wrapper_takes_the_generic_path_silently():
    model = nn.Sequential(nn.Linear(3, 3), nn.Sequential(_Scale()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning: the generic path is the default
        convert_module(model)
    scale = model[1][0]
    assert type(scale) is _Scale and is_layer(scale) and scale.param_names == ("gain",)
    assert not is_layer(model[1]) and generic_layer(model[1]) is None


def test_register_wrapper_makes_conversion_work():
    class Scale(CallbackModule, _Scale):
        param_names = ("gain",)

        def forward_callback(self, ctx, x):
            (gain,) = ctx.params
            ctx.save_for_backward(x)
            return x * gain

        def backward_callback(self, ctx, grad_output):
            (x,) = ctx.saved_tensors
            (gain,) = ctx.params
            return (grad_output * gain,), ((grad_output * x).reshape(-1, 3).sum(0),)

    try:
        register_wrapper(_Scale, Scale)
        torch.manual_seed(0)
        _compare(_Scale(), lambda: torch.randn(2, 3, requires_grad=True), torch.float32)
    finally:
        WRAPPERS.pop(_Scale, None)
    with pytest.raises(TypeError):
        register_wrapper(_Scale, Linear)


def test_embedding_options_it_does_not_implement_take_the_generic_path():
    for options in (dict(max_norm=1.0), dict(scale_grad_by_freq=True)):
        model = convert_module(nn.Sequential(nn.Embedding(4, 2, **options)))
        assert type(model[0]) is nn.Embedding, options  # class untouched: the generic path
        direct = Embedding(4, 2, **options)
        with pytest.raises(NotImplementedError, match="generic path"):
            direct(torch.tensor([1]))
    assert type(convert_module(nn.Sequential(nn.Embedding(4, 2, sparse=True)))[0]) is Embedding


@pytest.mark.parametrize(
    "layer, make_input",
    [
        (lambda: nn.Linear(0, 5), lambda: torch.randn(2, 3, 0, requires_grad=True)),
        (lambda: nn.Linear(7, 0), lambda: torch.randn(2, 3, 7, requires_grad=True)),
        (lambda: nn.Embedding(6, 0), lambda: torch.tensor([[1, 2], [5, 0]])),
    ],
    ids=["Linear-in0", "Linear-out0", "Embedding-dim0"],
)
@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")  # torch's, at init
def test_layers_of_size_zero_give_torchs_gradients(layer, make_input):
    """A model configured with a size of 0 (no extra features, say) trains as with torch."""
    torch.manual_seed(0)
    ref = layer()
    ours = convert_module(copy.deepcopy(ref))
    assert isinstance(ours, CallbackModule)
    x_ref = make_input()
    x_ours = x_ref.detach().clone().requires_grad_(x_ref.requires_grad)
    (ref(x_ref).sum() + 1).backward()
    (ours(x_ours).sum() + 1).backward()
    for p_ref, p_ours in zip(ref.parameters(), ours.parameters()):
        assert torch.equal(p_ref.grad, p_ours.grad)
    if x_ref.requires_grad:
        assert torch.equal(x_ref.grad, x_ours.grad)
