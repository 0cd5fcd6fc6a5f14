"""AdamW: Adam with decoupled weight decay, optional AMSGrad and maximize."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from tiny_fsdp.core.utils.casts import cast_like

from .base import BaseOptimizer, ParamsT, as_real, batch_limit

#: The most parameter bytes one call of the fused CPU kernel gets (``AdamW._batch_limit``).
FUSED_BATCH_BYTES = 32 * 2**20


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
    fused: Optional[bool] = None,
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

    ``fused``: None runs torch's one-pass kernel where it applies, else the foreach ops; False
    always the foreach ops (bit for bit ``torch.optim.AdamW``'s CPU default); True requires the
    kernel (ValueError where it does not apply). [Note: fused AdamW on the CPU].
    """
    grads = cast_like(grads, params)  # [Note: casts in one launch]
    _init_state(params, states, amsgrad)
    steps = [state["step"] for state in states]
    # On the CPU the foreach add runs tensor by tensor, wrapping a Python 1 into a tensor for
    # each: one wrapped here serves them all (the same sums).
    torch._foreach_add_(
        steps, torch.ones((), dtype=steps[0].dtype) if steps[0].is_cpu else 1, alpha=1
    )
    if any(p.is_complex() for p in params):  # real and imaginary parts step apart, as torch's
        params, grads = [as_real(p) for p in params], [as_real(g) for g in grads]
        states = [{k: as_real(v) if k != "step" else v for k, v in s.items()} for s in states]
    hyper = _Hyper(lr, beta1, beta2, eps, weight_decay, amsgrad, maximize)
    kernel = [fused is not False and _fused_takes(*t, amsgrad) for t in zip(params, grads, states)]
    if fused and not all(kernel):
        p = params[kernel.index(False)]
        raise ValueError(
            "AdamW(fused=True): the fused kernel takes contiguous float32 / float64 CPU tensors, "
            f"got a {p.dtype} tensor on {p.device} (contiguous: {p.is_contiguous()}); use "
            "fused=None (the default: the kernel where it applies)"
        )
    for on_kernel, update in ((True, _fused_adamw_), (False, _foreach_adamw_)):
        chosen = [i for i, k in enumerate(kernel) if k == on_kernel]
        if chosen:
            update(*([x[i] for i in chosen] for x in (params, grads, states)), hyper)


@dataclass(frozen=True)
class _Hyper:
    """One step's hyper-parameters, named as ``torch._fused_adamw_`` names them."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    amsgrad: bool
    maximize: bool


def _moments(state: dict, amsgrad: bool) -> list[Tensor]:
    """The optimizer state tensors the rule updates, in the kernel's order."""
    names = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if amsgrad else ("exp_avg", "exp_avg_sq")
    return [state[name] for name in names]


def _foreach_adamw_(
    params: list[Tensor], grads: list[Tensor], states: list[dict], h: _Hyper
) -> None:
    """The rule as foreach ops, a pass over memory each; steps already counted."""
    lr, beta1, beta2, eps = h.lr, h.beta1, h.beta2, h.eps
    if h.maximize:
        grads = torch._foreach_neg(grads)  # out of place: a grad may be a shared comm buffer
    exp_avgs = [state["exp_avg"] for state in states]
    exp_avg_sqs = [state["exp_avg_sq"] for state in states]
    step_counts = [state["step"].item() for state in states]

    # Decoupled: decay the weights directly instead of adding weight_decay * param to g.
    if h.weight_decay != 0:
        torch._foreach_mul_(params, 1 - lr * h.weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)

    second_moments = exp_avg_sqs
    if h.amsgrad:
        second_moments = [state["max_exp_avg_sq"] for state in states]
        torch._foreach_maximum_(second_moments, exp_avg_sqs)
    denoms = torch._foreach_sqrt(second_moments)
    torch._foreach_div_(denoms, [math.sqrt(1 - beta2**t) for t in step_counts])
    torch._foreach_add_(denoms, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denoms, [-lr / (1 - beta1**t) for t in step_counts])


def _init_state(params: list[Tensor], states: list[dict], amsgrad: bool) -> None:
    for param, state in zip(params, states):
        if "step" not in state:
            # step lives on the CPU so reading it for the bias correction never syncs a GPU.
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        if amsgrad and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)


#: A multiple of every CPU vector width in elements ([Note: fused AdamW on the CPU]).
_LANES = 64


