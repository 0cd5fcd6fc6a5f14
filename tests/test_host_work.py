"""Host work FSDP and ZeRO-3 do not do: per-tensor views in an unshard, a cast copy per tensor
on its way into the gather buffer under a policy, a call per tensor into the outside-read watch,
a division by one (nor do DDP and ZeRO-1/2); and their unshard buffers, made once, after an
unshard that raised. DDP and ZeRO-1/2 place a gradient with at most one view op.

An unshard's host work does not grow with the number of tensors it gathers ([Note: buffers
made once], ``core/utils/storage.py``): FSDP's and ZeRO-3's units make their buffers and every
view of them at their first unshard; later unshards dispatch a few ops per collective (copy the
local tensors in, the collective, the copy-out), not several per tensor. On a GPU each
dispatched op is host time during which the device may wait.
"""

from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from tests.harness import run_distributed
from tests.parity import global_batch, lm_loss, local_slice, make_model
from tiny_fsdp.core.ddp import DDP
from tiny_fsdp.core.fsdp import FSDP
from tiny_fsdp.core.module.handler import TrainingPhase
from tiny_fsdp.core.precision import MixedPrecisionPolicy
from tiny_fsdp.core.utils.casts import cast_all
from tiny_fsdp.core.utils.storage import holds_memory, packed_views
from tiny_fsdp.core.zero3 import Zero3, zero3_partition_tensors


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: List[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _unshard_ops(unit: Any, gathers_all: bool) -> Tuple[int, List[str]]:
    """(tensors, ops dispatched) of one unshard, wait and reshard of ``unit``; ``gathers_all``:
    every full tensor is gathered (FSDP; a ZeRO-3 owner computes with its own tensors)."""
    with _CountOps() as counter:
        unit.wait_for_unshard(unit.unshard(async_op=False))
        full = [t for t in unit.hold(unit.layers[0]) if t is not None]
        unit.release(unit.layers[0], TrainingPhase.FORWARD)
        unit.reshard()
    assert full and not (gathers_all and any(holds_memory(t) for t in full))  # freed
    return sum(len(group) for group in unit.groups), counter.ops


def _wrapped(world_size: int, policy: Optional[MixedPrecisionPolicy] = None) -> Dict[str, Any]:
    """gpt2_tiny under FSDP and under ZeRO-3, default arguments but ``policy``."""
    model = make_model(0)
    parts, _ = zero3_partition_tensors(OrderedDict(model.named_parameters()), ["cpu"] * world_size)
    return {
        "fsdp": FSDP(make_model(0), mixed_precision=policy),
        "zero3": Zero3(model, parts, mixed_precision=policy),
    }


def _worker(rank: int, world_size: int) -> Dict[str, List[Tuple[int, int, int, List[str]]]]:
    """Per strategy and unit: (tensors, groups, op count, ops) of its second unshard."""
    seen: Dict[str, List[Tuple[int, int, int, List[str]]]] = {}
    for name, wrapped in _wrapped(world_size).items():
        seen[name] = []
        for unit in wrapped.units:
            _unshard_ops(unit, name == "fsdp")  # the first makes the buffers
            tensors, ops = _unshard_ops(unit, name == "fsdp")
            seen[name].append((tensors, len(unit.groups), len(ops), ops))
    return seen


def test_an_unshard_dispatches_a_few_ops_per_collective_not_per_tensor() -> None:
    # gpt2_tiny's units: two blocks of 12 tensors and the root; before buffers were made once,
    # FSDP dispatched about 7 ops per tensor (views of the shards, of the output, of the
    # copy-out, the full views), ZeRO-3 about 2 per tensor it received.
    for per_rank in run_distributed(_worker, 2):
        for name, units in per_rank.items():
            assert max(tensors for tensors, _, _, _ in units) >= 12, (name, units)
            for tensors, groups, ops, names in units:
                # Per group: the copy in, the collective (on gloo a broadcast per rank, each
                # from a view of the output: [Note: collectives on gloo]) and the copy-out.
                assert ops <= groups * (4 + 2 * 2), (name, tensors, groups, names)


_ALLOCATIONS = ("aten::empty", "aten::empty_like", "aten::empty_strided")


def _unshard_allocations(rank: int, world_size: int) -> Dict[str, List[Tuple[int, int, int]]]:
    """Per strategy under a bf16 policy and unit: (tensors, groups, tensors allocated by ATen,
    inside kernels too, in its second unshard)."""
    seen: Dict[str, List[Tuple[int, int, int]]] = {}
    for name, wrapped in _wrapped(world_size, MixedPrecisionPolicy(torch.bfloat16)).items():
        seen[name] = []
        for unit in wrapped.units:
            _unshard_ops(unit, name == "fsdp")  # the first makes the buffers
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                tensors, _ = _unshard_ops(unit, name == "fsdp")
            allocated = sum(event.name in _ALLOCATIONS for event in prof.events())
            seen[name].append((tensors, len(unit.groups), allocated))
    return seen


def test_an_unshard_under_a_policy_casts_straight_into_its_buffer() -> None:
    # The owner's (ZeRO-3) or this rank's (FSDP) tensors are cast into the buffer that travels,
    # in one multi-tensor copy. torch.cat(out=) into a buffer of another dtype first made a
    # cast copy of every input (12 allocations and copies a block of gpt2_tiny; on a GPU a
    # kernel each). A buffer is at most two allocations per group (the CPU block cache).
    for per_rank in run_distributed(_unshard_allocations, 2):
        for name, units in per_rank.items():
            assert max(tensors for tensors, _, _ in units) >= 12, (name, units)
            assert all(allocated <= 2 * groups for _, groups, allocated in units), (name, units)


def _copy_outs(rank: int, world_size: int) -> List[Tuple[int, int, bool]]:
    """Per FSDP unit: (tensors, copy-outs in its second unshard, every full tensor a view of
    the all-gather output)."""
    wrapped = FSDP(make_model(0))
    seen = []
    for unit in wrapped.units:
        unit.wait_for_unshard(unit.unshard(async_op=False))  # the first makes the buffers
        unit.reshard()
        with _CountOps() as counter:
            pending = unit.unshard(async_op=False)
            unit.wait_for_unshard(pending)
        (_, buffers), *_ = pending
        out = buffers.out.buffer.untyped_storage().data_ptr()
        full = [t for t in unit.hold(unit.layers[0]) if t is not None]
        views = all(t.untyped_storage().data_ptr() == out for t in full)
        unit.release(unit.layers[0], TrainingPhase.FORWARD)
        unit.reshard()
        copies = sum("split_with_sizes_copy" in op for op in counter.ops)
        seen.append((sum(len(group) for group in unit.groups), copies, views))
    return seen


def test_on_one_rank_the_all_gather_output_is_the_full_tensors() -> None:
    # Rank-major, several ranks' shards of a unit's tensors are interleaved: one copy-out puts
    # each tensor's rows together. One rank's row is the tensors back to back, unpadded: the
    # full tensors are views of it, and an unshard copies nothing out.
    (one_rank,) = run_distributed(_copy_outs, 1)
    assert max(tensors for tensors, _, _ in one_rank) >= 12, one_rank
    assert all(copies == 0 and views for _, copies, views in one_rank), one_rank
    for two_ranks in run_distributed(_copy_outs, 2):
        several = [(c, v) for tensors, c, v in two_ranks if tensors > 1]
        assert several and all(c == 1 and not v for c, v in several), two_ranks


def _reduce_scatters_in_place(rank: int, world_size: int) -> List[bool]:
    """Per reduce-scatter of an FSDP backward: whether its output is its input."""
    from tiny_fsdp.core import comm

    wrapped = FSDP(make_model(0))
    x, y = global_batch(0, 2 * world_size, 8, 67)
    x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
    real, seen = comm.reduce_scatter, []

    def recording(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        seen.append(output.data_ptr() == input.data_ptr())
        return real(output, input, *args, **kwargs)

    comm.reduce_scatter = recording
    try:
        lm_loss(wrapped(x), y).backward()
    finally:
        comm.reduce_scatter = real
    return seen


def test_on_one_rank_a_unit_s_gradients_are_reduced_in_place() -> None:
    # A reduce-scatter on one rank is the identity: the unit's gradient buffer is its own
    # result, with no second buffer and no copy into one; with two ranks each rank receives
    # its row into a buffer of its own.
    (one_rank,) = run_distributed(_reduce_scatters_in_place, 1)
    assert len(one_rank) >= 3 and all(one_rank), one_rank
    for two_ranks in run_distributed(_reduce_scatters_in_place, 2):
        assert len(two_ranks) >= 3 and not any(two_ranks), two_ranks


def _watched_calls(rank: int, world_size: int) -> Dict[str, Tuple[int, int, int]]:
    """Per strategy: (tensors, groups of its units, calls of the watched parameters'
    ``__torch_function__`` in a later training forward)."""
    from tiny_fsdp.core.module import outside_reads

    watched = outside_reads._WatchedParam
    dispatch = watched.__dict__["__torch_function__"].__func__
    calls = [0]

    def counting(cls: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        calls[0] += 1
        return dispatch(cls, func, types, args, kwargs)

    seen = {}
    x = local_slice(global_batch(0, 2 * world_size, 8, 67)[0], rank, world_size)
    for name, wrapped in _wrapped(world_size).items():
        wrapped(x)  # the first forward of a training mode is watched another way
        watched.__torch_function__ = classmethod(counting)
        try:
            calls[0] = 0
            wrapped(x)
        finally:
            watched.__torch_function__ = classmethod(dispatch)
        groups = sum(len(unit.groups) for unit in wrapped.units)
        seen[name] = (len(list(wrapped.parameters())), groups, calls[0])
    return seen


def test_a_later_forward_watches_outside_reads_without_a_call_per_tensor() -> None:
    # A later forward makes each local parameter a subclass whose __torch_function__ runs on
    # every op that takes one ([Note: outside reads]); an unshard reads its tensors' addresses
    # (to keep its views) and each group's dtype and device (up to 4 calls a group). Each
    # address read was a call: one per tensor and forward (gpt2_tiny's 28 tensors: FSDP 34
    # calls, ZeRO-3 42).
    for per_rank in run_distributed(_watched_calls, 2):
        for name, (tensors, groups, calls) in per_rank.items():
            assert tensors >= 28 and calls <= 4 * groups < tensors, (name, tensors, groups, calls)


def _divisions(rank: int, world_size: int) -> Dict[str, int]:
    """Per strategy: division ops (``div``, ``div_``) a training backward runs."""
    from tiny_fsdp.core.zero import Zero1, Zero2

    counts = {}
    wrappers = {
        "ddp": DDP(make_model(0)),
        "zero1": Zero1(make_model(0)),
        "zero2": Zero2(make_model(0)),
        **_wrapped(world_size),
    }
    for name, wrapped in wrappers.items():
        x, y = global_batch(0, 2 * world_size, 8, 67)
        loss = lm_loss(wrapped(local_slice(x, rank, world_size)), local_slice(y, rank, world_size))
        with _CountOps() as counter:
            loss.backward()
        counts[name] = sum(op.startswith("aten.div") for op in counter.ops)
    return counts


def test_one_rank_averages_its_gradients_without_dividing_by_one() -> None:
    # x / 1 == x bit for bit, so one rank skips the pass over every reduction buffer (a kernel
    # per unit on a GPU) and DDP and ZeRO-1/2 copy each gradient into its bucket slot instead
    # of dividing it there (a cheaper op to issue); two ranks divide each buffer once before
    # its reduction, DDP and ZeRO-1/2 each gradient (gpt2_tiny's 28) as they copy it.
    expected = {"ddp": 0, "zero1": 0, "zero2": 0, "fsdp": 0, "zero3": 0}
    assert run_distributed(_divisions, 1)[0] == expected
    for counts in run_distributed(_divisions, 2):
        assert all(counts[name] >= 28 for name in ("ddp", "zero1", "zero2")), counts
        assert counts["fsdp"] >= 3 and counts["zero3"] >= 3, counts


_VIEW_OPS = ("aten.view", "aten.slice", "aten.as_strided", "aten.split", "aten._reshape_alias")


def _view_ops(rank: int, world_size: int) -> Dict[str, Tuple[int, int]]:
    """Per replicated strategy: (parameters, view ops its second backward dispatches beyond
    the plain model's)."""
    from tiny_fsdp.core.zero import Zero1, Zero2

    def views_in_backward(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
        lm_loss(model(x), y).backward()  # the first makes what later backwards reuse
        for p in model.parameters():
            p.grad = None  # zero_grad(set_to_none=True)
        loss = lm_loss(model(x), y)
        with _CountOps() as counter:
            loss.backward()
        return sum(op.startswith(_VIEW_OPS) for op in counter.ops)

    x, y = global_batch(0, 2 * world_size, 8, 67)
    x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
    own = views_in_backward(make_model(0), x, y)  # autograd's own: the layers' view backward
    wrappers = {"ddp": DDP, "zero1": Zero1, "zero2": Zero2}
    return {
        name: (
            len(list(make_model(0).parameters())),
            views_in_backward(wrap(make_model(0)), x, y) - own,
        )
        for name, wrap in wrappers.items()
    }


def test_a_backward_places_each_gradient_with_at_most_one_view_op() -> None:
    # Where each parameter's gradient goes is a view of a bucket: DDP's and ZeRO-1's buckets
    # are kept, so their views are made once; ZeRO-2's staging buffer is new each backward,
    # so each slot is one as_strided, except on one rank, where it stages into its shard
    # through views made once. Beyond that, a few view ops per bucket (its chunk of
    # this rank), fewer than half the parameters of gpt2_tiny. A slice and a reshape per slot,
    # and for ZeRO-1 such a pair per look at the slot (several a parameter: 62 ops for 28
    # parameters, ZeRO-2 59), were host work for every parameter in every step: about 3.6 us
    # a pair on the development machine's CPU.
    for world_size in (1, 2):
        for per_rank in run_distributed(_view_ops, world_size):
            for name, (params, extra) in per_rank.items():
                per_param = 1 if name == "zero2" and world_size > 1 else 0
                assert extra <= per_param * params + params // 2, (world_size, name, extra)


def _after_a_failed_unshard(rank: int, world_size: int) -> Dict[str, Any]:
    """Per strategy: the first collective of a forward raises on every rank; then one step."""
    from tiny_fsdp.core import comm

    seen: Dict[str, Any] = {}
    x, y = global_batch(0, 2 * world_size, 8, 67)
    x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
    for name, wrapped in _wrapped(world_size).items():
        kind = "all_gather" if name == "fsdp" else "broadcast"
        real = getattr(comm, kind)

        def fails(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("injected: the collective failed")

        setattr(comm, kind, fails)
        try:
            wrapped(x)
            raise AssertionError("the injected failure did not surface")
        except RuntimeError as error:
            assert "injected" in str(error), error
        finally:
            setattr(comm, kind, real)
        loss = lm_loss(wrapped(x), y)
        loss.backward()
        held = wrapped.memory_stats()["gathered_bytes"] if name == "fsdp" else None
        held = wrapped.fetch_stats.live_bytes if held is None else held
        seen[name] = (loss.item(), held)
    return seen


def test_an_unshard_that_raises_leaves_the_next_step_whole() -> None:
    # The failed unshard had allocated a buffer; a kept buffer would make the next unshard of
    # that unit refuse (an allocation over memory in use) or leak: it makes new ones instead.
    for per_rank in run_distributed(_after_a_failed_unshard, 2):
        for name, (loss, held) in per_rank.items():
            assert torch.isfinite(torch.tensor(loss)) and held == 0, (name, loss, held)


def _copied_after_a_step(rank: int, world_size: int) -> Dict[str, Any]:
    """Per strategy: a wrapper copied after a step, then both step alike: their next losses."""
    import copy

    seen: Dict[str, Any] = {}
    x, y = global_batch(0, 2 * world_size, 8, 67)
    x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
    for name, wrapped in _wrapped(world_size).items():
        lm_loss(wrapped(x), y).backward()  # every unit has made its buffers
        twin = copy.deepcopy(wrapped)
        losses = []
        for model in (wrapped, twin, wrapped):  # the original again: untouched by the copy
            model.zero_grad(set_to_none=True)
            loss = lm_loss(model(x), y)
            loss.backward()
            losses.append(loss.item())
        seen[name] = losses
    return seen


def test_a_copy_made_after_a_step_makes_buffers_of_its_own() -> None:
    # Buffers made once must not travel with a copy (copy.deepcopy of the wrapper): the copy
    # would gather into the original's memory. Same weights, same batch: the same losses.
    for per_rank in run_distributed(_copied_after_a_step, 2):
        for name, losses in per_rank.items():
            assert losses[0] == losses[1] == losses[2], (name, losses)


def _ddp_bf16_backward(rank: int, world_size: int) -> Dict[str, Any]:
    """DDP under bf16 mixed precision: the casts one backward runs, its buckets, its gradients."""
    from tiny_fsdp.core.ddp import DDP
    from tiny_fsdp.core.precision import MixedPrecisionPolicy

    model = DDP(make_model(0), mixed_precision=MixedPrecisionPolicy.from_name("bf16"))
    x, y = global_batch(0, 2 * world_size, 8, 67)
    loss = lm_loss(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size))
    with _CountOps() as counter:
        loss.backward()
    params = list(model.parameters())
    grads = [p.grad.clone() for p in params]
    # Again onto kept fp32 zeros: each average is copied into its .grad, not cast at once.
    model.zero_grad(set_to_none=False)
    lm_loss(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()
    return {
        "casts": counter.ops.count("aten._to_copy.default"),
        "buckets": len(model.buckets),
        "params": len(params),
        "grad dtypes": {p.grad.dtype for p in params},
        "grads": grads,
        "onto zeros alike": all(torch.equal(p.grad, g) for p, g in zip(params, grads)),
    }


def test_ddp_mixed_precision_casts_a_bucket_of_averages_at_once() -> None:
    # The bf16 averages of a bucket become fp32 gradients by one cast of the bucket (views of
    # it are the .grad tensors), not one cast per parameter: a kernel each on a GPU. The rest
    # of the backward casts once (the loss's fp32 logits). Both ranks hold the same averages,
    # and a backward onto kept zeros (zero_grad(set_to_none=False)) gives the same gradients.
    first, second = run_distributed(_ddp_bf16_backward, 2)
    for seen in (first, second):
        assert seen["buckets"] < seen["params"], seen["buckets"]
        assert seen["casts"] <= seen["buckets"] + 1, (seen["casts"], seen["buckets"])
        assert seen["grad dtypes"] == {torch.float32} and seen["onto zeros alike"]
    assert all(torch.equal(a, b) for a, b in zip(first["grads"], second["grads"]))


def _zero_bf16_step(rank: int, world_size: int) -> Dict[str, Any]:
    """ZeRO-1/2 under bf16: the copies one optimizer step runs (the rule's foreach ops copy
    nothing), and the buckets and pieces it writes back."""
    from tiny_fsdp.core import zero
    from tiny_fsdp.core.precision import MixedPrecisionPolicy

    seen = {}
    for stage in (1, 2):
        policy = MixedPrecisionPolicy.from_name("bf16")
        model = getattr(zero, f"Zero{stage}")(make_model(0), mixed_precision=policy)
        optimizer = getattr(zero, f"Zero{stage}AdamW")(model.named_parameters(), fused=False)
        x, y = global_batch(0, 2 * world_size, 8, 67)
        lm_loss(
            model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)
        ).backward()
        with _CountOps() as counter:
            optimizer.step()
        seen[stage] = (
            counter.ops.count("aten.copy_.default"),
            len(model.layout.buckets),
            len(model.owned_pieces),
        )
    return seen


def test_zero_mixed_precision_writes_back_a_bucket_of_masters_at_once() -> None:
    # The updated fp32 masters go back into the bf16 parameters one copy per run of adjacent
    # pieces (a bucket's chunk, when one optimizer steps them all), not one per piece.
    for per_rank in run_distributed(_zero_bf16_step, 2):
        for stage, (copies, buckets, pieces) in per_rank.items():
            assert buckets < pieces and copies <= buckets, (stage, copies, buckets, pieces)


def test_a_list_cast_together_is_to_s_casts_in_one_storage() -> None:
    # [Note: casts in one launch]: cast_all gives each tensor .to's values (one rounding); cast
    # together (an accelerator's default) the casts are views of one buffer, filled by one
    # multi-tensor copy. A tensor already of the dtype is returned as is; one that is not
    # contiguous is cast alone and keeps its strides, as .to keeps them, and so is a sparse one.
    # On the CPU (default) every tensor is cast alone.
    from unittest import mock

    from tiny_fsdp.core.utils import casts

    gen = torch.Generator().manual_seed(0)
    shapes = [(3, 5), (7,), (2, 3, 4), (1,)]
    for source, target in ((torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)):
        tensors = [torch.randn(s, generator=gen).to(source) for s in shapes]
        tensors.append(torch.randn(4, 6, generator=gen).to(source).t())
        tensors.append(torch.randn(4, 6, generator=gen).to(source).to_sparse())
        tensors.append(torch.randn(5, generator=gen).to(target))
        with mock.patch.object(casts, "joins_by_default", lambda device: True):
            joined = cast_all(tensors, target)
        for tensor, cast in zip(tensors[:-2], joined[:-2]):
            expected = tensor.to(target)
            assert torch.equal(cast, expected) and cast.stride() == expected.stride()
        sparse = joined[-2]
        assert sparse.dtype == target
        assert torch.equal(sparse.to_dense(), tensors[-2].to_dense().to(target))
        assert joined[-1] is tensors[-1]
        together = {c.untyped_storage().data_ptr() for c in joined[: len(shapes)]}
        assert len(together) == 1 and joined[-3].untyped_storage().data_ptr() not in together
        alone = {c.untyped_storage().data_ptr() for c in cast_all(tensors[:4], target)}
        assert len(alone) == len(shapes)


def _bf16_steps(rank: int, world_size: int) -> Dict[str, Dict[bool, Any]]:
    """DDP and ZeRO-1/2 under bf16, three steps each with the casts of [Note: casts in one
    launch] joined (an accelerator's way, here on the CPU) and not: (foreach copies in a step,
    final parameters)."""
    from unittest import mock

    from tiny_fsdp.core import zero
    from tiny_fsdp.core.ddp import DDPAdamW
    from tiny_fsdp.core.precision import MixedPrecisionPolicy
    from tiny_fsdp.core.utils import casts

    seen: Dict[str, Dict[bool, Any]] = {}
    for name in ("ddp", "zero1", "zero2"):
        seen[name] = {}
        for joined in (False, True):
            policy = MixedPrecisionPolicy.from_name("bf16")
            if name == "ddp":
                model: Any = DDP(make_model(0), mixed_precision=policy)
                optimizer: Any = DDPAdamW(model.named_parameters(), weight_decay=0.1)
            else:
                model = getattr(zero, f"Zero{name[-1]}")(make_model(0), mixed_precision=policy)
                optimizer_class = getattr(zero, f"Zero{name[-1]}AdamW")
                optimizer = optimizer_class(model.named_parameters(), weight_decay=0.1)
            with mock.patch.object(casts, "joins_by_default", lambda device: joined):
                for step in range(3):
                    x, y = global_batch(step, 2 * world_size, 8, 67)
                    x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
                    with _CountOps() as counter:
                        lm_loss(model(x), y).backward()
                        optimizer.step()
                    optimizer.zero_grad()
            joins = counter.ops.count("aten._foreach_copy_.default")
            seen[name][joined] = (joins, [p.detach().clone() for p in model.parameters()])
    return seen


def test_casts_joined_train_to_the_same_bits() -> None:
    # [Note: casts in one launch] on an accelerator: DDP's compute copies are views of one bf16
    # buffer and ZeRO-1/2's bf16 gradients reach the update rule as views of one fp32 buffer.
    # Joined here on the CPU (two ranks), training gives the same parameters bit for bit as
    # the casts made one by one, the CPU's default: DDP joins its forward's copies (one
    # foreach copy) and its optimizer has nothing to cast; ZeRO-1/2 join a batch's gradients.
    for per_rank in run_distributed(_bf16_steps, 2):
        for name, runs in per_rank.items():
            (alone, alone_params), (joined, joined_params) = runs[False], runs[True]
            assert joined > alone, (name, alone, joined)  # the fused CPU kernel copies too
            assert all(torch.equal(a, b) for a, b in zip(alone_params, joined_params)), name


def test_packed_views_are_split_and_view_in_one_op_each() -> None:
    # The reductions hand each parameter its part of a unit's output as one of these views.
    flat = torch.arange(40.0)[3:]  # an offset into its storage, as a row of a reduce buffer
    shapes = [(2, 3), (0, 4), (), (4,), (2, 0, 5), (1, 2, 2)]
    sizes = [int(torch.Size(shape).numel()) for shape in shapes]
    expected = [piece.view(shape) for piece, shape in zip(flat[: sum(sizes)].split(sizes), shapes)]
    with _CountOps() as counter:
        views = packed_views(flat, shapes)
    assert len(counter.ops) == len(shapes), counter.ops
    for view, want in zip(views, expected):
        assert view.shape == want.shape and view.stride() == want.stride()
        assert view.data_ptr() == want.data_ptr() and torch.equal(view, want)
