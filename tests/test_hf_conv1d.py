"""The benchmark's wrapper for ``transformers``' ``Conv1D`` (``example/bench/hf_wrappers.py``):
output and gradients match ``Conv1D``, and it is registered only inside its context."""

import copy

import pytest
import torch

pytest.importorskip("transformers")
from transformers.pytorch_utils import Conv1D  # noqa: E402

from example.bench.hf_wrappers import HFConv1D, hf_wrappers_registered  # noqa: E402
from tiny_fsdp.core.module import convert_module, generic_layer  # noqa: E402

ATOL = 1e-6  # float32; the task's bound


@pytest.mark.parametrize("frozen", [None, "weight", "bias"])
def test_hf_conv1d_matches_conv1d(frozen) -> None:
    torch.manual_seed(0)
    reference = torch.nn.Sequential(Conv1D(15, 7))  # nf=15 outputs, nx=7 inputs: weight (7, 15)
    torch.nn.init.normal_(reference[0].bias)
    with hf_wrappers_registered():
        model = convert_module(copy.deepcopy(reference))
    assert type(model[0]) is HFConv1D
    if frozen is not None:
        getattr(model[0], frozen).requires_grad_(False)
        getattr(reference[0], frozen).requires_grad_(False)
    x = torch.randn(2, 3, 7)
    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ref, out = reference(x_ref), model(x_ours)
    torch.testing.assert_close(out, out_ref, rtol=0, atol=ATOL)
    grad = torch.randn_like(out)
    out_ref.backward(grad)
    out.backward(grad)
    torch.testing.assert_close(x_ours.grad, x_ref.grad, rtol=0, atol=ATOL)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert (p.grad is None) == (q.grad is None)
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=ATOL)


def test_registered_only_inside_the_context() -> None:
    with hf_wrappers_registered():
        inside = convert_module(torch.nn.Sequential(Conv1D(4, 3)))
    outside = convert_module(torch.nn.Sequential(Conv1D(4, 3)))
    assert type(inside[0]) is HFConv1D
    assert type(outside[0]) is Conv1D and generic_layer(outside[0]) is not None
