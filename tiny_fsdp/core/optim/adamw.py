"""AdamW: Adam with decoupled weight decay, optional AMSGrad and maximize."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from .base import BaseOptimizer, ParamsT


def adamw_update_(
    params: list[Tensor],
    grads: list[Tensor],
    states: list[dict],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    amsgrad: bool = False,
    maximize: bool = False,
) -> None:
    """Update every ``params[i]`` in place by one AdamW step (``torch.optim.AdamW``'s semantics).

    ``grads[i]`` has the shape of ``params[i]`` and is never modified; ``states[i]`` is filled on
    first use: ``step`` (0-d float32 CPU tensor, this tensor's own step count), ``exp_avg`` and
    ``exp_avg_sq`` (shape of the parameter), plus ``max_exp_avg_sq`` if ``amsgrad``. Per tensor,
    with ``g = -grad if maximize else grad`` and ``t = step``: ``param *= 1 - lr * weight_decay``;
    ``m = lerp(m, g, 1 - beta1)``; ``v = beta2 * v + (1 - beta2) * g * g``;
    ``param -= lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)``, where AMSGrad
    uses the running max of ``v``. Temporaries: one denominator per tensor, plus a cast or
    negated gradient when ``grad`` is of another dtype or ``maximize``.
    """
    grads = [g.to(p.dtype) for p, g in zip(params, grads)]
    if maximize:
        grads = torch._foreach_neg(grads)  # out of place: a grad may be a shared comm buffer
    for param, state in zip(params, states):
        if "step" not in state:
            # step lives on the CPU so reading it for the bias correction never syncs a GPU.
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        if amsgrad and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    exp_avgs = [state["exp_avg"] for state in states]
    exp_avg_sqs = [state["exp_avg_sq"] for state in states]
    steps = [state["step"] for state in states]
    torch._foreach_add_(steps, 1)
    step_counts = [step.item() for step in steps]

    # Decoupled: decay the weights directly instead of adding weight_decay * param to g.
    if weight_decay != 0:
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)

    second_moments = exp_avg_sqs
    if amsgrad:
        second_moments = [state["max_exp_avg_sq"] for state in states]
        torch._foreach_maximum_(second_moments, exp_avg_sqs)
    denoms = torch._foreach_sqrt(second_moments)
    torch._foreach_div_(denoms, [math.sqrt(1 - beta2**t) for t in step_counts])
    torch._foreach_add_(denoms, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denoms, [-lr / (1 - beta1**t) for t in step_counts])


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

    def _update_(
        self, params: list[Tensor], grads: list[Tensor], states: list[dict], group: dict[str, Any]
    ) -> None:
        beta1, beta2 = group["betas"]
        adamw_update_(
            params,
            grads,
            states,
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            amsgrad=group["amsgrad"],
            maximize=group["maximize"],
        )