def _fused_takes(param: Tensor, grad: Tensor, state: dict, amsgrad: bool) -> bool:
    """[Note: fused AdamW on the CPU]

    On the CPU the foreach ops above run one kernel per op and tensor, each a pass over memory
    (about ten passes per step); torch's fused AdamW kernel does the whole update in one pass
    (gpt2_mini's 16M fp32 parameters, one thread: 84 ms -> 15 ms a step). It computes the same
    formula with its own operation order, so results differ from the foreach ops (and from
    ``torch.optim.AdamW``'s default on the CPU) by rounding only (4.8e-7 after 7 steps on
    unit-scale weights). Its vector loop rounds its constants to the parameter dtype while its
    scalar loop, which takes the last ``numel % vector width`` elements of a tensor, computes in
    double: an element's result would depend on where its tensor ends, and a dim-0 shard would
    not match the whole tensor ([Note: one update rule]). So every tensor goes to the kernel as
    a body of a multiple of ``_LANES`` elements plus its tail copied into a zero-padded row of
    ``_LANES`` (zeros update to zeros): every element takes the vector loop. The tails cost a
    few small ops per tensor (one thread, per tensor and step: ~11 us without a tail, ~50 us
    with one, the foreach ops ~22 us), so a fused call takes a large batch (``_batch_limit``)
    and most tensors of a model (sizes multiple of 64) have none.

    Used, tensor by tensor, for contiguous float32 / float64 CPU tensors, whose step counters
    already live on their device. The others of a call take the foreach ops: on CUDA (torch's
    default there; fused needs the step counter on the GPU), bf16 / fp16 parameters (the kernel
    computes them in float32 where torch.optim rounds every op) and other memory layouts (the
    kernel walks memory), e.g. a channels_last weight under DDP, which ZeRO / FSDP update as a
    flat contiguous shard on the kernel: the two then agree to rounding, not bit for bit.
    """
    return (
        param.device.type == "cpu"
        and param.dtype in (torch.float32, torch.float64)
        and hasattr(torch, "_fused_adamw_")
        and all(t.is_contiguous() for t in [param, grad, *_moments(state, amsgrad)])
    )


def _fused_adamw_(params: list[Tensor], grads: list[Tensor], states: list[dict], h: _Hyper) -> None:
    """The rule as one fused kernel call over contiguous tensors of one CPU dtype; steps already
    counted. Tails padded as above, a few calls per column rather than per tensor."""
    columns = [params, grads] + [list(c) for c in zip(*(_moments(s, h.amsgrad) for s in states))]
    steps = [state["step"] for state in states]
    whole = [i for i, p in enumerate(params) if p.numel() and p.numel() % _LANES == 0]
    cut = [i for i, p in enumerate(params) if p.numel() % _LANES]
    lengths = [params[i].numel() % _LANES for i in cut]  # of the tails
    cut_sizes = [(i, params[i].numel(), k) for i, k in zip(cut, lengths)]
    with_body = [j for j, i in enumerate(cut) if params[i].numel() > _LANES]
    calls = [[column[i] for i in whole] for column in columns]
    call_steps = [steps[i] for i in whole] + [steps[cut[j]] for j in with_body]
    tails, pads = [], []
    for call, column in zip(calls, columns):
        split = [column[i].view(-1).split_with_sizes([n - k, k]) for i, n, k in cut_sizes]
        call.extend(split[j][0] for j in with_body)
        tails.append([tail for _, tail in split])
    if cut:
        for call, column_tails in zip(calls, tails):
            pad = F.pad(pad_sequence(column_tails, batch_first=True), (0, _LANES - max(lengths)))
            call.extend(pad.unbind(0))
            pads.append(pad)
        call_steps.extend(steps[i] for i in cut)
    if not call_steps:
        return  # only empty tensors
    torch._fused_adamw_(*calls[:4], calls[4] if h.amsgrad else [], call_steps, **vars(h))
    if cut:
        kept = torch.arange(_LANES) < torch.tensor(lengths)[:, None]
        for c, (pad, column_tails) in enumerate(zip(pads, tails)):
            if c != 1:  # grads are read only
                torch._foreach_copy_(column_tails, list(pad[kept].split(lengths)))


class AdamW(BaseOptimizer):
    """AdamW; a ``torch.optim.Optimizer`` applying ``adamw_update_``. ``fused`` as there: None
    (default) the one-pass kernel on the CPU ([Note: fused AdamW on the CPU]), False the foreach
    ops (``torch.optim.AdamW``'s CPU default bit for bit). ``foreach`` as torch's: True or False
    (torch's for-loop, whose numbers the foreach ops give bit for bit) choose the foreach ops;
    with ``fused=True`` it is refused, as torch does."""

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
        foreach: Optional[bool] = None,
        fused: Optional[bool] = None,
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            foreach=foreach,
            fused=fused,
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
        for key in ("foreach", "fused"):
            if hyper.get(key) not in (None, False, True):
                raise ValueError(f"{key} must be None, False or True, got {hyper[key]!r}")
        if hyper.get("fused") and hyper.get("foreach"):
            raise ValueError("fused=True and foreach=True cannot be asked for together")

    @staticmethod
    def _fused(group: dict[str, Any]) -> Optional[bool]:
        """The rule's ``fused`` for ``group``: ``foreach`` given and ``fused`` not means False;
        checkpoints of earlier versions have neither."""
        fused = group.get("fused")
        return False if fused is None and group.get("foreach") is not None else fused

    def _batch_limit(self, group: dict[str, Any], device: torch.device) -> int:
        """The fused kernel keeps no temporaries and pays for tails per call: large batches."""
        if self._fused(group) is not False and device.type == "cpu":
            return FUSED_BATCH_BYTES
        return batch_limit(device)

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
            fused=self._fused(group),
        )
