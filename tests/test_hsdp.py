"""Specification of HSDP, ``FSDP(model, mesh=2-D mesh)`` ([Note: hybrid sharding]), on 4 gloo ranks.

A (replicas, shard_size) mesh shards within each row and replicates across rows; every layout of
4 ranks is checked: 2 x 2, 4 x 1 (DDP-like: no sharding) and 1 x 4 (plain FSDP). Oracles: one
device with ``torch.optim``, PyTorch DDP + ``torch.optim``, FSDP2's own HSDP
(``fully_shard(mesh=2-D mesh)``), and the byte formula of the communication ledger. Many checks
share each ``run_distributed`` call, on one 4-rank pool (the checkpoint test also loads on 2
ranks). The two-node torchrun run is in ``tests/test_examples.py``.
"""

import copy
import os
from collections import Counter
from typing import Dict, List, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.build import adamw, build, sgd
from tests.harness import run_distributed
from tests.parity import (
    LOSS_ATOL,
    PARAM_ATOL,
    global_batch,
    lm_loss,
    local_slice,
    make_model,
    mean_over_ranks,
)
from tiny_fsdp.checkpoint import full_checkpoint_file, load_checkpoint, save_checkpoint
from tiny_fsdp.core import comm
from tiny_fsdp.core.fsdp import FSDP, FSDPSGD, FSDPAdamW, hsdp_mesh, shard_info
from tiny_fsdp.core.overflow import AGREEMENT_BYTES
from tiny_fsdp.core.precision import MixedPrecisionPolicy
from tiny_fsdp.core.reductions import PendingReductions
from tiny_fsdp.models.gpt2 import GPT2Model, GPTConfig
from tiny_fsdp.plan import gpt2_costs, load_calibration, plan
from tiny_fsdp.core.streams import CommStreams

WORLD = 4
LAYOUTS = [(2, 2), (4, 1), (1, 4)]  # (replicas, shard_size)
OPTIMIZERS = {
    "sgd": sgd(lr=0.05, momentum=0.9, weight_decay=0.01),
    "adamw": adamw(lr=1e-3, weight_decay=0.1),
}
STEPS = 3
_MESHES: Dict[Tuple[int, int], object] = {}  # per worker process: groups are made once


def _mesh(layout: Tuple[int, int]) -> object:
    if layout not in _MESHES:
        _MESHES[layout] = hsdp_mesh(layout[0], node_local=False)
    return _MESHES[layout]


def _hsdp(model: nn.Module, layout: Tuple[int, int], optim: str, **kw) -> Tuple[FSDP, object]:
    wrapped = FSDP(model, mesh=_mesh(layout), **kw)
    cls = FSDPSGD if OPTIMIZERS[optim].kind == "sgd" else FSDPAdamW
    return wrapped, cls(wrapped.named_parameters(), **OPTIMIZERS[optim].hyper)


