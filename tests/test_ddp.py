"""Specification of DDP: replicated model, gradients averaged over ranks in buckets.

Every distributed check runs inside ``run_distributed`` workers (module-level ``_..._worker``
functions) and loops over several configurations per call to keep the suite fast.
"""

import copy
from typing import Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from example.model import GPTConfigs
from tests.build import adamw, build, sgd
from tests.harness import run_distributed
from tests.parity import (
    PARAM_ATOL,
    check_parity,
    global_batch,
    lm_loss,
    local_slice,
    make_model,
)
from tests.zoo import BranchyNet
from tiny_fsdp.core.comm import LEDGER
from tiny_fsdp.core.ddp import DDP, DDPSGD, DDPAdamW, build_buckets

# DDP's arithmetic does not depend on how many ranks there are past 2 (every gradient is summed
# whole): 3 ranks cover the odd count, and a 4th rank on 2 CPU cores only slows the suite.
WORLD_SIZES = [1, 2, 3]
TINY_BUCKET_MB = 0.002  # ~500 fp32 gradients: gpt2_tiny is cut into ~20 buckets
# Gradients of the global-batch mean after one backward from identical weights: the same float32
# products summed in another order (per rank, then across ranks); measured <= 1e-7, and a wrong
# scale (sum instead of mean) would be off by the gradient itself, ~1e-2.
GRAD_ATOL = 1e-6
# (optimizer, bucket_cap_mb, enable_async_communication) trained against one device.
PARITY_CASES = [
    ("adamw", 25.0, False),
    ("adamw", TINY_BUCKET_MB, True),
    ("sgd", 25.0, True),
    ("sgd", TINY_BUCKET_MB, False),
]
# Adam turns the float32 rounding noise of gradients that are analytically zero (attention key
# biases: softmax ignores them) into updates of size ~lr; lr=1e-3 keeps 10 steps within
# PARAM_ATOL (measured: <= 1.1e-5), lr=1e-2 would not (1e-4).
ADAM_LR = 1e-3
OPTIMIZERS = {
    "adamw": adamw(lr=ADAM_LR, weight_decay=0.1),
    # SGD, unlike Adam, is not invariant to the gradient's scale: it catches a wrong average.
    "sgd": sgd(lr=0.5, momentum=0.9),
}


