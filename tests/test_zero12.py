"""Specification of ZeRO-1 / ZeRO-2: replicated parameters, sharded optimizer state (and grads).

Distributed checks run in ``run_distributed`` workers (module-level ``_..._worker`` functions)
and loop over several configurations per call to keep the suite fast.
"""

import contextlib
import copy
import gc
from typing import Any, Dict, List, Set, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.build import adamw, build, sgd
from tests.harness import run_distributed
from tests.parity import PARAM_ATOL, check_parity, global_batch, lm_loss, local_slice, make_model
from tests.zoo import BranchyNet
from tiny_fsdp.core.comm import LEDGER
from tiny_fsdp.core.module import convert_module
from tiny_fsdp.core.zero import FlatLayout, StagedGradShard, Zero1AdamW, Zero2, Zero2SGD
from tiny_fsdp.core.zero.grad_stores import FLAG_DTYPE

WORLD_SIZES = [1, 2, 3, 4]  # 4: the one size where the byte test's ZeRO buffers need padding
TINY_BUCKET_MB = 0.002  # ~500 fp32 elements: gpt2_tiny (10062 parameters) makes ~20 buckets
SMALL_BUCKET_MB = 0.01  # ~2600 fp32 elements: ~5 buckets (fewer collectives on 2 cores)
# Adam turns the float32 rounding noise of gradients that are analytically ~zero (attention key
# biases) into updates of size ~lr; at lr=1e-3 torch's own DDP + AdamW stays within PARAM_ATOL
# of one device after 10 steps (measured 1.0e-5 at N=2), at lr=1e-2 it would not (1.8e-4).
ADAM_LR = 1e-3
# SGD, unlike Adam, is not invariant to the gradient's scale: it catches a wrong average.
OPTIMIZERS = {"adamw": adamw(lr=ADAM_LR, weight_decay=0.1), "sgd": sgd(lr=0.5, momentum=0.9)}
# (stage, optimizer, bucket_cap_mb, enable_async_communication) trained against one device.
PARITY_CASES = [
    (1, "adamw", SMALL_BUCKET_MB, False),
    (1, "sgd", TINY_BUCKET_MB, True),
    (2, "adamw", TINY_BUCKET_MB, True),
    (2, "sgd", SMALL_BUCKET_MB, False),
]


def _xy(step: int, rows: int) -> Tuple[torch.Tensor, torch.Tensor]:
    return global_batch(step, rows, seq_len=8, vocab=make_model().config.vocab_size)


def _train_step(model: nn.Module, optimizer: Any, x: torch.Tensor, y: torch.Tensor) -> float:
    loss = lm_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


# ---------------------------------------------------------------------------- layout (no dist)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("cap", [1, 7, 40, 10_000])
def test_layout_gives_every_element_exactly_one_owner(world_size: int, cap: int) -> None:
    shapes = [torch.Size(s) for s in [(5, 3), (1,), (7,), (2, 2, 3), (4, 4), (3,)]]
    layout = FlatLayout(shapes, world_size, cap)
    assert layout.numel == layout.shard_numel * world_size
    assert layout.padding() == layout.numel - sum(s.numel() for s in shapes)
    end = 0
    for b in layout.buckets:
        assert b.start == end and b.numel == b.chunk * world_size  # contiguous, padded to N
        end += b.numel
        members = [layout.slots[i] for i in b.slots]
        assert sum(s.numel for s in members) <= max(cap, members[0].numel)  # cap, or one param
        assert b.numel - sum(s.numel for s in members) < world_size  # minimal padding
    assert end == layout.numel
    owners: Dict[int, List[int]] = {i: [0] * s.numel() for i, s in enumerate(shapes)}
    for rank in range(world_size):
        shard_used = 0
        for piece in layout.pieces(rank):
            slot, bucket = layout.slots[piece.index], layout.buckets[piece.bucket]
            lo, hi = layout.chunk_range(piece.bucket, rank)
            assert lo <= piece.start and piece.start + piece.numel <= hi
            assert piece.start - slot.start == piece.param_start
            assert piece.shard_start == bucket.shard_start + piece.start - lo
            for k in range(piece.param_start, piece.param_start + piece.numel):
                owners[piece.index][k] += 1
            shard_used += piece.numel
        assert shard_used <= layout.shard_numel
    assert all(count == 1 for counts in owners.values() for count in counts)


# ---------------------------------------------------------------------------- parity


def _parity_worker(rank: int, world_size: int) -> List[float]:
    diffs = []
    for stage, opt, bucket_mb, async_comm in PARITY_CASES:
        result = check_parity(
            rank,
            world_size,
            lambda m: build(
                f"zero{stage}",
                m,
                OPTIMIZERS[opt],
                bucket_cap_mb=bucket_mb,
                enable_async_communication=async_comm,
            ),
            lambda m: OPTIMIZERS[opt].reference(m.parameters()),
            lambda m: m.state_dict(),
        )
        diffs.append(result.max_param_diff)
    return diffs


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_trains_like_one_device(world_size: int) -> None:
    """fp32, 10 steps, both stages, AdamW and SGD + momentum, odd parameter sizes."""
    run_distributed(_parity_worker, world_size)


