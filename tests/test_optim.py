"""Specification of tiny_fsdp's SGD and AdamW, with torch.optim as the oracle."""

from __future__ import annotations

import io
from typing import Any, Callable

import pytest
import torch
from torch import nn

from example.model import GPT2Model, GPTConfigs
from tiny_fsdp.core.optim import SGD, AdamW, BaseOptimizer, adamw_update_, sgd_update_
from tiny_fsdp.core.optim.base import (
    CPU_UPDATE_BATCH_BYTES,
    UPDATE_BATCH_BYTES,
    sum_of_squares,
    update_batches,
)

# Both implementations run the same fp32 ops in the same order; 1e-6 leaves room for a
# different kernel (e.g. lerp vs mul/add) rounding differently without hiding a real bug.
ATOL = 1e-6
N_STEPS = 25
SHAPES = [(5, 3), (3,), (2, 2, 2)]

SGD_CONFIGS = [
    dict(lr=0.1),
    dict(lr=0.1, weight_decay=0.1),
    dict(lr=0.05, momentum=0.9),
    dict(lr=0.05, momentum=0.9, dampening=0.3),
    dict(lr=0.05, momentum=0.9, nesterov=True),
    dict(lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.05, maximize=True),
    dict(lr=0.1, maximize=True),
]
ADAMW_CONFIGS = [
    dict(lr=0.01),
    dict(lr=0.01, weight_decay=0.0),
    dict(lr=0.01, weight_decay=0.1),
    dict(lr=0.01, amsgrad=True),
    dict(lr=0.01, betas=(0.8, 0.99), eps=1e-6, maximize=True),
    dict(lr=0.02, weight_decay=0.05, amsgrad=True, maximize=True),
]
CASES = [(SGD, torch.optim.SGD, c) for c in SGD_CONFIGS] + [
    (AdamW, torch.optim.AdamW, c) for c in ADAMW_CONFIGS
]
CASE_IDS = [f"{ours.__name__}-{cfg}" for ours, _, cfg in CASES]
# One representative stateful config per optimizer, for the API tests below.
SGD_MOMENTUM = (SGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.3))
ADAMW_AMSGRAD = (AdamW, torch.optim.AdamW, dict(lr=0.02, weight_decay=0.05, amsgrad=True))
REPRESENTATIVE = pytest.mark.parametrize(
    "ours_cls, ref_cls, cfg", [SGD_MOMENTUM, ADAMW_AMSGRAD], ids=["SGD", "AdamW"]
)


def make_params(seed: int = 0) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]


def clone_params(params: list[nn.Parameter]) -> list[nn.Parameter]:
    return [nn.Parameter(p.detach().clone()) for p in params]


def set_random_grads(param_sets: list[list[nn.Parameter]], gen: torch.Generator, step: int) -> None:
    """Give every param set the same fresh gradients; the last param has none every 3rd step."""
    for i, shape in enumerate(SHAPES):
        skip = i == len(SHAPES) - 1 and step % 3 == 0
        grad = None if skip else torch.randn(shape, generator=gen)
        for params in param_sets:
            params[i].grad = None if grad is None else grad.clone()


def assert_same(ours: list[torch.Tensor], ref: list[torch.Tensor], atol: float = ATOL) -> None:
    for a, b in zip(ours, ref):
        assert (a - b).abs().max().item() <= atol


def assert_same_state(ours: torch.optim.Optimizer, ref: torch.optim.Optimizer) -> None:
    """Compare per-parameter state (ignoring empty entries) via state_dict ids."""
    a = {k: v for k, v in ours.state_dict()["state"].items() if v}
    b = {k: v for k, v in ref.state_dict()["state"].items() if v}
    assert a.keys() == b.keys()
    for pid in a:
        assert {k for k, v in a[pid].items() if v is not None} == {
            k for k, v in b[pid].items() if v is not None
        }
        for key, value in a[pid].items():
            if value is not None:
                assert (value.float() - b[pid][key].float()).abs().max().item() <= ATOL