def _global_xy(step: int, rows: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(x, y) of shape (rows, 8): the global batch of ``step``."""
    return global_batch(step, rows, seq_len=8, vocab=GPTConfigs.gpt2_tiny.vocab_size)


def _assert_grads_close(model: nn.Module, reference: nn.Module, atol: float, what: str) -> None:
    expected = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        ref_grad = expected[name].grad
        assert (param.grad is None) == (ref_grad is None), f"{what}: {name} grad presence"
        if ref_grad is not None:
            diff = (param.grad - ref_grad).abs().max().item()
            assert diff <= atol, f"{what}: grad of {name} differs by {diff:.2e}"


def _assert_same_on_all_ranks(tensors: List[torch.Tensor], what: str) -> None:
    flat = torch.cat([t.reshape(-1) for t in tensors])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(g, gathered[0]) for g in gathered), f"{what}: replicas differ"


def _allreduce_payload(params: List[nn.Parameter]) -> int:
    """Bytes one synchronised backward all-reduces: every gradient once, plus one flag each."""
    return sum((p.numel() + 1) * p.element_size() for p in params)


# ----------------------------------------------------------------------------- parity


def _parity_worker(rank: int, world_size: int, cases: list) -> List[float]:
    max_diffs = []
    for opt_name, bucket_mb, async_comm in cases:
        spec = OPTIMIZERS[opt_name]

        def wrap(model: nn.Module) -> Tuple[nn.Module, torch.optim.Optimizer]:
            return build(
                "ddp", model, spec, bucket_cap_mb=bucket_mb, enable_async_communication=async_comm
            )

        result = check_parity(
            rank,
            world_size,
            wrap,
            lambda m: spec.reference(m.parameters()),
            lambda m: m.state_dict(),
        )
        max_diffs.append(result.max_param_diff)
    return max_diffs


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_training_matches_single_device_on_the_global_batch(world_size: int) -> None:
    """Loss every step and all parameters after 10 steps, AdamW and SGD+momentum."""
    run_distributed(_parity_worker, world_size, PARITY_CASES)


def _first_grads_worker(rank: int, world_size: int) -> None:
    for bucket_mb, async_comm, checkpointing in [
        (25.0, False, False),
        (TINY_BUCKET_MB, True, False),
        (TINY_BUCKET_MB, True, True),
    ]:
        reference = make_model()
        model = DDP(copy.deepcopy(reference), bucket_mb, async_comm)
        model.gradient_checkpointing = checkpointing
        x, y = _global_xy(0, 2 * world_size)
        lm_loss(reference(x), y).backward()
        lm_loss(
            model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)
        ).backward()
        what = f"rank {rank} bucket_mb={bucket_mb} async={async_comm} ckpt={checkpointing}"
        _assert_grads_close(model.module, reference, GRAD_ATOL, what)
        _assert_same_on_all_ranks([p.grad for p in model.parameters()], what)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_first_gradients_are_the_single_device_gradients(world_size: int) -> None:
    """Averaged (not summed) gradients, identical on every rank, whatever the bucketing."""
    run_distributed(_first_grads_worker, world_size)


def _torch_ddp_worker(rank: int, world_size: int, steps: int) -> None:
    torch_model = nn.parallel.DistributedDataParallel(make_model())
    ours, our_opt = build(
        "ddp",
        make_model(),
        OPTIMIZERS["adamw"],
        bucket_cap_mb=TINY_BUCKET_MB,
        enable_async_communication=True,
    )
    torch_opt = OPTIMIZERS["adamw"].reference(torch_model.parameters())
    for step in range(steps):
        x, y = _global_xy(step, 2 * world_size)
        x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
        torch_loss = lm_loss(torch_model(x), y)
        our_loss = lm_loss(ours(x), y)
        # Identical weights and data: the same forward math, up to float32 kernel rounding.
        assert abs(torch_loss.item() - our_loss.item()) <= 1e-5, f"step {step}"
        torch_loss.backward()
        our_loss.backward()
        if step == 0:
            _assert_grads_close(ours.module, torch_model.module, GRAD_ATOL, f"rank {rank}")
        for opt in (torch_opt, our_opt):
            opt.step()
            opt.zero_grad(set_to_none=True)
    expected = torch_model.module.state_dict()
    for name, value in ours.state_dict().items():
        diff = (value - expected[name]).abs().max().item()
        assert diff <= PARAM_ATOL, f"rank {rank}: {name} differs from torch DDP by {diff:.2e}"


@pytest.mark.parametrize("world_size", [2, 3])
def test_matches_torch_distributed_data_parallel(world_size: int) -> None:
    run_distributed(_torch_ddp_worker, world_size, 6)


# ----------------------------------------------------------------------------- accumulation


def _accumulation_worker(rank: int, world_size: int) -> None:
    micro_steps, rows_per_micro, steps = 2, 2, 3
    for use_context, async_comm in [(True, False), (False, True)]:
        reference = make_model()
        model, optimizer = build(
            "ddp",
            copy.deepcopy(reference),
            OPTIMIZERS["sgd"],
            bucket_cap_mb=TINY_BUCKET_MB,
            enable_async_communication=async_comm,
        )
        ref_optimizer = OPTIMIZERS["sgd"].reference(reference.parameters())
        for step in range(steps):
            x, y = _global_xy(step, micro_steps * rows_per_micro * world_size)
            lm_loss(reference(x), y).backward()  # one step on the whole batch
            for micro in range(micro_steps):
                # Micro-batch `micro` of rank r: block micro * world_size + r of the batch.
                n_blocks = micro_steps * world_size
                xs, ys = (local_slice(t, micro * world_size + rank, n_blocks) for t in (x, y))
                LEDGER.reset()
                last = micro == micro_steps - 1
                if use_context and not last:
                    with model.no_sync():
                        (lm_loss(model(xs), ys) / micro_steps).backward()
                else:
                    model.require_backward_grad_sync = last
                    (lm_loss(model(xs), ys) / micro_steps).backward()
                if not last:
                    assert sum(LEDGER.calls.values()) == 0, "no_sync backward communicated"
            assert model.require_backward_grad_sync
            if step == 0:  # later steps start from parameters that differ by rounding
                what = f"rank {rank} context={use_context} async={async_comm}"
                _assert_grads_close(model.module, reference, GRAD_ATOL, what)
            for opt in (optimizer, ref_optimizer):
                opt.step()
                opt.zero_grad(set_to_none=True)
        _assert_params_close(model.module, reference, PARAM_ATOL)


def _assert_params_close(model: nn.Module, reference: nn.Module, atol: float) -> None:
    expected = reference.state_dict()
    for name, value in model.state_dict().items():
        diff = (value - expected[name]).abs().max().item()
        assert diff <= atol, f"{name} differs by {diff:.2e}"


@pytest.mark.parametrize("world_size", [2, 3])
def test_accumulation_under_no_sync_equals_one_bigger_step(world_size: int) -> None:
    """K=2 micro-steps of batch b (loss / K), only the last synced == one step of batch 2b."""
    run_distributed(_accumulation_worker, world_size)


# ----------------------------------------------------------------------------- parameters

FROZEN = ["transformer.wpe.weight", "transformer.h.0.ln_1.weight", "transformer.h.1.mlp.c_fc.bias"]


def _frozen_worker(rank: int, world_size: int) -> None:
    reference = make_model()
    for name, param in reference.named_parameters():
        param.requires_grad_(name not in FROZEN)
    model, optimizer = build(
        "ddp",
        copy.deepcopy(reference),
        OPTIMIZERS["adamw"],
        bucket_cap_mb=TINY_BUCKET_MB,
        enable_async_communication=True,
    )
    frozen = {name: p.detach().clone() for name, p in model.module.named_parameters()}
    ref_optimizer = OPTIMIZERS["adamw"].reference(reference.parameters())
    trainable = [p for p in model.parameters() if p.requires_grad]
    bucketed = [id(p) for bucket in model.buckets for p in bucket.params]
    assert sorted(bucketed) == sorted(map(id, trainable))
    for step in range(3):
        x, y = _global_xy(step, 2 * world_size)
        lm_loss(reference(x), y).backward()
        LEDGER.reset()
        lm_loss(
            model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)
        ).backward()
        assert LEDGER.payload_bytes["all_reduce"] == _allreduce_payload(trainable)
        if step == 0:  # later steps start from parameters that differ by rounding
            _assert_grads_close(model.module, reference, GRAD_ATOL, f"rank {rank}")
        for opt in (optimizer, ref_optimizer):
            opt.step()
            opt.zero_grad(set_to_none=True)
    params = dict(model.module.named_parameters())
    for name in FROZEN:
        assert params[name].grad is None and torch.equal(params[name], frozen[name]), name
    _assert_params_close(model.module, reference, PARAM_ATOL)


def test_frozen_parameters_take_no_part() -> None:
    """Not bucketed, not communicated, no gradient, unchanged; the rest trains normally."""
    run_distributed(_frozen_worker, 2)


def _tied_worker(rank: int, world_size: int) -> None:
    reference = make_model()
    model = DDP(copy.deepcopy(reference), TINY_BUCKET_MB, enable_async_communication=True)
    wte = model.module.transformer.wte.weight
    assert model.module.lm_head.weight is wte
    slots = [p for bucket in model.buckets for p in bucket.params if p is wte]
    assert len(slots) == 1, "the tied weight must have exactly one bucket slot"
    x, y = _global_xy(0, 2 * world_size)
    lm_loss(reference(x), y).backward()
    LEDGER.reset()
    lm_loss(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()
    # The payload counts each unique parameter once, the tied (vocab, dim) matrix included.
    assert LEDGER.payload_bytes["all_reduce"] == _allreduce_payload(list(model.parameters()))
    # Both uses (embedding rows + output projection) are in the one averaged gradient.
    diff = (wte.grad - reference.transformer.wte.weight.grad).abs().max().item()
    assert diff <= GRAD_ATOL


def test_tied_weight_is_reduced_once_with_both_uses() -> None:
    run_distributed(_tied_worker, 2)


# Which ranks use `branch` in the synchronised backward, and in an earlier no_sync backward.
UNUSED_CASES = {
    "rank 0 only": (lambda r: r == 0, None),
    "no rank": (lambda r: False, None),
    "accumulated earlier": (lambda r: False, lambda r: True),
}


def _unused_worker(rank: int, world_size: int) -> None:
    for case, (sync_uses, earlier_uses) in UNUSED_CASES.items():
        for async_comm in (False, True):
            torch.manual_seed(0)
            reference = BranchyNet()
            # 0.0001 MiB = 104 bytes: every Linear's weight sits in a bucket of its own.
            model, optimizer = build(
                "ddp",
                copy.deepcopy(reference),
                adamw(lr=0.1, weight_decay=0.5),
                bucket_cap_mb=0.0001,
                enable_async_communication=async_comm,
            )
            gen = torch.Generator().manual_seed(1)
            micro_steps = [uses for uses in (earlier_uses, sync_uses) if uses is not None]
            for i, uses in enumerate(micro_steps):
                data = [  # (x (4, 6), y (4, 3)) of every rank
                    (torch.randn(4, 6, generator=gen), torch.randn(4, 3, generator=gen))
                    for _ in range(world_size)
                ]
                # Single device: the mean over ranks of each rank's loss.
                for r, (x, y) in enumerate(data):
                    (F.mse_loss(reference(x, uses(r)), y) / world_size).backward()
                model.require_backward_grad_sync = i == len(micro_steps) - 1
                x, y = data[rank]
                F.mse_loss(model(x, uses(rank)), y).backward()
            what = f"rank {rank} case '{case}' async={async_comm}"
            _assert_grads_close(model.module, reference, GRAD_ATOL, what)
            assert model.module.never.weight.grad is None, what
            never_before = model.module.never.weight.detach().clone()
            optimizer.step()
            # No gradient anywhere: skipped by the optimizer (weight decay not applied either).
            assert torch.equal(model.module.never.weight, never_before), what


def test_parameters_unused_in_forward_never_block_and_get_the_right_gradient() -> None:
    """Used by some ranks: single-device gradient. Used by none: grad stays None."""
    for world_size in (2, 3):
        run_distributed(_unused_worker, world_size, timeout=60.0)


# ----------------------------------------------------------------------------- communication


def _async_worker(rank: int, world_size: int) -> None:
    for bucket_mb in (TINY_BUCKET_MB, 25.0):
        base = make_model()
        models, optimizers = {}, {}
        for a in (False, True):
            models[a], optimizers[a] = build(
                "ddp",
                copy.deepcopy(base),
                adamw(lr=1e-2),
                bucket_cap_mb=bucket_mb,
                enable_async_communication=a,
            )
        launched_before_last_hook = {}
        for step in range(3):
            x, y = _global_xy(step, 2 * world_size)
            xs, ys = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
            for a, model in models.items():
                wte = model.module.transformer.wte.weight
                # Registered after DDP's hook, so it runs right after it, at the end of the
                # backward (the embedding is the first layer).
                handle = wte.register_post_accumulate_grad_hook(
                    lambda p, a=a: launched_before_last_hook.__setitem__(
                        a, LEDGER.calls["all_reduce"]
                    )
                )
                LEDGER.reset()
                lm_loss(model(xs), ys).backward()
                handle.remove()
            for p_off, p_on in zip(models[False].parameters(), models[True].parameters()):
                assert torch.equal(p_off.grad, p_on.grad), f"bucket_mb={bucket_mb} step {step}"
            for opt in optimizers.values():
                opt.step()
                opt.zero_grad(set_to_none=True)
            # Overlap: with several buckets, some were all-reduced while backward still ran.
            assert launched_before_last_hook[False] == 0
            if len(models[True].buckets) > 2:
                assert launched_before_last_hook[True] > 0
        for p_off, p_on in zip(models[False].parameters(), models[True].parameters()):
            assert torch.equal(p_off, p_on)


@pytest.mark.parametrize("world_size", [2, 3])
def test_async_communication_overlaps_and_is_bitwise_identical_to_sync(world_size: int) -> None:
    run_distributed(_async_worker, world_size)


def _bucket_view_worker(rank: int, world_size: int) -> None:
    from tiny_fsdp.core.precision import MixedPrecisionPolicy

    x, y = _global_xy(0, 2 * world_size)
    xs, ys = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
    for set_to_none in (True, False):
        model = DDP(make_model(), TINY_BUCKET_MB)
        optimizer = DDPAdamW(model.named_parameters(), lr=1e-3)
        addresses = []
        for _ in range(2):
            lm_loss(model(xs), ys).backward()
            slots = [(b, s) for b in model.buckets for s in range(len(b.params))]
            # param.grad IS its bucket slot: the in-place all-reduce left the average there.
            assert all(b.is_slot(s, b.params[s].grad) for b, s in slots), set_to_none
            addresses.append([b.params[s].grad.data_ptr() for b, s in slots])
            optimizer.step()
            optimizer.zero_grad(set_to_none=set_to_none)
        assert addresses[0] == addresses[1]
    # bf16 buckets cannot be fp32 gradients: the average is copied back into an fp32 .grad.
    model = DDP(make_model(), TINY_BUCKET_MB, mixed_precision=MixedPrecisionPolicy(torch.bfloat16))
    lm_loss(model(xs).float(), ys).backward()
    for bucket in model.buckets:
        assert bucket.buffer.dtype == torch.bfloat16
        assert all(p.grad.dtype == p.dtype == torch.float32 for p in bucket.params)


def test_gradients_are_views_of_the_buckets() -> None:
    """No copy in or out: the slot is ``.grad`` from the first backward on, whatever
    ``zero_grad`` does; under a bf16 policy the fp32 gradient is separate."""
    run_distributed(_bucket_view_worker, 2)


# ----------------------------------------------------------------------------- wrapping, API


def _broadcast_worker(rank: int, world_size: int) -> None:
    model = make_model(seed=rank)  # different weights on every rank
    model.register_buffer("table", torch.full((3,), float(rank)))
    model = DDP(model)
    expected = make_model(seed=0).state_dict()
    for name, value in model.state_dict().items():
        if name == "table":
            assert torch.equal(value, torch.zeros(3))
        else:
            assert torch.equal(value, expected[name]), f"rank {rank}: {name} is not rank 0's"


def test_wrapping_broadcasts_rank0_parameters_and_buffers() -> None:
    run_distributed(_broadcast_worker, 3)


def _api_worker(rank: int, world_size: int) -> None:
    plain = make_model()
    model = DDP(copy.deepcopy(plain))
    # state_dict: the plain model's keys and values; load_state_dict takes them back.
    assert list(model.state_dict()) == list(plain.state_dict())
    other = make_model(seed=5)
    model.load_state_dict(other.state_dict())
    assert all(torch.equal(v, other.state_dict()[k]) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="assign=True: the parameters are real.*leave assign out"):
        model.load_state_dict(other.state_dict(), assign=True)
    # Optimizers accept the wrapper's parameters, named or not, and reject foreign ones.
    DDPAdamW(model.named_parameters())
    DDPSGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="wrap the model first"):
        DDPSGD([{"params": model.parameters()}, {"params": plain.parameters()}], lr=0.1)
    optimizer = DDPAdamW(model.named_parameters())
    with pytest.raises(ValueError, match="'extra'"):
        optimizer.add_param_group({"params": [("extra", nn.Parameter(torch.zeros(2)))]})
    # Wrapping errors are raised on every rank at the same point (collectives stay in step).
    with pytest.raises(ValueError, match="already belongs"):
        DDP(model.module)
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        DDP(make_model(), bucket_cap_mb=0)
    # torch DDP's keywords: device_ids name the GPU the module is on (refused for a CPU module,
    # as by torch); unused parameters are always found, so find_unused_parameters is accepted.
    with pytest.raises(ValueError, match=r"parameters are on \['cpu'\].*leave device_ids out"):
        DDP(make_model(), device_ids=[rank], output_device=rank)
    with pytest.raises(ValueError, match="device_ids is a keyword here"):
        DDP(make_model(), [rank])
    DDP(make_model(), find_unused_parameters=True, broadcast_buffers=False)
    # ... and its other common keywords: gradients are bucket views and the buckets follow
    # each step's graph anyway; a group of every rank is the default one, a subgroup refused.
    DDP(make_model(), bucket_cap_mb=None, gradient_as_bucket_view=True, static_graph=True)
    DDP(make_model(), process_group=dist.group.WORLD)
    DDP(make_model(), process_group=dist.new_group(list(range(world_size))))
    subgroup = dist.new_group([0])
    with pytest.raises(ValueError, match=r"1 of 2 ranks.*leave process_group out"):
        DDP(make_model(), process_group=subgroup)
    torch.manual_seed(0)
    mismatched = nn.Linear(3, 2 + rank)
    if world_size > 1:
        with pytest.raises(ValueError, match="differs from rank 0"):
            DDP(mismatched)


def test_state_dict_optimizer_checks_and_wrapping_errors() -> None:
    run_distributed(_api_worker, 2)


@pytest.mark.parametrize("optimizer_cls", [DDPAdamW, DDPSGD])
def test_ddp_optimizer_on_an_unwrapped_model_raises(optimizer_cls: type) -> None:
    plain = make_model()
    with pytest.raises(ValueError, match=r"wrap the model first \(model = DDP\(model\)\)"):
        optimizer_cls(plain.named_parameters(), lr=0.1)


def test_ddp_without_a_process_group_raises() -> None:
    if dist.is_initialized():
        pytest.skip("this process has a process group")
    with pytest.raises(RuntimeError, match="init_process_group"):
        DDP(make_model())


def _sizes(buckets) -> List[List[int]]:
    return [[p.numel() for p in bucket.params] for bucket in buckets]


def test_buckets_follow_reverse_order_cap_and_dtype() -> None:
    params = [nn.Parameter(torch.zeros(n)) for n in (10, 20, 30, 5, 100)]
    # Cap of 35 fp32 values: 100 alone (larger than the cap), then 5+30, then 20+10.
    buckets = build_buckets(params, bucket_cap_bytes=35 * 4, world_size=2)
    assert _sizes(buckets) == [[100], [5, 30], [20, 10]]
    assert [b.buffer.numel() for b in buckets] == [101, 37, 32]  # gradients + one flag each
    mixed: Dict[int, nn.Parameter] = {
        n: nn.Parameter(torch.zeros(n, dtype=torch.bfloat16 if n % 2 else torch.float32))
        for n in (2, 3, 4, 5)
    }
    buckets = build_buckets(list(mixed.values()), bucket_cap_bytes=1 << 20, world_size=2)
    assert _sizes(buckets) == [[5, 3], [4, 2]]  # one dtype per bucket, in order of first use
    assert [b.buffer.dtype for b in buckets] == [torch.bfloat16, torch.float32]