def _torch_zero_worker(rank: int, world_size: int) -> None:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    for stage, opt in [(1, "adamw"), (2, "sgd"), (2, "adamw"), (1, "sgd")]:
        spec = OPTIMIZERS[opt]
        base = make_model(0)
        torch_model = DistributedDataParallel(copy.deepcopy(base))
        torch_opt = ZeroRedundancyOptimizer(
            torch_model.parameters(), optimizer_class=spec.reference_class, **spec.hyper
        )
        ours, our_opt = build(
            f"zero{stage}",
            base,
            spec,
            bucket_cap_mb=SMALL_BUCKET_MB,
            enable_async_communication=stage == 2,
        )
        what = f"stage {stage} {opt}"
        for step in range(5):
            x, y = (local_slice(t, rank, world_size) for t in _xy(step, 2 * world_size))
            expected = _train_step(torch_model, torch_opt, x, y)
            got = _train_step(ours, our_opt, x, y)
            # Same local batch and parameters: only the gradient averaging rounds differently.
            assert abs(got - expected) <= 1e-5, f"{what} step {step}: {got} vs {expected}"
        theirs = torch_model.module.state_dict()
        for name, value in ours.state_dict().items():
            diff = (value - theirs[name]).abs().max().item()
            assert diff <= PARAM_ATOL, f"{what}: {name} differs from torch by {diff:.2e}"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_trains_like_torch_zero_redundancy_optimizer(world_size: int) -> None:
    """Against torch DDP + ZeroRedundancyOptimizer(AdamW / SGD) on the same per-rank batches."""
    run_distributed(_torch_zero_worker, world_size)


def _variants_worker(rank: int, world_size: int) -> None:
    for stage in (1, 2):
        results = []
        # (enable_async_communication, gradient_checkpointing): same collectives on the same data,
        # and recomputation reproduces the activations exactly, so no bit may change.
        for async_comm, checkpointing in [(False, False), (True, False), (True, True)]:
            model, optimizer = build(
                f"zero{stage}",
                make_model(0),
                OPTIMIZERS["adamw"],
                bucket_cap_mb=TINY_BUCKET_MB,
                enable_async_communication=async_comm,
            )
            model.gradient_checkpointing = checkpointing
            for step in range(3):
                x, y = (local_slice(t, rank, world_size) for t in _xy(step, 2 * world_size))
                _train_step(model, optimizer, x, y)
            results.append(model.state_dict())
        for name, value in results[0].items():
            for other in results[1:]:
                assert torch.equal(value, other[name]), f"stage {stage}: {name}"


@pytest.mark.parametrize("world_size", [2, 3])
def test_async_communication_and_checkpointing_change_no_bit(world_size: int) -> None:
    run_distributed(_variants_worker, world_size)


# ---------------------------------------------------------------------------- bf16 precision path

BF16_LR = 1e-2
BF16_STEPS = 4


