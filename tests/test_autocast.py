"""``torch.autocast``: the layer wrappers compute as their ``torch.nn`` layers do under autocast,
and every strategy trains as PyTorch's DDP + ``torch.optim`` under the same autocast, whether
``backward()`` is called inside the autocast region or after it ([Note: autocast] in
``tiny_fsdp/core/module/base.py``).
"""

import copy
import dataclasses
from typing import Callable, Dict, List, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from example.model import GPTConfigs
from tests.build import adamw, build
from tests.devices import CPU_AND_CUDA
from tests.harness import run_distributed
from tests.parity import LOSS_ATOL, PARAM_ATOL, global_batch, local_slice, make_model
from tiny_fsdp.core.module import CallbackModule, convert_module
from tiny_fsdp.core.module import base as callback_base

LOW = [torch.bfloat16, torch.float16]
STRATEGIES = ["ddp", "zero1", "zero2", "zero3", "fsdp"]
STEPS, ROWS, SEQ, VOCAB = 3, 2, 8, 64
HYPER = dict(lr=1e-3, weight_decay=0.1)
# Every wrapper but RMSNorm calls the kernels torch.nn's forward and autograd call: bit for bit.
# RMSNorm's hand-written backward sums in another order than autograd's formula, with autocast
# or without (no op of it is autocast on CPU): tests/test_extending.py's 1e-6.
RMSNORM_ATOL = 1e-6


