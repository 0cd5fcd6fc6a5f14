"""Specification of FSDP (``tiny_fsdp.core.fsdp``): dim-0 shards gathered per layer, on gloo ranks.

Each ``_underscored`` function runs on every rank (``run_distributed``) and loops over many
cases, so that the worker pools start once per world size. Gloo collectives cost milliseconds
here, so runs are a few steps of ``gpt2_tiny`` or of ``OddNet``, whose shapes divide no world
size evenly.
"""

import copy
import gc
import math
import weakref
from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from example.model import GPT2Model, GPTConfigs
from tests.build import adamw, build, sgd
from tests.harness import run_distributed
from tests.parity import (
    LOSS_ATOL,
    PARAM_ATOL,
    check_parity,
    global_batch,
    lm_loss,
    local_slice,
    make_model,
    mean_over_ranks,
)
from tiny_fsdp.core import comm
from tiny_fsdp.core.fsdp import FSDP, FSDPSGD, FSDPAdamW, ShardedParam, shard_info
from tiny_fsdp.core.module import CallbackModule
from tiny_fsdp.core.utils.storage import holds_memory

CFG = GPTConfigs.gpt2_tiny
OPTIMIZERS = {
    "adamw": adamw(lr=1e-3, weight_decay=0.1),
    "sgd_momentum": sgd(lr=0.05, momentum=0.9, weight_decay=0.01),
}
STEPS = 4  # enough for momentum / Adam moments to matter; each step is ~50 collectives


def _reference_optimizer(optim: str, model: nn.Module) -> torch.optim.Optimizer:
    return OPTIMIZERS[optim].reference([p for p in model.parameters() if p.requires_grad])


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ----------------------------------------------------------------------- shard geometry


# 0-d, fewer rows than ranks, empty, odd rows, and the widths of OddNet / gpt2_tiny.
SHAPES = [(), (1,), (2, 5), (5, 2), (13,), (7, 15), (16, 17), (67, 18), (0, 3), (3, 0), (4, 2, 3)]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_shards_tile_the_padded_tensor(shape: Tuple[int, ...], world: int) -> None:
    """Every rank's shard, in rank order, is the full tensor's rows followed by zero padding."""
    full = torch.randn(shape) + 2.0  # no zeros, so padding rows are recognisable
    infos = [ShardedParam(tuple(shape), r, world) for r in range(world)]
    shards = [info.shard_of(full) for info in infos]
    rows = shape[0] if shape else 1
    assert all(s.shape == (math.ceil(rows / world), *shape[1:]) for s in shards)
    assert sum(info.valid_rows for info in infos) == rows
    for info, shard in zip(infos, shards):
        assert (shard[info.valid_rows :] == 0).all()
    gathered = torch.cat([s.reshape(-1) for s in shards])
    assert torch.equal(infos[0].full_view(gathered), full)


@pytest.mark.parametrize("world", [1, 3, 4])
@pytest.mark.parametrize("left, right", [(0, 0), (3, 2)])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_copy_in_and_out_through_a_wider_grid(
    shape: Tuple[int, ...], world: int, left: int, right: int
) -> None:
    """A tensor's columns of a rank-major (world, group_numel) buffer hold its padded shards:
    read rank after rank, its full tensor then its padding rows."""
    info = ShardedParam(tuple(shape), 0, world)
    full = torch.randn(shape)
    grid = torch.full((world, left + info.shard_numel + right), 7.0)
    columns = grid[:, left : left + info.shard_numel]
    info.copy_in(full, columns, accumulate=False)
    expected = torch.stack(
        [ShardedParam(tuple(shape), r, world).shard_of(full) for r in range(world)]
    )
    assert torch.equal(columns, expected.reshape(world, -1))
    assert (grid[:, :left] == 7).all() and (grid[:, left + info.shard_numel :] == 7).all()
    info.copy_in(full, columns, accumulate=True)  # padding rows stay zero
    assert torch.equal(columns, 2 * expected.reshape(world, -1))
    # Read back rank after rank (the all-gather's copy-out): the padded full tensor.
    assert torch.equal(info.full_view(columns.reshape(-1)), 2 * full)


# ----------------------------------------------------------------------- parity with one device