def _bf16_worker(rank: int, world_size: int, stage: int) -> Dict[str, float]:
    """ZeRO with bf16 params vs one process on the same precision path ([Note: ZeRO optimizer
    step]): bf16 forward/backward with the same layer math, each rank's gradient divided by N in
    bf16 and summed over ranks in bf16, fp32 master + torch AdamW, bf16 copy-back."""
    base = make_model(0).to(torch.bfloat16)
    reference = convert_module(copy.deepcopy(base))  # the same layer code, one process
    # fused=False: the foreach ops, bit for bit the reference's torch AdamW (foreach=False); the
    # precision path is what is tested here, the fused kernel in tests/test_optim.py.
    hyper = adamw(lr=BF16_LR, weight_decay=0.1, fused=False)
    model, optimizer = build(f"zero{stage}", base, hyper, bucket_cap_mb=SMALL_BUCKET_MB)
    ref_params = list(reference.parameters())
    masters = [p.detach().float().clone() for p in ref_params]
    ref_optimizer = torch.optim.AdamW(masters, lr=BF16_LR, weight_decay=0.1, foreach=False)
    for step in range(BF16_STEPS):
        x, y = _xy(step, 2 * world_size)
        loss = lm_loss(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = None
        for r in range(world_size):  # every rank's gradient, reduced as the collective does
            ref_loss = lm_loss(
                reference(local_slice(x, r, world_size)), local_slice(y, r, world_size)
            )
            ref_loss.backward()
            if r == rank and world_size <= 2:
                assert torch.equal(ref_loss, loss), f"step {step}: same bf16 params, same loss"
            shares = [p.grad / world_size for p in ref_params]
            total = shares if total is None else [t + s for t, s in zip(total, shares)]
            reference.zero_grad(set_to_none=True)
        for master, grad in zip(masters, total):
            master.grad = grad.float()
        ref_optimizer.step()
        with torch.no_grad():
            for p, master in zip(ref_params, masters):
                p.copy_(master)  # round to bf16, as the strategy writes back
    optimizer.consolidate_state_dict(to=0)
    state = optimizer.state_dict()["state"] if rank == 0 else None
    diffs: Dict[str, float] = {}
    for i, (name, p) in enumerate(model.module.named_parameters()):
        ref_p = ref_params[i]
        diffs[name] = (p.float() - ref_p.float()).abs().max().item()
        if world_size <= 2:
            assert torch.equal(p, ref_p), f"{name}: bf16 parameter not bit-exact"
            if state is not None:
                ref_state = ref_optimizer.state[masters[i]]
                assert torch.equal(state[i]["master"], masters[i]), f"{name}: fp32 master"
                for key in ("exp_avg", "exp_avg_sq", "step"):
                    assert torch.equal(state[i][key], ref_state[key]), f"{name}: {key}"
    return diffs


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_bf16_matches_same_precision_path(world_size: int, stage: int) -> None:
    """Bit-exact (torch.equal: bf16 params, fp32 masters, Adam moments) at N = 1 and 2.

    At N = 2 the reduced gradient is one bf16 addition of the two pre-divided shares, which is
    commutative, so the reference can reproduce it exactly. At N >= 3 the collective adds three
    or more shares in an order of its own (a ring), which rounds differently wherever the shares
    cancel; there we require the parameters to agree within the bf16 spacing of the values plus
    what a flipped Adam update can move (lr per step)."""
    diffs = run_distributed(_bf16_worker, world_size, stage)[0]
    if world_size > 2:
        worst = max(diffs.values())
        assert worst <= 2**-7 + BF16_LR * BF16_STEPS, f"{worst}"


# ---------------------------------------------------------------------------- bytes per rank


def _storages(*roots: Any) -> Dict[int, int]:
    """{storage address: bytes} of every tensor reachable from ``roots`` through modules,
    optimizers, containers and tiny_fsdp objects: what a rank holds through them."""
    found: Dict[int, int] = {}
    seen: Set[int] = set()
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or obj is None:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.numel() and obj.device.type != "meta":
                storage = obj.untyped_storage()
                found[storage.data_ptr()] = storage.nbytes()
        elif isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            stack.extend(obj)
        elif isinstance(obj, (nn.Module, torch.optim.Optimizer)) or type(obj).__module__.startswith(
            "tiny_fsdp"
        ):
            stack.extend(vars(obj).values())
    return found


def _held_bytes(model: nn.Module, optimizer: Any) -> Dict[str, int]:
    params = _storages(*[p.data for p in model.parameters() if p.requires_grad])
    wrapper = _storages(model, *[p.grad for p in model.parameters()])
    optim = _storages(optimizer)
    # The fp32 masters live in the wrapper, shared by its optimizers: optimizer state.
    masters = _storages(model.master_shard())
    grads = {k: v for k, v in wrapper.items() if k not in params and k not in masters}
    state = {k: v for k, v in optim.items() if k not in params and k not in grads}
    return {
        "params": sum(params.values()),
        "grads": sum(grads.values()),
        "optim": sum(state.values()),
    }


# Bytes per parameter: (replicated, divided by N) for params, grads, optimizer state incl. master.
# fp32 parameters are their own master (no copy); bf16 ones get an fp32 master shard.
EXPECTED_BYTES = {
    (1, torch.float32): {"params": (4, 0), "grads": (4, 0), "optim": (0, 8)},
    (2, torch.float32): {"params": (4, 0), "grads": (0, 4), "optim": (0, 8)},
    (1, torch.bfloat16): {"params": (2, 0), "grads": (2, 0), "optim": (0, 12)},
    (2, torch.bfloat16): {"params": (2, 0), "grads": (0, 2), "optim": (0, 12)},
}


def _bytes_worker(rank: int, world_size: int) -> List[Dict[str, Any]]:
    report = []
    configs = [(*key, False) for key in EXPECTED_BYTES] + [(2, torch.float32, True)]
    for stage, dtype, async_comm in configs:
        expected = EXPECTED_BYTES[stage, dtype]
        report.append(_check_bytes(rank, world_size, stage, dtype, expected, async_comm))
        gc.collect()  # the previous configuration's tensors must not linger in the next one
    return report


def _check_bytes(
    rank: int,
    world_size: int,
    stage: int,
    dtype: torch.dtype,
    expected: Dict[str, Any],
    async_comm: bool,
) -> Dict[str, Any]:
    model, optimizer = build(
        f"zero{stage}",
        make_model(0).to(dtype),
        adamw(lr=ADAM_LR),
        bucket_cap_mb=TINY_BUCKET_MB / 2,
        enable_async_communication=async_comm,
    )
    n_params = sum(p.numel() for p in model.parameters())  # tied weight once
    padding = model.layout.padding()
    params = _storages(*[p.data for p in model.parameters()])
    masters = _storages(model.master_shard())  # optimizer state, kept by the wrapper
    peak = [0]

    def after_our_hook(param: nn.Parameter) -> None:  # registered later: runs after ours
        assert param.grad is None, "ZeRO-2 must release param.grad"
        held = _storages(model, *[p.grad for p in model.parameters()])
        peak[0] = max(peak[0], sum(v for k, v in held.items() if k not in {**params, **masters}))

    if stage == 2:
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(after_our_hook)
    LEDGER.reset()
    x, y = (local_slice(t, rank, world_size) for t in _xy(0, 2 * world_size))
    lm_loss(model(x), y).backward()
    optimizer.step()  # creates the Adam state
    held = _held_bytes(model, optimizer)
    what = f"rank {rank} stage {stage} {dtype} async={async_comm}"
    for kind, (replicated, sharded) in expected.items():
        formula = replicated * n_params + sharded * n_params / world_size
        # Padding: each bucket is padded by < N elements, and a rank's share of the elements
        # can differ from P / N by at most the padding.
        slack = (replicated + sharded) * padding
        if kind == "optim":  # plus AdamW's 0-d fp32 step counter per owned piece
            slack += 4 * len(list(model.parameters()))
        assert abs(held[kind] - formula) <= slack, f"{what}: {kind} {held[kind]} vs {formula}"
    # The padded gradient buffer is reduced once and the parameter buffer gathered once, by
    # reduce-scatter / all-gather; on gloo by broadcasts, and all-reduce but on 2 ranks
    # ([Note: ZeRO collectives on gloo]); besides, one int32 flag per parameter is all-reduced
    # (who had a gradient, [Note: ZeRO gradient stores]); nothing else is sent.
    flat_bytes = model.layout.numel * dtype.itemsize
    flag_bytes = FLAG_DTYPE.itemsize * len(model.params)
    gloo = dist.get_backend() == "gloo"
    if gloo and world_size != 2:
        expected_payload = {"all_reduce": flat_bytes + flag_bytes, "broadcast": flat_bytes}
    else:
        expected_payload = {
            "reduce_scatter": flat_bytes,
            "broadcast" if gloo else "all_gather": flat_bytes,
            "all_reduce": flag_bytes,
        }
    assert dict(LEDGER.payload_bytes) == expected_payload, what
    if stage == 2:
        # Buckets are freed as they are reduced: at most the bucket being filled and the tied
        # embedding's bucket (its gradient is ready last) are alive besides the shard, plus,
        # with asynchronous communication, the reductions still in flight (max_in_flight).
        in_flight = type(model).grad_store.max_in_flight if async_comm else 0
        bucket_bytes = max(b.numel for b in model.layout.buckets) * dtype.itemsize
        full_grad_peak = peak[0] - held["grads"]  # beyond the shard
        assert full_grad_peak <= (2 + in_flight) * bucket_bytes, f"{what}: peak {full_grad_peak}"
        assert full_grad_peak < n_params * dtype.itemsize / 4, f"{what}: full grads kept"
    return dict(stage=stage, dtype=str(dtype), P=n_params, pad=padding, **held)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_bytes_per_rank_follow_the_zero_paper(world_size: int) -> None:
    """Counted from the tensors each rank holds, after backward + step, within padding:
    fp32 ZeRO-1 4P + 4P + 8P/N, ZeRO-2 4P + 12P/N; bf16 ZeRO-1 2P + 2P + 12P/N, ZeRO-2 2P + 14P/N.
    """
    run_distributed(_bytes_worker, world_size)


# ---------------------------------------------------------------------------- accumulation


def _no_sync_worker(rank: int, world_size: int) -> None:
    micro_steps, rows = 3, 2 * world_size
    for stage in (1, 2):
        reference = make_model(0)
        model, optimizer = build(
            f"zero{stage}",
            copy.deepcopy(reference),
            OPTIMIZERS["sgd"],
            bucket_cap_mb=SMALL_BUCKET_MB,
            enable_async_communication=True,
        )
        ref_optimizer = OPTIMIZERS["sgd"].reference(reference.parameters())
        for step in range(3):
            for micro in range(micro_steps):
                x, y = _xy(step * micro_steps + micro, rows)
                lm_loss(reference(x), y).backward()  # accumulates over the micro-batches
                last = micro == micro_steps - 1
                with contextlib.nullcontext() if last else model.no_sync():
                    loss = lm_loss(
                        model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)
                    )
                    loss.backward()
                for p in model.parameters():
                    if not last:  # full LOCAL gradients are kept, ZeRO-2 included
                        assert p.grad is not None and p.grad.shape == p.shape
                    elif stage == 2:  # reduced into the shard: no full-size gradient left
                        assert p.grad is None
            ref_optimizer.step()
            ref_optimizer.zero_grad()
            optimizer.step()
            optimizer.zero_grad()
        expected = reference.state_dict()
        for name, value in model.state_dict().items():
            diff = (value - expected[name]).abs().max().item()
            assert diff <= PARAM_ATOL, f"stage {stage}: {name} differs by {diff:.2e}"


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_no_sync_accumulates_micro_batches(world_size: int) -> None:
    """Two micro-batches under no_sync() then a synchronised one == one device summing all three."""
    run_distributed(_no_sync_worker, world_size)


