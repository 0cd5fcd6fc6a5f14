"""Training features x every strategy, each against single-device training with the same feature.

Features: gradient accumulation (``no_sync``), gradient clipping (``clip_grad_norm_``), gradient
checkpointing, asynchronous communication, mixed precision (bf16 policy) and ``model.half()``.
Strategies: single device (``convert_module`` + our optimizer), DDP, ZeRO-1, ZeRO-2, ZeRO-3,
FSDP. Every rank also trains the single-device reference on the whole global batch, so one
``run_distributed`` call checks all strategies of a feature.
"""

import argparse
import contextlib
import weakref
from typing import Any, Callable, Dict, List, Optional

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from example.model import GPTConfigs
from example.trainer import lr_at
from example.trainer import main as trainer_main
from tests.build import adamw, build
from tests.harness import run_distributed
from tests.parity import PARAM_ATOL, global_batch, lm_loss, local_slice, make_model
from tiny_fsdp.core import comm
from tiny_fsdp.core.module import ParamHandler, convert_module
from tiny_fsdp.core.overflow import AGREEMENT_BYTES
from tiny_fsdp.core.precision import MixedPrecisionPolicy, apply_mixed_precision
from tiny_fsdp.core.zero.grad_stores import FLAG_DTYPE

STRATEGIES = ["single", "ddp", "zero1", "zero2", "zero3", "fsdp"]
# FSDP gathers per layer here (its default is per block): the checkpointing figures below count
# one all-gather per layer.
PER_LAYER = {"fsdp": {"unit": "layer"}, "zero3": {"unit": "tensor"}}  # counts below: per layer
DISTRIBUTED = STRATEGIES[1:]
LR = 1e-3
ADAMW = adamw(lr=LR)  # every strategy's own AdamW
CONFIG = GPTConfigs.gpt2_tiny
BATCH_PER_RANK, SEQ = 2, 8
BF16 = MixedPrecisionPolicy(torch.bfloat16)
PARAM_KINDS = ("all_gather", "broadcast")  # collectives that move parameters in a step
GRAD_KINDS = ("all_reduce", "reduce_scatter", "reduce")  # ... and gradients

# fp32 strategy vs fp32 single device: summation order only (see tests/parity.py).
LOSS_ATOL = 1e-5
# bf16 strategy vs bf16 single device, 4 steps, lr 1e-3: gradients are averaged in bf16 (one
# rounding of 2^-9 relative per reduction, absent on one device) and, for ZeRO-1/2, tied and
# accumulated gradients add in the bf16 parameters' .grad; Adam turns a relative gradient
# difference into an update difference of order lr, and near-zero gradients (attention key bias)
# into updates of size ~lr. An early Adam step moves a parameter by at most ~lr, so two runs
# differ by at most 2 lr per step: 8e-3 after 4 steps. Measured: losses within 1.4e-4 (every
# strategy); parameters within 3.0e-3 (DDP, ZeRO-3, FSDP) and 3.8e-3 (ZeRO-1/2).
BF16_LOSS_ATOL = 1e-3
BF16_PARAM_ATOL = 2 * LR * 4
# bf16 vs fp32 loss curve, FSDP, 50 steps cycling 4 batches (fp32 falls 4.20 -> 3.72): bf16 has
# 8 mantissa bits, so each forward is off by ~2^-9 relative; measured worst step 5.1e-4, mean
# 1.7e-4. 1e-2 is 0.25 % of the loss, far below the 0.48 the curve falls.
BF16_CURVE_ATOL = 1e-2
BF16_CURVE_MIN_DROP = 0.3


# ---------------------------------------------------------------------------------- training