def run_lockstep(
    ours: torch.optim.Optimizer,
    ref: torch.optim.Optimizer,
    param_sets: list[list[nn.Parameter]],
    steps: int,
    on_step: Callable[[], None] = lambda: None,
) -> None:
    """Step both optimizers on identical fresh gradients; params must agree after every step."""
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        set_random_grads(param_sets, gen, step)
        ours.step()
        ref.step()
        on_step()
        assert_same(param_sets[0], param_sets[1])


@pytest.mark.parametrize("ours_cls, ref_cls, cfg", CASES, ids=CASE_IDS)
def test_matches_torch_optim(ours_cls: type, ref_cls: type, cfg: dict[str, Any]) -> None:
    ours_p = make_params()
    ref_p = clone_params(ours_p)
    ours = ours_cls(ours_p, **cfg)
    ref = ref_cls(ref_p, foreach=False, **cfg)
    run_lockstep(ours, ref, [ours_p, ref_p], N_STEPS)
    assert_same_state(ours, ref)


@REPRESENTATIVE
def test_two_param_groups_with_own_lr_and_weight_decay(ours_cls, ref_cls, cfg) -> None:
    ours_p = make_params()
    ref_p = clone_params(ours_p)

    def groups(p):
        return [{"params": p[:1], "lr": 0.003, "weight_decay": 0.2}, {"params": p[1:]}]

    ours = ours_cls(groups(ours_p), **cfg)
    ref = ref_cls(groups(ref_p), foreach=False, **cfg)
    assert [g["lr"] for g in ours.param_groups] == [0.003, cfg["lr"]]
    run_lockstep(ours, ref, [ours_p, ref_p], N_STEPS)
    assert_same_state(ours, ref)


@pytest.mark.parametrize("cls", [SGD, AdamW])
def test_step_state_is_per_parameter(cls: type) -> None:
    """A param skipped on some steps keeps its own step count (AdamW bias correction)."""
    params = make_params()
    opt = cls(params, lr=0.1, momentum=0.9) if cls is SGD else cls(params, lr=0.1)
    gen = torch.Generator().manual_seed(0)
    for step in range(6):
        set_random_grads([params], gen, step)
        opt.step()
    if cls is AdamW:
        assert opt.state[params[0]]["step"].item() == 6.0
        assert opt.state[params[-1]]["step"].item() == 4.0  # no grad on steps 0 and 3
        assert opt.state[params[0]]["step"].dtype == torch.float32
        assert opt.state[params[0]]["step"].dim() == 0
    else:
        assert all("momentum_buffer" in opt.state[p] for p in params)


