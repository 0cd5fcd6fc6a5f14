"""The probe model of the calibration: tiny layers, whose step is the fixed cost of running a layer,
and layers of about the model's scale, plain and under each strategy's wrapper with its default
arguments ([Note: calibration]).

[Note: wrapper costs]
A wrapper costs more than its collectives: hooks, copies into and out of flat buffers, Python.
``fit_wrapper_costs`` charges it as the planner does, a cost per layer (``wrapper_layer_s``) and,
for ZeRO-3 and FSDP, per unit (``wrapper_unit_s``; ZeRO-3's per owner of a unit's tensors, each
with its own buffer, broadcast and reduction), and picks the values for which the planner's
own schedule of the probe step ([Note: strategy schedules]) takes the planned plain step plus
what the wrapper was measured to add to the same probe: with two probes of the same layers in 8
and in 4 units for ZeRO-3 and FSDP, whose difference is the cost per unit. Whatever the schedule
leaves out at the probe's scale (a collective waiting on a late rank, a wait that does not
overlap) lands in these costs, consistently with how the planner uses them; a cost is never
negative.

The wrapped probes compute at about the model's scale (``wide_dims``: the calibration shape's
rows and width, capped): on a CPU whose cores the ranks fill, a collective issued while the
ranks compute waits for its thread to get a core (a 4 KiB gloo broadcast: 0.2 ms idle, 3.8 ms
with 2 ranks computing on the 2-core development machine), so a probe of tiny layers shows too
little of it. With it, ZeRO-3's predicted step on 2-4 ranks moved from 18-27 % short to between
23 % short and 22 % long (two runs each, ``tests/test_plan.py``'s step-time check), and charging
ZeRO-3's unit cost per owner moved its 4-rank row from 20-24 % short to 11-15 %. The fixed cost
of a layer comes from a probe of tiny layers (``PROBE_ROWS`` x 8), whose step is nearly all of
it.
"""

from typing import Callable, Dict, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from tiny_fsdp.plan.calibration import Calibration

WRAPPED = ("ddp", "zero1", "zero2", "zero3", "fsdp")


UNITS = ("zero3", "fsdp")  # strategies whose cost is also per unit: probed twice
PROBE_ROWS = 4  # rows of the fixed-cost probe's input: (PROBE_ROWS, 8)
WIDE_ROWS, WIDE_WIDTH = 512, 128  # at most this many rows and this width for the wrapped probes


def wide_dims(shape: Sequence[int]) -> Tuple[int, int]:
    """``(rows, width)`` of the wrapped probes for a calibration shape ``(rows, in, out)``
    ([Note: wrapper costs])."""
    return min(shape[0], WIDE_ROWS), min(shape[1], WIDE_WIDTH)


class Probe(nn.Module):
    """``layers`` tiny layers, linear and layer norm in turn (a transformer's two kinds of
    layer, whose wrapped forms cost differently), in ``layers / per_block`` blocks of a
    ``ModuleList``: the auto units of FSDP and ZeRO-3 are its blocks."""

    def __init__(self, layers: int = 8, width: int = 8, per_block: int = 1) -> None:
        super().__init__()
        self.layers = layers
        kinds = [
            nn.Linear(width, width) if i % 2 == 0 else nn.LayerNorm(width) for i in range(layers)
        ]

        self.blocks = nn.ModuleList(  # one type of block: the repeated blocks of unit_layout
            nn.Sequential(*kinds[i : i + per_block]) for i in range(0, layers, per_block)
        )

    @torch.no_grad()
    def init_parameter(self, name: str, tensor: torch.Tensor) -> None:
        tensor.fill_(0.01)  # [Note: per-parameter init]: any pure function of the name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def wrap_probe(strategy: str, device: torch.device, per_block: int = 1, width: int = 8):
    """``(model, optimizer)`` of ``Probe(width, per_block)`` under ``strategy`` (``"plain"``:
    none), default arguments."""
    from tiny_fsdp.core.ddp import DDP, DDPAdamW
    from tiny_fsdp.core.fsdp import FSDP, FSDPAdamW
    from tiny_fsdp.core.optim import AdamW
    from tiny_fsdp.core.zero import Zero1, Zero1AdamW, Zero2, Zero2AdamW
    from tiny_fsdp.core.zero3 import Zero3, Zero3AdamW, zero3_partition_tensors

    torch.manual_seed(0)
    if strategy in ("zero3", "fsdp"):
        with torch.device("meta"):
            meta = Probe(width=width, per_block=per_block)
        if strategy == "fsdp":
            model = FSDP(meta, device=device)
            return model, FSDPAdamW(model.parameters())
        ranks = [device.type] * dist.get_world_size()
        table, _ = zero3_partition_tensors(dict(meta.named_parameters()), ranks)
        model = Zero3(meta, table)
        return model, Zero3AdamW(model.module.named_parameters(), param_part_table=table)
    plain = Probe(width=width, per_block=per_block).to(device)
    if strategy == "plain":
        return plain, AdamW(plain.parameters())
    wrapper, optim = {"ddp": (DDP, DDPAdamW), "zero1": (Zero1, Zero1AdamW),
                      "zero2": (Zero2, Zero2AdamW)}[strategy]  # fmt: skip
    model = wrapper(plain)
    return model, optim(model.parameters())


