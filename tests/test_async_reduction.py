"""FSDP / ZeRO-3 asynchronous gradient reduction, communication streams and default units.

[Note: asynchronous reduction] (``core/reductions.py``), [Note: communication streams]
(``core/streams.py``) and ``unit="auto"`` ([Note: gather units]). Every ``_underscored`` function
runs on every rank (``run_distributed``). The CUDA side is driven here by a fake backend; the
real one by ``pytest -m cuda`` (``tests/test_cuda.py``) and ``benchmarks/gpu.sh``.
"""

import contextlib
from collections import OrderedDict
from typing import Any, Dict, Iterator, List, Tuple

import torch
from torch import nn

from tests.harness import run_distributed
from tests.parity import global_batch, lm_loss, local_slice, make_model
from tiny_fsdp.core import streams
from tiny_fsdp.core.fsdp import FSDP, FSDPAdamW
from tiny_fsdp.core.unit_layout import unit_layers
from tiny_fsdp.core.memory import memory_ledger
from tiny_fsdp.core.module import convert_module
from tiny_fsdp.core.reductions import PendingReductions
from tiny_fsdp.core.streams import CommStreams, CudaStreams
from tiny_fsdp.core.zero3 import Zero3, Zero3AdamW, zero3_partition_tensors

FROZEN = "transformer.h.0.attn.c_attn.weight"


def _build(strategy: str, world_size: int, **kw: Any) -> Tuple[nn.Module, Any]:
    model = make_model(0)
    model.get_parameter(FROZEN).requires_grad_(False)
    if strategy == "fsdp":
        wrapped = FSDP(model, **kw)
        return wrapped, FSDPAdamW(wrapped.named_parameters(), lr=1e-3)
    parts, _ = zero3_partition_tensors(OrderedDict(model.named_parameters()), ["cpu"] * world_size)
    wrapped = Zero3(model, parts, **kw)
    named = wrapped.module.named_parameters()
    return wrapped, Zero3AdamW(named, lr=1e-3, param_part_table=parts)


def _reduce_stats(model: nn.Module) -> Any:
    return model._state.reductions.stats if isinstance(model, FSDP) else model.reduce_stats


def _grads(model: nn.Module) -> List[Any]:
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _train(model: nn.Module, opt: Any, rank: int, world_size: int) -> Dict[str, List[Any]]:
    """Two steps of four micro-batches: two accumulated onto ``.grad`` (no no_sync), then two
    more of which the first is under ``no_sync``; clipping before each step."""
    seen: Dict[str, List[Any]] = {"grads": [], "losses": [], "norms": []}
    for step in range(2):
        for micro in range(4):
            x, y = global_batch(4 * step + micro, 2 * world_size, 8, 67)
            ctx = model.no_sync() if micro == 2 else contextlib.nullcontext()
            with ctx:
                loss = lm_loss(
                    model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)
                )
                loss.backward()
            # Delivered before backward() returned: nothing left in flight.
            assert _reduce_stats(model).live_bytes == 0
            seen["losses"].append(loss.detach())
            seen["grads"].append(_grads(model))
        seen["norms"].append(opt.clip_grad_norm_(1.0))
        opt.step()
        opt.zero_grad(set_to_none=True)
    seen["params"] = [p.detach().clone() for p in model.parameters()]
    return seen


def _assert_same(a: Any, b: Any, what: str) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), what
        for key in a:
            _assert_same(a[key], b[key], f"{what}[{key}]")
    elif not isinstance(a, torch.Tensor) and not isinstance(a, (list, tuple)):
        assert a == b, what
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{what}[{i}]")
    elif a is None or b is None:
        assert a is None and b is None, what
    else:
        assert torch.equal(a, b), what


def _on_off_bitwise(rank: int, world_size: int) -> None:
    for strategy in ("fsdp", "zero3"):
        runs = {}
        for async_on in (True, False):
            model, opt = _build(strategy, world_size, enable_async_communication=async_on)
            runs[async_on] = _train(model, opt, rank, world_size)
            # The frozen parameter never gets a gradient; every other one does on its holder.
            frozen = model.module.get_parameter(FROZEN)
            index = [i for i, p in enumerate(model.parameters()) if p is frozen][0]
            assert all(grads[index] is None for grads in runs[async_on]["grads"])
        _assert_same(runs[True], runs[False], f"{strategy}: async on vs off")


def _defaults(rank: int, world_size: int) -> Dict[str, bool]:
    from tests.build import WRAPPERS
    from tiny_fsdp import core

    return {
        name: getattr(core, name)(make_model()).enable_async_communication
        for name in WRAPPERS.values()
    }


