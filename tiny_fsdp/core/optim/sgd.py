"""SGD with momentum, dampening, Nesterov, (coupled) weight decay and maximize."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from tiny_fsdp.core.utils.casts import cast_like

from .base import BaseOptimizer, ParamsT


def sgd_update_(
    params: list[Tensor],
    grads: list[Tensor],
    states: list[dict],
    *,
    lr: float,
    momentum: float = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    maximize: bool = False,
) -> None:
    """Update every ``params[i]`` in place by one SGD step (``torch.optim.SGD``'s semantics).

    Per tensor, with ``g = (-grad if maximize else grad) + weight_decay * param``:
    ``buf = g`` on the first step, else ``momentum * buf + (1 - dampening) * g``;
    ``d = g + momentum * buf`` (Nesterov), ``buf`` (momentum) or ``g`` (no momentum);
    ``param -= lr * d``. ``grads[i]`` (shape of ``params[i]``, cast to its dtype) is never
    modified; ``states[i]["momentum_buffer"]`` (shape of the parameter) exists only if
    momentum != 0.
    """
    d_ps = cast_like(grads, params)  # [Note: casts in one launch]
    # Out-of-place ops until the d_ps are fresh tensors: a grad may be a shared comm buffer.
    if maximize:
        d_ps = torch._foreach_neg(d_ps)
    if weight_decay != 0:
        d_ps = torch._foreach_add(d_ps, params, alpha=weight_decay)
    if momentum != 0:
        running = [i for i, state in enumerate(states) if "momentum_buffer" in state]
        if running:
            bufs = [states[i]["momentum_buffer"] for i in running]
            torch._foreach_mul_(bufs, momentum)
            torch._foreach_add_(bufs, [d_ps[i] for i in running], alpha=1 - dampening)
        for d_p, state in zip(d_ps, states):
            if "momentum_buffer" not in state:
                # The first step seeds the buffer with the undampened gradient, as torch does.
                state["momentum_buffer"] = d_p.clone()
        bufs = [state["momentum_buffer"] for state in states]
        d_ps = torch._foreach_add(d_ps, bufs, alpha=momentum) if nesterov else bufs
    torch._foreach_add_(params, d_ps, alpha=-lr)


class SGD(BaseOptimizer):
    """Stochastic gradient descent; a ``torch.optim.Optimizer`` applying ``sgd_update_``."""

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
    ) -> None:
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            maximize=maximize,
        )
        super().__init__(params, defaults)

    def _check_hyperparams(self, hyper: dict[str, Any]) -> None:
        if hyper["lr"] < 0.0:
            raise ValueError(f"Invalid learning rate: {hyper['lr']}")
        if hyper["momentum"] < 0.0:
            raise ValueError(f"Invalid momentum value: {hyper['momentum']}")
        if hyper["weight_decay"] < 0.0:
            raise ValueError(f"Invalid weight_decay value: {hyper['weight_decay']}")
        if hyper["nesterov"] and (hyper["momentum"] <= 0 or hyper["dampening"] != 0):
            raise ValueError(
                "Nesterov momentum requires momentum > 0 and zero dampening, got "
                f"momentum={hyper['momentum']}, dampening={hyper['dampening']}"
            )

    def _update_(
        self, params: list[Tensor], grads: list[Tensor], states: list[dict], group: dict[str, Any]
    ) -> None:
        sgd_update_(
            params,
            grads,
            states,
            lr=group["lr"],
            momentum=group["momentum"],
            dampening=group["dampening"],
            nesterov=group["nesterov"],
            weight_decay=group["weight_decay"],
            maximize=group["maximize"],
        )
