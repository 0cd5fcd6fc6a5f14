"""Each strategy's step as the wrappers run it with their default arguments: collectives, overlap,
transient buffers ([Note: planned timeline], [Note: strategy schedules]).

[Note: strategy schedules]
One rank's step, with the defaults of ``DDP``, ``Zero1/2``, ``Zero3`` and ``FSDP``:

- DDP: gradients in 25 MiB buckets in reverse parameter order (plus one flag element per
  parameter); a full bucket's all-reduce is issued during backward and runs while earlier layers
  compute; the optimizer waits for all of them.
- ZeRO-1 / ZeRO-2: the same buckets (padded to ``N``), each reduce-scattered (gloo on more than
  2 ranks: all-reduced); ZeRO-2 keeps one reduction in flight, so a second full bucket waits for
  the first, and so does ZeRO-1 on 2 gloo ranks, whose reductions in place receive into a
  buffer of a chunk each; the optimizer updates ``1 / N`` of the parameters, then each bucket
  is all-gathered (gloo: ``N`` broadcasts). ZeRO-2's staging buffers (the bucket being reduced
  and the one filling; a bucket of one unpadded tensor stages in its gradient; none on one
  rank, which stages into its shard) and ZeRO-1's receive buffers (two consecutive buckets'
  chunks) are transient memory.
- ZeRO-3 and FSDP (``unit="auto"``: the blocks, and a root unit with the other layers): the
  root unit is unsharded at the start and kept until the end of backward (full through the
  forward, and the first unit of the backward); each block is unsharded before its forward
  (the next ones prefetched: 2 for ZeRO-3, 1 for FSDP) and freed after it, again in backward;
  after a unit's last backward layer its summed gradients are reduced, asynchronously, 2
  reductions in flight, then a 3-element all-reduce (the ranks agree on overflow). FSDP issues
  one all-gather and one reduce-scatter per unit; ZeRO-3 one
  broadcast and one reduce per owner of the unit's tensors, owners from ``Zero3``'s default
  partition of the tensor sizes (which also says how many tensors its busiest rank updates).
  Unsharded units, the gradient sum being filled and the reductions in flight are transient
  memory.
- HSDP (``R`` replica groups): FSDP inside groups of ``N / R`` ranks, and each reduced shard is
  then all-reduced across the ``R`` groups (over the inter-node link when the calibration gives
  one).

Compute per layer ([Note: model costs]): its matrix products at the calibrated rate, an equal
share of the attention FLOPs and the elementwise work, and the fixed per-layer cost; backward is
twice the forward (plus a forward of each block again under gradient checkpointing), less the
frozen share of the layer's parameters: a frozen weight's backward computes the input's
gradient only (a LoRA-adapted Llama on a CPU: backward 1.1 x its forward, 1.9 x with every
weight trained).
"""

from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from tiny_fsdp.core.comm import ring_bytes
from tiny_fsdp.core.overflow import AGREEMENT_BYTES
from tiny_fsdp.core.zero.grad_stores import FLAG_DTYPE
from tiny_fsdp.plan.calibration import Calibration
from tiny_fsdp.plan.collectives import collective_s
from tiny_fsdp.plan.model_costs import ModelCosts
from tiny_fsdp.plan.timeline import Timeline

BUCKET_CAP_BYTES = 25 * 2**20  # DDP / ZeRO-1/2 default bucket_cap_mb
ZERO3_PREFETCH = 2  # Zero3 default prefetch_limit
FSDP_PREFETCH = 1  # FSDP default prefetch_limit
IN_FLIGHT = 2  # asynchronous reductions in flight (reductions.py)
INTER_GROUP = "replicate"  # HSDP's group across nodes; every other group is inside one


@dataclass(frozen=True)
class StepSetup:
    """What one rank computes: ``tokens`` = its batch rows times ``seq_len``."""

    costs: ModelCosts
    calibration: Calibration
    world_size: int
    tokens: int
    seq_len: int
    param_bytes: int  # bytes of a parameter or gradient as computed / communicated (bf16: 2)
    act_bytes: int  # bytes of an activation element
    grad_ckpt: bool = False
    replicas: int = 1  # HSDP replica groups