class ConvLM(nn.Module):
    """Conv1d / Conv2d with 'same' padding (the 2-d one asymmetric), BatchNorm, GroupNorm,
    LayerNorm, a head and a raw 0-d parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.c1 = nn.Conv1d(8, 16, 3, padding="same")
        self.bn = nn.BatchNorm1d(16)
        self.gn = nn.GroupNorm(4, 16)
        self.c2 = nn.Conv2d(1, 2, 4, padding="same", bias=False)
        self.ln = nn.LayerNorm(32)
        self.head = nn.Linear(32, VOCAB)
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx).transpose(1, 2)  # (B, 8, T)
        h = self.gn(F.relu(self.bn(self.c1(h))))  # (B, 16, T)
        h = self.c2(h.unsqueeze(1)).flatten(1, 2).transpose(1, 2)  # (B, T, 32)
        return self.head(self.ln(h)) * self.scale


# ------------------------------------------------------------------------------- one layer


def _layers() -> Dict[str, Tuple[nn.Module, Callable[[], torch.Tensor]]]:
    """name -> (torch.nn layer, its input), inputs in fp32 and, where a low-precision layer
    feeds them, in bf16."""
    torch.manual_seed(0)
    return {
        "linear": (nn.Linear(6, 5), lambda: torch.randn(2, 3, 6)),
        "layernorm": (nn.LayerNorm(6), lambda: torch.randn(2, 3, 6)),
        "layernorm-bf16-input": (nn.LayerNorm(6), lambda: torch.randn(2, 3, 6).bfloat16()),
        "rmsnorm": (nn.RMSNorm(6), lambda: torch.randn(2, 3, 6)),
        "embedding": (nn.Embedding(7, 5), lambda: torch.randint(7, (2, 3))),
        "conv1d": (nn.Conv1d(4, 6, 3, padding="same"), lambda: torch.randn(2, 4, 9)),
        "conv2d": (nn.Conv2d(2, 3, 4, padding="same", bias=False), lambda: torch.randn(2, 2, 5, 5)),
    }


@pytest.mark.parametrize("device", CPU_AND_CUDA)
@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("name", list(_layers()))
def test_each_wrapper_computes_as_its_torch_layer(name: str, dtype: torch.dtype, device: str):
    """Same output dtype and values, same gradients (in the parameters' fp32), bit for bit on
    CPU: the wrapper calls the ops torch.nn calls and its backward casts as autograd's cast
    nodes do (on CUDA autocast also runs layer norm in fp32; gradients there within one
    rounding of the low dtype)."""
    ref, make_input = _layers()[name]
    ref = ref.to(device)
    ours = convert_module(copy.deepcopy(ref))
    assert isinstance(ours, CallbackModule)
    x_ref = make_input().to(device)
    if x_ref.is_floating_point():
        x_ref.requires_grad_()
    x_ours = x_ref.detach().clone().requires_grad_(x_ref.requires_grad)
    with torch.autocast(device, dtype=dtype):
        out_ref, out_ours = ref(x_ref), ours(x_ours)
    assert out_ours.dtype == out_ref.dtype
    assert torch.equal(out_ours, out_ref)
    grad_out = torch.randn_like(out_ref)
    out_ref.backward(grad_out)
    out_ours.backward(grad_out)
    atol = RMSNORM_ATOL if name == "rmsnorm" else 0.0
    grads = [("input", x_ours.grad, x_ref.grad)] if x_ref.requires_grad else []
    for (key, p_ref), p_ours in zip(ref.named_parameters(), ours.parameters()):
        assert p_ref.grad.dtype == torch.float32, key  # the parameter's, as autograd casts
        grads.append((key, p_ours.grad, p_ref.grad))
    for key, got, want in grads:
        assert got.dtype == want.dtype, f"{name}: grad of {key} in {got.dtype}"
        if device == "cuda":  # CUDA's backward kernels may sum with atomics (any order)
            atol = max(atol, torch.finfo(dtype).eps * want.abs().max().item())
        gap = (got - want).abs().max().item()
        assert gap <= atol, f"{name}: grad of {key} differs by {gap:.2e}"


@pytest.mark.parametrize("ask_the_device", [False, True])
@pytest.mark.parametrize("name", ["linear", "layernorm", "conv1d"])
def test_a_backward_inside_autocast_after_a_forward_without_computes_as_torch(
    name: str, ask_the_device: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forward without autocast whose ``backward()`` runs inside ``torch.autocast`` (a loss
    region that also covers the backward): the wrapper's gradients equal the torch layer's, bit
    for bit. Autocast casts the torch layer's backward ops there (a linear's matmuls run in
    bf16), so the wrapper's backward must not restore its forward's fp32. ``ask_the_device``:
    the forward records its device's autocast state, as where torch has no query for "autocast
    on anywhere" or some device has it on."""
    if ask_the_device:
        monkeypatch.setattr(callback_base, "_any_autocast", None)
    ref, make_input = _layers()[name]
    ours = convert_module(copy.deepcopy(ref))
    x = make_input().requires_grad_()
    grad_out = torch.randn_like(ref(x))
    grads = []
    for module in (ref, ours):
        x.grad = None
        out = module(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out.backward(grad_out)
        grads.append([x.grad, *(p.grad for p in module.parameters())])
    for want, got in zip(*grads):
        assert got.dtype == want.dtype == torch.float32
        assert torch.equal(got, want)


# ------------------------------------------------------------------------- every strategy


def _models() -> Dict[str, Callable[[], nn.Module]]:
    gpt2 = dataclasses.replace(GPTConfigs.gpt2_tiny, vocab_size=VOCAB)
    models = {"gpt2": lambda: make_model(0, gpt2), "conv": ConvLM}
    try:
        import transformers as tf
    except ImportError:
        return models
    models["hf-llama"] = lambda: tf.LlamaForCausalLM(
        tf.LlamaConfig(hidden_size=12, intermediate_size=20, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, vocab_size=VOCAB,
                       max_position_embeddings=32, bos_token_id=0, eos_token_id=0,
                       pad_token_id=0)  # fmt: skip
    )
    return models


def _logits(output) -> torch.Tensor:
    return getattr(output, "logits", output)


def _train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    rank: int,
    world_size: int,
    dtype: torch.dtype,
    backward_inside: bool,
) -> Tuple[List[float], Dict[str, torch.Tensor]]:
    """STEPS steps under autocast: losses and final state. Checks that the model's last linear
    layer computes in ``dtype`` (the run does not ignore autocast)."""
    losses, computed_in = [], set()
    head = [m for m in model.modules() if isinstance(m, nn.Linear)][-1]
    head.register_forward_hook(lambda module, args, out: computed_in.add(out.dtype))
    for step in range(STEPS):
        x, y = global_batch(step, ROWS * world_size, SEQ, VOCAB)
        x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
        with torch.autocast("cpu", dtype=dtype):
            logits = _logits(model(x)).float()
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
            if backward_inside:
                loss.backward()
        if not backward_inside:
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert computed_in == {dtype}, computed_in
    torch_ddp = isinstance(model, nn.parallel.DistributedDataParallel)
    state = (model.module if torch_ddp else model).state_dict()  # ours: full, plain keys
    return losses, {k: v.detach().float().clone() for k, v in state.items()}


def _torch_ddp(build_model, rank, world_size, dtype, backward_inside):
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(build_model(), broadcast_buffers=False)
    optimizer = torch.optim.AdamW(ddp.parameters(), **HYPER)
    return _train(ddp, optimizer, rank, world_size, dtype, backward_inside)


def _strategies_worker(rank: int, world_size: int) -> List[str]:
    checked = []
    cases = [(torch.bfloat16, False), (torch.float16, True)]  # (autocast dtype, backward inside)
    for name, build_model in _models().items():
        for dtype, inside in cases:
            want_losses, want = _torch_ddp(build_model, rank, world_size, dtype, inside)
            for strategy in STRATEGIES:
                what = f"rank {rank} {name} {strategy} {dtype} backward inside={inside}"
                torch.manual_seed(0)
                # Buffers are not broadcast, as in FSDP / ZeRO-3 and the oracle.
                kw = {"broadcast_buffers": False} if strategy in ("ddp", "zero1", "zero2") else {}
                model, optimizer = build(strategy, build_model(), adamw(**HYPER), **kw)
                losses, got = _train(model, optimizer, rank, world_size, dtype, inside)
                # Same ops on the same operands in the same dtypes; only the fp32 gradient
                # average is summed in another order, as in fp32 training: tests/parity.py's
                # tolerances.
                for step, (a, b) in enumerate(zip(losses, want_losses)):
                    assert abs(a - b) <= LOSS_ATOL, f"{what} step {step}: loss {a} vs {b}"
                assert set(got) == set(want), what
                gap = max((got[k] - want[k]).abs().max().item() for k in want if want[k].numel())
                assert gap <= PARAM_ATOL, f"{what}: parameters differ by {gap:.2e}"
                checked.append(what)
    return checked


def test_every_strategy_trains_as_torch_ddp_under_autocast() -> None:
    results = run_distributed(_strategies_worker, 2, timeout=300.0)
    assert len(results[0]) == len(_models()) * 2 * len(STRATEGIES)


# ---------------------------------------------------------------------------- loss scaling

# torch.amp.GradScaler with every strategy but ZeRO-2, as with torch's DDP ([Note: agreeing on
# overflow]); FSDP and ZeRO-3 also with the ShardedGradScaler that PyTorch's FSDP asks for.
SCALERS = [
    ("ddp", "GradScaler"),
    ("zero1", "GradScaler"),
    ("zero3", "GradScaler"),
    ("fsdp", "GradScaler"),
    ("zero3", "Sharded"),
    ("fsdp", "Sharded"),
]
OVERFLOW_STEP, INIT_SCALE = 1, 2.0**10


def _scaler(kind: str) -> torch.amp.GradScaler:
    if kind == "Sharded":
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler("cpu", init_scale=INIT_SCALE)
    return torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)


