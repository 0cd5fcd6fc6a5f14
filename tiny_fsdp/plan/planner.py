"""Predict every strategy's peak memory per rank and step time ([Note: what the planner predicts]).

[Note: what the planner predicts]
For each strategy, per rank (the largest rank where ranks differ):

    peak_bytes = model states            ZeRO formulas ([Note: ZeRO memory formulas]), the
                                          trainable tensors' gradients and optimizer state
                                          only; ZeRO-3 by its partition table, FSDP by its
                                          shards (rows padded, the first ranks updating the
                                          most rows); bf16 in the dtypes each strategy keeps
                                          (``model_states``)
               + activations              kept for backward by this rank's batch ([Note: model
                                          costs])
               + transient buffers        gathered parameters, reduction / staging buffers in
                                          flight at their peak ([Note: strategy schedules])

It is the sum of each part's own peak, so an upper bound of the bytes in use at one moment; it
leaves out what no strategy controls (the logits' gradient, autograd's temporaries, allocator
caching). ``tests/test_plan.py`` measures the same three parts: the memory ledger, the
saved-tensor bytes of the forward, and the strategies' own buffer meters.

``payload_bytes`` are the bytes one rank's collectives carry in a step and ``calls`` their
number, per (group, kind), as the communication ledger counts them ([Note: communication
ledger]): group ``"world"`` for the strategies over all ranks, HSDP's ``"shard"`` (inside a
replica group, a node) and ``"replicate"`` (across them, the inter-node link).
``inter_group_bytes`` is the payload across groups, and ``sent_bytes`` turns the payloads into
the bytes a rank sends under the ring model, in its group (``"intra"``) and across groups
(``"inter"``): what a link carries.

``step_ms`` is the planned timeline of one step ([Note: strategy schedules]); ``tokens_per_s``
is the global batch (all ranks) over it; ``fits`` is ``peak_bytes <= gpu_memory``.
"""

from dataclasses import asdict, dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from tiny_fsdp.core.memory import MemoryReport
from tiny_fsdp.estimate import bytes_per_param
from tiny_fsdp.plan.calibration import Calibration, load_calibration
from tiny_fsdp.plan.model_costs import ModelCosts, module_costs
from tiny_fsdp.plan.schedules import INTER_GROUP, StepSetup, plan_step

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")


@dataclass(frozen=True)
class Prediction:
    """One strategy's plan ([Note: what the planner predicts]); bytes per rank."""

    peak_bytes: int
    step_ms: float
    tokens_per_s: float
    fits: Optional[bool]
    model_state_bytes: int
    activation_bytes: int
    transient_bytes: int
    compute_ms: float
    comm_ms: float
    payload_bytes: Dict[Tuple[str, str], int]
    calls: Dict[Tuple[str, str], int]
    sent_bytes: Dict[str, float]

    @property
    def inter_group_bytes(self) -> int:
        """Payload of the collectives across HSDP's replica groups (0 for the others)."""
        return sum(n for (group, _), n in self.payload_bytes.items() if group == INTER_GROUP)

    def summary(self) -> Dict[str, object]:
        """The four figures of ``--json``."""
        keys = ("peak_bytes", "step_ms", "tokens_per_s", "fits")
        return {k: v for k, v in asdict(self).items() if k in keys}


def model_states(
    costs: ModelCosts, strategy: str, ranks: int, precision: str = "fp32", optimizer: str = "adamw"
) -> List[MemoryReport]:
    """Per rank of ``ranks`` (FSDP's: of a shard group), the model states ``strategy`` keeps:
    every tensor's parameters, gradients and optimizer state of the trainable ones (a frozen
    tensor has neither), laid out as the strategy lays them out (ZeRO-3 by its partition table,
    FSDP by its shards), in the bytes it keeps them. fp32: the ZeRO formulas' ([Note: ZeRO
    memory formulas]). bf16: ZeRO-1/2 the formulas' (bf16 parameters and gradients, fp32
    masters in the optimizer's shard); DDP, ZeRO-3 and FSDP keep fp32 parameters (their own
    masters) and fp32 gradients, DDP with a bf16 copy of every parameter to compute with."""
    p, g, k = bytes_per_param(precision, optimizer)
    if precision == "bf16" and strategy not in ("zero1", "zero2"):
        p, g, k = (6 if strategy == "ddp" else 4), 4, k - 4
    psi, trained = costs.num_params, costs.num_trainable
    if strategy in ("ddp", "zero1", "zero2"):
        grads = trained / ranks if strategy == "zero2" else trained
        state = trained if strategy == "ddp" else trained / ranks
        return [MemoryReport(round(p * psi), round(g * grads), round(k * state))] * ranks
    if strategy == "zero3":  # whole tensors, each on its owner
        owned, trainable = costs.zero3_owned(ranks), set(costs.trainable)
        held = [sum(costs.tensors[t] for t in o) for o in owned]
        graded = [sum(costs.tensors[t] for t in o if t in trainable) for o in owned]
        return [MemoryReport(p * h, g * t, k * t) for h, t in zip(held, graded)]
    if strategy in ("fsdp", "hsdp"):  # its shards, padding and all
        return [
            MemoryReport(p * held, g * graded, k * updated)
            for held, graded, updated in costs.fsdp_rank_elements(ranks)
        ]
    raise ValueError(f"unknown strategy {strategy!r}")