class OddNet(nn.Module):
    """Weights 11x15, 7x15, 7, 17x7, 13x17, 3x13: no row count divides 2 or 4 evenly."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 15)
        self.up = nn.Linear(15, 7)
        self.norm = nn.LayerNorm(7)
        self.wide = nn.Linear(7, 17)
        self.mid = nn.Linear(17, 13)
        self.head = nn.Linear(13, 3)  # 3 rows over 4 ranks: one shard is all padding

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.up(self.emb(idx)))
        return self.head(torch.tanh(self.mid(F.gelu(self.wide(x)))))  # (B, T, 3)


def _odd_batch(step: int) -> Tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    x = torch.randint(11, (2 * WORLD, 5), generator=gen)
    return x, torch.randint(3, (2 * WORLD, 5), generator=gen)


# ----------------------------------------------------------------------- parity


def _parity(rank: int, world_size: int) -> Dict[str, float]:
    """Every layout x optimizer on OddNet against one device and against PyTorch DDP; the 2 x 2
    layout with async communication on and off (which must agree bitwise)."""
    worst: Dict[str, float] = {"single": 0.0, "ddp": 0.0, "grad": 0.0}
    cases = [(layout, optim, True) for layout in LAYOUTS for optim in OPTIMIZERS]
    cases += [((2, 2), "sgd", False)]
    finals: Dict[Tuple, Dict[str, torch.Tensor]] = {}
    for layout, optim, async_on in cases:
        torch.manual_seed(1)
        reference = OddNet()
        ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(reference))
        model, opt = _hsdp(
            copy.deepcopy(reference),
            layout,
            optim,
            unit="layer",
            enable_async_communication=async_on,
        )
        ref_opt = OPTIMIZERS[optim].reference(reference.parameters())
        ddp_opt = OPTIMIZERS[optim].reference(ddp.parameters())
        for step in range(STEPS):
            x, y = _odd_batch(step)
            xs, ys = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
            ref_loss = lm_loss(reference(x), y)
            ref_loss.backward()
            lm_loss(ddp(xs), ys).backward()
            loss = lm_loss(model(xs), ys)
            loss.backward()
            # Gradients before the step (Adam would hide a wrong divisor): each shard's real
            # rows are the single-device gradient's rows.
            ref_grads = dict(reference.named_parameters())
            for name, param in model.module.named_parameters():
                info = shard_info(param)
                if info.valid_rows == 0:
                    continue
                start = info.rank * info.shard_rows
                expected = ref_grads[name].grad[start : start + info.valid_rows]
                diff = (param.grad[: info.valid_rows] - expected).abs().max().item()
                worst["grad"] = max(worst["grad"], diff)
            for o in (ref_opt, ddp_opt, opt):
                o.step()
                o.zero_grad()
            assert abs(mean_over_ranks(loss) - ref_loss.item()) <= LOSS_ATOL, (layout, optim)
        full = model.state_dict()
        finals[layout, optim, async_on] = full
        for name, value in reference.state_dict().items():
            worst["single"] = max(worst["single"], (full[name] - value).abs().max().item())
        for name, value in ddp.module.state_dict().items():
            worst["ddp"] = max(worst["ddp"], (full[name] - value).abs().max().item())
        for param in model.parameters():  # padding rows stay zero on every replica
            assert (param.detach()[shard_info(param).valid_rows :] == 0).all()
    on, off = finals[(2, 2), "sgd", True], finals[(2, 2), "sgd", False]
    assert all(torch.equal(on[k], off[k]) for k in on), "async on / off differ"
    return worst


def test_every_layout_matches_single_device_and_pytorch_ddp() -> None:
    for worst in run_distributed(_parity, WORLD):
        # Same per-rank gradients summed in another order than one device / DDP: the parity
        # tolerances of tests/parity.py apply (float32 rounding, amplified by Adam).
        assert worst["single"] <= PARAM_ATOL and worst["ddp"] <= PARAM_ATOL, worst
        assert worst["grad"] <= 1e-6, worst  # one backward: float32 rounding only


def _features(rank: int, world_size: int) -> Dict[str, float]:
    """gpt2_tiny on 2 x 2 with its tied wte / lm_head, a frozen wpe, gradient checkpointing,
    two no_sync micro-batches per step and clipping, against one device, and a copy of it;
    then 1 x 4 against plain FSDP (bitwise), and bf16 mixed precision against plain FSDP."""
    out: Dict[str, float] = {}
    reference = make_model(0)
    reference.transformer.wpe.weight.requires_grad_(False)
    model, opt = _hsdp(copy.deepcopy(reference), (2, 2), "adamw")
    model.gradient_checkpointing = True
    ref_opt = OPTIMIZERS["adamw"].reference([p for p in reference.parameters() if p.requires_grad])
    vocab = reference.config.vocab_size
    worst_norm = 0.0
    for step in range(STEPS):
        micro = [global_batch(2 * step + m, 2 * world_size, 8, vocab) for m in range(2)]
        ref_loss = sum(lm_loss(reference(x), y) for x, y in micro) / 2
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        for m, (x, y) in enumerate(micro):
            xs, ys = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
            if m == 0:
                with model.no_sync():
                    (lm_loss(model(xs), ys) / 2).backward()
            else:
                (lm_loss(model(xs), ys) / 2).backward()
        # torch's function too ([Note: clipping with torch's function]); max_norm=inf: no scaling
        by_torch = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
        norm = opt.clip_grad_norm_(0.5)  # counted once: squares summed in the shard group only
        for got in (norm, by_torch):
            worst_norm = max(worst_norm, abs(got.item() - ref_norm.item()) / ref_norm.item())
        opt.step()
        opt.zero_grad()
    full = model.state_dict()
    out["single"] = max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    out["norm"] = worst_norm
    assert torch.equal(full["lm_head.weight"], full["transformer.wte.weight"])
    wpe = [p for n, p in model.module.named_parameters() if n.endswith("wpe.weight")][0]
    assert wpe.grad is None and len(opt.state[wpe]) == 0  # frozen: no gradient, no state
    # A copy (an EMA model, a teacher) runs on the same groups ([Note: copying a wrapped model]).
    x = local_slice(global_batch(0, 2 * world_size, 8, vocab)[0], rank, world_size)
    with torch.no_grad():
        out["copy"] = (copy.deepcopy(model)(x) - model(x)).abs().max().item()

    # 1 x 4 is plain FSDP over all ranks, collective for collective: bitwise the same.
    runs = {}
    for name, mesh in (("hsdp_1x4", _mesh((1, 4))), ("fsdp", None)):
        m = FSDP(make_model(0), mesh=mesh)
        o = FSDPAdamW(m.named_parameters(), **OPTIMIZERS["adamw"].hyper)
        for step in range(2):
            x, y = global_batch(step, 2 * world_size, 8, vocab)
            lm_loss(
                m(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)
            ).backward()
            o.step()
            o.zero_grad()
        runs[name] = m.state_dict()
    assert all(torch.equal(runs["fsdp"][k], runs["hsdp_1x4"][k]) for k in runs["fsdp"])

    # bf16 compute and gathers, fp32 reduction: HSDP 2 x 2 and FSDP see the same bf16 numbers
    # and reduce in fp32 in another order, so they differ by float32 rounding amplified by the
    # bf16 recasts of parameters that moved by it (measured ~1e-6; bound 1e-4).
    policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32)
    losses: Dict[str, List[float]] = {}
    for name, mesh in (("hsdp", _mesh((2, 2))), ("fsdp", None)):
        m = FSDP(make_model(0), mesh=mesh, mixed_precision=policy)
        o = FSDPAdamW(m.named_parameters(), **OPTIMIZERS["adamw"].hyper)
        losses[name] = []
        for step in range(2):
            x, y = global_batch(step, 2 * world_size, 8, vocab)
            loss = lm_loss(m(local_slice(x, rank, world_size)), local_slice(y, rank, world_size))
            loss.backward()
            assert all(p.grad.dtype == torch.float32 for p in m.parameters())
            o.step()
            o.zero_grad()
            losses[name].append(mean_over_ranks(loss))
    out["bf16"] = max(abs(a - b) for a, b in zip(losses["hsdp"], losses["fsdp"]))
    return out


def test_tied_frozen_checkpointing_no_sync_clipping_and_mixed_precision() -> None:
    for out in run_distributed(_features, WORLD):
        assert out["single"] <= PARAM_ATOL, out  # as tests/parity.py
        assert out["norm"] <= 1e-5, out  # a norm counted twice would be sqrt(2) too large
        assert out["bf16"] <= 1e-4, out
        assert out["copy"] == 0.0, out


# ----------------------------------------------------------------------- FSDP2's HSDP


def _fsdp2(rank: int, world_size: int) -> float:
    from torch.distributed.fsdp import fully_shard

    reference = make_model(0)
    theirs = copy.deepcopy(reference)
    mesh = _mesh((2, 2))
    for block in theirs.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(theirs, mesh=mesh)
    their_opt = OPTIMIZERS["adamw"].reference(theirs.parameters())
    blocks = copy.deepcopy(reference)
    ours, opt = _hsdp(blocks, (2, 2), "adamw", unit=list(blocks.transformer.h))
    for step in range(STEPS):
        x, y = global_batch(step, 2 * world_size, 8, reference.config.vocab_size)
        x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
        losses = []
        for model, o in ((theirs, their_opt), (ours, opt)):
            loss = lm_loss(model(x), y)
            loss.backward()
            o.step()
            o.zero_grad()
            losses.append(mean_over_ranks(loss))
        assert abs(losses[0] - losses[1]) <= LOSS_ATOL, (step, losses)
    full = ours.state_dict()
    return max(
        (full[k] - v.full_tensor()).abs().max().item() for k, v in theirs.state_dict().items()
    )


def test_matches_pytorch_fsdp2_hybrid_sharding() -> None:
    # Same layout and units as FSDP2; per-rank gradients summed in another order: parity tolerance.
    assert max(run_distributed(_fsdp2, WORLD)) <= PARAM_ATOL


# ----------------------------------------------------------------------- two-stage reductions


class _Work:
    """A fake collective: done when the test says so, or when waited for."""

    def __init__(self, log: List[str], name: str) -> None:
        self.log, self.name, self.done = log, name, False
        log.append(f"issue {name}")

    def is_completed(self) -> bool:
        return self.done

    def wait(self) -> None:
        if not self.done:
            self.log.append(f"wait {self.name}")
        self.done = True


def _two_stage_run(streams: CommStreams) -> Tuple[List[str], torch.Tensor]:
    """Four two-stage reductions (A_i then B_i); A1 finishes before A0, then A0."""
    log: List[str] = []
    works: Dict[str, _Work] = {}
    param = nn.Parameter(torch.zeros(2))
    reductions = PendingReductions(streams, in_flight_limit=4)

    def stage(name: str):
        def launch(async_op: bool) -> _Work:
            works[name] = _Work(log, name)
            return works[name]

        return launch

    class Backward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
            for i in range(4):
                if i == 2:
                    works["A1"].done = True  # A0 still running: B1 must wait for B0
                if i == 3:
                    works["A0"].done = True
                log.append(f"launch {i}")
                part = torch.full((2,), float(i))
                reductions.launch(
                    stage(f"A{i}"), [part], [(param, part)], async_op=True, then=stage(f"B{i}")
                )
            return grad

    Backward.apply(torch.ones(2, requires_grad=True)).sum().backward()
    return log, param.grad


def test_second_stage_starts_after_the_first_and_in_issue_order() -> None:
    """[Note: asynchronous reduction]'s two-stage reductions, with fake works on one process."""
    log, grad = _two_stage_run(CommStreams())
    issued_b = [line for line in log if line.startswith("issue B")]
    assert issued_b == ["issue B0", "issue B1", "issue B2", "issue B3"]
    for i in range(4):  # never before its own first stage is done
        assert log.index(f"issue B{i}") > log.index(f"issue A{i}")
    assert log.index("issue B1") > log.index("launch 3")  # A1 done early, but B0 goes first
    a3 = log.index("issue A3")  # the launch after A0 finished starts B0 and B1, then stops at A2
    assert log[a3 + 1 : a3 + 3] == ["issue B0", "issue B1"] and "issue B2" not in log[: a3 + 3]
    assert torch.equal(grad, torch.full((2,), 6.0))  # parts 0 + 1 + 2 + 3, delivered at the end

    class StreamOrdered(CommStreams):  # CUDA: both stages at once, ordered by the stream
        uses_streams = True

    log, grad = _two_stage_run(StreamOrdered())
    for i in range(4):
        a, b = log.index(f"issue A{i}"), log.index(f"issue B{i}")
        assert log[a + 1 : b + 1] == [f"wait A{i}", f"issue B{i}"]  # the caller waits, then B
    assert torch.equal(grad, torch.full((2,), 6.0))