def _parity_gpt(rank: int, world_size: int) -> Dict[str, float]:
    """Per (optimizer, reshard, unit): async off and on agree bitwise; both match one device.

    Per-block units with resharding are checked against FSDP2 below (same layout).
    """
    diffs = {}
    for optim, reshard, limit, blocks in (
        ("adamw", True, 1, False),
        ("sgd_momentum", False, 2, True),
    ):
        runs = {}
        for async_on in (False, True):
            kept: List[Any] = []

            def wrap(model: nn.Module) -> Tuple[FSDP, Any]:
                unit = list(model.transformer.h) if blocks else "layer"
                fsdp, opt = build(
                    "fsdp",
                    model,
                    OPTIMIZERS[optim],
                    reshard_after_forward=reshard,
                    prefetch_limit=limit,
                    unit=unit,
                )
                fsdp.enable_async_communication = async_on  # the attribute works like the arg
                kept.append(fsdp)
                return fsdp, opt

            result = check_parity(
                rank,
                world_size,
                wrap,
                lambda m: _reference_optimizer(optim, m),
                lambda m: m.state_dict(),
                steps=STEPS,
            )
            runs[async_on] = (result.losses, kept[0].state_dict())
            diffs[f"{optim}-reshard={reshard}-blocks={blocks}-async={async_on}"] = (
                result.max_param_diff
            )
        # Same collectives on the same values, only issued earlier: bitwise identical.
        assert runs[False][0] == runs[True][0]
        assert all(torch.equal(runs[False][1][k], runs[True][1][k]) for k in runs[False][1])
    return diffs


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_gpt2_tiny_matches_single_device(world_size: int) -> None:
    diffs = run_distributed(_parity_gpt, world_size)[0]
    assert len(diffs) == 4 and max(diffs.values()) <= PARAM_ATOL


