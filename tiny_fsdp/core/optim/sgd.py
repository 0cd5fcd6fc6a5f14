"""SGD with momentum, dampening, Nesterov, (coupled) weight decay and maximize."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from .base import BaseOptimizer, ParamsT


def sgd_update_(
    param: Tensor,
    grad: Tensor,
    state: dict,
    *,
    lr: float,
    momentum: float = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    maximize: bool = False,
) -> None:
    """Update ``param`` in place by one SGD step (same semantics as ``torch.optim.SGD``).

    With ``g = (-grad if maximize else grad) + weight_decay * param``:
    ``buf = g`` on the first step, else ``momentum * buf + (1 - dampening) * g``;
    ``d = g + momentum * buf`` (Nesterov), ``buf`` (momentum) or ``g`` (no momentum);
    ``param -= lr * d``. ``grad`` (same shape as ``param``, cast to its dtype) is never
    modified; ``state["momentum_buffer"]`` (shape of ``param``) exists only if momentum != 0.
    """
    d_p = grad.to(param.dtype)
    # Out-of-place ops until d_p is a fresh tensor: grad may be a shared comm buffer.
    if maximize:
        d_p = -d_p
    if weight_decay != 0:
        d_p = d_p.add(param, alpha=weight_decay)
    if momentum != 0:
        buf = state.get("momentum_buffer")
        if buf is None:
            # The first step seeds the buffer with the undampened gradient, as torch does.
            buf = d_p.clone()
            state["momentum_buffer"] = buf
        else:
            buf.mul_(momentum).add_(d_p, alpha=1 - dampening)
        d_p = d_p.add(buf, alpha=momentum) if nesterov else buf
    param.add_(d_p, alpha=-lr)


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

    def _update_(self, param: Tensor, grad: Tensor, state: dict, group: dict[str, Any]) -> None:
        sgd_update_(
            param,
            grad,
            state,
            lr=group["lr"],
            momentum=group["momentum"],
            dampening=group["dampening"],
            nesterov=group["nesterov"],
            weight_decay=group["weight_decay"],
            maximize=group["maximize"],
        )
