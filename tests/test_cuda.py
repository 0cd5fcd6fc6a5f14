"""Every strategy on CUDA (``pytest -m cuda``; skipped without a GPU): NCCL at world size 1.

Parity recipe of ``tests/parity.py`` on ``cuda:0``: a plain GPT-2 with ``torch.optim.AdamW`` is
the reference; each strategy trains a copy for a few steps and its losses and final parameters
must match. With several ranks (2 sharing the GPU through gloo) FSDP and ZeRO-3 issue their
collectives through side streams ([Note: communication streams]); on one rank, where each
collective is the identity, through none. The optimizers' update rule runs as multi-tensor
kernels.
``benchmarks/gpu.sh`` runs every test marked ``cuda``, then the throughput check.
"""

import copy
import functools
from collections import OrderedDict
from typing import Any, Tuple

import pytest
import torch
from torch import nn

from tests.harness import run_distributed
from tests.parity import global_batch, lm_loss, make_model

pytestmark = pytest.mark.cuda

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")
HYPER = dict(lr=1e-3, weight_decay=0.1)
STEPS = 3


def _wrap(strategy: str, model: nn.Module, world_size: int) -> Tuple[nn.Module, Any]:
    """Every argument at its default, as a user wraps (ZeRO-3's table over ``world_size``)."""
    from tiny_fsdp.core import zero
    from tiny_fsdp.core.ddp import DDP, DDPAdamW
    from tiny_fsdp.core.fsdp import FSDP, FSDPAdamW, hsdp_mesh
    from tiny_fsdp.core.zero3 import Zero3, Zero3AdamW, zero3_partition_tensors

    if strategy == "ddp":
        wrapped = DDP(model)
        return wrapped, DDPAdamW(wrapped.named_parameters(), **HYPER)
    if strategy in ("zero1", "zero2"):
        stage = strategy[-1]
        wrapped = getattr(zero, f"Zero{stage}")(model)
        return wrapped, getattr(zero, f"Zero{stage}AdamW")(wrapped.named_parameters(), **HYPER)
    if strategy == "zero3":
        device = str(next(model.parameters()).device)
        named = OrderedDict(model.named_parameters())
        parts, _ = zero3_partition_tensors(named, [device] * world_size)
        wrapped = Zero3(model, parts)
        return wrapped, Zero3AdamW(
            wrapped.module.named_parameters(), param_part_table=parts, **HYPER
        )
    if strategy == "hsdp":  # a mesh on the default group's device: CUDA under NCCL
        mesh = hsdp_mesh(1, node_local=False)
        assert mesh.device_type == "cuda", mesh
        wrapped = FSDP(model, mesh=mesh)
    else:
        wrapped = FSDP(model)
    return wrapped, FSDPAdamW(wrapped.named_parameters(), **HYPER)