def test_every_wrapper_overlaps_communication_by_default() -> None:
    """What a user gets with no arguments (issue #17), as PyTorch's DDP and FSDP2 do."""
    for on_rank in run_distributed(_defaults, 2):
        assert on_rank == {name: True for name in on_rank}, on_rank


def test_async_on_and_off_are_bitwise_identical_with_accumulation_no_sync_and_clipping() -> None:
    run_distributed(_on_off_bitwise, 2)


def _memory_bound(rank: int, world_size: int) -> None:
    """[Note: asynchronous reduction]'s bound on the reduction buffers in flight."""
    for strategy in ("fsdp", "zero3"):
        for async_on in (True, False):
            model, opt = _build(strategy, world_size, enable_async_communication=async_on)
            stats = _reduce_stats(model)
            limit = model._state.reductions.in_flight_limit if strategy == "fsdp" else 2
            for step in range(2):
                x, y = global_batch(step, 2 * world_size, 8, 67)
                stats.peak_bytes = stats.live_bytes
                lm_loss(
                    model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)
                ).backward()
                # Outputs awaiting finalize: this backward's local gradients, each reduction's
                # part; with .grad None before the backward they ARE the gradients (ledger).
                grads = memory_ledger(model).grads
                outputs = grads if strategy == "fsdp" else _zero3_parts_bytes(model)
                # In flight: at most `limit` inputs, plus the unit sum being filled.
                bound = (limit + 1) * stats.largest_input_bytes + outputs
                assert stats.live_bytes == 0, (strategy, async_on)
                assert 0 < stats.peak_bytes <= bound, (strategy, async_on, stats, bound)
                assert stats.peak_in_flight <= (limit if async_on else 1)
                opt.step()
                opt.zero_grad(set_to_none=True)


def _zero3_parts_bytes(model: Zero3) -> int:
    """Bytes of the owner's reduced parts of one backward: a tied tensor has one per use."""
    total = 0
    for layer in model.module.modules():
        for name in getattr(layer, "param_names", ()):
            p = getattr(layer, name)
            if p is not None and p.requires_grad and p.grad is not None:
                total += p.grad.numel() * p.grad.element_size()
    return total


def _reduction_kinds(rank: int, world_size: int) -> Dict[Tuple[str, bool], set]:
    """Per (strategy, async_on): how its gradient reductions were issued in a traced step."""
    from tiny_fsdp.trace import trace_step

    issued = {}
    for strategy in ("fsdp", "zero3"):
        for async_on in (True, False):
            model, opt = _build(strategy, world_size, enable_async_communication=async_on)
            x, y = global_batch(0, 2 * world_size, 8, 67)
            with trace_step(model, opt) as recorder:
                lm_loss(
                    model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)
                ).backward()
            comms = recorder.records(rank)["comms"]
            reductions = [c for c in comms if c["kind"] in ("reduce_scatter", "reduce")]
            issued[strategy, async_on] = {"async" if not c["sync"] else "sync" for c in reductions}
    return issued


def test_gradient_reductions_leave_the_critical_path_by_default() -> None:
    """Issue #17: with overlap on, FSDP's reduce-scatters and ZeRO-3's reduces are issued
    asynchronously (they travel while earlier layers' backward computes; finalize waits at
    the end), and synchronously with it off."""
    for issued in run_distributed(_reduction_kinds, 2):
        for strategy in ("fsdp", "zero3"):
            assert issued[strategy, True] == {"async"}, (strategy, issued)
            assert issued[strategy, False] == {"sync"}, (strategy, issued)


def test_reduction_buffers_in_flight_stay_within_the_stated_bound() -> None:
    run_distributed(_memory_bound, 2)


# ------------------------------------------------------------------------- fake CUDA streams


class _FakeEvent:
    def __init__(self, log: List[Tuple[str, ...]], stream: str, n: int) -> None:
        self.name = f"{stream}#{n}"
        log.append(("record", stream, self.name))

    def query(self) -> bool:
        return True


class _FakeStream:
    def __init__(self, name: str, backend: "_FakeBackend") -> None:
        self.name, self.backend = name, backend

    def wait_stream(self, other: "_FakeStream") -> None:
        self.backend.log.append(("wait_stream", self.name, other.name))

    def record_event(self) -> _FakeEvent:
        assert self.backend.current is self, "an event is recorded on its own stream"
        self.backend.events += 1
        return _FakeEvent(self.backend.log, self.name, self.backend.events)

    def wait_event(self, event: _FakeEvent) -> None:
        self.backend.log.append(("wait_event", self.name, event.name))


