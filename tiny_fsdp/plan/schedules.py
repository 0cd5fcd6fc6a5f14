"""Each strategy's step as the wrappers run it with their default arguments: collectives, overlap,
transient buffers ([Note: planned timeline], [Note: strategy schedules]).

[Note: strategy schedules]
One rank's step, with the defaults of ``DDP``, ``Zero1/2``, ``Zero3`` and ``FSDP``:

- DDP: gradients in 25 MiB buckets in reverse parameter order (plus one flag element per
  parameter); a full bucket's all-reduce is issued during backward and runs while earlier layers
  compute; the optimizer waits for all of them.
- ZeRO-1 / ZeRO-2: the same buckets (padded to ``N``), each reduce-scattered (gloo: all-reduced);
  ZeRO-2 keeps one reduction in flight, so a second full bucket waits for the first; the optimizer
  updates ``1 / N`` of the parameters, then each bucket is all-gathered (gloo: ``N`` broadcasts).
  ZeRO-2's staging buffers (the bucket being reduced and the one filling) are transient memory.
- ZeRO-3: each layer broadcasts each tensor it uses from its owner before its forward and again
  before its backward, at most 2 layers ahead (prefetch); after a layer's backward each tensor
  use is reduced to its owner, asynchronously, 2 in flight. Fetched tensors of other owners are
  transient memory (the layer computing and the 2 prefetched), as are the reductions in flight.
- FSDP (``unit="auto"``): the root unit is all-gathered at the start and kept until the end of
  backward; each block is all-gathered before its forward (the next one prefetched) and freed
  after it, again in backward; each layer's gradients are reduce-scattered after its backward,
  asynchronously, 2 in flight. Gathered units and reductions in flight are transient memory.
- HSDP (``R`` replica groups): FSDP inside groups of ``N / R`` ranks, and each reduced shard is
  then all-reduced across the ``R`` groups (over the inter-node link when the calibration gives
  one).

Compute per layer ([Note: model costs]): its matrix products at the calibrated rate, an equal
share of the attention FLOPs and the elementwise work, and the fixed per-layer cost; backward is
twice the forward (plus a forward of each block again under gradient checkpointing).
"""

from dataclasses import dataclass
from typing import Dict, List, Optional

from tiny_fsdp.plan.calibration import Calibration
from tiny_fsdp.plan.collectives import collective_s
from tiny_fsdp.plan.model_costs import ModelCosts
from tiny_fsdp.plan.timeline import Timeline

BUCKET_CAP_BYTES = 25 * 2**20  # DDP / ZeRO-1/2 default bucket_cap_mb
ZERO3_PREFETCH = 2  # Zero3 default prefetch_limit
FSDP_PREFETCH = 1  # FSDP default prefetch_limit
IN_FLIGHT = 2  # asynchronous reductions in flight (reductions.py)


@dataclass(frozen=True)
class StepSetup:
    """What one rank computes: ``tokens`` = its batch rows times ``seq_len``."""

    costs: ModelCosts
    calibration: Calibration
    world_size: int
    tokens: int
    seq_len: int
    param_bytes: int  # bytes of a parameter as computed / communicated (2 under bf16)
    act_bytes: int  # bytes of an activation element
    grad_ckpt: bool = False
    replicas: int = 1  # HSDP replica groups


@dataclass
class StepPlan:
    seconds: float
    compute_s: float
    comm_s: float
    transient_bytes: int  # gathered parameters, reduce / staging buffers at their peak


def _planned(tl: Timeline, cal: Calibration, transient: float) -> StepPlan:
    """The step of timeline ``tl``, with the calibration's overlap ([Note: calibration])."""
    compute, comm = tl.busy("compute"), tl.busy("comm")
    seconds = cal.overlap * tl.seconds + (1 - cal.overlap) * max(tl.seconds, compute + comm)
    return StepPlan(seconds, compute, comm, int(transient))