def _scaled_lm() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(VOCAB, 16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, VOCAB)
    )


def _train_scaled(model, optimizer, scaler, rank, world_size) -> List[Tuple[float, float]]:
    """fp16 autocast with loss scaling; at OVERFLOW_STEP rank 0's gradient of its first token's
    embedding becomes inf: one row of the embedding's gradient (the last, so under FSDP one
    shard, under ZeRO-3 one owner) overflows, and every rank must skip that step and halve its
    scale. Returns (loss, scale after the step) per step."""
    embedding = next(m for m in model.modules() if isinstance(m, nn.Embedding))
    overflow = [False]

    def poison(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad[0, 0] = float("inf")
        return grad

    def hook(module, args, out) -> None:
        if overflow[0] and rank == 0:
            out.register_hook(poison)

    embedding.register_forward_hook(hook)
    trace = []
    for step in range(4):
        overflow[0] = step == OVERFLOW_STEP
        x, y = global_batch(step, ROWS * world_size, SEQ, VOCAB)
        x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
        if overflow[0] and rank == 0:
            x = x.clone()
            x[0, 0] = VOCAB - 1
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(x).float()
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        trace.append((loss.item(), scaler.get_scale()))
    return trace


def _scaling_worker(rank: int, world_size: int) -> None:
    ddp = nn.parallel.DistributedDataParallel(_scaled_lm())
    optimizer = torch.optim.AdamW(ddp.parameters(), **HYPER)
    want = _train_scaled(ddp, optimizer, _scaler("GradScaler"), rank, world_size)
    want_state = ddp.module.state_dict()
    assert want[OVERFLOW_STEP][1] == INIT_SCALE / 2  # the step overflowed and was skipped
    from tiny_fsdp.core import Zero1, Zero1Optimizer

    def torch_class_under_zero1() -> Tuple[nn.Module, torch.optim.Optimizer]:
        model = Zero1(_scaled_lm())  # ZeroRedundancyOptimizer's way: a torch.optim class
        optimizer = Zero1Optimizer(model.named_parameters(), torch.optim.AdamW, **HYPER)
        return model, optimizer

    builders = [
        (strategy, kind, lambda strategy=strategy: build(strategy, _scaled_lm(), adamw(**HYPER)))
        for strategy, kind in SCALERS
    ] + [("zero1 with torch.optim.AdamW", "GradScaler", torch_class_under_zero1)]
    for strategy, kind, make in builders:
        model, optimizer = make()
        got = _train_scaled(model, optimizer, _scaler(kind), rank, world_size)
        # The same fp16 ops; the fp32 gradient average is summed in another order.
        for step, ((loss, scale), (want_loss, want_scale)) in enumerate(zip(got, want)):
            what = f"{strategy} with {kind} step {step}"
            assert scale == want_scale, f"{what}: scale {scale}, not {want_scale}"
            assert abs(loss - want_loss) <= LOSS_ATOL, what
        state = model.state_dict()
        gap = max((state[k] - v).abs().max().item() for k, v in want_state.items())
        assert gap <= PARAM_ATOL, f"{strategy} with {kind}: parameters differ by {gap:.2e}"
    model, optimizer = build("zero2", _scaled_lm(), adamw(**HYPER))
    with pytest.raises(TypeError, match="ZeRO-2 keeps its reduced gradients in shards"):
        _train_scaled(model, optimizer, _scaler("Sharded"), rank, world_size)


def test_loss_scaling_skips_an_overflowing_step_on_every_rank() -> None:
    """Each strategy with a loss scaler (ZeRO-2: a clear error) follows torch's DDP +
    GradScaler through a step where only one shard's gradient overflows."""
    run_distributed(_scaling_worker, 2, timeout=300.0)