def plan(
    costs: ModelCosts,
    calibration: Union[Calibration, str],
    world_size: int,
    batch_size: int,
    seq_len: int,
    precision: str = "fp32",
    optimizer: str = "adamw",
    grad_ckpt: bool = False,
    gpu_memory: Optional[float] = None,
    hsdp_replicas: Optional[int] = None,
    strategies: Sequence[str] = STRATEGIES,
) -> Dict[str, Prediction]:
    """``{strategy: Prediction}``; ``batch_size`` is per rank. With ``hsdp_replicas`` = R, also
    ``"hsdp"``: FSDP over ``N / R`` ranks. ``calibration``: a ``Calibration``, a preset's name
    (``"h100_sxm"``) or a calibration file."""
    calibration = _calibration(calibration)
    if hsdp_replicas is not None and (hsdp_replicas < 1 or world_size % hsdp_replicas):
        raise ValueError(f"--hsdp {hsdp_replicas} must divide world_size {world_size}")
    p_bytes, _, _ = bytes_per_param(precision, optimizer)
    act_bytes = 2 if precision == "bf16" else 4
    names = list(strategies) + (["hsdp"] if hsdp_replicas else [])
    tokens = batch_size * seq_len
    activations = costs.activation_bytes(tokens, act_bytes, grad_ckpt)
    out = {}
    for name in names:
        replicas = hsdp_replicas if name == "hsdp" else 1
        setup = StepSetup(
            costs, calibration, world_size, tokens, seq_len, p_bytes, act_bytes, grad_ckpt,
            replicas,
        )  # fmt: skip
        step = plan_step(name, setup)
        per_rank = model_states(costs, name, world_size // replicas, precision, optimizer)
        model_state = max(r.model_states for r in per_rank)
        peak = model_state + activations + step.transient_bytes
        out[name] = Prediction(
            peak_bytes=int(peak),
            step_ms=1e3 * step.seconds,
            tokens_per_s=tokens * world_size / step.seconds if step.seconds > 0 else float("inf"),
            fits=None if gpu_memory is None else peak <= gpu_memory,
            model_state_bytes=int(model_state),
            activation_bytes=int(activations),
            transient_bytes=int(step.transient_bytes),
            compute_ms=1e3 * step.compute_s,
            comm_ms=1e3 * step.comm_s,
            payload_bytes=step.payload_bytes,
            calls=step.calls,
            sent_bytes={
                "intra": sum(n for g, n in step.sent_bytes.items() if g != INTER_GROUP),
                "inter": step.sent_bytes.get(INTER_GROUP, 0.0),
            },
        )
    return out


def plan_model(
    model: nn.Module,
    calibration: Union[Calibration, str],
    world_size: int,
    batch_size: int,
    seq_len: int,
    precision: str = "fp32",
    optimizer: str = "adamw",
    grad_ckpt: bool = False,
    gpu_memory: Optional[float] = None,
    hsdp_replicas: Optional[int] = None,
    example_input: Union[torch.Tensor, Mapping[str, torch.Tensor], None] = None,
) -> Dict[str, Prediction]:
    """``plan`` for an ``nn.Module`` (on ``meta`` is best): its layers, units and ZeRO-3
    partition table are read from it, its activations from one forward on ``meta`` of
    ``example_input``, by default token ids of the planned batch, ``(batch_size, seq_len)``;
    another input (images, audio, features) is taken as samples of ``seq_len`` tokens each
    (a ViT's patches) ([Note: model costs])."""
    calibration = _calibration(calibration)
    device = device_type(calibration)
    costs = batch_costs(model, batch_size, seq_len, device, example_input, precision=precision)
    return plan(
        costs, calibration, world_size, batch_size, seq_len, precision, optimizer, grad_ckpt,
        gpu_memory, hsdp_replicas,
    )  # fmt: skip


def _calibration(calibration: Union[Calibration, str]) -> Calibration:
    """A ``Calibration``, loaded from a preset's name or a file if given one."""
    if isinstance(calibration, str):
        calibration = load_calibration(calibration)
    if not isinstance(calibration, Calibration):
        raise TypeError(
            "calibration must be a Calibration, a preset name or a calibration file, got "
            f"{type(calibration).__name__}"
        )
    return calibration


def device_type(calibration: Optional[Calibration]) -> str:
    """The device whose kernels ``calibration`` measured (gloo's: the CPU); None: this one."""
    if calibration is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cpu" if calibration.backend == "gloo" else "cuda"


def batch_costs(
    model: nn.Module,
    batch_size: int,
    seq_len: int,
    device: str = "cuda",
    example_input: Union[torch.Tensor, Mapping[str, torch.Tensor], None] = None,
    name: Optional[str] = None,
    precision: str = "fp32",
) -> ModelCosts:
    """``module_costs`` measured on one batch: ``example_input``, by default token ids of shape
    ``(batch_size, seq_len)``; an example that is not token ids holds samples of ``seq_len``
    tokens each; computing in ``precision``'s dtype; a model that takes no token ids says what
    to pass."""
    tokens = torch.zeros(batch_size, seq_len, dtype=torch.long)
    example = tokens if example_input is None else example_input
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    try:
        return module_costs(model, example, name, device, seq_len, dtype)
    except Exception as exc:
        if example_input is not None:
            raise
        raise ValueError(
            f"the planner measures the activations of {type(model).__name__} with one forward "
            f"on meta of token ids of shape ({batch_size}, {seq_len}), which failed "
            f"({type(exc).__name__}: {exc}). Pass example_input=<the input of one batch>, a "
            "tensor or the forward's keyword arguments (a dict)."
        ) from exc