def _ceil_to(n: int, k: int) -> int:
    return -(-n // k) * k


def _layer_seconds(s: StepSetup, strategy: str) -> List[float]:
    """Forward seconds per layer ([Note: strategy schedules]); backward takes twice as long."""
    cal, costs = s.calibration, s.costs
    layers = len(costs.layers)
    shared = 2.0 * costs.attention_flops_per_token * s.seq_len * s.tokens / cal.flops_per_s
    shared += costs.activation_bytes(s.tokens, s.act_bytes) * cal.activation_s_per_byte / 3
    wrapper = cal.wrapper_layer_s.get("fsdp" if strategy == "hsdp" else strategy, 0.0)
    fixed = (cal.layer_overhead_s + wrapper) / 3
    return [
        2.0 * m * s.tokens / cal.flops_per_s + shared / layers + fixed for m in costs.layer_matmul
    ]


def _compute(tl: Timeline, fwd: List[float], s: StepSetup) -> None:
    """Plain forward and backward, no communication."""
    for t in fwd:
        tl.add("compute", t)
    for t in reversed(fwd):
        tl.add("compute", 2 * t + (t if s.grad_ckpt else 0.0))


def _bucket_members(s: StepSetup) -> List[List[int]]:
    """Tensor indices of each gradient bucket, in backward (launch) order: reverse parameter
    order, a new bucket when the next tensor would pass the cap ([Note: gradient bucket
    layout])."""
    cap = BUCKET_CAP_BYTES // s.param_bytes
    out: List[List[int]] = []
    filled = 0
    for i in reversed(range(len(s.costs.tensors))):
        n = s.costs.tensors[i]
        if not out or (filled > 0 and filled + n > cap):
            out.append([])
            filled = 0
        out[-1].append(i)
        filled += n
    return out


def _bucketed(s: StepSetup, zero_stage: int) -> StepPlan:
    """DDP (``zero_stage`` 0) and ZeRO-1/2: bucketed reductions overlapping backward."""
    cal, n, tl = s.calibration, s.world_size, Timeline(comm_channels=s.calibration.comm_channels)
    fwd = _layer_seconds(s, ("ddp", "zero1", "zero2")[zero_stage])
    gloo = cal.backend == "gloo"
    members = _bucket_members(s)
    if zero_stage == 0:  # DDP: one flag element per parameter rides in its bucket
        buckets = [sum(s.costs.tensors[t] for t in m) + len(m) for m in members]
    else:
        buckets = [_ceil_to(sum(s.costs.tensors[t] for t in m), n) for m in members]
    for t in fwd:
        tl.add("compute", t)
    kind = "all_reduce" if zero_stage == 0 or gloo else "reduce_scatter"
    remaining = [set(m) for m in members]
    launched: List[int] = []
    layers = s.costs.layers
    for i in reversed(range(len(layers))):  # backward; hooks launch complete buckets in order
        tl.add("compute", fwd[i] * (2 + s.grad_ckpt), label=f"bwd {i}")
        if i > 0:  # a tied tensor is complete after its first (in forward order) layer
            done = {t for t in layers[i] if all(t not in layers[j] for j in range(i))}
        else:
            done = set(layers[0])
        for rest in remaining:
            rest -= done
        while len(launched) < len(buckets) and not remaining[len(launched)]:
            if zero_stage == 2 and launched:
                tl.wait([launched[-1]])  # one reduction in flight: the next launch waits
            seconds = collective_s(cal, kind, buckets[len(launched)] * s.param_bytes, n)
            launched.append(tl.add("comm", seconds, label=f"reduce bucket {len(launched)}"))
    tl.wait(launched)
    local = s.costs.num_params / (1 if zero_stage == 0 else n)
    tl.add("compute", local * cal.optimizer_s_per_param, label="optimizer")
    if zero_stage:
        gathers = []
        for numel in buckets:
            if gloo:  # one broadcast per owner ([Note: ZeRO collectives on gloo])
                for _ in range(n):
                    seconds = collective_s(cal, "broadcast", numel // n * s.param_bytes, n)
                    gathers.append(tl.add("comm", seconds))
            else:
                gathers.append(
                    tl.add("comm", collective_s(cal, "all_gather", numel * s.param_bytes, n))
                )
        tl.wait(gathers)
    transient = 0
    if zero_stage == 2:  # staging: the bucket reduced and the one filling
        transient = sum(sorted(buckets)[-2:]) * s.param_bytes
    return _planned(tl, cal, transient)


def _zero3(s: StepSetup) -> StepPlan:
    cal, n, tl, costs = (
        s.calibration,
        s.world_size,
        Timeline(comm_channels=s.calibration.comm_channels),
        s.costs,
    )
    fwd = _layer_seconds(s, "zero3")
    if n == 1:
        _compute(tl, fwd, s)
    else:

        def fetch_all(order: List[int], backward: bool) -> None:
            computes: List[int] = []
            fetched: Dict[int, int] = {}
            reductions: List[int] = []
            for pos, i in enumerate(order):
                for ahead in range(pos, min(pos + ZERO3_PREFETCH + 1, len(order))):
                    j = order[ahead]
                    if j in fetched:
                        continue
                    start_of = computes[-1] if computes else None
                    op = None
                    for t in costs.layers[j]:
                        op = tl.add(
                            "comm",
                            collective_s(cal, "broadcast", costs.tensors[t] * s.param_bytes, n),
                            issue_at_start_of=start_of,
                        )
                    fetched[j] = op
                seconds = fwd[i] * ((2 + s.grad_ckpt) if backward else 1)
                computes.append(tl.add("compute", seconds, [fetched[i]]))
                if backward:
                    for t in costs.layers[i]:
                        if len(reductions) >= IN_FLIGHT:
                            tl.wait([reductions[-IN_FLIGHT]])
                        reductions.append(
                            tl.add("comm", collective_s(cal, "reduce", costs.tensors[t] * 4, n))
                        )
            tl.wait(reductions)

        order = list(range(len(costs.layers)))
        fetch_all(order, False)
        fetch_all(order[::-1], True)
    owned = costs.num_params / n  # the partition table balances bytes
    tl.add("compute", owned * cal.optimizer_s_per_param, label="optimizer")
    largest = sorted((sum(costs.tensors[t] for t in layer) for layer in costs.layers))
    fetched = sum(largest[-(ZERO3_PREFETCH + 1) :]) * s.param_bytes * (n - 1) / n if n > 1 else 0
    reduce = sum(sorted(costs.tensors)[-IN_FLIGHT:]) * 4 if n > 1 else 0
    return _planned(tl, cal, fetched + reduce)


def _fsdp(s: StepSetup) -> StepPlan:
    cal, tl, costs = s.calibration, Timeline(comm_channels=s.calibration.comm_channels), s.costs
    shard_world = s.world_size // s.replicas
    n = shard_world
    fwd = _layer_seconds(s, "fsdp")
    unit_of: Dict[int, int] = {t: u for u, unit in enumerate(costs.units) for t in unit}
    layer_unit = [unit_of[layer[0]] for layer in costs.layers]
    padded = [sum(_ceil_to(costs.tensors[t], n) for t in unit) for unit in costs.units]

    def gather(u: int, start_of: Optional[int]) -> int:
        return tl.add(
            "comm",
            collective_s(cal, "all_gather", padded[u] * s.param_bytes, n),
            issue_at_start_of=start_of,
            label=f"gather unit {u}",
        )

    order = list(range(len(costs.layers)))
    gathered: Dict[int, int] = {0: gather(0, None)}  # the root, kept for the whole step
    current = None
    for i in order:  # forward: gather a unit at its first layer, prefetch the next one
        u = layer_unit[i]
        if u not in gathered:
            gathered[u] = gather(u, current)
        nxt = u + 1
        if nxt < len(costs.units) and nxt not in gathered:
            gathered[nxt] = gather(nxt, current)
        current = tl.add("compute", fwd[i], [gathered[u]])
    regathered: Dict[int, int] = {0: gathered[0]}
    reductions: List[int] = []
    reduced = set()
    current = None
    for i in reversed(order):
        u = layer_unit[i]
        if u not in regathered:
            regathered[u] = gather(u, current)
        prev = u - 1
        if prev > 0 and prev not in regathered:
            regathered[prev] = gather(prev, current)
        current = tl.add("compute", fwd[i] * (2 + s.grad_ckpt), [regathered[u]])
        tensors = [t for t in costs.layers[i] if t not in reduced]
        reduced.update(tensors)
        if tensors:
            if len(reductions) >= IN_FLIGHT:
                tl.wait([reductions[-IN_FLIGHT]])
            numel = sum(_ceil_to(costs.tensors[t], n) for t in tensors)
            seconds = collective_s(cal, "reduce_scatter", numel * 4, n)
            if s.replicas > 1:
                seconds += collective_s(
                    cal, "all_reduce", numel // n * 4, s.replicas, inter_node=True
                )
            reductions.append(tl.add("comm", seconds, label=f"reduce layer {i}"))
    tl.wait(reductions)
    tl.add("compute", costs.num_params / n * cal.optimizer_s_per_param, label="optimizer")
    blocks = sorted(padded[1:]) or [0]
    gathered_bytes = (padded[0] + sum(blocks[-(FSDP_PREFETCH + 1) :])) * s.param_bytes
    layer_numels = sorted(
        sum(_ceil_to(costs.tensors[t], n) for t in layer) for layer in costs.layers
    )
    reduce_bytes = sum(layer_numels[-IN_FLIGHT:]) * 4
    return StepPlan(tl.seconds, tl.busy("compute"), tl.busy("comm"), gathered_bytes + reduce_bytes)


def plan_step(strategy: str, s: StepSetup) -> StepPlan:
    """The step of ``strategy`` ([Note: strategy schedules])."""
    if strategy in ("ddp", "zero1", "zero2"):
        return _bucketed(s, {"ddp": 0, "zero1": 1, "zero2": 2}[strategy])
    if strategy == "zero3":
        return _zero3(s)
    if strategy in ("fsdp", "hsdp"):
        return _fsdp(s)
    raise ValueError(f"unknown strategy {strategy!r}")