@pytest.mark.parametrize("cls", [SGD, AdamW])
def test_accepts_named_parameters_and_records_names(cls: type) -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    opt = cls(model.named_parameters(), lr=0.1)
    assert opt.param_groups[0]["param_names"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert opt.param_groups[0]["params"] == list(model.parameters())


@pytest.mark.parametrize("cls", [SGD, AdamW])
def test_accepts_groups_of_named_parameters(cls: type) -> None:
    model = nn.Linear(3, 4)
    named = list(model.named_parameters())
    opt = cls([{"params": named[:1], "lr": 0.5}, {"params": named[1:]}], lr=0.1)
    assert [g["param_names"] for g in opt.param_groups] == [["weight"], ["bias"]]
    assert [g["lr"] for g in opt.param_groups] == [0.5, 0.1]
    assert opt.param_groups[1]["params"][0] is model.bias


@pytest.mark.parametrize("cls", [SGD, AdamW])
def test_unnamed_params_get_flat_index_names(cls: type) -> None:
    p = make_params()
    opt = cls([{"params": p[:2]}, {"params": p[2:]}], lr=0.1)
    assert [g["param_names"] for g in opt.param_groups] == [["param0", "param1"], ["param2"]]
    opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
    assert opt.param_groups[-1]["param_names"] == ["param3"]
    assert opt.param_groups[-1]["lr"] == 0.1  # defaults filled in


@pytest.mark.parametrize("cls", [SGD, AdamW])
def test_add_named_param_group_trains_it(cls: type) -> None:
    p = make_params()
    opt = cls(p[:1], lr=0.1)
    extra = nn.Parameter(torch.ones(3))
    opt.add_param_group({"params": [("extra", extra)], "lr": 0.2})
    assert opt.param_groups[-1]["param_names"] == ["extra"]
    extra.grad = torch.ones(3)
    opt.step()
    assert not torch.equal(extra.detach(), torch.ones(3))


@pytest.mark.parametrize(
    "params, error",
    [
        (lambda p: [("a", p[0]), p[1]], ValueError),  # names on some params only
        (lambda p: p[0], TypeError),  # a bare tensor is not an iterable of params
        (lambda p: [], ValueError),  # nothing to optimise
        (lambda p: set(p), TypeError),  # unordered
        (lambda p: [{"params": p[:1]}, p[1]], TypeError),  # mixing groups and params
        (lambda p: [{"params": p[:1], "param_names": ["a", "b"]}], ValueError),  # wrong count
    ],
    ids=["partly-named", "bare-tensor", "empty", "set", "groups-and-params", "names-count"],
)
def test_rejects_malformed_params(params: Callable, error: type) -> None:
    with pytest.raises(error):
        SGD(params(make_params()), lr=0.1)


@REPRESENTATIVE
def test_state_dict_round_trip_continues_identically(ours_cls, ref_cls, cfg) -> None:
    uninterrupted_p = make_params()
    resumed_p = clone_params(uninterrupted_p)
    uninterrupted = ours_cls(uninterrupted_p, **cfg)
    first = ours_cls(resumed_p, **cfg)
    gen = torch.Generator().manual_seed(3)
    for step in range(10):
        set_random_grads([uninterrupted_p, resumed_p], gen, step)
        uninterrupted.step()
        first.step()

    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    resumed_p = clone_params(resumed_p)  # fresh parameter objects, as after a restart
    resumed = ours_cls(resumed_p, lr=123.0)  # hyper-parameters must come from the checkpoint
    resumed.load_state_dict(torch.load(buffer))
    assert resumed.param_groups[0]["lr"] == cfg["lr"]

    for step in range(10, 20):
        set_random_grads([uninterrupted_p, resumed_p], gen, step)
        uninterrupted.step()
        resumed.step()
        # Identical ops on identical inputs: bitwise equal, no tolerance needed.
        assert_same(uninterrupted_p, resumed_p, atol=0.0)
    assert_same_state(resumed, uninterrupted)


@REPRESENTATIVE
def test_works_with_lr_scheduler(ours_cls, ref_cls, cfg) -> None:
    ours_p = make_params()
    ref_p = clone_params(ours_p)
    ours = ours_cls(ours_p, **cfg)
    ref = ref_cls(ref_p, foreach=False, **cfg)
    ours_sched = torch.optim.lr_scheduler.LambdaLR(ours, lambda step: 0.8**step)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref, lambda step: 0.8**step)

    def advance() -> None:
        ours_sched.step()
        ref_sched.step()

    run_lockstep(ours, ref, [ours_p, ref_p], N_STEPS, on_step=advance)
    assert ours.param_groups[0]["lr"] == pytest.approx(cfg["lr"] * 0.8**N_STEPS)
    assert ours.param_groups[0]["lr"] == ref.param_groups[0]["lr"]


