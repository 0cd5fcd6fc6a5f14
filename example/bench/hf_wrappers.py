"""A tiny_fsdp wrapper for ``transformers``' ``Conv1D`` (HF GPT-2's linear layers), registered only
while the benchmark's ``fsdp_wrapped`` strategy is built. Needs ``transformers``; the library never
imports this file.

Without it our FSDP runs ``Conv1D`` through the generic path ([Note: generic layer]); with it,
through a wrapper like ``tiny_fsdp.core.module.linear.Linear`` (the explicit path). The benchmark
runs both on the same model to measure what the generic path costs.
"""

import contextlib
from typing import Any, Iterator

import torch
from transformers.pytorch_utils import Conv1D

from tiny_fsdp.core.module import CallbackModule, register_wrapper
from tiny_fsdp.core.module.registry import WRAPPERS


class HFConv1D(CallbackModule, Conv1D):
    """Drop-in ``Conv1D``: y = x @ W + b. ``weight``: (in, out) (transposed vs ``nn.Linear``),
    ``bias``: (out,); ``x``: (..., in)."""

    param_names = ("weight", "bias")

    def forward_callback(self, ctx: Any, x: torch.Tensor) -> torch.Tensor:
        weight, bias = ctx.params
        ctx.save_for_backward(x)
        y = torch.addmm(bias, x.reshape(-1, x.shape[-1]), weight)  # (N, out): Conv1D's own op
        return y.view(*x.shape[:-1], weight.shape[1])

    def backward_callback(self, ctx: Any, grad_output: torch.Tensor) -> Any:
        (x,) = ctx.saved_tensors
        weight, _ = ctx.params
        weight_needs_grad, bias_needs_grad = ctx.param_needs_grad
        grad_x = grad_output.matmul(weight.t()) if ctx.needs_input_grad[2] else None  # (..., in)
        g2d = grad_output.reshape(-1, grad_output.shape[-1])  # (N, out)
        grad_weight = x.reshape(-1, x.shape[-1]).t().mm(g2d) if weight_needs_grad else None
        grad_bias = g2d.sum(0) if bias_needs_grad else None
        return (grad_x,), (grad_weight, grad_bias)


@contextlib.contextmanager
def hf_wrappers_registered() -> Iterator[None]:
    """``HFConv1D`` is ``Conv1D``'s wrapper meanwhile (models converted inside keep it); the
    registry is restored afterwards, so strategies built later take the generic path again."""
    saved = WRAPPERS.get(Conv1D)
    register_wrapper(Conv1D, HFConv1D)
    try:
        yield
    finally:
        if saved is None:
            del WRAPPERS[Conv1D]
        else:
            WRAPPERS[Conv1D] = saved
