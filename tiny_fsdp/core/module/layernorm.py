"""``LayerNorm`` wrapper over the last ``len(normalized_shape)`` dimensions."""

from typing import Any

import torch
from torch import nn

from tiny_fsdp.core.module.base import CallbackModule


class LayerNorm(CallbackModule, nn.LayerNorm):
    """Drop-in ``nn.LayerNorm``; ``weight``/``bias`` have ``normalized_shape`` (or are None).

    y = (x - mean) * rstd * weight + bias. The math runs through ATen's layer-norm kernels (the
    ones ``torch.nn`` uses), so outputs and all three gradients are bit-identical to PyTorch's:
    with rstd = 1/sqrt(var + eps) and x_hat = (x - mean) * rstd the backward is
    grad_x = rstd * (g*w - mean(g*w) - x_hat * mean(g*w*x_hat)), grad_w = sum(g * x_hat),
    grad_b = sum(g), sums over every dimension that is not normalised.
    """

    param_names = ("weight", "bias")

    def forward_callback(self, ctx: Any, x: torch.Tensor) -> torch.Tensor:
        weight, bias = ctx.params
        out, mean, rstd = torch.ops.aten.native_layer_norm(
            x, list(self.normalized_shape), weight, bias, self.eps
        )
        # x in the dtype the kernel computed in: on CUDA autocast runs layer norm in fp32.
        ctx.save_for_backward(x.to(out.dtype), mean, rstd)
        return out

    def backward_callback(self, ctx: Any, grad_output: torch.Tensor) -> Any:
        x, mean, rstd = ctx.saved_tensors
        weight, bias = ctx.params
        mask = [ctx.needs_input_grad[2], *ctx.param_needs_grad]
        grad_x, grad_weight, grad_bias = torch.ops.aten.native_layer_norm_backward(
            grad_output, x, list(self.normalized_shape), mean, rstd, weight, bias, mask
        )
        return (grad_x,), (grad_weight, grad_bias)