FROZEN = (
    "transformer.wpe.weight",
    "transformer.h.0.ln_1.weight",
    "transformer.h.1.attn.c_attn.bias",
)


def _frozen_tied_worker(rank: int, world_size: int) -> None:
    for stage in (1, 2):
        reference = make_model(0)
        for name, p in reference.named_parameters():
            p.requires_grad_(name not in FROZEN)
        model, optimizer = build(
            f"zero{stage}",
            copy.deepcopy(reference),
            OPTIMIZERS["adamw"],
            bucket_cap_mb=SMALL_BUCKET_MB,
        )
        ref_optimizer = OPTIMIZERS["adamw"].reference(reference.parameters())
        named = dict(model.module.named_parameters())
        # Tied: one Parameter, one slot; frozen: no slot, not a view of the buffer.
        assert model.module.lm_head.weight is named["transformer.wte.weight"]
        trainable = [p for p in named.values() if p.requires_grad]
        assert len(model.layout.slots) == len(trainable) == len(named) - len(FROZEN)
        assert model.layout.numel - model.layout.padding() == sum(p.numel() for p in trainable)
        spans = [(t.data_ptr(), t.data_ptr() + t.nbytes) for t in model.param_buffer.tensors]
        for name, p in named.items():
            in_buffer = any(lo <= p.data_ptr() < hi for lo, hi in spans)
            assert in_buffer == (name not in FROZEN), name
        frozen_before = {n: named[n].detach().clone() for n in FROZEN}
        for step in range(4):
            x, y = _xy(step, 2 * world_size)
            lm_loss(reference(x), y).backward()
            ref_optimizer.step()
            ref_optimizer.zero_grad()
            _train_step(
                model, optimizer, local_slice(x, rank, world_size), local_slice(y, rank, world_size)
            )
            assert all(named[n].grad is None for n in FROZEN)
        expected = reference.state_dict()
        for name, value in model.state_dict().items():
            diff = (value - expected[name]).abs().max().item()
            assert diff <= PARAM_ATOL, f"stage {stage}: {name} differs by {diff:.2e}"
        for name in FROZEN:
            assert torch.equal(named[name], frozen_before[name]), f"frozen {name} changed"
        optimizer.consolidate_state_dict(to=0)
        if rank == 0:
            state = optimizer.state_dict()["state"]
            names = optimizer.param_groups[0]["param_names"]
            assert {names[i] for i in state} == {f"module.{n}" for n in named if n not in FROZEN}


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_frozen_parameters_stay_out_and_tied_ones_share_a_slot(world_size: int) -> None:
    run_distributed(_frozen_tied_worker, world_size)