def _parity_on_cuda(rank: int, world_size: int) -> None:
    from tiny_fsdp.core.streams import CudaStreams

    device = torch.device("cuda", 0)
    reference = make_model(0).to(device)
    for strategy in (*STRATEGIES, "hsdp"):
        ref = copy.deepcopy(reference)
        ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)
        model, opt = _wrap(strategy, copy.deepcopy(reference), 1)
        if strategy in ("zero3", "fsdp", "hsdp"):  # one rank: every collective is done at once, on
            runtime = model._runtime if strategy == "zero3" else model._state  # no side stream
            assert not isinstance(runtime.streams, CudaStreams), strategy
        for step in range(STEPS):
            x, y = (t.to(device) for t in global_batch(step, 2, 8, 67))
            losses = []
            for net, optimizer in ((ref, ref_opt), (model, opt)):
                loss = lm_loss(net(x), y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                losses.append(loss.item())
            assert abs(losses[0] - losses[1]) < 1e-4, (strategy, step, losses)
        full = model.state_dict()
        for name, value in ref.state_dict().items():
            assert torch.allclose(full[name].to(device), value, atol=1e-4), (strategy, name)
    torch.cuda.synchronize()


def test_every_strategy_matches_pytorch_on_cuda_with_nccl() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    run_distributed(_parity_on_cuda, 1, backend="nccl")


def _makes_the_host_wait(step: Any) -> bool:
    """Whether ``step()`` calls anything that blocks the host on the GPU (CUDA's sync debug
    mode raises there)."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    except RuntimeError as error:
        if "synchronizing" not in str(error):
            raise
        return True
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return False


def _steps_without_host_sync(rank: int, world_size: int) -> Tuple[list, list]:
    """(models and strategies checked, models skipped): per model, a plain copy with
    torch.optim.AdamW first (a model whose own code waits for the GPU, as transformers' GPT-2
    does to check for padding, is skipped), then each strategy with default arguments; the
    third step is checked (the first makes buffers and optimizer state)."""
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    checked, skipped = [], []
    for name, (build, loss_fn, vocab) in _one_gpu_models(device).items():
        x, y = (t.to(device) for t in global_batch(0, 2, 8, vocab))
        plain = build()
        wraps = [(name, plain, torch.optim.AdamW(plain.parameters(), **HYPER))]
        for strategy in STRATEGIES:
            torch.manual_seed(0)
            wraps.append((f"{name} {strategy}", *_wrap(strategy, build(), world_size)))
        for label, model, opt in wraps:

            def step(model: nn.Module = model, opt: Any = opt) -> None:
                loss_fn(model, x, y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            step()
            step()
            if model is plain:
                if _makes_the_host_wait(step):
                    skipped.append(name)
                    break
                continue
            assert not _makes_the_host_wait(step), f"{label}: the host waited for the GPU"
            checked.append(label)
    torch.cuda.synchronize()
    return checked, skipped


def test_a_training_step_makes_the_host_wait_for_the_gpu_nowhere() -> None:
    """Issue 17's "no host synchronisation inside a step": forward, backward (reductions and
    their finalize) and the optimizer's step only queue work, so the host runs ahead of the
    GPU. CUDA's sync debug mode raises at any call that would block the host on the device (a
    read of a device value, a synchronous copy, a stream or device synchronisation). One rank
    on NCCL; our GPT-2 (registered layers) and transformers' models (generic path)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    checked, skipped = run_distributed(_steps_without_host_sync, 1, backend="nccl")[0]
    assert "gpt2_tiny" not in skipped, skipped  # our own model never waits
    assert len(checked) >= len(STRATEGIES), (checked, skipped)