def train(
    strategy: str,
    rank: int,
    world_size: int,
    steps: int,
    *,
    policy: Optional[MixedPrecisionPolicy] = None,
    async_comm: bool = False,
    grad_accum: int = 1,
    clip: Optional[float] = None,
    ckpt: bool = False,
    on_step: Optional[Callable[[int], None]] = None,
    n_batches: Optional[int] = None,
) -> Dict[str, object]:
    """Train gpt2_tiny ``steps`` steps; return losses (rank mean), clip norms, full state dict.

    The single-device run sees the whole global batch; the others their rank's slice. Each step
    splits its batch into ``grad_accum`` equal micro-batches, the inner ones under ``no_sync()``
    (which rows share a micro-batch differs between one device and N ranks; the step's
    gradient, the mean over the whole global batch, does not).
    ``n_batches``: cycle through that many global batches (a loss curve that really falls).
    """
    single = strategy == "single"
    model, optimizer = build(
        strategy,
        make_model(0, CONFIG),
        ADAMW,
        mixed_precision=policy,
        enable_async_communication=async_comm,
        **PER_LAYER.get(strategy, {}),
    )
    model.gradient_checkpointing = ckpt
    losses, norms = [], []
    for step in range(steps):
        batch = step if n_batches is None else step % n_batches
        x, y = global_batch(batch, BATCH_PER_RANK * world_size * grad_accum, SEQ, CONFIG.vocab_size)
        if not single:
            x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
        step_loss = torch.zeros(())
        for micro, (xm, ym) in enumerate(zip(x.chunk(grad_accum), y.chunk(grad_accum))):
            inner = micro < grad_accum - 1 and not single
            with model.no_sync() if inner else contextlib.nullcontext():
                loss = lm_loss(model(xm).float(), ym) / grad_accum
                loss.backward()
            step_loss += loss.detach()
        if clip is not None:
            norms.append(optimizer.clip_grad_norm_(clip).item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if not single:
            torch.distributed.all_reduce(step_loss)  # logging only: not counted in the ledger
            step_loss /= world_size
        losses.append(step_loss.item())
        if on_step is not None:
            on_step(step)
    state = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    return {
        "losses": losses,
        "norms": norms,
        "state": state,
        "model": model,
        "optimizer": optimizer,
    }


def assert_close_run(got: dict, want: dict, loss_atol: float, param_atol: float, what: str):
    for step, (a, b) in enumerate(zip(got["losses"], want["losses"])):
        assert abs(a - b) <= loss_atol, f"{what} step {step}: loss {a:.7f} vs {b:.7f}"
    assert set(got["state"]) == set(want["state"]), what
    for name, value in want["state"].items():
        diff = (got["state"][name] - value).abs().max().item()
        assert diff <= param_atol, f"{what}: parameter {name} differs by {diff:.3e}"


def assert_identical_run(got: dict, want: dict, what: str) -> None:
    assert got["losses"] == want["losses"], f"{what}: {got['losses']} vs {want['losses']}"
    for name, value in want["state"].items():
        assert torch.equal(got["state"][name], value), f"{what}: parameter {name} differs"


# ---------------------------------------------------------------------------------- features


def _check_grad_accum(rank: int, world_size: int) -> None:
    """K=2 micro-batches: the same run as single-device K=2; inner micro-steps reduce nothing."""
    reference = train("single", rank, world_size, steps=3, grad_accum=2)
    for strategy in DISTRIBUTED:
        # A backward inside no_sync() issues no gradient collective at all.
        model, optimizer = build(strategy, make_model(0, CONFIG), ADAMW)
        x, y = global_batch(0, BATCH_PER_RANK * world_size, SEQ, CONFIG.vocab_size)
        comm.LEDGER.reset()
        with model.no_sync():
            xs, ys = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
            lm_loss(model(xs), ys).backward()
        inner = sum(comm.LEDGER.calls[k] for k in GRAD_KINDS)
        assert inner == 0, f"{strategy}: {inner} gradient collectives inside no_sync()"
        model.set_requires_gradient_sync(False)  # FSDP2's spelling of no_sync()
        lm_loss(model(xs), ys).backward()
        inner = sum(comm.LEDGER.calls[k] for k in GRAD_KINDS)
        assert inner == 0, f"{strategy}: {inner} gradient collectives without gradient sync"
        model.set_requires_gradient_sync(True)
        assert model.require_backward_grad_sync, strategy
        with pytest.raises(ValueError, match="recurse=True"):
            model.set_requires_gradient_sync(False, recurse=False)
        got = train(strategy, rank, world_size, steps=3, grad_accum=2)
        assert_close_run(got, reference, LOSS_ATOL, PARAM_ATOL, f"{strategy} grad_accum=2")


def _check_clipping(rank: int, world_size: int) -> None:
    """``optimizer.clip_grad_norm_`` == ``torch.nn.utils.clip_grad_norm_`` on one device."""
    max_norm = 0.05  # below the gradient norm of every step (asserted), so clipping acts
    torch_model = make_model(0, CONFIG)
    torch_opt = torch.optim.AdamW(torch_model.parameters(), lr=LR)
    want = {"losses": [], "norms": []}
    for step in range(3):
        x, y = global_batch(step, BATCH_PER_RANK * world_size, SEQ, CONFIG.vocab_size)
        loss = lm_loss(torch_model(x), y)
        loss.backward()
        want["norms"].append(torch.nn.utils.clip_grad_norm_(torch_model.parameters(), max_norm))
        torch_opt.step()
        torch_opt.zero_grad(set_to_none=True)
        want["losses"].append(loss.item())
    assert min(want["norms"]) > 2 * max_norm, "the test must really clip"
    want["state"] = {k: v.detach().clone() for k, v in torch_model.state_dict().items()}
    for strategy in STRATEGIES:
        got = train(strategy, rank, world_size, steps=3, clip=max_norm)
        # Norms: the same squares summed in another order (per shard, then across ranks).
        torch.testing.assert_close(
            torch.tensor(got["norms"]),
            torch.stack(want["norms"]),
            rtol=1e-5,
            atol=0,
            msg=lambda m: f"{strategy}: {m}",
        )
        assert_close_run(got, want, LOSS_ATOL, PARAM_ATOL, f"{strategy} clip={max_norm}")


def _check_checkpointing(rank: int, world_size: int) -> None:
    """Recomputing blocks changes no number; FSDP / ZeRO-3 gather the blocks' params again."""
    blocks = make_model(0, CONFIG).transformer.h
    block_layers = [m for m in blocks.modules() if isinstance(m, (nn.Linear, nn.LayerNorm))]
    block_tensors = sum(len(list(m.parameters(recurse=False))) for m in block_layers)
    last_tensors = sum(len(list(block.mlp.c_proj.parameters())) for block in blocks)
    # Backward of a block's last layer reads its saved input first, which recomputes the block
    # inside that backward: FSDP gathers every block layer once more (one all-gather per
    # layer, the unit these tests use) and ZeRO-3 broadcasts every block tensor once more (one
    # broadcast per tensor, its unit here), except those of the last layer (mlp.c_proj), whose
    # recomputation finds the unit its backward holds.
    extra_fetches = {
        "fsdp": ("all_gather", len(block_layers) - len(blocks)),
        "zero3": ("broadcast", block_tensors - last_tensors),
    }
    for strategy in STRATEGIES:
        calls = {}
        runs = {}
        for ckpt in (False, True):

            def count(step: int, ckpt: bool = ckpt) -> None:
                calls.setdefault(ckpt, dict(comm.LEDGER.calls))

            comm.LEDGER.reset()
            runs[ckpt] = train(strategy, rank, world_size, steps=1, ckpt=ckpt, on_step=count)
        # The same kernels on the same inputs: bitwise equal, not just close.
        assert_identical_run(runs[True], runs[False], f"{strategy} gradient checkpointing")
        for kind in GRAD_KINDS:
            assert calls[True].get(kind, 0) == calls[False].get(kind, 0), (strategy, kind)
        if strategy == "zero3":  # every fetched buffer accounted as released again
            assert runs[True]["model"].fetch_stats.live_bytes == 0
        if strategy in extra_fetches:
            kind, extra = extra_fetches[strategy]
            got = calls[True].get(kind, 0) - calls[False].get(kind, 0)
            assert got == extra, f"{strategy}: {got} extra {kind} with checkpointing, not {extra}"


def _check_async(rank: int, world_size: int) -> None:
    """``enable_async_communication`` on and off: bitwise identical runs (fp32 and bf16)."""
    for strategy in DISTRIBUTED:
        for policy in (None, BF16):
            off = train(strategy, rank, world_size, steps=2, policy=policy, grad_accum=2)
            on = train(
                strategy, rank, world_size, steps=2, policy=policy, grad_accum=2, async_comm=True
            )
            assert_identical_run(on, off, f"{strategy} async on/off, policy {policy}")


def _check_bf16(rank: int, world_size: int) -> None:
    """bf16 runs follow single-device bf16; parameter and gradient bytes on the wire halve."""
    reference = train("single", rank, world_size, steps=4, policy=BF16)
    fp32_reference = train("single", rank, world_size, steps=4)
    # bf16 really computes in bf16: its losses are not the fp32 ones.
    assert reference["losses"][1:] != fp32_reference["losses"][1:]
    for strategy in DISTRIBUTED:
        got = train(strategy, rank, world_size, steps=4, policy=BF16)
        assert_close_run(got, reference, BF16_LOSS_ATOL, BF16_PARAM_ATOL, f"{strategy} bf16")
        # fp32 masters and optimizer state: the module's own tensors (FSDP / ZeRO-3 / DDP) or,
        # for ZeRO-1/2 whose stored parameters are bf16, the masters keying the optimizer state.
        optimizer = got["optimizer"]
        masters = [p for g in optimizer.param_groups for p in g["params"]]
        if strategy in ("zero1", "zero2"):
            assert {p.dtype for p in masters} == {torch.bfloat16}, strategy
            masters = list(optimizer.state)
        assert {p.dtype for p in masters} == {torch.float32}, strategy
        state = [v for st in optimizer.state.values() for v in st.values() if v.dim() > 0]
        assert state and {v.dtype for v in state} == {torch.float32}, strategy
        payload = {}
        for policy in (None, BF16):
            comm.LEDGER.reset()
            model, optimizer = build(strategy, make_model(0, CONFIG), ADAMW, mixed_precision=policy)
            x, y = global_batch(0, BATCH_PER_RANK * world_size, SEQ, CONFIG.vocab_size)
            comm.LEDGER.reset()  # count one training step, not the wrap-time broadcasts
            xs, ys = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
            lm_loss(model(xs).float(), ys).backward()
            optimizer.step()
            payload[policy] = dict(comm.LEDGER.payload_bytes)
            if strategy in ("zero1", "zero2"):  # the "had a gradient" flags are no gradients
                payload[policy]["all_reduce"] -= FLAG_DTYPE.itemsize * len(model.params)
            if strategy in ("zero3", "fsdp"):  # nor the flag of [Note: agreeing on overflow]
                payload[policy]["all_reduce"] -= AGREEMENT_BYTES
        for kinds in (PARAM_KINDS, GRAD_KINDS):
            fp32 = sum(payload[None].get(k, 0) for k in kinds)
            bf16 = sum(payload[BF16].get(k, 0) for k in kinds)
            assert 2 * bf16 == fp32, f"{strategy} {kinds}: {bf16} bf16 bytes vs {fp32} fp32"
        if strategy != "ddp":  # DDP moves no parameters during a step
            assert sum(payload[None].get(k, 0) for k in PARAM_KINDS) > 0, strategy


def _check_bf16_curve(rank: int, world_size: int) -> None:
    """50 steps of FSDP in bf16 follow the fp32 loss curve (the sharded path with every cast)."""
    fp32 = train("fsdp", rank, world_size, steps=50, n_batches=4)["losses"]
    bf16 = train("fsdp", rank, world_size, steps=50, policy=BF16, n_batches=4)["losses"]
    assert fp32[-1] < fp32[0] - BF16_CURVE_MIN_DROP, f"the curve must fall: {fp32[0]} -> {fp32[-1]}"
    worst = max(abs(a - b) for a, b in zip(fp32, bf16))
    assert worst <= BF16_CURVE_ATOL, f"bf16 loss curve off the fp32 one by {worst:.4f}"


def _check_half_raises(rank: int, world_size: int) -> None:
    """``.half()`` / ``.bfloat16()`` / ``.to(dtype)`` on a wrapper raise and name the policy."""
    for strategy in DISTRIBUTED:
        model, _ = build(strategy, make_model(0, CONFIG), ADAMW)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        for cast in (lambda m: m.half(), lambda m: m.bfloat16(), lambda m: m.to(torch.float16)):
            with pytest.raises(TypeError, match="MixedPrecisionPolicy"):
                cast(model)
        assert model.to("cpu") is model  # a device move without dtype is still allowed
        assert model.float() is model  # fp32 already: nothing to change, allowed
        after = model.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before), strategy
        with pytest.raises(ValueError, match="fp32 master"):  # a policy on a half model
            build(strategy, make_model(0, CONFIG).bfloat16(), ADAMW, mixed_precision=BF16)