# ---------------------------------------------------------------------------- checkpoints

CKPT_ROWS = 6  # global batch divisible by 1, 2 and 3 ranks
CKPT_STEPS = (3, 3)  # steps before the checkpoint, steps after


def _continue(rank: int, world_size: int, model: nn.Module, optimizer: Any) -> Dict[str, Any]:
    losses = []
    for step in range(CKPT_STEPS[0], sum(CKPT_STEPS)):
        x, y = (local_slice(t, rank, world_size) for t in _xy(step, CKPT_ROWS))
        loss = torch.tensor(_train_step(model, optimizer, x, y)) / world_size
        dist.all_reduce(loss)
        losses.append(loss.item())
    return {"losses": losses, "params": model.state_dict()}


def _save_worker(rank: int, world_size: int, path: str) -> Dict[str, Any]:
    model, optimizer = build(
        "zero1", make_model(0), OPTIMIZERS["adamw"], bucket_cap_mb=SMALL_BUCKET_MB
    )
    for step in range(CKPT_STEPS[0]):
        x, y = (local_slice(t, rank, world_size) for t in _xy(step, CKPT_ROWS))
        _train_step(model, optimizer, x, y)
    optimizer.consolidate_state_dict(to=0)
    if rank == 0:
        torch.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, path)
    else:
        with pytest.raises(RuntimeError, match="consolidate_state_dict"):
            optimizer.state_dict()  # only the destination rank holds the consolidated state
    dist.barrier()
    return _continue(rank, world_size, model, optimizer)


def _load_worker(rank: int, world_size: int, path: str, stage: int) -> Dict[str, Any]:
    checkpoint = torch.load(path, weights_only=True)
    model, optimizer = build(
        f"zero{stage}",
        make_model(1),  # other init
        OPTIMIZERS["adamw"],
        bucket_cap_mb=TINY_BUCKET_MB,
        enable_async_communication=True,
    )
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optim"])
    optimizer.consolidate_state_dict(to=0)
    if rank == 0:  # the round trip through another sharding is exact
        saved, again = checkpoint["optim"], optimizer.state_dict()
        assert saved["param_groups"] == again["param_groups"]
        assert saved["state"].keys() == again["state"].keys()
        for i, entry in saved["state"].items():
            assert entry.keys() == again["state"][i].keys()
            for key, value in entry.items():
                assert torch.equal(value, again["state"][i][key]), f"param {i} {key}"
    return _continue(rank, world_size, model, optimizer)