class OddNet(nn.Module):
    """Token classifier whose weights are 11x15, 7x15, 7, 17x7, 16x17, 13x16, 5x13, 2x5."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 15)
        self.up = nn.Linear(15, 7)
        self.norm = nn.LayerNorm(7)
        self.wide = nn.Linear(7, 17)
        self.mid = nn.Linear(17, 16)
        self.thirteen = nn.Linear(16, 13)
        self.narrow = nn.Linear(13, 5, bias=False)
        self.head = nn.Linear(5, 2)  # 2 rows: on 3 or 4 ranks some shards are all padding

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.up(self.emb(idx)))
        x = self.thirteen(self.mid(F.gelu(self.wide(x))))
        return self.head(torch.tanh(self.narrow(x)))  # (B, T, 2)


def _odd_batch(step: int, world_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randint(11, (2 * world_size, 5), generator=gen), torch.randint(
        2, (2 * world_size, 5), generator=gen
    )


def _parity_odd(rank: int, world_size: int) -> float:
    worst = 0.0
    cases = [("adamw", "layer", True, False), ("sgd_momentum", "tensor", False, True)]
    for optim, unit, reshard, async_on in cases:
        torch.manual_seed(1)
        reference = OddNet()
        fsdp, opt = build(
            "fsdp",
            copy.deepcopy(reference),
            OPTIMIZERS[optim],
            unit=unit,
            reshard_after_forward=reshard,
            enable_async_communication=async_on,
        )
        ref_opt = _reference_optimizer(optim, reference)
        for step in range(STEPS):
            x, y = _odd_batch(step, world_size)
            ref_loss = lm_loss(reference(x), y)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            loss = lm_loss(fsdp(local_slice(x, rank, world_size)), local_slice(y, rank, world_size))
            loss.backward()
            opt.step()
            opt.zero_grad()
            assert abs(mean_over_ranks(loss) - ref_loss.item()) <= LOSS_ATOL
        full = fsdp.state_dict()
        for name, value in reference.state_dict().items():
            diff = (full[name] - value).abs().max().item()
            assert diff <= PARAM_ATOL, f"{optim}/{unit}: {name} differs by {diff:.2e}"
            worst = max(worst, diff)
        for param in fsdp.parameters():  # the optimizers never touch padding rows
            assert (param.detach()[shard_info(param).valid_rows :] == 0).all()
    return worst


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_odd_shapes_and_all_padding_shards_match_single_device(world_size: int) -> None:
    assert max(run_distributed(_parity_odd, world_size)) <= PARAM_ATOL


# ----------------------------------------------------------------------- parity with FSDP2


def _parity_fsdp2(rank: int, world_size: int) -> float:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    reference = make_model(0, CFG)
    theirs = copy.deepcopy(reference)
    mesh = init_device_mesh("cpu", (world_size,))
    for block in theirs.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(theirs, mesh=mesh)
    runs = [(theirs, OPTIMIZERS["adamw"].reference(theirs.parameters()))]
    for unit in ("layer", "blocks"):  # ours per layer, and with FSDP2's units
        model = copy.deepcopy(reference)
        blocks = list(model.transformer.h) if unit == "blocks" else unit
        runs.append(
            build("fsdp", model, OPTIMIZERS["adamw"], enable_async_communication=True, unit=blocks)
        )
    for step in range(STEPS):
        x, y = global_batch(step, 2 * world_size, 8, CFG.vocab_size)
        x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
        losses = []
        for model, opt in runs:
            loss = lm_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(mean_over_ranks(loss))
        assert max(losses) - min(losses) <= LOSS_ATOL, f"step {step}: {losses}"
    expected = {name: value.full_tensor() for name, value in theirs.state_dict().items()}
    worst = 0.0
    for ours, _ in runs[1:]:
        full = ours.state_dict()
        worst = max(worst, *((full[k] - v).abs().max().item() for k, v in expected.items()))
    return worst


def test_matches_pytorch_fully_shard_on_cpu() -> None:
    # Both sum the same per-rank gradients in a different order: the parity tolerance applies.
    assert max(run_distributed(_parity_fsdp2, 2)) <= PARAM_ATOL


# ----------------------------------------------------------------------- memory


def _expected_between_steps(full_shapes: Dict[str, Tuple[int, ...]], rank: int, world: int) -> int:
    """Bytes of fp32 shards + shard grads + AdamW state (real rows, 4-byte step) on ``rank``."""
    total = 0
    for shape in full_shapes.values():
        rows = shape[0] if shape else 1
        row_numel = math.prod(shape[1:])
        shard_rows = math.ceil(rows / world)
        valid = max(0, min(shard_rows, rows - rank * shard_rows))
        total += 4 * (2 * shard_rows * row_numel + 2 * valid * row_numel) + 4
    return total


def _held_between_steps(fsdp: FSDP, opt: torch.optim.Optimizer) -> int:
    tensors = {}
    for p in fsdp.parameters():
        tensors[id(p)] = p
        tensors[id(p.grad)] = p.grad
    for state in opt.state.values():
        tensors.update({id(v): v for v in state.values()})
    return sum(_nbytes(t) for t in tensors.values())


def _memory(rank: int, world_size: int) -> Dict[str, int]:
    peaks = {}
    for reshard, async_on, limit in ((True, False, 1), (True, True, 2), (False, False, 1)):
        model = make_model(0, CFG)
        shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
        fsdp, opt = build(
            "fsdp",
            model,
            OPTIMIZERS["adamw"],
            reshard_after_forward=reshard,
            enable_async_communication=async_on,
            prefetch_limit=limit,
            unit="layer",  # the windows below are counted in layers (the default is per block)
        )
        handlers = [m.param_handler for m in fsdp.module.modules() if isinstance(m, CallbackModule)]
        # Every full tensor a fetch hands out must hold no memory once the step is over: gone,
        # or a view made once whose storage was freed ([Note: buffers made once]).
        handed_out: List[weakref.ref] = []
        for handler in handlers:
            fetch = handler.fetch

            def tracked_fetch(module: nn.Module, phase: str, fetch: Any = fetch) -> Any:
                params = fetch(module, phase)
                handed_out.extend(weakref.ref(p) for p in params if p is not None)
                return params

            handler.fetch = tracked_fetch
        for step in range(2):  # the first records the order, the second prefetches
            x, y = global_batch(step, 2 * world_size, 8, CFG.vocab_size)
            fsdp.reset_peak_memory_stats()
            lm_loss(
                fsdp(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)
            ).backward()
            opt.step()
            gc.collect()
            assert _held_between_steps(fsdp, opt) == _expected_between_steps(
                shapes, rank, world_size
            )
            stats = fsdp.memory_stats()
            assert stats["gathered_bytes"] == 0 and stats["accumulated_grad_bytes"] == 0
            assert handed_out and not any(holds_memory(ref()) for ref in handed_out)
            opt.zero_grad()
        # In flight at once: one layer's gather (+ its copy-out when it has several tensors),
        # up to `limit` prefetched layers, and lm_head, kept from forward for its backward;
        # without resharding, every layer until its backward.
        layer_bytes = [4 * unit.gathered_numel() for unit in fsdp.units]
        peak = stats["peak_gathered_bytes"]
        if reshard:
            window = limit + 1 if async_on else 1
            bound = max(sum(layer_bytes[i : i + window]) for i in range(len(layer_bytes)))
            assert max(layer_bytes) <= peak <= 2 * bound + layer_bytes[-1]
        else:
            assert sum(layer_bytes) / 2 <= peak <= 2 * sum(layer_bytes)
        peaks[f"reshard={reshard}-async={async_on}"] = peak
    return peaks


@pytest.mark.parametrize("world_size", [2, 3])
def test_between_steps_only_shards_and_in_step_only_layers_in_flight(world_size: int) -> None:
    peaks = run_distributed(_memory, world_size)[0]
    assert peaks["reshard=False-async=False"] > peaks["reshard=True-async=True"]
    assert peaks["reshard=True-async=True"] > peaks["reshard=True-async=False"]


# ----------------------------------------------------------------------- wrap-time behaviour


def _meta_init(rank: int, world_size: int) -> None:
    for seed in (0, 5):
        torch.manual_seed(seed)
        normal = FSDP(GPT2Model(CFG)).state_dict()
        torch.manual_seed(seed)
        with torch.device("meta"):
            meta_model = GPT2Model(CFG)
        fsdp = FSDP(meta_model)
        assert all(p.device.type == "cpu" for p in fsdp.parameters())
        assert fsdp.module.lm_head.weight is fsdp.module.transformer.wte.weight  # still tied
        from_meta = fsdp.state_dict()
        assert from_meta.keys() == normal.keys()
        assert all(torch.equal(from_meta[k], normal[k]) for k in normal)  # same values, bitwise
    # Without init_parameter: the layer's own reset_parameters ([Note: meta parameters]); a
    # parameter nothing initialises is refused and the fix named.
    with torch.device("meta"):
        own_init = nn.Sequential(nn.LayerNorm(4))
    assert all(
        torch.equal(v, torch.ones(4) * (k == "0.weight"))
        for k, v in FSDP(own_init).state_dict().items()
    )
    with torch.device("meta"):
        no_init = nn.ParameterList([nn.Parameter(torch.ones(3))])
    with pytest.raises(ValueError, match=r"\['0'\] are on the meta device.*Add init_parameter"):
        FSDP(no_init)


def test_meta_model_materialises_to_the_same_weights() -> None:
    run_distributed(_meta_init, 2)


def _sharding_and_errors(rank: int, world_size: int) -> None:
    # Rank 0's values win at wrap time: ranks that built different weights end up agreeing.
    torch.manual_seed(rank)
    fsdp = FSDP(OddNet())
    torch.manual_seed(0)
    expected = OddNet().state_dict()
    full = fsdp.state_dict()  # a collective: called on every rank
    assert all(torch.equal(full[k], v) for k, v in expected.items())
    for param in fsdp.parameters():
        info = shard_info(param)
        assert tuple(param.shape) == (math.ceil(info.rows / world_size), *info.row_shape)
    with pytest.raises(ValueError, match="world_size"):
        FSDP(OddNet(), world_size=world_size + 1)
    with pytest.raises(ValueError, match="rank"):
        FSDP(OddNet(), rank=world_size)
    with pytest.raises(TypeError, match="not an FSDP shard"):
        FSDPAdamW(OddNet().named_parameters(), lr=1e-3)
    # One unit holds both users of a tied weight. A backward that reaches only one of them
    # still delivers that one's part: the unit's sum is reduced at the end of the backward
    # ([Note: unit reduction]); nothing is lost, nothing waits for the absent user.
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5, bias=False))
    reference[1].weight = reference[0].weight
    tied = copy.deepcopy(reference)
    fsdp = FSDP(tied, unit=[])  # no listed modules: every layer in the root unit
    tokens = torch.tensor([[1, 2]])
    for model, layers in ((reference, reference), (fsdp, fsdp.module)):
        model(tokens).sum().backward()  # both users contribute
        layers[0](tokens).sum().backward()  # only the embedding
    shard = fsdp.module[0].weight
    expected_grad = shard_info(shard).shard_of(reference[0].weight.grad)
    assert torch.allclose(shard.grad, expected_grad, atol=1e-6)  # fp32 sums of 2-4 terms
    opt = FSDPSGD(fsdp.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="not an FSDP shard"):
        opt.add_param_group({"params": [nn.Parameter(torch.ones(2))]})
    assert len(opt.param_groups) == 1  # the rejected group was not kept


def test_wrap_shards_rank0_values_and_rejects_bad_arguments() -> None:
    run_distributed(_sharding_and_errors, 4)


def _communication_unit(rank: int, world_size: int) -> Dict[str, int]:
    counts = {}
    for unit in ("layer", "tensor", "blocks"):
        model = make_model(0, CFG)
        fsdp = FSDP(model, unit=list(model.transformer.h) if unit == "blocks" else unit)
        fsdp(global_batch(9, 2, 8, CFG.vocab_size)[0]).sum().backward()  # records the order
        x, y = global_batch(0, 2 * world_size, 8, CFG.vocab_size)
        comm.LEDGER.reset()
        loss = lm_loss(fsdp(local_slice(x, rank, world_size)), local_slice(y, rank, world_size))
        counts[f"{unit}-forward-gathers"] = comm.LEDGER.calls["all_gather"]
        loss.backward()
        counts[f"{unit}-backward-gathers"] = (
            comm.LEDGER.calls["all_gather"] - counts[f"{unit}-forward-gathers"]
        )
        counts[f"{unit}-reduce-scatters"] = comm.LEDGER.calls["reduce_scatter"]
        assert comm.LEDGER.calls["all_reduce"] == 1  # [Note: agreeing on overflow]'s flag only
    return counts


def test_one_gather_and_one_reduce_scatter_per_unit() -> None:
    counts = run_distributed(_communication_unit, 2)[0]
    model = make_model(0, CFG)
    layers = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.LayerNorm, nn.Embedding))]
    tensors = sum(len([p for p in m.parameters(recurse=False)]) for m in layers)
    assert (len(layers), tensors) == (16, 29)  # the tied weight counts in wte and in lm_head
    # (forward gathers, backward gathers, reduce-scatters). The unit used first in backward
    # (lm_head; with blocks, the root unit) stays gathered from forward to backward; the two
    # embeddings' backward reads no parameter value, so their own units are not gathered for it
    # ([Note: full units]). One reduce-scatter per unit: per layer or tensor, or per block +
    # root ([Note: unit reduction]).
    embeddings = 2
    expected = {
        "layer": (len(layers), len(layers) - 1 - embeddings, len(layers)),
        "tensor": (tensors, tensors - 1 - embeddings, tensors),
        # The root unit holds wte and lm_head: their tied weight is gathered and reduced once.
        "blocks": (CFG.n_layer + 1, CFG.n_layer, CFG.n_layer + 1),
    }
    for unit, (forward, backward, reduce) in expected.items():
        assert counts[f"{unit}-forward-gathers"] == forward
        assert counts[f"{unit}-backward-gathers"] == backward
        assert counts[f"{unit}-reduce-scatters"] == reduce


# ----------------------------------------------------------------------- training features

FROZEN_SETS = (
    ("transformer.wpe.weight", "transformer.h.0.attn.c_attn.bias", "transformer.ln_f.weight"),
    ("lm_head.weight",),  # the tied weight: frozen in both of its layers
)


def _frozen(rank: int, world_size: int) -> None:
    for frozen in FROZEN_SETS:
        kept: List[Any] = []

        def freeze(model: nn.Module) -> nn.Module:
            for name in frozen:
                model.get_parameter(name).requires_grad_(False)
            return model

        def wrap(model: nn.Module) -> Tuple[FSDP, Any]:
            fsdp, opt = build(
                "fsdp", freeze(model), OPTIMIZERS["adamw"], enable_async_communication=True
            )
            kept.append((fsdp, opt, {n: p.detach().clone() for n, p in fsdp.state_dict().items()}))
            return fsdp, opt

        check_parity(
            rank,
            world_size,
            wrap,
            lambda m: _reference_optimizer("adamw", freeze(m)),
            lambda m: m.state_dict(),
            steps=STEPS,
        )
        fsdp, opt, initial = kept[0]
        after = fsdp.state_dict()
        for name in frozen:
            param = fsdp.module.get_parameter(name)
            assert shard_info(param) is not None and not param.requires_grad  # sharded too
            assert param.grad is None and param not in opt.state
            assert torch.equal(after[name], initial[name])


def test_frozen_parameters_are_sharded_but_get_no_grad_or_state() -> None:
    run_distributed(_frozen, 3)


def _no_sync(rank: int, world_size: int, micro: int, blocks: bool) -> None:
    reference = make_model(0, CFG)
    model = copy.deepcopy(reference)
    unit = list(model.transformer.h) if blocks else "layer"
    fsdp, opt = build(
        "fsdp", model, OPTIMIZERS["sgd_momentum"], enable_async_communication=True, unit=unit
    )
    ref_opt = _reference_optimizer("sgd_momentum", reference)
    # Every parameter's padded full gradient is kept once per unit that uses it (the tied
    # weight twice with per-layer units, once in the root unit with blocks): exactly the bytes
    # of one gather of every unit.
    padded_grad_bytes = sum(4 * unit.gathered_numel() for unit in fsdp.units)
    for step in range(2):
        batches = [
            global_batch(micro * step + k, 2 * world_size, 8, CFG.vocab_size) for k in range(micro)
        ]
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        lm_loss(reference(x), y).backward()  # one big batch == the micro-batches' mean
        ref_opt.step()
        ref_opt.zero_grad()
        for k, (xk, yk) in enumerate(batches):
            comm.LEDGER.reset()
            logits = fsdp(local_slice(xk, rank, world_size))
            loss = lm_loss(logits, local_slice(yk, rank, world_size)) / micro
            if k < micro - 1:
                with fsdp.no_sync():
                    loss.backward()
                assert comm.LEDGER.calls["reduce_scatter"] == 0
                assert all(p.grad is None for p in fsdp.parameters())
                assert fsdp.memory_stats()["accumulated_grad_bytes"] == padded_grad_bytes
            else:
                loss.backward()
                # One per unit: per layer, or per block + the root ([Note: unit reduction]).
                assert comm.LEDGER.calls["reduce_scatter"] == (CFG.n_layer + 1 if blocks else 16)
                assert fsdp.memory_stats()["accumulated_grad_bytes"] == 0
        opt.step()
        opt.zero_grad()
    full = fsdp.state_dict()
    for name, value in reference.state_dict().items():
        assert (full[name] - value).abs().max().item() <= PARAM_ATOL, name


@pytest.mark.parametrize("world_size, micro, blocks", [(2, 3, False), (3, 2, True)])
def test_no_sync_micro_batches_equal_one_big_batch(
    world_size: int, micro: int, blocks: bool
) -> None:
    run_distributed(_no_sync, world_size, micro, blocks)


def _tied(rank: int, world_size: int) -> None:
    reference = make_model(0, CFG)
    fsdp, opt = build("fsdp", copy.deepcopy(reference), OPTIMIZERS["adamw"])
    wte, head = fsdp.module.transformer.wte.weight, fsdp.module.lm_head.weight
    assert wte is head and len(list(fsdp.parameters())) == len(list(reference.parameters()))
    assert wte.shape == (math.ceil(CFG.vocab_size / world_size), CFG.n_embd)
    x, y = global_batch(0, 2 * world_size, 8, CFG.vocab_size)
    lm_loss(reference(x), y).backward()
    lm_loss(fsdp(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()
    # The shard's grad is the embedding's and the head's contributions summed.
    info = shard_info(wte)
    start = rank * info.shard_rows
    expected = reference.lm_head.weight.grad[start : start + info.valid_rows]
    assert (wte.grad[: info.valid_rows] - expected).abs().max().item() <= 1e-6
    assert (wte.grad[info.valid_rows :] == 0).all()
    # Global gradient norm over the shards (the tied weight once, padding adds zeros).
    ours = opt.clip_grad_norm_(1.0).item()
    theirs = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0).item()
    assert abs(ours - theirs) <= 1e-5 * theirs


def test_tied_weight_is_one_shard_with_both_gradients_and_norm_counts_it_once() -> None:
    # Gradients of one backward: only the reduction order differs, 1e-6 absolute suffices.
    run_distributed(_tied, 3)


def _state_dict(rank: int, world_size: int) -> None:
    trained, opt = build("fsdp", make_model(0, CFG), OPTIMIZERS["adamw"])
    for step in range(2):
        x, y = global_batch(step, 2 * world_size, 8, CFG.vocab_size)
        lm_loss(
            trained(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)
        ).backward()
        opt.step()
        opt.zero_grad()
    saved = trained.state_dict()
    plain = make_model(0, CFG).state_dict()
    assert list(saved) == list(plain) and "lm_head.weight" in saved
    assert all(saved[k].shape == plain[k].shape for k in plain)
    assert torch.equal(saved["lm_head.weight"], saved["transformer.wte.weight"])

    fresh = FSDP(make_model(7, CFG), enable_async_communication=True)
    fresh.load_state_dict(saved)
    assert all(torch.equal(fresh.state_dict()[k], saved[k]) for k in saved)
    x, _ = global_batch(5, 2 * world_size, 8, CFG.vocab_size)
    with torch.no_grad():
        assert torch.equal(fresh(x), trained(x))

    broken = dict(saved)
    del broken["transformer.ln_f.bias"]
    with pytest.raises(RuntimeError, match="missing keys \\['transformer.ln_f.bias'\\]"):
        fresh.load_state_dict(broken)
    result = fresh.load_state_dict({**broken, "extra": torch.ones(1)}, strict=False)
    assert result.missing_keys == ["transformer.ln_f.bias"] and result.unexpected_keys == ["extra"]
    with pytest.raises(RuntimeError, match="unexpected keys \\['module.x'\\]"):
        fresh.load_state_dict({**saved, "module.x": torch.ones(1)})
    with pytest.raises(RuntimeError, match="shape"):
        fresh.load_state_dict({**saved, "transformer.wpe.weight": torch.ones(3, 3)})


def test_state_dict_is_full_and_round_trips() -> None:
    run_distributed(_state_dict, 3)


def _prefetch(rank: int, world_size: int) -> Dict[str, int]:
    hits = {}
    for async_on in (False, True):
        # Counted in layers below (the default unit is per block).
        fsdp = FSDP(make_model(0, CFG), enable_async_communication=async_on, unit="layer")
        state = fsdp._state
        take = state.take_prefetched
        counter = [0]

        def counting_take(handler: Any) -> Any:
            gathered = take(handler)
            counter[0] += gathered is not None
            return gathered

        state.take_prefetched = counting_take
        for step in range(2):
            counter[0] = 0
            x, y = global_batch(step, 2 * world_size, 8, CFG.vocab_size)
            lm_loss(
                fsdp(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)
            ).backward()
            hits[f"async={async_on}-step={step}"] = counter[0]
            assert fsdp.memory_stats()["gathered_bytes"] == 0  # nothing left pending
    return hits


def test_async_prefetch_serves_every_layer_but_the_first_of_each_pass() -> None:
    hits = run_distributed(_prefetch, 2)[0]
    layers = 16
    assert hits == {
        "async=False-step=0": 0,
        "async=False-step=1": 0,
        # The first forward records the order; backward uses it. Every layer but the first of
        # a pass is served by a prefetch; in backward, lm_head's unit is kept from forward and
        # the two embeddings' units are not gathered at all ([Note: full units]).
        "async=True-step=0": layers - 3,
        "async=True-step=1": (layers - 1) + (layers - 3),
    }


def _checkpointing(rank: int, world_size: int) -> None:
    """Recomputing blocks in backward (with prefetch on) changes nothing, bitwise."""
    results = []
    for checkpointing, async_on in ((False, False), (True, True)):
        fsdp, opt = build(
            "fsdp", make_model(0, CFG), OPTIMIZERS["adamw"], enable_async_communication=async_on
        )
        fsdp.gradient_checkpointing = checkpointing
        for step in range(2):
            x, y = global_batch(step, 2 * world_size, 8, CFG.vocab_size)
            lm_loss(
                fsdp(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)
            ).backward()
            opt.step()
            opt.zero_grad()
            assert fsdp.memory_stats()["gathered_bytes"] == 0
        results.append(fsdp.state_dict())
    assert all(torch.equal(results[0][k], results[1][k]) for k in results[0])


def test_gradient_checkpointing_with_prefetch_is_bitwise_identical() -> None:
    run_distributed(_checkpointing, 2)


def test_auto_units_are_the_blocks_of_every_tower() -> None:
    """``unit="auto"``: the children of every ``nn.ModuleList`` / ``nn.Sequential`` /
    ``nn.ModuleDict`` of same-type modules holding parameters, outermost lists only; the rest
    is the root."""
    from tiny_fsdp.core.module import convert_module
    from tiny_fsdp.core.unit_layout import unit_layers

    class Tower(nn.Module):
        def __init__(self, n: int) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(
                nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)) for _ in range(n)
            )

    class TwoTowers(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.encoder = Tower(2)
            self.decoder = Tower(3)  # a list inside each block: part of the block
            self.stages = nn.Sequential(nn.LayerNorm(4), nn.LayerNorm(4))
            self.mixed = nn.ModuleList([nn.Linear(4, 4), nn.LayerNorm(4)])  # not one type
            self.acts = nn.Sequential(nn.ReLU(), nn.ReLU())  # no parameters
            # torchtitan's Llama keeps its blocks in a dict
            self.layers = nn.ModuleDict({"0": Tower(1), "1": Tower(1)})

    units = unit_layers(convert_module(TwoTowers()), "auto")
    assert [name for name, _ in units] == [
        "encoder.blocks.0", "encoder.blocks.1",
        "decoder.blocks.0", "decoder.blocks.1", "decoder.blocks.2",
        "stages.0", "stages.1", "layers.0", "layers.1", "<root>",
    ]  # fmt: skip
    assert [len(layers) for _, layers in units] == [
        2,
        2,
        2,
        2,
        2,
        1,
        1,
        2,
        2,
        3,
    ]  # root: embed, mixed
    plain = convert_module(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))
    assert [name for name, _ in unit_layers(plain, "auto")] == ["0", "2"]  # no list: per layer


def test_auto_units_leave_a_layer_shared_by_blocks_to_the_root() -> None:
    """A layer module that several blocks hold (ALBERT-style sharing) is in none of their
    units but in the root; a weight tied across two blocks stays in both; listing two modules
    that share a layer is refused, saying what to list instead."""
    from tiny_fsdp.core.module import convert_module
    from tiny_fsdp.core.unit_layout import unit_layers

    class Block(nn.Module):
        def __init__(self, norm: nn.Module) -> None:
            super().__init__()
            self.norm, self.fc = norm, nn.Linear(4, 4)

    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            norm = nn.LayerNorm(4)
            self.blocks = nn.ModuleList(Block(norm) for _ in range(3))
            self.blocks[2].fc.weight = self.blocks[0].fc.weight

    model = convert_module(Shared())
    units = dict(unit_layers(model, "auto"))
    norm, blocks = model.blocks[0].norm, model.blocks
    assert list(units) == ["blocks.0", "blocks.1", "blocks.2", "<root>"]
    assert [units[f"blocks.{i}"] for i in range(3)] == [[b.fc] for b in blocks]
    assert units["<root>"] == [model.embed, norm]
    with pytest.raises(ValueError, match="inside two unit modules.*list neither"):
        unit_layers(model, list(blocks))


def test_unit_layers_groups_listed_modules_and_a_root() -> None:
    from tiny_fsdp.core.unit_layout import unit_layers
    from tiny_fsdp.core.module import convert_module

    model = convert_module(make_model(0, CFG))
    blocks = list(model.transformer.h)
    units = unit_layers(model, blocks)
    assert [name for name, _ in units] == ["transformer.h.0", "transformer.h.1", "<root>"]
    assert [len(layers) for _, layers in units] == [6, 6, 4]  # root: wte, wpe, ln_f, lm_head
    assert len(unit_layers(model, "layer")) == len(unit_layers(model, "tensor")) == 16
    with pytest.raises(ValueError, match="inside two unit modules"):
        unit_layers(model, [blocks[0], blocks[0].attn])
    with pytest.raises(ValueError, match="not a submodule"):
        unit_layers(model, [nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="unit must be"):
        unit_layers(model, "block")