class _FakeBackend:
    """Stands for ``streams.CudaBackend``: records what CudaStreams asks of CUDA."""

    def __init__(self) -> None:
        self.log: List[Tuple[str, ...]] = []
        self.events = 0
        self.compute = _FakeStream("compute", self)
        self.current = self.compute
        self.created: List[_FakeStream] = []

    def new_stream(self) -> _FakeStream:
        stream = _FakeStream(f"side{len(self.created)}", self)
        self.created.append(stream)
        return stream

    def current_stream(self) -> _FakeStream:
        return self.current

    @contextlib.contextmanager
    def use_stream(self, stream: _FakeStream) -> Iterator[None]:
        previous, self.current = self.current, stream
        self.log.append(("enter", stream.name))
        try:
            yield
        finally:
            self.current = previous
            self.log.append(("exit", stream.name))


def _fake_streams(rank: int, world_size: int) -> None:
    backends: List[_FakeBackend] = []

    def fake_streams_for(device: torch.device, communicates: bool = True) -> CommStreams:
        backends.append(_FakeBackend())
        return CudaStreams(backends[-1])

    real = streams.streams_for
    for strategy in ("fsdp", "zero3"):
        runs = []
        for fake in (False, True):
            streams.streams_for = fake_streams_for if fake else real
            try:
                model, opt = _build(strategy, world_size)
            finally:
                streams.streams_for = real
            runs.append(_train(model, opt, rank, world_size))
        _assert_same(runs[0], runs[1], f"{strategy}: fake CUDA streams vs CPU")
        log = backends[-1].log
        recorded = [entry[2] for entry in log if entry[0] == "record"]
        waited = [entry[2] for entry in log if entry[0] == "wait_event"]
        assert recorded and sorted(recorded) == sorted(waited), "every event waited once"
        assert all(entry[1] == "compute" for entry in log if entry[0] == "wait_event")
        side_names = {s.name for s in backends[-1].created}
        assert len(side_names) == 2  # one for gathers, one for reductions
        for i, entry in enumerate(log):  # a side stream first waits for the compute stream
            if entry[0] == "enter":
                assert log[i - 1] == ("wait_stream", entry[1], "compute")


def test_cuda_stream_ordering_with_a_fake_backend_changes_no_result() -> None:
    run_distributed(_fake_streams, 2)


def _side_streams_asked(rank: int, world_size: int) -> Dict[str, bool]:
    """Whether each sharded strategy asks for side streams (``streams_for``'s
    ``communicates``)."""
    asked: Dict[str, bool] = {}
    real = streams.streams_for
    for strategy in ("fsdp", "zero3"):

        def record(device: torch.device, communicates: bool = True) -> CommStreams:
            asked[strategy] = communicates
            return real(device, communicates)

        streams.streams_for = record
        try:
            _build(strategy, world_size)
        finally:
            streams.streams_for = real
    return asked


def test_side_streams_only_where_a_collective_reaches_another_rank() -> None:
    """On one rank every collective is done at once ([Note: collectives on one rank]): no side
    stream is asked for, whose events and switches would only cost host time on a GPU."""
    assert run_distributed(_side_streams_asked, 1)[0] == {"fsdp": False, "zero3": False}
    assert run_distributed(_side_streams_asked, 2)[0] == {"fsdp": True, "zero3": True}
    assert not isinstance(streams.streams_for(torch.device("cuda"), False), CudaStreams)


# ------------------------------------------------------------------------- unit="auto"


class _Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.small = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
        self.mixed = nn.ModuleList([nn.Linear(8, 8), nn.LayerNorm(8)])  # not one type
        self.head = nn.Linear(8, 2)


def _traffic_by_unit(rank: int, world_size: int) -> Dict[str, Any]:
    """The collectives (calls, bytes per kind) of one FSDP step per ``unit`` choice."""
    from tiny_fsdp.core import comm

    traffic = {}
    for unit in ("default", "blocks", "layer"):
        model = make_model(0)
        blocks = list(model.transformer.h)
        kw = {"default": {}, "blocks": {"unit": blocks}, "layer": {"unit": "layer"}}[unit]
        wrapped = FSDP(model, **kw)
        x, y = global_batch(0, 2 * world_size, 8, 67)
        comm.LEDGER.reset()
        lm_loss(
            wrapped(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)
        ).backward()
        traffic[unit] = (dict(comm.LEDGER.calls), dict(comm.LEDGER.payload_bytes))
    return traffic