@pytest.mark.parametrize(
    "cls, kwargs, match",
    [
        (SGD, dict(lr=-0.1), "-0.1"),
        (SGD, dict(lr=0.1, momentum=-0.5), "-0.5"),
        (SGD, dict(lr=0.1, weight_decay=-0.01), "-0.01"),
        (SGD, dict(lr=0.1, nesterov=True), "momentum=0.0"),
        (SGD, dict(lr=0.1, momentum=0.9, dampening=0.1, nesterov=True), "dampening=0.1"),
        (AdamW, dict(lr=-1.0), "-1.0"),
        (AdamW, dict(eps=-1e-8), "-1e-08"),
        (AdamW, dict(betas=(1.0, 0.999)), "index 0: 1.0"),
        (AdamW, dict(betas=(0.9, -0.1)), "index 1: -0.1"),
        (AdamW, dict(weight_decay=-0.5), "-0.5"),
        (AdamW, dict(fused="yes"), "fused"),
        (AdamW, dict(foreach="no"), "foreach"),
        (AdamW, dict(fused=True, foreach=True), "together"),
    ],
)
def test_bad_hyperparameters_raise(cls: type, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        cls(make_params(), **kwargs)
    # The same check applies to a group that overrides the bad value.
    opt = cls(make_params()[:1], lr=0.1)
    with pytest.raises(ValueError, match=match):
        opt.add_param_group({"params": make_params()[1:], **kwargs})


@pytest.mark.parametrize("cls", [SGD, AdamW])
def test_zero_grad_and_closure(cls: type) -> None:
    params = make_params()
    opt = cls(params, lr=0.1)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = sum((p**2).sum() for p in params)
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and loss.requires_grad  # closure ran with grad enabled
    opt.zero_grad()
    assert all(p.grad is None for p in params)


ADAMW_RULE_HYPER = dict(
    lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, amsgrad=True, maximize=True
)


@pytest.mark.parametrize(
    "rule, hyper",
    [
        (sgd_update_, dict(lr=0.1, momentum=0.9, weight_decay=0.1, maximize=True)),
        (adamw_update_, ADAMW_RULE_HYPER),  # the fused kernel (default on the CPU)
        (adamw_update_, dict(ADAMW_RULE_HYPER, fused=False)),  # the foreach ops
    ],
    ids=["sgd", "adamw", "adamw-foreach"],
)
def test_rule_is_elementwise_and_leaves_grad_alone(rule: Callable, hyper: dict[str, Any]) -> None:
    """Updating a list of tensors, each tensor alone, or dim-0 shards with their own state: the
    same result bit for bit, and the grads are untouched. 70 x 4 = 280 elements: the fused
    kernel's vector loop takes 256 of the whole tensor but 128 of each 140-element shard
    ([Note: fused AdamW on the CPU]); an empty tensor is updated too (to nothing)."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(70, 4), (3,), (2, 3, 2), (0,)]
    together = [torch.randn(s, generator=gen) for s in shapes]
    alone = [t.clone() for t in together]
    shards = [s.clone() for s in together[0].chunk(2)]
    together_states: list[dict] = [{} for _ in shapes]
    alone_states: list[dict] = [{} for _ in shapes]
    shard_states: list[dict] = [{}, {}]
    for _ in range(5):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        grads_before = [g.clone() for g in grads]
        rule(together, grads, together_states, **hyper)
        for t, g, state in zip(alone, grads, alone_states):
            rule([t], [g], [state], **hyper)
        rule(shards, list(grads[0].chunk(2)), shard_states, **hyper)
        assert all(torch.equal(g, before) for g, before in zip(grads, grads_before))
    # Same elementwise ops on the same values: results agree bitwise.
    assert all(torch.equal(a, b) for a, b in zip(together, alone))
    assert torch.equal(torch.cat(shards), together[0])
    for key in together_states[0]:
        if key != "step":
            assert torch.equal(torch.cat([s[key] for s in shard_states]), together_states[0][key])


@pytest.mark.parametrize("cfg", ADAMW_CONFIGS, ids=[str(c) for c in ADAMW_CONFIGS])
def test_adamw_runs_torchs_fused_kernel_on_the_cpu_and_foreach_ops_when_asked(cfg) -> None:
    """Default: torch's one-pass CPU kernel, bit for bit ``torch.optim.AdamW(fused=True)`` on
    tensors whose size is a multiple of the kernel's vector width (elsewhere its scalar loop
    rounds the last elements its own way, [Note: fused AdamW on the CPU]). ``fused=False``, or
    torch's ``foreach`` given: bit for bit ``torch.optim.AdamW``'s CPU default (its for-loop).
    The profiler names the kernel each one ran."""
    shapes = [(64, 3), (128,)]
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=gen) for s in shapes]
    runs = {}
    for key, cls, kwargs in [
        ("ours", AdamW, {}),
        ("ours_foreach", AdamW, dict(fused=False)),
        ("ours_foreach_true", AdamW, dict(foreach=True)),  # torch's keywords, as torch's
        ("ours_foreach_false", AdamW, dict(foreach=False)),
        ("torch_fused", torch.optim.AdamW, dict(fused=True)),
        ("torch_default", torch.optim.AdamW, dict(foreach=False)),
    ]:
        params = [nn.Parameter(t.clone()) for t in start]
        optimizer = cls(params, **cfg, **kwargs)
        grads = torch.Generator().manual_seed(1)
        for _ in range(N_STEPS):
            for p in params:
                p.grad = torch.randn(p.shape, generator=grads)
            optimizer.step()
        runs[key] = params
    same = {
        pair: all(torch.equal(a, b) for a, b in zip(runs[pair[0]], runs[pair[1]]))
        for pair in [
            ("ours", "torch_fused"),
            ("ours_foreach", "torch_default"),
            ("ours_foreach_true", "torch_default"),
            ("ours_foreach_false", "torch_default"),
        ]
    }
    assert all(same.values()), same
    assert_same(runs["ours"], runs["torch_default"])  # rounding apart: within ATOL
    # Which kernel ran, as the profiler sees it (whether the two kernels round these values
    # apart depends on the CPU's vector width: on some machines they agree bit for bit).
    for kwargs, fused in [({}, True), (dict(fused=False), False), (dict(foreach=True), False)]:
        params = [nn.Parameter(t.clone()) for t in start]
        for p in params:
            p.grad = torch.ones_like(p)
        optimizer = AdamW(params, **cfg, **kwargs)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            optimizer.step()
        ops = {event.key for event in prof.key_averages()}
        assert ("aten::_fused_adamw_" in ops) == fused, (kwargs, sorted(ops))


def test_adamw_chooses_the_kernel_tensor_by_tensor() -> None:
    """A tensor the fused kernel cannot take (here non-contiguous, as a channels_last weight)
    takes the foreach ops without moving the others of its call off the kernel."""
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(64, 3, generator=gen), torch.randn(3, 64, generator=gen).t()]
    assert not start[1].is_contiguous()
    together = [t.clone() for t in start]
    alone = [start[0].clone(), start[1].clone()]
    alone_states, together_states = [{}, {}], [{}, {}]
    hyper = dict(lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
    for _ in range(N_STEPS):
        grads = [torch.randn(t.shape, generator=gen) for t in start]
        adamw_update_(together, grads, together_states, **hyper)
        adamw_update_(alone[:1], grads[:1], alone_states[:1], **hyper)
        adamw_update_(alone[1:], grads[1:], alone_states[1:], **hyper, fused=False)
    assert all(torch.equal(a, b) for a, b in zip(together, alone))


def test_adamw_steps_a_cpu_model_in_one_fused_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused kernel keeps no temporaries and pays for tails per call, so AdamW does not cut
    its CPU tensors into the foreach ops' small batches (CPU_UPDATE_BATCH_BYTES)."""
    calls = []
    kernel = torch._fused_adamw_
    monkeypatch.setattr(torch, "_fused_adamw_", lambda *a, **kw: calls.append(kernel(*a, **kw)))
    params = [nn.Parameter(torch.randn(20_000)) for _ in range(40)]  # 3.2 MB
    assert sum(p.numel() * 4 for p in params) > 4 * CPU_UPDATE_BATCH_BYTES
    for p in params:
        p.grad = torch.randn_like(p)
    AdamW(params).step()
    assert len(calls) == 1