@pytest.mark.parametrize("world_size, stage", [(2, 2), (3, 1), (1, 2)])
def test_consolidated_state_resumes_at_any_world_size(
    world_size: int, stage: int, tmp_path: Any
) -> None:
    """Save Zero1 + Zero1AdamW at N = 2; load into ZeRO-`stage` at N = `world_size`; continue.

    Same world size: bitwise the uninterrupted run (same reductions, same data). Other world
    sizes: the gradient average of N ranks rounds differently, hence PARAM_ATOL."""
    path = str(tmp_path / "ckpt.pt")
    uninterrupted = run_distributed(_save_worker, 2, path)[0]
    resumed = run_distributed(_load_worker, world_size, path, stage)[0]
    for name, value in uninterrupted["params"].items():
        if world_size == 2:
            assert torch.equal(resumed["params"][name], value), name
        else:
            diff = (resumed["params"][name] - value).abs().max().item()
            assert diff <= PARAM_ATOL, f"{name} differs by {diff:.2e}"
    tol = 0.0 if world_size == 2 else 1e-5
    for got, expected in zip(resumed["losses"], uninterrupted["losses"]):
        assert abs(got - expected) <= tol, f"{resumed['losses']} vs {uninterrupted['losses']}"


# ---------------------------------------------------------------------------- misuse


def _errors_worker(rank: int, world_size: int) -> None:
    with pytest.raises(ValueError, match="does not belong to a Zero1-wrapped model"):
        Zero1AdamW(make_model(0).named_parameters(), lr=ADAM_LR)
    model, optimizer = build(
        "zero1", make_model(0), OPTIMIZERS["adamw"], bucket_cap_mb=SMALL_BUCKET_MB
    )
    with pytest.raises(ValueError, match="use Zero1SGD"):
        Zero2SGD(model.named_parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="consolidate_state_dict"):
        optimizer.state_dict()
    plain = make_model(0)
    with pytest.raises(ValueError, match="expects a state saved by consolidate_state_dict"):
        optimizer.load_state_dict(torch.optim.AdamW(plain.parameters()).state_dict())
    sgd_model, sgd = build("zero1", make_model(0), OPTIMIZERS["sgd"], bucket_cap_mb=SMALL_BUCKET_MB)
    sgd.consolidate_state_dict(to=0)
    sgd_state = [sgd.state_dict() if rank == 0 else None]
    dist.broadcast_object_list(sgd_state, src=0)
    with pytest.raises(ValueError, match="cannot load the state of a SGD optimizer"):
        optimizer.load_state_dict(sgd_state[0])
    x, y = (local_slice(t, rank, world_size) for t in _xy(0, 2 * world_size))
    lm_loss(model(x), y).backward()
    with pytest.raises(RuntimeError, match=r"already reduced\. A backward adds onto them"):
        lm_loss(model.module(x), y).backward()  # again, but not from the wrapper's output
    # A torch.optim optimizer cannot train a ZeRO model (ZeRO-2 leaves every .grad None): its
    # step raises, naming the optimizers that can (Zero2Optimizer takes its class).
    zero2 = Zero2(make_model(0))
    torch_optimizer = torch.optim.AdamW(zero2.parameters(), lr=ADAM_LR)
    lm_loss(zero2(x), y).backward()
    assert all(p.grad is None for p in zero2.parameters())
    with pytest.raises(
        RuntimeError, match="AdamW steps parameters of a Zero2 model.*Zero2Optimizer.*Zero2SGD"
    ):
        torch_optimizer.step()


def test_misuse_raises_clear_errors() -> None:
    run_distributed(_errors_worker, 2)


def test_a_bucket_of_one_unpadded_parameter_stages_in_its_gradient() -> None:
    """ZeRO-2's hook divides such a gradient by N in place and reduces it as it is: no staging
    buffer, no copy. A bucket of several parameters, or one that needs padding, gets a buffer,
    counted by the store's ``stats`` (``Zero2.staging_stats``) until its reduction finishes."""
    whole, padded, small_a, small_b = (nn.Parameter(torch.randn(n)) for n in (6, 5, 1, 2))
    params = [small_a, small_b, padded, whole]  # buckets (cap 3): [a, b], [padded], [whole]
    layout = FlatLayout([p.shape for p in params], world_size=2, bucket_cap_numel=3)
    assert [b.slots for b in layout.buckets] == [(0, 1), (2,), (3,)]
    store = StagedGradShard(params, layout, [torch.float32], torch.device("cpu"), 0)
    for p in params:
        p.grad = torch.ones_like(p)
    grad = whole.grad
    store.add(3, whole)
    assert whole.grad is None and store.stats.live_bytes == 0
    assert torch.equal(grad, torch.full((6,), 0.5))  # the gradient / N, in place
    store.add(2, padded)  # 5 elements padded to 6
    store.add(0, small_a)
    assert store.stats.live_bytes == (6 + 4) * 4  # [a, b]: 3 elements padded to 4
    store.reset()
    assert store.stats.live_bytes == 0 and store.stats.peak_bytes == (6 + 4) * 4