@dataclass
class StepPlan:
    seconds: float
    compute_s: float
    comm_s: float
    transient_bytes: int  # gathered parameters, reduce / staging buffers at their peak
    gathered_bytes: int  # of which gathered parameters (FSDP, ZeRO-3)
    # (group, kind) -> payload bytes of one rank's collectives in the step, as the ledger counts
    # them ([Note: communication ledger]); group "world", or HSDP's "shard" / "replicate".
    payload_bytes: Dict[Tuple[str, str], int] = field(default_factory=dict)
    calls: Dict[Tuple[str, str], int] = field(default_factory=dict)  # the same keys
    sent_bytes: Dict[str, float] = field(default_factory=dict)  # group -> ring-model bytes sent


class _Collectives:
    """The collectives of one planned step: each one's seconds ([Note: collective costs]), and
    what they add up to per (group, kind): payload bytes and calls, and per group the bytes a
    rank sends on a ring of the collective's ``n`` ranks ([Note: communication ledger])."""

    def __init__(self, calibration: Calibration) -> None:
        self.calibration = calibration
        self.payload: Counter = Counter()
        self.calls: Counter = Counter()
        self.sent: Counter = Counter()

    def seconds(
        self, kind: str, nbytes: float, n: int, group: str = "world", inter_node: bool = False
    ) -> float:
        self.payload[group, kind] += int(nbytes)
        self.calls[group, kind] += 1
        self.sent[group] += ring_bytes({kind: nbytes}, n)[kind]
        return collective_s(self.calibration, kind, nbytes, n, inter_node)


def _planned(tl: Timeline, comms: _Collectives, transient: float, gathered: float = 0) -> StepPlan:
    """The step of timeline ``tl``, with the calibration's overlap ([Note: calibration])."""
    cal = comms.calibration
    compute, comm = tl.busy("compute"), tl.busy("comm")
    seconds = cal.overlap * tl.seconds + (1 - cal.overlap) * max(tl.seconds, compute + comm)
    ledger = map(dict, (comms.payload, comms.calls, comms.sent))
    return StepPlan(seconds, compute, comm, int(transient), int(gathered), *ledger)


