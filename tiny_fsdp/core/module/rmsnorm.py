"""``RMSNorm`` wrapper: root-mean-square normalisation with its backward written by hand."""

from typing import Any, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from tiny_fsdp.core.module.base import CallbackModule
from tiny_fsdp.core.module.registry import register_wrapper


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float32 for float32 and narrower inputs (bf16 / fp16), float64 for float64."""
    return torch.promote_types(x.dtype, torch.float32)


class RMSNorm(CallbackModule, nn.RMSNorm):
    """Drop-in ``nn.RMSNorm`` over the last ``len(normalized_shape)`` dims of ``x`` (..., *shape).

    ``weight`` has ``normalized_shape`` (None when ``elementwise_affine=False``). With
    r = rsqrt(mean(x^2) + eps) and x_hat = x * r (means over the normalised dims), y = x_hat * w
    and the backward is grad_x = r * (g*w - x_hat * mean(g*w * x_hat)) and
    grad_w = sum(g * x_hat) over the other dims. The forward is torch's ``F.rms_norm`` (the
    output bits of ``torch.nn`` on every device; r is recomputed in backward). The backward
    computes bf16 / fp16 inputs in float32, as torch does, and ``eps=None`` means the machine
    epsilon of that compute dtype (float32's for a bf16 input, not bf16's).
    """

    param_names = ("weight",)

    def _dims(self) -> Tuple[int, ...]:
        return tuple(range(-len(self.normalized_shape), 0))

    def forward_callback(self, ctx: Any, x: torch.Tensor) -> torch.Tensor:
        (weight,) = ctx.params
        ctx.save_for_backward(x)
        # torch.nn's own op (a fused kernel on CUDA): the same output bits on every device.
        return F.rms_norm(x, self.normalized_shape, weight, self.eps)

    def backward_callback(self, ctx: Any, grad_output: torch.Tensor) -> Any:
        (x,) = ctx.saved_tensors
        (weight,) = ctx.params
        dims = self._dims()
        xc = x.to(_compute_dtype(x))
        eps = self.eps if self.eps is not None else torch.finfo(xc.dtype).eps
        rstd = torch.rsqrt(xc.pow(2).mean(dims, keepdim=True) + eps)  # (..., 1, .., 1)
        x_hat = xc * rstd  # (..., *normalized_shape)
        g = grad_output.to(rstd.dtype)
        g_hat = g if weight is None else g * weight.to(rstd.dtype)  # gradient w.r.t. x_hat
        grad_x = grad_weight = None
        if ctx.needs_input_grad[2]:
            proj = (g_hat * x_hat).mean(dims, keepdim=True)
            grad_x = (rstd * (g_hat - x_hat * proj)).to(x.dtype)
        if ctx.param_needs_grad[0]:
            # Sum over every dimension that is not normalised: (..., *shape) -> shape. Reshape
            # first: sum over an empty dim list would sum everything (unbatched input).
            per_row = (g * x_hat).reshape(-1, *self.normalized_shape)  # (rows, *shape)
            grad_weight = per_row.sum(0).to(weight.dtype)
        return (grad_x,), (grad_weight,)


register_wrapper(nn.RMSNorm, RMSNorm)