def _smallest_reaching(
    f: Callable[[float], float], target: float, hi: float, grow: bool = True
) -> float:
    """The smallest ``x >= 0`` with ``f(x) >= target`` for a nondecreasing ``f`` (bisection);
    0 if ``f(0)`` already reaches it. ``grow=False``: only up to ``hi``, and ``hi`` if
    ``f(hi)`` falls short."""
    if f(0.0) >= target:
        return 0.0
    hi = max(hi, 1e-9)
    for _ in range(200):  # f grows without bound in x here; 200 doublings is far past any step
        if f(hi) >= target or not grow:
            break
        hi *= 2
    if f(hi) < target:
        return hi
    lo = 0.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
    return hi


def fit_wrapper_costs(
    calibration: Calibration,
    extra_s: Dict[str, float],
    dims: Tuple[int, int],
    world_size: int,
) -> None:
    """Fill ``calibration.wrapper_layer_s`` / ``wrapper_unit_s`` from what each wrapper was
    measured to add to the plain step of ``Probe(width)`` on ``rows`` rows (``dims``),
    ``extra_s`` (``{strategy: s}``, and ``"<strategy> x2"`` for two layers per unit), on
    ``world_size`` ranks ([Note: wrapper costs])."""
    from tiny_fsdp.plan.model_costs import module_costs
    from tiny_fsdp.plan.schedules import StepSetup, plain_step_seconds, plan_step

    rows, width = dims
    with torch.device("meta"):
        costs = {
            k: module_costs(Probe(width=width, per_block=k), name=f"probe x{k}") for k in (1, 2)
        }
    plain = plain_step_seconds(StepSetup(costs[1], calibration, 1, rows, 1, 4, 4))
    probe_s = {name: plain + extra for name, extra in extra_s.items()}

    def planned(name: str, per_block: int, layer_s: float, unit_s: float) -> float:
        calibration.wrapper_layer_s[name] = layer_s
        if name in UNITS:
            calibration.wrapper_unit_s[name] = unit_s
        setup = StepSetup(costs[per_block], calibration, world_size, rows, 1, 4, 4)
        return plan_step(name, setup).seconds

    for name in WRAPPED:
        measured = probe_s[name]
        if name not in UNITS:
            layer = _smallest_reaching(lambda x: planned(name, 1, x, 0.0), measured, measured)
            planned(name, 1, layer, 0.0)
            continue

        # Per unit u: the layer cost that matches the 8-unit probe, then the u whose 4-unit
        # probe matches too: a larger u leaves less to the layers, so the 4-unit probe's
        # time falls, up to the u that leaves them nothing.
        def layer_for(unit: float) -> float:
            return _smallest_reaching(lambda x: planned(name, 1, x, unit), measured, measured)

        def minus_x2(unit: float) -> float:
            return -planned(name, 2, layer_for(unit), unit)

        most = _smallest_reaching(lambda u: planned(name, 1, 0.0, u), measured, measured)
        unit = _smallest_reaching(minus_x2, -probe_s[f"{name} x2"], most, grow=False)
        planned(name, 1, layer_for(unit), unit)