def _ceil_to(n: int, k: int) -> int:
    return -(-n // k) * k


def _layer_seconds(s: StepSetup, strategy: str, unit_groups: int = 0) -> List[float]:
    """Forward seconds per layer ([Note: strategy schedules]; backward: ``_backward_seconds``).
    ``unit_groups``: ZeRO-3 / FSDP's units, or ZeRO-3's (unit, owner) pairs, which each cost
    ``wrapper_unit_s``."""
    cal, costs = s.calibration, s.costs
    layers = len(costs.layers)
    shared = 2.0 * costs.attention_flops_per_token * s.seq_len * s.tokens / cal.flops_per_s
    shared += costs.activation_bytes(s.tokens, s.act_bytes) * cal.activation_s_per_byte / 3
    name = "fsdp" if strategy == "hsdp" else strategy
    wrapper = cal.wrapper_layer_s.get(name, 0.0)
    # ZeRO-3 / FSDP also pay per unit group (an unshard, a summed reduction), over the layers.
    wrapper += cal.wrapper_unit_s.get(name, 0.0) * unit_groups / layers
    fixed = (cal.layer_overhead_s + wrapper) / 3
    return [
        2.0 * m * s.tokens / cal.flops_per_s + shared / layers + fixed for m in costs.layer_matmul
    ]


def _optimizer_s(cal: Calibration, params: float, tensors: int) -> float:
    """One optimizer step over ``params`` elements in ``tensors`` tensors (or pieces)."""
    return params * cal.optimizer_s_per_param + tensors * cal.optimizer_s_per_tensor


def _zero_pieces(s: StepSetup, members: List[List[int]], buckets: List[int]) -> int:
    """ZeRO-1/2: the most tensor pieces one rank updates. A bucket's flat buffer (its tensors
    back to back, padded to ``N``) is cut in ``N`` equal ranges; a tensor crossing a cut is a
    piece on each side."""
    n = s.world_size
    pieces = [0] * n
    for tensors, padded in zip(members, buckets):
        share, start = padded // n, 0
        for t in tensors:
            end = start + s.costs.tensors[t]
            if end > start:
                for rank in range(start // share, (end - 1) // share + 1):
                    pieces[rank] += 1
            start = end
    return max(pieces)


def _backward_seconds(s: StepSetup, fwd: List[float]) -> List[float]:
    """Backward seconds per layer ([Note: strategy schedules]): twice the forward for trained
    parameters, once for frozen ones, plus the forward again under gradient checkpointing."""
    costs, out = s.costs, []
    for layer, t in zip(costs.layers, fwd):
        numel = sum(costs.tensors[i] for i in layer)
        frozen = sum(costs.tensors[i] for i in layer if i in costs.frozen)
        out.append(t * (2 - (frozen / numel if numel else 0.0) + s.grad_ckpt))
    return out


def _compute(tl: Timeline, fwd: List[float], s: StepSetup) -> None:
    """Plain forward and backward, no communication."""
    for t in fwd:
        tl.add("compute", t)
    for t in reversed(_backward_seconds(s, fwd)):
        tl.add("compute", t)


def _bucket_members(s: StepSetup) -> List[List[int]]:
    """Tensor indices of each gradient bucket, in backward (launch) order: reverse parameter
    order, a new bucket when the next tensor would pass the cap ([Note: gradient bucket
    layout])."""
    cap = BUCKET_CAP_BYTES // s.param_bytes
    out: List[List[int]] = []
    filled = 0
    for i in reversed(s.costs.trainable):  # a frozen tensor has no gradient to reduce
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
    comms = _Collectives(cal)
    fwd = _layer_seconds(s, ("ddp", "zero1", "zero2")[zero_stage])
    bwd = _backward_seconds(s, fwd)
    gloo = cal.backend == "gloo"
    members = _bucket_members(s)
    if zero_stage == 0:  # DDP: one flag element per parameter rides in its bucket
        buckets = [sum(s.costs.tensors[t] for t in m) + len(m) for m in members]
    else:
        buckets = [_ceil_to(sum(s.costs.tensors[t] for t in m), n) for m in members]
    for t in fwd:
        tl.add("compute", t)
    pairs = gloo and n == 2  # a reduce-scatter is a send and a receive there
    kind = "reduce_scatter" if zero_stage and (pairs or not gloo) else "all_reduce"
    # ZeRO-2 frees a staging buffer, ZeRO-1 on pairs a receive buffer, per finished reduction
    one_in_flight = zero_stage == 2 or (zero_stage == 1 and pairs)
    remaining = [set(m) for m in members]
    launched: List[int] = []
    layers = s.costs.layers
    for i in reversed(range(len(layers))):  # backward; hooks launch complete buckets in order
        tl.add("compute", bwd[i], label=f"bwd {i}")
        if i > 0:  # a tied tensor is complete after its first (in forward order) layer
            done = {t for t in layers[i] if all(t not in layers[j] for j in range(i))}
        else:
            done = set(layers[0])
        for rest in remaining:
            rest -= done
        while len(launched) < len(buckets) and not remaining[len(launched)]:
            if one_in_flight and launched:
                tl.wait([launched[-1]])  # one reduction in flight: the next launch waits
            seconds = comms.seconds(kind, buckets[len(launched)] * s.param_bytes, n)
            launched.append(tl.add("comm", seconds, label=f"reduce bucket {len(launched)}"))
    tl.wait(launched)
    if zero_stage:  # which tensors had a gradient: a flag each ([Note: ZeRO gradient stores])
        flags = FLAG_DTYPE.itemsize * len(s.costs.trainable)
        tl.wait([tl.add("comm", comms.seconds("all_reduce", flags, n))])
    if zero_stage == 0:
        optimizer = _optimizer_s(cal, s.costs.num_trainable, len(s.costs.trainable))
    else:
        optimizer = _optimizer_s(cal, s.costs.num_trainable / n, _zero_pieces(s, members, buckets))
    tl.add("compute", optimizer, label="optimizer")
    if zero_stage:
        gathers = []
        for numel in buckets:
            if gloo:  # one broadcast per owner ([Note: ZeRO collectives on gloo])
                for _ in range(n):
                    seconds = comms.seconds("broadcast", numel // n * s.param_bytes, n)
                    gathers.append(tl.add("comm", seconds))
            else:
                seconds = comms.seconds("all_gather", numel * s.param_bytes, n)
                gathers.append(tl.add("comm", seconds))
        tl.wait(gathers)
    transient = 0
    if zero_stage == 2 and n > 1:  # staging: the bucket reduced and the one filling, except a
        # bucket of one unpadded tensor, which stages in its own gradient (one rank: the shard)
        staged = [b for m, b in zip(members, buckets) if s.costs.tensors[m[0]] != b]
        transient = sum(sorted(staged)[-2:]) * s.param_bytes
    if zero_stage == 1 and pairs:  # a chunk received apart for the launched reduction and the
        # one before it, which is finished right after the launch
        pairs_of_chunks = [a + b for a, b in zip(buckets, buckets[1:])] or buckets
        transient = max(pairs_of_chunks) // n * s.param_bytes
    return _planned(tl, comms, transient)


def _unit_schedule(s: StepSetup, strategy: str) -> StepPlan:
    """ZeRO-3 and FSDP / HSDP with ``unit="auto"``: per unit, unshard before its first layer
    (prefetching ahead), the root kept from forward to backward, one reduction per unit group
    after its last backward layer, ``IN_FLIGHT`` reductions in flight ([Note: strategy
    schedules])."""
    cal, tl, costs = s.calibration, Timeline(comm_channels=s.calibration.comm_channels), s.costs
    comms = _Collectives(cal)
    group = "shard" if strategy == "hsdp" else "world"
    zero3 = strategy == "zero3"
    n = s.world_size if zero3 else s.world_size // s.replicas
    prefetch = ZERO3_PREFETCH if zero3 else FSDP_PREFETCH
    units = min(len(costs.units), len(costs.layers))
    if n == 1 and zero3:  # one rank: nothing to broadcast or reduce
        fwd = _layer_seconds(s, strategy, units)
        _compute(tl, fwd, s)
        optimizer = _optimizer_s(cal, costs.num_params, len(costs.tensors))
        tl.add("compute", optimizer, label="optimizer")
        return _planned(tl, comms, 0)
    unit_of: Dict[int, int] = {t: u for u, unit in enumerate(costs.units) for t in unit}
    layer_unit = [unit_of[layer[0]] for layer in costs.layers]
    trainable = set(costs.trainable)  # the others are gathered, not reduced nor stepped
    if zero3:  # whole tensors; one collective per owner of the unit's tensors
        owner = costs.zero3_owners(n)

        def per_owner(tensors: List[int]) -> List[int]:
            by_owner: Dict[int, int] = {}
            for t in tensors:
                by_owner[owner[t]] = by_owner.get(owner[t], 0) + costs.tensors[t]
            return [by_owner[r] for r in sorted(by_owner)]

        parts = [per_owner(unit) for unit in costs.units]
        grad_parts = [per_owner([t for t in unit if t in trainable]) for unit in costs.units]
        optimizer = max(
            _optimizer_s(cal, sum(costs.tensors[t] for t in o), len(o))
            for o in costs.zero3_owned(n, trainable_only=True, owner=owner)
        )
    else:  # dim-0 shards, rows padded to a multiple of n; one collective per unit

        def padded(tensors: List[int]) -> List[int]:
            numel = sum(costs.padded_numel(t, n) for t in tensors)
            return [numel] if numel else []

        parts = [padded(unit) for unit in costs.units]
        grad_parts = [padded([t for t in unit if t in trainable]) for unit in costs.units]
        optimizer = _optimizer_s(cal, costs.num_trainable / n, len(trainable))
    numel = [sum(p) for p in parts]
    grad_numel = [sum(p) for p in grad_parts]
    # A wrapper cost per unit; ZeRO-3's per owner of a unit's tensors (a buffer, a broadcast
    # and a reduction for each).
    fwd = _layer_seconds(s, strategy, sum(map(len, parts)) if zero3 else units)
    bwd = _backward_seconds(s, fwd)
    unshard_kind = "broadcast" if zero3 else "all_gather"
    reduce_kind = "reduce" if zero3 else "reduce_scatter"

    def unshard(u: int, start_of: Optional[int]) -> int:
        op = 0
        for part in parts[u]:
            seconds = comms.seconds(unshard_kind, part * s.param_bytes, n, group)
            op = tl.add("comm", seconds, issue_at_start_of=start_of, label=f"unshard unit {u}")
        return op

    order = list(range(len(costs.layers)))
    units_fwd = list(dict.fromkeys(layer_unit[i] for i in order))
    units_bwd = list(dict.fromkeys(layer_unit[i] for i in reversed(order)))
    last_bwd_layer = {u: min(i for i in order if layer_unit[i] == u) for u in units_bwd}
    full: Dict[int, int] = {}
    current = None
    for i in order:  # forward: unshard a unit at its first layer, prefetch the next ones
        u = layer_unit[i]
        position = units_fwd.index(u)
        for ahead in units_fwd[position : position + prefetch + 1]:
            if ahead not in full:
                full[ahead] = unshard(ahead, current)
        current = tl.add("compute", fwd[i], [full[u]])
    kept = {units_bwd[0]: full[units_bwd[0]]}  # the first unit of the backward stays full
    full, reductions, current = kept, [], None
    for i in reversed(order):
        u = layer_unit[i]
        position = units_bwd.index(u)
        for ahead in units_bwd[position : position + prefetch + 1]:
            if ahead not in full:
                full[ahead] = unshard(ahead, current)
        current = tl.add("compute", bwd[i], [full[u]])
        if last_bwd_layer[u] != i:
            continue
        for part in grad_parts[u]:  # the unit's gradients, one reduction per group
            if len(reductions) >= IN_FLIGHT:
                tl.wait([reductions[-IN_FLIGHT]])
            seconds = comms.seconds(reduce_kind, part * s.param_bytes, n, group)
            if s.replicas > 1:  # then across the replica groups, over the inter-node link
                seconds += comms.seconds(
                    "all_reduce",
                    grad_numel[u] // n * s.param_bytes,
                    s.replicas,
                    INTER_GROUP,
                    inter_node=True,
                )
            reductions.append(tl.add("comm", seconds, label=f"reduce unit {u}"))
    tl.wait(reductions)
    if n > 1:  # the ranks agree on overflow ([Note: agreeing on overflow])
        flag = comms.seconds("all_reduce", AGREEMENT_BYTES, n, group)
        tl.wait([tl.add("comm", flag, label="overflow flag")])
    tl.add("compute", optimizer, label="optimizer")  # the busiest rank's, for ZeRO-3
    # Transient bytes: the root (full for the whole step) and the unit computing with the
    # prefetched ones; the gradient sum being filled and IN_FLIGHT reductions' inputs.
    root, blocks = numel[units_bwd[0]], sorted(numel[u] for u in units_bwd[1:]) or [0]
    unsharded = root + sum(blocks[-(prefetch + 1) :])
    first = units_fwd[0]
    if not zero3 and len(costs.units[first]) > 1:
        # FSDP copies a unit of several tensors out of its all-gather's output, both alive for
        # a moment: at the forward's start, the first unit twice and the next ones prefetched.
        ahead = sum(numel[u] for u in units_fwd[1 : 1 + prefetch])
        unsharded = max(unsharded, 2 * numel[first] + ahead)
    unsharded *= s.param_bytes
    reducing = sum(sorted(grad_numel)[-(IN_FLIGHT + 1) :]) * s.param_bytes
    return _planned(tl, comms, unsharded + reducing, unsharded)


def plain_step_seconds(s: StepSetup) -> float:
    """One rank's step with no wrapper and no communication: forward, backward, the optimizer
    over every tensor."""
    tl = Timeline()
    _compute(tl, _layer_seconds(s, "plain"), s)
    return tl.seconds + _optimizer_s(s.calibration, s.costs.num_params, len(s.costs.tensors))


def plan_step(strategy: str, s: StepSetup) -> StepPlan:
    """The step of ``strategy`` ([Note: strategy schedules])."""
    if strategy in ("ddp", "zero1", "zero2"):
        return _bucketed(s, {"ddp": 0, "zero1": 1, "zero2": 2}[strategy])
    if strategy in ("zero3", "fsdp", "hsdp"):
        return _unit_schedule(s, strategy)
    raise ValueError(f"unknown strategy {strategy!r}")