# ----------------------------------------------------------------------- ledger


def _ledger(rank: int, world_size: int) -> List[Tuple]:
    """One step per layout; the ledger's per-group bytes and calls against the formula."""
    for replicas, shard in LAYOUTS:
        torch.manual_seed(0)
        model, opt = _hsdp(
            OddNet(), (replicas, shard), "sgd", unit="layer", reshard_after_forward=False
        )
        x, y = _odd_batch(0)
        comm.LEDGER.reset()
        lm_loss(
            model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)
        ).backward()
        got = dict(comm.LEDGER.group_payload_bytes), dict(comm.LEDGER.group_calls)
        ledger_total = dict(comm.LEDGER.payload_bytes)
        opt.step()
        # Formula: every parameter is all-gathered once (padded: shard_size * shard rows) in
        # forward (its unit stays full until backward), its gradient reduce-scattered once from
        # the same padded size, and the reduced shard (1 / shard_size of it) all-reduced across
        # the replicas. fp32: 4 bytes an element. 6 layers: one collective each.
        padded = sum(shard * shard_info(p).shard_numel * 4 for p in model.parameters())
        expected_bytes = {("shard", "all_gather"): padded, ("shard", "reduce_scatter"): padded}
        expected_calls = {("shard", "all_gather"): 6, ("shard", "reduce_scatter"): 6}
        if replicas > 1:
            expected_bytes["replicate", "all_reduce"] = padded // shard
            expected_calls["replicate", "all_reduce"] = 6
        if shard > 1:  # one flag: [Note: agreeing on overflow]
            expected_bytes["shard", "all_reduce"] = AGREEMENT_BYTES
            expected_calls["shard", "all_reduce"] = 1
        assert got == (expected_bytes, expected_calls), (replicas, shard, got)
        # Nothing else travelled: the totals are the labelled collectives.
        totals = Counter()
        for (_, kind), n in expected_bytes.items():
            totals[kind] += n
        assert ledger_total == dict(totals)
        traffic = comm.LEDGER.group_traffic_bytes("replicate", replicas)
        assert traffic.get("all_reduce", 0.0) == 2 * (replicas - 1) / replicas * (padded // shard)
    _planned_bytes(rank, world_size)
    # Without a mesh nothing is labelled.
    plain = FSDP(OddNet(), unit="layer")
    comm.LEDGER.reset()
    x, y = _odd_batch(0)
    lm_loss(plain(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()
    assert not comm.LEDGER.group_payload_bytes and comm.LEDGER.payload_bytes["all_gather"] > 0
    return []


def _planned_bytes(rank: int, world_size: int) -> None:
    """The planner's intra-group and inter-group bytes for ``--hsdp R`` ([Note: what the
    planner predicts]) against the ledger: a GPT-2 with odd row counts, default arguments (block
    units, resharded after forward), the second step of each layout; and of 2 x 2 under
    ``--precision bf16``, whose reductions, in the group and across, carry bf16."""
    config = GPTConfig(block_size=8, vocab_size=97, n_layer=2, n_head=3, n_embd=18)
    costs = gpt2_costs(config)
    for replicas, shard, precision in [*(layout + ("fp32",) for layout in LAYOUTS), (2, 2, "bf16")]:
        torch.manual_seed(0)
        policy = MixedPrecisionPolicy.from_name(precision)
        model, opt = _hsdp(GPT2Model(config), (replicas, shard), "adamw", mixed_precision=policy)
        x = torch.randint(97, (2, 8), generator=torch.Generator().manual_seed(rank))
        for _ in range(2):
            comm.LEDGER.reset()
            F.cross_entropy(model(x).reshape(-1, 97), x.reshape(-1)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        predicted = plan(costs, load_calibration("h100_sxm"), world_size, 2, 8,
                         precision=precision, hsdp_replicas=replicas)["hsdp"]  # fmt: skip
        where = (replicas, precision, rank)
        assert dict(comm.LEDGER.group_payload_bytes) == predicted.payload_bytes, where
        assert dict(comm.LEDGER.group_calls) == predicted.calls, where
        sent = {
            "intra": sum(comm.LEDGER.group_traffic_bytes("shard", shard).values()),
            "inter": sum(comm.LEDGER.group_traffic_bytes("replicate", replicas).values()),
        }
        assert predicted.sent_bytes == pytest.approx(sent, rel=1e-12)  # the ring model's sums
        # Across the groups travels each reduced shard: 1 / shard of what was reduce-scattered.
        scattered = predicted.payload_bytes["shard", "reduce_scatter"]
        assert predicted.inter_group_bytes == (scattered // shard if replicas > 1 else 0)


def test_ledger_counts_intra_and_inter_group_bytes_by_the_formula() -> None:
    """... and the planner predicts both."""
    run_distributed(_ledger, WORLD)


# ----------------------------------------------------------------------- bad meshes


def _bad_meshes(rank: int, world_size: int) -> List[str]:
    from torch.distributed.device_mesh import init_device_mesh

    errors = []

    def expect(fn, *args, **kw) -> None:
        try:
            fn(*args, **kw)
        except ValueError as e:
            errors.append(str(e))
        else:
            raise AssertionError(f"{fn.__name__}{args} {kw} did not raise")

    expect(hsdp_mesh, 3)  # 3 replica groups of 4 ranks
    os.environ["GROUP_RANK"] = str(rank // 2)  # two "nodes" of 2 ranks each
    try:
        expect(hsdp_mesh, 1, node_local=True)  # a shard group of 4 ranks spans both nodes
        os.environ["LOCAL_WORLD_SIZE"] = "2"
        default = hsdp_mesh()  # one replica group per node, node-local: accepted
        assert tuple(default.shape) == (2, 2) and default.mesh_dim_names == ("replicate", "shard")
        assert default.device_type == "cpu"  # the default group's device: gloo, the CPU
    finally:
        os.environ.pop("GROUP_RANK")
        os.environ.pop("LOCAL_WORLD_SIZE", None)
    expect(FSDP, OddNet(), mesh=init_device_mesh("cpu", (1, 2, 2)))  # 3-D
    named = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    expect(FSDP, OddNet(), mesh=named)  # which dim replicates is unknown
    return errors


def test_the_default_mesh_is_on_the_device_of_the_default_group(monkeypatch) -> None:
    """A user on GPUs who calls ``hsdp_mesh()`` gets a CUDA mesh, not a CPU one (NCCL moves
    CUDA tensors only); on gloo a CPU one (checked on 4 ranks above)."""
    from tiny_fsdp.core.utils import dist as dist_utils

    monkeypatch.setattr(dist_utils.dist, "get_backend", lambda group=None: "nccl")
    assert dist_utils.default_device_type() == "cuda"
    monkeypatch.setattr(dist_utils.dist, "get_backend", lambda group=None: "gloo")
    assert dist_utils.default_device_type() == "cpu"


def test_bad_meshes_raise_on_every_rank() -> None:
    results = run_distributed(_bad_meshes, WORLD)
    assert len(results) == WORLD and results[1:] == results[:-1]  # same errors everywhere
    divide, spans, three_d, names = results[0]
    assert "3 replica groups do not divide the world size 4" in divide
    assert "ranks 0..3 spans nodes ['0', '1']" in spans
    assert "1-D or 2-D DeviceMesh" in three_d
    assert "('replicate', 'shard')" in names and "('dp', 'tp')" in names


# ----------------------------------------------------------------------- checkpoints


def _train_and_save(rank: int, world_size: int, path: str, layout) -> None:
    """Two AdamW steps on OddNet; a sharded checkpoint at ``path`` and a full one next to it."""
    torch.manual_seed(1)
    if layout is None:
        model = FSDP(OddNet(), unit="layer")
        opt = FSDPAdamW(model.named_parameters(), **OPTIMIZERS["adamw"].hyper)
    else:
        model, opt = _hsdp(OddNet(), tuple(layout), "adamw", unit="layer")
    for step in range(2):
        x, y = _odd_batch(step)
        n = x.shape[0] // world_size  # any world size: 2 * WORLD rows split evenly
        lm_loss(model(x[rank * n : (rank + 1) * n]), y[rank * n : (rank + 1) * n]).backward()
        opt.step()
        opt.zero_grad()
    save_checkpoint(path, model, opt, step=2, sharded=True)
    save_checkpoint(path + "_full", model, opt, step=2)


def _load_and_resave(rank: int, world_size: int, src: str, dst: str, strategies) -> None:
    """Load ``src`` into fresh models of each strategy ("hsdp": 2 x 2, else ``tests/build``'s);
    save each at ``dst/<strategy>``, sharded, and next to it full."""
    for strategy in strategies:
        torch.manual_seed(5)  # other initial weights: the load must overwrite them all
        if strategy == "hsdp":
            model, opt = _hsdp(OddNet(), (2, 2), "adamw", unit="layer")
        else:
            kw = {"unit": "layer"} if strategy == "fsdp" else {}
            model, opt = build(strategy, OddNet(), OPTIMIZERS["adamw"], **kw)
        assert load_checkpoint(src, model, opt)["step"] == 2
        save_checkpoint(f"{dst}/{strategy}", model, opt, step=2, sharded=True)
        save_checkpoint(f"{dst}/{strategy}_full", model, opt, step=2)


def _full(path: str) -> Dict:
    return torch.load(full_checkpoint_file(path), weights_only=True)


def test_checkpoint_hsdp_to_fsdp_ddp_zero3_at_another_world_size_and_back(tmp_path) -> None:
    """2 x 2 HSDP saves; FSDP, DDP and ZeRO-3 on 2 ranks load it (and save); HSDP loads FSDP's
    back. Every full checkpoint written along the way equals the first one, bit for bit."""
    hsdp, two, back = str(tmp_path / "hsdp"), str(tmp_path / "two"), str(tmp_path / "back")
    run_distributed(_train_and_save, WORLD, hsdp, (2, 2))
    run_distributed(_load_and_resave, 2, hsdp, two, ["fsdp", "ddp", "zero3"])
    run_distributed(_load_and_resave, WORLD, f"{two}/fsdp", back, ["hsdp"])
    first = _full(hsdp + "_full")
    for other in ("two/fsdp", "two/ddp", "two/zero3", "back/hsdp"):
        other = _full(str(tmp_path / f"{other}_full"))
        assert first["model"].keys() == other["model"].keys()
        assert all(torch.equal(v, other["model"][k]) for k, v in first["model"].items())
        for name, state in first["optimizer"]["state"].items():
            for key, value in state.items():
                assert torch.equal(value, other["optimizer"]["state"][name][key]), (name, key)
