"""AdamW: Adam with decoupled weight decay, optional AMSGrad and maximize."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from .base import BaseOptimizer, ParamsT


def adamw_update_(
    param: Tensor,
    grad: Tensor,
    state: dict,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    amsgrad: bool = False,
    maximize: bool = False,
) -> None:
    """Update ``param`` in place by one AdamW step (same semantics as ``torch.optim.AdamW``).

    ``state`` is filled on first use: ``step`` (0-d float32 CPU tensor, this tensor's own step
    count), ``exp_avg`` and ``exp_avg_sq`` (shape of ``param``), plus ``max_exp_avg_sq`` if
    ``amsgrad``. With ``g = -grad if maximize else grad`` and ``t = step``:
    ``param *= 1 - lr * weight_decay``; ``m = lerp(m, g, 1 - beta1)``;
    ``v = beta2 * v + (1 - beta2) * g * g``;
    ``param -= lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)``
    where AMSGrad uses the running max of ``v`` instead of ``v``. ``grad`` is never modified.
    """
    g = grad.to(param.dtype)
    if maximize:
        g = -g  # out of place: grad may be a shared comm buffer
    if "step" not in state:
        # step lives on the CPU so reading it for the bias correction never syncs a GPU.
        state["step"] = torch.zeros((), dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    if amsgrad and "max_exp_avg_sq" not in state:
        state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]

    state["step"] += 1
    step = state["step"].item()

    # Decoupled: decay the weights directly instead of adding weight_decay * param to g.
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)

    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = math.sqrt(1 - beta2**step)
    second_moment = exp_avg_sq
    if amsgrad:
        torch.maximum(state["max_exp_avg_sq"], exp_avg_sq, out=state["max_exp_avg_sq"])
        second_moment = state["max_exp_avg_sq"]
    denom = second_moment.sqrt().div_(bias_correction2_sqrt).add_(eps)  # one temporary
    param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)


class AdamW(BaseOptimizer):
    """AdamW; a ``torch.optim.Optimizer`` applying ``adamw_update_``."""

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
        )
        super().__init__(params, defaults)

    def _check_hyperparams(self, hyper: dict[str, Any]) -> None:
        if hyper["lr"] < 0.0:
            raise ValueError(f"Invalid learning rate: {hyper['lr']}")
        if hyper["eps"] < 0.0:
            raise ValueError(f"Invalid epsilon value: {hyper['eps']}")
        for i, beta in enumerate(hyper["betas"]):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {beta}")
        if hyper["weight_decay"] < 0.0:
            raise ValueError(f"Invalid weight_decay value: {hyper['weight_decay']}")

    def _update_(self, param: Tensor, grad: Tensor, state: dict, group: dict[str, Any]) -> None:
        beta1, beta2 = group["betas"]
        adamw_update_(
            param,
            grad,
            state,
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            amsgrad=group["amsgrad"],
            maximize=group["maximize"],
        )
