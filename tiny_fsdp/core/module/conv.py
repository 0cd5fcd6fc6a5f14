"""``Conv1d`` / ``Conv2d`` wrappers: one convolution forward, one ``convolution_backward``.

[Note: convolution backward]
For y = conv(x, W) + b with stride s, dilation d and groups G, every gradient is again a
convolution: grad_x is the transposed convolution of grad_y with W, grad_W correlates x with
grad_y, and grad_b sums grad_y over batch and positions. ATen computes all three in one call,
``aten.convolution_backward``, the kernel that ``torch.nn``'s own autograd formula calls, so the
wrappers match PyTorch to the last bit; ``output_mask`` skips the gradients nobody needs. The
same code serves every spatial rank: ``n`` is 1 for ``Conv1d`` and 2 for ``Conv2d``.
"""

from typing import Any, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from tiny_fsdp.core.module.base import CallbackModule
from tiny_fsdp.core.module.registry import register_wrapper


class _ConvCallback(CallbackModule):
    """Math shared by the N-d convolution wrappers (mixed into ``nn.Conv1d`` / ``nn.Conv2d``).

    ``weight``: (out, in / groups, *kernel), ``bias``: (out,) or None;
    ``x``: (batch, in, *spatial) or unbatched (in, *spatial).
    """

    param_names = ("weight", "bias")

    @classmethod
    def implements(cls, module: nn.Module) -> bool:
        return super().implements(module) and module.padding_mode == "zeros"

    def check_supported(self) -> None:
        """Only zero padding is implemented; other modes need their own padding backward
        (``convert_module`` leaves them to the generic path)."""
        if not self.implements(self):
            raise NotImplementedError(
                f"tiny_fsdp {type(self).__name__} supports padding_mode='zeros' only (got "
                f"'{self.padding_mode}'); pad the input with F.pad before the layer instead."
            )

    def _padding(self) -> Tuple[List[int], Optional[List[int]]]:
        """(symmetric padding for the kernel, extra F.pad amounts or None).

        ``padding='same'`` with an even total d*(k-1) needs one more zero on the right than on the
        left; as PyTorch does, the extra zeros are added with ``F.pad`` before the convolution.
        """
        if self.padding == "valid":
            return [0] * len(self.kernel_size), None
        if self.padding != "same":
            return list(self.padding), None
        left, extra = [], []
        for d, k in zip(self.dilation, self.kernel_size):
            total = d * (k - 1)
            left.append(total // 2)
            extra.append(total - 2 * (total // 2))  # 0 or 1, on the right
        if not any(extra):
            return left, None
        # F.pad lists (left, right) pairs from the LAST dimension backwards.
        pad = [amount for e in reversed(extra) for amount in (0, e)]
        return left, pad

    def forward_callback(self, ctx: Any, x: torch.Tensor) -> torch.Tensor:
        self.check_supported()  # also for wrappers built directly, not by convert_module
        weight, bias = ctx.params
        padding, extra = self._padding()
        n = len(self.kernel_size)
        batched = x.dim() == n + 2
        xb = x if batched else x.unsqueeze(0)  # (batch, in, *spatial)
        if extra is not None:
            xb = F.pad(xb, extra)
        ctx.save_for_backward(xb)
        ctx.batched, ctx.extra, ctx.padding = batched, extra, padding
        conv = (F.conv1d, F.conv2d)[n - 1]  # torch.nn's op, which autocast casts alike
        out = conv(xb, weight, bias, self.stride, padding, self.dilation, self.groups)
        return out if batched else out.squeeze(0)  # (batch, out, *spatial_out)

    def backward_callback(self, ctx: Any, grad_output: torch.Tensor) -> Any:
        (xb,) = ctx.saved_tensors
        weight, bias = ctx.params
        n = len(self.kernel_size)
        grad_out = grad_output if ctx.batched else grad_output.unsqueeze(0)
        # The dtype the forward computed in ([Note: autocast]): autocast lists conv, not its
        # backward.
        xb, weight = xb.to(grad_out.dtype), weight.to(grad_out.dtype)
        mask = [ctx.needs_input_grad[2], *ctx.param_needs_grad]
        grad_x, grad_weight, grad_bias = torch.ops.aten.convolution_backward(
            grad_out,
            xb,
            weight,
            None if bias is None else list(bias.shape),
            self.stride,
            ctx.padding,
            self.dilation,
            False,
            [0] * n,
            self.groups,
            mask,
        )
        if grad_x is not None:
            if ctx.extra is not None:  # drop the gradient of the extra right-hand zeros
                for dim, e in enumerate(reversed(ctx.extra[1::2])):
                    grad_x = grad_x.narrow(dim + 2, 0, grad_x.shape[dim + 2] - e)
            grad_x = grad_x if ctx.batched else grad_x.squeeze(0)
        return (grad_x,), (grad_weight, grad_bias)


class Conv1d(_ConvCallback, nn.Conv1d):
    """Drop-in ``nn.Conv1d``: ``weight`` (out, in / groups, k); ``x`` (batch, in, length).

    Supports stride, integer / 'valid' / 'same' padding, dilation, groups and bias; not the
    reflect / replicate / circular padding modes ([Note: convolution backward]).
    """


class Conv2d(_ConvCallback, nn.Conv2d):
    """Drop-in ``nn.Conv2d``: ``weight`` (out, in / groups, kh, kw); ``x`` (batch, in, h, w)."""


register_wrapper(nn.Conv1d, Conv1d)
register_wrapper(nn.Conv2d, Conv2d)