def test_adamw_launches_a_few_kernels_per_batch_on_cuda() -> None:
    """[Note: one update rule]: on CUDA a step is a few multi-tensor kernels per batch, not a
    dozen per tensor, and it matches torch.optim.AdamW (its foreach default there)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from torch.profiler import ProfilerActivity, profile

    from tiny_fsdp.core.optim import AdamW

    gen = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(64, generator=gen).cuda()) for _ in range(150)]
    ref = [nn.Parameter(p.detach().clone()) for p in params]
    for p, r in zip(params, ref):
        p.grad = torch.randn(64, generator=gen).cuda()
        r.grad = p.grad.clone()
    ours, theirs = AdamW(params, **HYPER), torch.optim.AdamW(ref, **HYPER)
    ours.step()  # the state is made on the first step
    theirs.step()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        ours.step()
        torch.cuda.synchronize()
    theirs.step()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert 0 < len(kernels) < len(params), len(kernels)  # per tensor it would be ~8 each
    for p, r in zip(params, ref):
        torch.testing.assert_close(p, r, atol=1e-6, rtol=0)


def test_a_list_is_cast_in_one_launch_on_cuda() -> None:
    """[Note: casts in one launch]: DDP's bf16 compute copies of 150 parameters, and an AdamW
    step whose gradients are bf16 (ZeRO-1/2's), launch a few kernels, not one per tensor, and
    give ``.to``'s values and torch.optim.AdamW's update of the fp32 gradients."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from torch.profiler import ProfilerActivity, profile

    from tiny_fsdp.core.ddp.mixed_precision import ParamCast
    from tiny_fsdp.core.optim import adamw_update_

    def kernels_of(run: Any) -> int:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
        return sum(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events())

    gen = torch.Generator().manual_seed(0)
    shapes = [(64,), (3, 40), (5, 2, 7)] * 50
    params = [nn.Parameter(torch.randn(s, generator=gen).cuda()) for s in shapes]
    expected = [p.detach().to(torch.bfloat16) for p in params]
    cast = ParamCast(params, torch.bfloat16)
    assert kernels_of(cast.to_compute) < 10
    assert all(p.dtype == torch.bfloat16 and torch.equal(p, e) for p, e in zip(params, expected))
    cast.to_master()
    assert all(p.dtype == torch.float32 for p in params)

    # The rule with bf16 gradients (ZeRO-1/2's pieces), with them cast beforehand, and torch's.
    grads = [torch.randn(p.shape, generator=gen).cuda().to(torch.bfloat16) for p in params]
    ours, cast_first = [p.detach().clone() for p in params], [p.detach().clone() for p in params]
    ref = [nn.Parameter(p.detach().clone()) for p in params]
    for r, g in zip(ref, grads):
        r.grad = g.float()
    theirs = torch.optim.AdamW(ref, **HYPER, foreach=True)
    hyper = dict(lr=HYPER["lr"], beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
    states: Any = ([{} for _ in params], [{} for _ in params])
    for _ in range(2):  # the state is made on the first step, the kernels counted on the second
        launched = kernels_of(functools.partial(adamw_update_, ours, grads, states[0], **hyper))
        adamw_update_(cast_first, [g.float() for g in grads], states[1], **hyper)
        theirs.step()
    assert launched < 30, launched  # one per tensor: 150 casts alone
    assert all(torch.equal(a, b) for a, b in zip(ours, cast_first))
    for a, r in zip(ours, ref):
        torch.testing.assert_close(a, r, atol=1e-6, rtol=0)  # as in the test above


def test_adamw_runs_the_foreach_ops_on_cuda_and_refuses_fused_true() -> None:
    """[Note: fused AdamW on the CPU]: the fused kernel is the CPU's; on CUDA the default is the
    foreach ops (``fused=False`` bit for bit) and ``fused=True`` says it cannot."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from tiny_fsdp.core.optim import AdamW

    gen = torch.Generator().manual_seed(0)
    start, grad = torch.randn(100, generator=gen).cuda(), torch.randn(100, generator=gen).cuda()
    results = []
    for fused in (None, False):
        param = nn.Parameter(start.clone())
        param.grad = grad.clone()
        AdamW([param], **HYPER, fused=fused).step()
        results.append(param.detach())
    assert torch.equal(results[0], results[1])
    param.grad = grad.clone()
    with pytest.raises(ValueError, match="fused=True"):
        AdamW([param], **HYPER, fused=True).step()


def _ddp_takes_torch_device_ids(rank: int, world_size: int) -> None:
    from tiny_fsdp.core.ddp import DDP

    device = torch.device("cuda", 0)
    reference = make_model(0).to(device)
    model = DDP(copy.deepcopy(reference), device_ids=[0], output_device=0)
    x, y = global_batch(0, 2, 8, reference.config.vocab_size)  # on the CPU
    logits = model(x)  # moved to device_ids[0], as torch's DDP does
    assert logits.device == device
    torch.testing.assert_close(logits, reference(x.to(device)), rtol=0, atol=0)
    lm_loss(logits, y.to(device)).backward()
    assert all(p.grad is not None and p.grad.device == device for p in model.parameters())


def test_ddp_takes_torch_device_ids_and_moves_inputs() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    run_distributed(_ddp_takes_torch_device_ids, 1, backend="nccl")


class _BatchLM(nn.Module):
    """A GPT-2 called with a batch dict, ``{"idx": ids}``."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, batch: dict) -> torch.Tensor:
        return self.inner(batch["idx"])


def _sharded_move_inputs(rank: int, world_size: int) -> None:
    device = torch.device("cuda", 0)
    reference = make_model(0).to(device)
    x, y = global_batch(0, 2, 8, reference.config.vocab_size)  # on the CPU
    want = reference(x.to(device))
    for strategy in ("zero3", "fsdp"):
        model, _ = _wrap(strategy, _BatchLM(copy.deepcopy(reference)), world_size)
        logits = model({"idx": x})  # moved to the GPU, as FSDP2's root moves them
        assert logits.device == device, strategy
        # The same computation; fp32's default tolerance covers another kernel choice.
        torch.testing.assert_close(logits, want)
        lm_loss(logits, y.to(device)).backward()


def test_fsdp_and_zero3_move_inputs_to_their_gpu_as_fsdp2_does() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    run_distributed(_sharded_move_inputs, 1, backend="nccl")


# ------------------------------------------------------------ several ranks on one GPU (gloo)

GLOO_STEPS = 3


def _one_gpu_models(device: torch.device) -> dict:
    """name -> (build on ``device``, loss(model, x, y), vocab): our GPT-2 (registered layers) and
    transformers' GPT-2 / Llama (the generic path), if installed."""
    from example.model import GPTConfigs

    models = {
        "gpt2_tiny": (
            lambda: make_model(0).to(device),
            lambda m, x, y: lm_loss(m(x), y),
            GPTConfigs.gpt2_tiny.vocab_size,
        )
    }
    try:
        from tests.zoo import hf_models
    except ImportError:  # pragma: no cover - transformers missing
        return models
    for name in ("gpt2", "llama"):
        build, loss, vocab = hf_models()[name]
        models[f"hf {name}"] = (lambda build=build: build().to(device), loss, vocab)
    return models


def _train_on(model, optimizer, loss_fn, vocab, rank, world_size, device) -> list:
    from tests.parity import local_slice

    losses = []
    for step in range(GLOO_STEPS):
        x, y = global_batch(step, 2 * world_size, 8, vocab)
        x, y = (local_slice(t, rank, world_size).to(device) for t in (x, y))
        loss = loss_fn(model, x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _one_gpu_worker(rank: int, world_size: int, device_type: str) -> list:
    """Every strategy (default arguments) against torch's DDP + torch.optim.AdamW, all ranks on
    ``device_type``'s device 0 through gloo: losses every step, every tensor at the end."""
    from tests.parity import assert_trains_alike

    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    seen = []
    for name, (build, loss_fn, vocab) in _one_gpu_models(device).items():
        torch.manual_seed(0)
        oracle = nn.parallel.DistributedDataParallel(build())
        oracle_opt = torch.optim.AdamW(oracle.parameters(), **HYPER)
        want = _train_on(oracle, oracle_opt, loss_fn, vocab, rank, world_size, device)
        want_state = {k: v.detach().float().cpu() for k, v in oracle.module.state_dict().items()}
        for strategy in STRATEGIES:
            torch.manual_seed(0)
            model, opt = _wrap(strategy, build(), world_size)
            if strategy in ("zero3", "fsdp"):
                from tiny_fsdp.core.streams import CudaStreams

                runtime = model._runtime if strategy == "zero3" else model._state
                on_side_streams = isinstance(runtime.streams, CudaStreams)
                assert on_side_streams == (device.type == "cuda"), (name, strategy)
            got = _train_on(model, opt, loss_fn, vocab, rank, world_size, device)
            state = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
            # fp32 on both sides; only the summation order of the gradient differs (a
            # collective's partial sums), so tests/parity.py's AdamW tolerances hold.
            assert_trains_alike(f"{name} {strategy}", got, state, want, want_state)
            seen.append(f"{name} {strategy}")
    if device.type == "cuda":
        torch.cuda.synchronize()
    return seen


def test_every_strategy_trains_as_torch_ddp_with_two_ranks_on_one_gpu_through_gloo() -> None:
    """Several ranks on one GPU: NCCL refuses two ranks on one device, gloo carries CUDA
    tensors (through host copies), so the multi-rank paths (shards, owners, buckets) run on
    CUDA memory and CUDA streams with one GPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    for seen in run_distributed(_one_gpu_worker, 2, "cuda", timeout=300.0):
        assert len(seen) == len(_one_gpu_models(torch.device("cpu"))) * len(STRATEGIES)