def test_policy_defaults_and_validation() -> None:
    policy = MixedPrecisionPolicy(torch.bfloat16)
    assert policy.reduce_dtype == torch.bfloat16  # None means "the param dtype"
    assert MixedPrecisionPolicy(torch.bfloat16, torch.float32).reduce_dtype == torch.float32
    assert MixedPrecisionPolicy.from_name("fp32") is None
    assert MixedPrecisionPolicy.from_name("bf16") == policy
    with pytest.raises(ValueError, match="floating-point"):
        MixedPrecisionPolicy(torch.int8)
    with pytest.raises(ValueError, match="floating-point"):
        MixedPrecisionPolicy(torch.bfloat16, "bf16")
    with pytest.raises(AttributeError):  # frozen: a policy shared by wrappers cannot change
        policy.param_dtype = torch.float16  # type: ignore[misc]


def test_single_device_bf16_computes_in_bf16_keeps_fp32_masters() -> None:
    model = apply_mixed_precision(convert_module(make_model(0, CONFIG)), BF16)
    seen = []
    model.lm_head.register_forward_hook(lambda m, i, o: seen.append((i[0].dtype, o.dtype)))
    x, y = global_batch(0, 2, SEQ, CONFIG.vocab_size)
    lm_loss(model(x).float(), y).backward()
    assert seen == [(torch.bfloat16, torch.bfloat16)]
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert {p.grad.dtype for p in model.parameters()} == {torch.float32}
    with pytest.raises(ValueError, match="already has"):  # a strategy handler is not replaced
        model.lm_head.param_handler = object.__new__(type("Other", (ParamHandler,), {}))
        apply_mixed_precision(model, BF16)


