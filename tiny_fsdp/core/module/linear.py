"""``Linear`` wrapper: y = x @ W^T + b, with its backward written out."""

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tiny_fsdp.core.module.base import CallbackModule


class Linear(CallbackModule, nn.Linear):
    """Drop-in ``nn.Linear``. ``weight``: (out, in), ``bias``: (out,) or None; ``x``: (..., in)."""

    param_names = ("weight", "bias")

    def forward_callback(self, ctx: Any, x: torch.Tensor) -> torch.Tensor:
        weight, bias = ctx.params
        ctx.save_for_backward(x)
        return F.linear(x, weight, bias)

    def backward_callback(self, ctx: Any, grad_output: torch.Tensor) -> Any:
        (x,) = ctx.saved_tensors
        weight, _ = ctx.params
        weight_needs_grad, bias_needs_grad = ctx.param_needs_grad
        grad_x = grad_output.matmul(weight) if ctx.needs_input_grad[2] else None  # (..., in)
        rows = math.prod(x.shape[:-1])  # N, named: a size of 0 (in or out) leaves -1 ambiguous
        g2d = grad_output.reshape(rows, grad_output.shape[-1])  # (N, out)
        grad_weight = g2d.t().mm(x.reshape(rows, x.shape[-1])) if weight_needs_grad else None
        grad_bias = g2d.sum(0) if bias_needs_grad else None
        return (grad_x,), (grad_weight, grad_bias)