def test_fsdp_gathers_a_block_at_a_time_by_default() -> None:
    """``FSDP(model)`` with no ``unit``: one unit per repeated block (issue #17), the same
    collectives as naming the blocks, fewer than a unit per layer."""
    for traffic in run_distributed(_traffic_by_unit, 2):
        assert traffic["default"] == traffic["blocks"]
        assert traffic["default"][0]["all_gather"] < traffic["layer"][0]["all_gather"]


def test_auto_unit_picks_the_repeated_blocks_else_every_layer() -> None:
    gpt = convert_module(make_model(0))
    names = [name for name, _ in unit_layers(gpt, "auto")]
    blocks = [f"transformer.h.{i}" for i in range(len(gpt.transformer.h))]
    assert names == blocks + ["<root>"]
    assert [n for n, _ in unit_layers(gpt, "auto")] == [
        n for n, _ in unit_layers(gpt, list(gpt.transformer.h))
    ]
    mixed = convert_module(_Mixed())
    # The only same-type list is `small`: its two Linears are units, the rest is the root.
    assert [n for n, _ in unit_layers(mixed, "auto")] == ["small.0", "small.1", "<root>"]
    flat = convert_module(nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1)))
    assert [n for n, _ in unit_layers(flat, "auto")] == ["0", "1"]


# ------------------------------------------------------------------------- PendingReductions


class _SlowWork:
    """A work that is never done until waited for."""

    def __init__(self, log: List[str], name: str) -> None:
        self.log, self.name = log, name

    def is_completed(self) -> bool:
        return False

    def wait(self) -> None:
        self.log.append(self.name)


def test_finalize_sums_a_backwards_parts_then_accumulates_like_autograd() -> None:
    """Parts of one parameter are summed in launch order, then added to the existing .grad;
    at most ``in_flight_limit`` reductions are unretired (the oldest is waited for first)."""
    param = nn.Parameter(torch.zeros(3))
    param.grad = torch.full((3,), 0.1)
    parts = [torch.tensor([1e8, 1.0, 2.0]), torch.tensor([-1e8, 3.0, 4.0]), torch.ones(3)]
    waited: List[str] = []
    reductions = PendingReductions(CommStreams(), in_flight_limit=2)

    class Launcher(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            for i, part in enumerate(parts):
                reductions.launch(
                    lambda async_op, i=i: _SlowWork(waited, f"r{i}"),
                    [part.clone()],
                    [(param, part)],
                    async_op=True,
                )
                assert reductions.stats.peak_in_flight <= 2
                assert torch.equal(param.grad, torch.full((3,), 0.1))  # not delivered yet
            return grad

    x = torch.ones(3, requires_grad=True)
    Launcher.apply(x).sum().backward()
    assert waited == ["r0", "r1", "r2"]  # r0 when r2 launched, then the rest at finalize
    expected = torch.full((3,), 0.1) + ((parts[0] + parts[1]) + parts[2])
    assert torch.equal(param.grad, expected)
    assert reductions.stats.live_bytes == 0 and reductions.stats.peak_in_flight == 2


def _cast_once_worker(rank: int, world_size: int) -> Dict[str, Tuple[int, int]]:
    """(gradients delivered, distinct storages behind them) after a bf16 backward."""
    from tiny_fsdp.core.precision import MixedPrecisionPolicy

    seen = {}
    for strategy in ("fsdp", "zero3"):
        model, _ = _build(strategy, world_size, mixed_precision=MixedPrecisionPolicy())
        x, y = global_batch(0, 2 * world_size, 8, model.module.config.vocab_size)
        lm_loss(
            model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)
        ).backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None and p.grad.numel()]
        assert all(g.dtype == torch.float32 for g in grads)  # the master weights' dtype
        seen[strategy] = (len(grads), len({g.untyped_storage().data_ptr() for g in grads}))
    return seen


def test_a_reductions_output_is_cast_to_the_parameters_dtype_once() -> None:
    """[Note: asynchronous reduction]: a bf16 reduction's output becomes fp32 ``.grad`` by one
    cast of the whole output (its parts are views of the cast), not one cast per parameter:
    a GPU launches a kernel for each. gpt2_tiny: FSDP's 3 units (2 blocks and the root) give 3
    storages; ZeRO-3's 3 units give at most one per unit and owner."""
    for per_rank in run_distributed(_cast_once_worker, 2):
        grads, storages = per_rank["fsdp"]
        assert grads > 20 and storages == 3, per_rank
        grads, storages = per_rank["zero3"]
        assert grads > 5 and storages <= 3, per_rank