class _WeightCasts(TorchDispatchMode):
    """Weak references to the copies of ``params`` cast to another dtype, in making order."""

    def __init__(self, params: List[torch.Tensor]) -> None:
        super().__init__()
        self.addresses = {p.data_ptr() for p in params}
        self.made: List[weakref.ref] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and args[0].data_ptr() in self.addresses:
            self.made.append(weakref.ref(out))
        return out

    def alive(self) -> int:
        return sum(ref() is not None for ref in self.made)


def test_single_device_bf16_casts_each_weight_once_a_step_and_keeps_no_cast() -> None:
    # As torch.autocast: the forward's casts are kept in the graph for the backward (which
    # casts nothing), and dropped by it; a forward that records no graph keeps none.
    model = apply_mixed_precision(convert_module(make_model(0, CONFIG)), BF16)
    x, y = global_batch(0, 2, SEQ, CONFIG.vocab_size)
    with torch.no_grad(), _WeightCasts(list(model.parameters())) as casts:
        logits = model(x)
    per_forward = len(casts.made)
    assert per_forward >= len(list(model.parameters())) and casts.alive() == 0
    with _WeightCasts(list(model.parameters())) as casts:
        loss = lm_loss(model(x).float(), y)
        assert casts.alive() == per_forward  # kept for the backward
        loss.backward()
    assert len(casts.made) == per_forward and casts.alive() == 0  # loss (and graph) still alive
    del logits, loss


