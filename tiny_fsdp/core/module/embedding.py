"""``Embedding`` wrapper: a row lookup whose gradient scatters back into the rows."""

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tiny_fsdp.core.module.base import CallbackModule
from tiny_fsdp.core.utils import huge_pages


class Embedding(CallbackModule, nn.Embedding):
    """Drop-in ``nn.Embedding``. ``weight``: (num_embeddings, dim); ``idx``: any int shape.

    The row at ``padding_idx`` gets no gradient, as in ``torch.nn``. With ``sparse=True`` the
    gradient is computed dense ([Note: sparse gradients]). ``max_norm`` and
    ``scale_grad_by_freq`` are not implemented: ``convert_module`` leaves such an embedding to
    the generic path (where wrappers refuse ``max_norm``: [Note: embeddings with max_norm]).
    """

    param_names = ("weight",)
    backward_reads_params = False  # the gradient is a scatter of grad_output's rows

    @classmethod
    def implements(cls, module: nn.Module) -> bool:
        plain = module.max_norm is None and not module.scale_grad_by_freq
        return super().implements(module) and plain

    def check_supported(self) -> None:
        """Raise if this instance uses an option the wrapper does not implement (a wrapper
        built directly, not by ``convert_module``)."""
        if not self.implements(self):
            raise NotImplementedError(
                "tiny_fsdp Embedding supports neither max_norm nor scale_grad_by_freq (got "
                f"max_norm={self.max_norm}, scale_grad_by_freq={self.scale_grad_by_freq}); "
                "convert_module leaves such an nn.Embedding to the generic path."
            )

    def forward_callback(self, ctx: Any, idx: torch.Tensor) -> torch.Tensor:
        self.check_supported()  # also for wrappers built directly, not by convert_module
        (weight,) = ctx.params
        ctx.save_for_backward(idx)
        return F.embedding(idx, weight, self.padding_idx)

    def backward_callback(self, ctx: Any, grad_output: torch.Tensor) -> Any:
        (idx,) = ctx.saved_tensors
        (weight,) = ctx.params
        grad_weight = None
        if ctx.param_needs_grad[0]:
            flat_grad = grad_output.reshape(idx.numel(), weight.shape[1])  # (N, dim)
            # A row looked up thousands of times (a frequent token) sums thousands of terms:
            # in fp32, rounded once to a low-precision weight's dtype, whatever a device's
            # index_add_ does in that dtype (tests/test_module.py checks one rounding).
            acc = torch.promote_types(weight.dtype, torch.float32)
            # A full-size buffer each backward: on the CPU, the block the last backward
            # freed once nothing holds it, else a new one in huge pages ([Note: huge pages
            # for transient buffers]).
            grad_weight = huge_pages.empty(weight.shape, acc, weight.device).zero_()
            grad_weight.index_add_(0, idx.reshape(-1), flat_grad.to(acc))
            grad_weight = grad_weight.to(weight.dtype)
            if self.padding_idx is not None:
                grad_weight[self.padding_idx] = 0
        return (None,), (grad_weight,)