def test_adamw_fused_true_refuses_what_the_kernel_cannot_take() -> None:
    """bf16 parameters take the foreach ops by default; ``fused=True`` says it cannot."""
    param = nn.Parameter(torch.randn(8).bfloat16())
    param.grad = torch.randn(8).bfloat16()
    AdamW([param]).step()
    with pytest.raises(ValueError, match="fused=True"):
        AdamW([param], fused=True).step()


def test_update_batches_share_device_and_dtype_and_cap_their_bytes() -> None:
    """A rule gets tensors of one dtype (and device) at a time, at most max_bytes of them unless
    a single tensor is larger; every tensor is updated exactly once."""
    f32 = [torch.zeros(n) for n in (10, 10, 30, 5)]  # 40, 40, 120, 20 bytes
    f64 = [torch.zeros(3, dtype=torch.float64)]
    updates = [(t, t, {"i": i}) for i, t in enumerate(f32[:2] + f64 + f32[2:])]
    batches = list(update_batches(updates, limit=lambda device: 100))
    as_ids = [[state["i"] for state in states] for _, _, states in batches]
    assert sorted(as_ids) == [[0, 1], [2], [3], [4]]
    for params, grads, states in batches:
        assert len({(p.dtype, p.device) for p in params}) == 1
        assert sum(p.numel() * p.element_size() for p in params) <= 100 or len(params) == 1
        assert all(p is g for p, g in zip(params, grads))
    # On the CPU small tensors share a call up to CPU_UPDATE_BATCH_BYTES; a larger one is alone.
    cap = CPU_UPDATE_BATCH_BYTES
    sizes = (cap // 16, cap // 8, cap // 4)  # float32: a quarter, a half, all of the cap
    big = [(t, t, {}) for t in map(torch.zeros, sizes)]
    assert [len(params) for params, _, _ in update_batches(updates)] == [4, 1]  # by dtype
    assert [len(params) for params, _, _ in update_batches(big)] == [2, 1]


def test_an_accelerator_steps_gpt2_124m_in_a_few_calls_of_the_rule() -> None:
    """[Note: one update rule]: on an accelerator a batch holds up to UPDATE_BATCH_BYTES of
    parameters, so GPT-2 124M's 148 tensors (475 MiB of fp32) take four calls of ~10
    multi-tensor kernels each, not 14 (32 MiB batches, which left a GPU waiting for its host);
    the rule's temporaries stay within a batch (the token embedding, 147 MiB, is one alone),
    where torch.optim.AdamW's are the size of the whole model."""
    with torch.device("meta"):
        params = list(GPT2Model(GPTConfigs.gpt2).parameters())
    batches = [p for p, _, _ in update_batches((p, p, {}) for p in params)]
    assert len(params) == 148 and len(batches) == 4
    assert all(
        sum(p.numel() * 4 for p in batch) <= UPDATE_BATCH_BYTES or len(batch) == 1
        for batch in batches
    )


class ShardedSGD(SGD):
    """Updates each parameter as two dim-0 halves with separate state, like a ZeRO shard."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shard_state: dict[tuple[int, int], dict] = {}

    def _tensors_to_update(self, group):
        for param in group["params"]:
            if param.grad is not None:
                for i, (p, g) in enumerate(zip(param.chunk(2), param.grad.chunk(2))):
                    yield p, g, self.shard_state.setdefault((id(param), i), {})


def test_subclass_chooses_which_tensors_to_update() -> None:
    full_p = make_params()
    shard_p = clone_params(full_p)
    cfg = dict(lr=0.05, momentum=0.9, weight_decay=0.1)
    full = SGD(full_p, **cfg)
    sharded = ShardedSGD(shard_p, **cfg)
    gen = torch.Generator().manual_seed(2)
    for step in range(5):
        set_random_grads([full_p, shard_p], gen, step)
        full.step()
        sharded.step()
    assert_same(full_p, shard_p, atol=0.0)  # elementwise rule: bitwise equal
    assert len(sharded.state) == 0 and len(sharded.shard_state) == 2 * len(SHAPES)
    assert isinstance(sharded, BaseOptimizer) and isinstance(sharded, torch.optim.Optimizer)


def test_sum_of_squares_for_clipping_is_accurate_on_large_cpu_tensors() -> None:
    """The global norm adds millions of squares: float32 added one by one drifts (torch's CPU
    norm kernel: 6e-5 relative here), pairwise summation stays within a few ulps."""
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(2**21, generator=gen), torch.randn(3, 5, generator=gen).bfloat16()]
    exact = sum(t.double().square().sum() for t in tensors).item()
    got = sum_of_squares(tensors)
    assert got.dtype == torch.float32 and got.dim() == 0
    assert abs(got.item() / exact - 1) < 1e-6