def test_lr_schedule_warmup_then_cosine() -> None:
    args = argparse.Namespace(lr=1.0, warmup_steps=4, steps=14, min_lr_ratio=0.1)
    assert [lr_at(step, args) for step in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert lr_at(9, args) == pytest.approx(0.55)  # half-way down the cosine: (peak + floor) / 2
    assert lr_at(14, args) == pytest.approx(0.1) and lr_at(99, args) == pytest.approx(0.1)


def test_trainer_precision_flag() -> None:
    """``--precision bf16`` trains through the shared loop, near the fp32 run."""
    argv = "--model gpt2_bytes --steps 2 --batch_size 1 --seq_len 16 --tokenizer byte --lr 1e-3"
    fp32 = trainer_main("single_device", argv.split() + ["--precision", "fp32"])
    bf16 = trainer_main("single_device", argv.split() + ["--precision", "bf16"])
    assert fp32 != bf16  # really another dtype
    # Same data and init; bf16 rounding (2^-9 relative) keeps the losses ~1e-3 apart (loss ~5.5).
    assert max(abs(a - b) for a, b in zip(fp32, bf16)) < 5e-2, (fp32, bf16)


@pytest.mark.parametrize(
    "check",
    [
        _check_grad_accum,
        _check_clipping,
        _check_checkpointing,
        _check_async,
        _check_bf16,
        _check_bf16_curve,
        _check_half_raises,
    ],
    ids=lambda f: f.__name__[len("_check_") :],
)
@pytest.mark.parametrize("world_size", [2])
def test_feature_every_strategy(check: Callable, world_size: int) -> None:
    run_distributed(check, world_size, timeout=300.0)


# 3 ranks: no dimension of gpt2_tiny divides evenly (padding rows, uneven ZeRO pieces), for the
# two features whose arithmetic crosses shards: the clipping norm and bf16 reductions.
@pytest.mark.parametrize("check", [_check_clipping, _check_bf16], ids=["clipping", "bf16"])
def test_sharded_features_on_three_ranks(check: Callable) -> None:
    run_distributed(check, 3, timeout=300.0)