def _receive_buffers_worker(rank: int, world_size: int) -> None:
    model, optimizer = build(
        "zero1", make_model(0), OPTIMIZERS["sgd"], bucket_cap_mb=TINY_BUCKET_MB
    )
    chunks = [b.numel // world_size * 4 for b in model.layout.buckets]  # fp32; launch order
    assert len(chunks) >= 10
    for step in range(2):
        x, y = (local_slice(t, rank, world_size) for t in _xy(step, 2 * world_size))
        lm_loss(model(x), y).backward()
        stats = model.receive_stats
        assert stats.live_bytes == 0 and model.transient_bytes() == {"receive": 0}
        if world_size == 2:
            two_in_a_row = max(a + b for a, b in zip(chunks, chunks[1:]))
            assert max(chunks) <= stats.peak_bytes <= two_in_a_row, (stats.peak_bytes, chunks)
        else:  # an all-reduce in place: nothing received apart
            assert stats.peak_bytes == 0
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("world_size", [2, 3])
def test_zero1_receive_buffers_stay_within_two_chunks(world_size: int) -> None:
    """ZeRO-1 reduces each bucket into its own chunk of the full gradient buffer. On 2 gloo
    ranks that reduce-scatter is a send and a receive ([Note: ZeRO collectives on gloo]), and
    the other rank's part arrives in a buffer of the chunk's size: ``receive_stats`` counts
    those buffers, and one reduction in flight keeps them to the chunks of two consecutive
    buckets, never the whole gradient's half. On 3 ranks gloo all-reduces in place."""
    run_distributed(_receive_buffers_worker, world_size)


def _check_branchy(ours: nn.Module, reference: nn.Module, initial: nn.Module, case: str) -> None:
    """A trained ``BranchyNet`` equals the reference; its ``never`` was never stepped."""
    for (name, param), ref in zip(ours.named_parameters(), reference.parameters()):
        gap = (param - ref).abs().max().item()
        assert gap <= PARAM_ATOL, f"{case}: {name} differs by {gap:.2e}"
    for param, start in zip(ours.never.parameters(), initial.never.parameters()):
        assert torch.equal(param, start), f"{case}: an unused parameter was stepped"


def _unused_worker(rank: int, world_size: int) -> List[str]:
    """A branch used by rank 0 only, then by no rank; ``never`` never used: parameters after two
    AdamW steps (weight decay on) as torch.optim's on one device, which skips a None grad."""
    seen = []
    for strategy in ("zero1", "zero2"):
        torch.manual_seed(0)
        reference = BranchyNet()
        initial = copy.deepcopy(reference)
        hyper = dict(lr=0.01, weight_decay=0.5)
        ref_optimizer = torch.optim.AdamW(reference.parameters(), **hyper)
        # 0.0001 MiB = 104 bytes: every Linear's weight sits in a bucket of its own.
        model, optimizer = build(
            strategy, copy.deepcopy(reference), adamw(**hyper), bucket_cap_mb=0.0001
        )
        gen = torch.Generator().manual_seed(1)
        for uses in (lambda r: r == 0, lambda r: False):
            data = [  # (x (4, 6), y (4, 3)) of every rank
                (torch.randn(4, 6, generator=gen), torch.randn(4, 3, generator=gen))
                for _ in range(world_size)
            ]
            for r, (x, y) in enumerate(data):  # one device: the mean of the ranks' losses
                (F.mse_loss(reference(x, uses(r)), y) / world_size).backward()
            ref_optimizer.step()
            ref_optimizer.zero_grad()
            x, y = data[rank]
            F.mse_loss(model(x, uses(rank)), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        _check_branchy(model.module, reference, initial, f"rank {rank} {strategy}")
        seen.append(strategy)
    return seen


def _backward_again_worker(rank: int, world_size: int) -> List[str]:
    """Backwards on gradients not cleared since the last one add up, as in torch's DDP ([Note:
    backward again before the step]). ``branch`` is used by rank 0 only in backward 0, by no
    rank in backward 1, by all in backward 2; ``never`` never. An action: ``("backward", i,
    synchronised)``, ``("step",)``, or ``("forwards", [i, ...])`` (their backwards follow)."""
    uses = [lambda r: r == 0, lambda r: False, lambda r: True]
    schedules = {
        "two backwards": [("backward", 0, True), ("backward", 1, True), ("step",)],
        "sync, no_sync, sync": [
            ("backward", 0, True), ("backward", 1, False), ("backward", 2, True), ("step",)],
        "two forwards, then their backwards": [("forwards", [0, 1]), ("step",)],
        "step, backward without zero_grad, step": [  # a GAN's discriminator
            ("backward", 0, True), ("step",), ("backward", 1, True), ("step",)],
    }  # fmt: skip
    seen = []
    for strategy, async_comm in (("zero1", True), ("zero2", False), ("zero2", True)):
        for what, actions in schedules.items():
            torch.manual_seed(0)
            reference = BranchyNet()
            initial = copy.deepcopy(reference)
            hyper = dict(lr=0.01, weight_decay=0.5)
            ref_optimizer = torch.optim.AdamW(reference.parameters(), **hyper)
            model, optimizer = build(  # 104-byte buckets: every Linear weight alone
                strategy, copy.deepcopy(reference), adamw(**hyper), bucket_cap_mb=0.0001,
                enable_async_communication=async_comm,
            )  # fmt: skip
            gen = torch.Generator().manual_seed(1)
            for _ in range(2):
                data = [  # per backward, per rank: (x (4, 6), y (4, 3))
                    [(torch.randn(4, 6, generator=gen), torch.randn(4, 3, generator=gen))
                     for _ in range(world_size)]
                    for _ in range(3)
                ]  # fmt: skip

                def loss(i: int) -> torch.Tensor:
                    x, y = data[i][rank]
                    return F.mse_loss(model(x, uses[i](rank)), y)

                for action in actions:
                    if action[0] == "step":
                        ref_optimizer.step()
                        optimizer.step()
                        continue
                    indices = action[1] if action[0] == "forwards" else [action[1]]
                    for i in indices:  # one device: the mean over the ranks' losses
                        for r, (x, y) in enumerate(data[i]):
                            (F.mse_loss(reference(x, uses[i](r)), y) / world_size).backward()
                    sync = action[0] == "forwards" or action[2]
                    with contextlib.nullcontext() if sync else model.no_sync():
                        for pending in [loss(i) for i in indices]:
                            pending.backward()
                ref_optimizer.zero_grad()
                optimizer.zero_grad()
            case = f"rank {rank} {strategy} async={async_comm} {what}"
            _check_branchy(model.module, reference, initial, case)
            seen.append(case)
    return seen


def test_a_backward_again_before_the_step_adds_on_as_in_torch_ddp() -> None:
    assert len(run_distributed(_backward_again_worker, 2)[0]) == 12


def test_parameters_no_rank_used_are_not_stepped() -> None:
    """A parameter unused on some ranks gets the average of the others'; unused on all, it is
    skipped by the optimizer (no weight decay, no momentum), as torch.optim skips a None grad."""
    # 3 ranks: the branch is used by one rank and skipped by two, then used by none.
    assert run_distributed(_unused_worker, 3)[0] == ["zero1", "zero2"]


# ----------------------------------------------------------------------------- outside writes

OUTSIDE_WRITES = ("model.module.load_state_dict", "copy_ under no_grad", "nn.init", ".data =")
TARGET = 0.5  # every element of every parameter after the write


def _write_outside(how: str, model: nn.Module, target: Dict[str, torch.Tensor]) -> None:
    if how == "model.module.load_state_dict":  # torch DDP code's way to load
        model.module.load_state_dict(target)
    elif how == "nn.init":
        for param in model.module.parameters():
            nn.init.constant_(param, TARGET)
    elif how == ".data =":  # a new tensor: the parameter is no view of the flat buffer now
        for name, param in model.module.named_parameters():
            param.data = target[name].to(param.dtype).clone()
    else:
        with torch.no_grad():
            for name, param in model.module.named_parameters():
                param.copy_(target[name])


def _outside_writes_worker(rank: int, world_size: int) -> List[str]:
    from tiny_fsdp.core import MixedPrecisionPolicy, Zero1, Zero1SGD, Zero2, Zero2SGD

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    target = {k: torch.full_like(v, TARGET) for k, v in plain.state_dict().items()}
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    setups = {  # parameters below 32 bits: the optimizer keeps separate fp32 masters
        "an fp32 model": (lambda: copy.deepcopy(plain), None),  # the buffer is the master
        "a bf16 model": (lambda: copy.deepcopy(plain).to(torch.bfloat16), None),
        "a bf16 policy": (lambda: copy.deepcopy(plain), MixedPrecisionPolicy(torch.bfloat16)),
    }
    seen = []
    for wrapper, optim in ((Zero1, Zero1SGD), (Zero2, Zero2SGD)):
        for setup, (make, policy) in setups.items():
            for how in ("the wrapper's load_state_dict",) + OUTSIDE_WRITES:
                model = wrapper(make(), mixed_precision=policy)
                optimizer = optim(model.named_parameters(), lr=0.1)
                for step in range(2):  # the write comes between two steps
                    if step == 1 and how.startswith("the wrapper"):
                        model.load_state_dict(target)
                    elif step == 1:
                        _write_outside(how, model, target)
                    model(x.to(next(model.parameters()).dtype)).float().square().mean().backward()
                    optimizer.step()
                    optimizer.zero_grad()
                state = model.state_dict()
                if how.startswith("the wrapper"):
                    expected = state  # the path that always re-read the masters
                    continue
                what = f"{wrapper.__name__}, {setup}, {how}"
                for key, value in expected.items():  # not undone by the step's write-back
                    assert torch.equal(state[key], value), f"{what}: {key} lost the write"
                seen.append(what)
    return seen


def test_parameters_written_outside_the_optimizer_are_kept() -> None:
    """A write to the parameters between steps (loading through the inner model as torch DDP
    code does, a copy_ under no_grad, an nn.init, ``p.data = tensor``) is where the next step
    starts from, as after the wrapper's own load_state_dict, also when the optimizer keeps
    separate fp32 masters ([Note: writes outside the optimizer] in
    ``tiny_fsdp/core/zero/optim.py``)."""
    seen = run_distributed(_outside_writes_worker, 2)[0]
    assert len(seen) == 2 * 3 * len(OUTSIDE_WRITES)
