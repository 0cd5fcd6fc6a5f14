"""Specification of ZeRO-3 inter-tensor (``tiny_fsdp.core.zero3``) on gloo ranks.

Each ``_underscored`` function runs on every rank (``run_distributed``) and loops over many
cases, so that the worker pools are started once per world size.
"""

import contextlib
import copy
import dataclasses
import time
import types
from collections import OrderedDict
from typing import Any, Dict, List

import pytest
import torch
from torch import nn

from example.model import GPT2Model, GPTConfigs
from tests.build import adamw, build, sgd, zero3_table
from tests.harness import run_distributed
from tests.parity import PARAM_ATOL, check_parity, global_batch, lm_loss, local_slice, make_model
from tiny_fsdp.core import comm
from tiny_fsdp.core.module import CallbackModule
from tiny_fsdp.core.zero3 import Zero3, Zero3AdamW, Zero3SGD, zero3_partition_tensors

CFG = GPTConfigs.gpt2_tiny
OPTIMIZERS = {"adamw": adamw(lr=1e-3, weight_decay=0.1), "sgd_momentum": sgd(lr=0.05, momentum=0.9)}
# Frozen in some parity cases: a plain tensor, a bias, and the tied wte / lm_head pair.
FROZEN = ("transformer.wpe.weight", "transformer.h.0.attn.c_attn.bias", "lm_head.weight")


def _local_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _freeze(model: nn.Module) -> None:
    for name in FROZEN:
        model.get_parameter(name).requires_grad_(False)


# ------------------------------------------------------------------------------------ parity


def _parity(rank: int, world_size: int) -> Dict[str, float]:
    cases = [  # (optimizer, evenness, async, prefetch depth, frozen)
        ("adamw", 0.0, False, 2, False),
        ("sgd_momentum", 1.0, True, 2, False),
        ("adamw", 1.0, True, 1, True),
        ("sgd_momentum", 0.0, False, 2, True),
    ]
    diffs = {}
    for optim, evenness, async_on, depth, frozen in cases:
        seen: List[Any] = []

        def wrap(model: nn.Module):
            if frozen:
                _freeze(model)
            seen.append({n: p.shape for n, p in model.named_parameters()})
            zero3, opt = build(
                "zero3", model, OPTIMIZERS[optim], evenness=evenness, prefetch_depth=depth
            )
            zero3.enable_async_communication = async_on  # the attribute works like the arg
            seen.append((zero3, opt))
            return zero3, opt

        def reference_optimizer(reference: nn.Module):
            if frozen:
                _freeze(reference)
            return OPTIMIZERS[optim].reference(reference.parameters())

        case = f"{optim} evenness={evenness} async={async_on} frozen={frozen}"
        result = check_parity(rank, world_size, wrap, reference_optimizer, lambda m: m.state_dict())
        diffs[case] = result.max_param_diff
        shapes, (zero3, opt) = seen
        for name, param in zero3.module.named_parameters():
            owned = zero3.param_part_table[name] == rank
            assert param.shape == (shapes[name] if owned else (0,)), (case, name)
            if frozen and name in FROZEN:  # never updated: no optimizer state
                assert len(opt.state[param]) == 0, (case, name)
    return diffs


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])  # 3: no table splits the model evenly
def test_matches_single_device_training(world_size: int) -> None:
    for diffs in run_distributed(_parity, world_size):
        assert len(diffs) == 4 and all(d <= PARAM_ATOL for d in diffs.values()), diffs


def _lopsided_table(rank: int, world_size: int) -> List[Any]:
    # Rank 0 owns the embeddings and the final norm, rank 1 every block tensor: locally rank 0's
    # blocks are empty placeholders. The unit layout (blocks + root, unit="auto") comes from
    # full sizes, so it is the same on both ranks and their collectives pair up.
    reference = make_model(0)
    table = {
        name: 1 if name.startswith("transformer.h.") else 0
        for name, _ in reference.named_parameters()
    }

    seen: List[Zero3] = []

    def wrap(model: nn.Module):
        seen.append(Zero3(model, table))
        opt = Zero3SGD(seen[-1].named_parameters(), param_part_table=table, lr=0.05, momentum=0.9)
        return seen[-1], opt

    check_parity(  # asserts losses and parameters against one device, step by step
        rank,
        world_size,
        wrap,
        lambda m: OPTIMIZERS["sgd_momentum"].reference(m.parameters()),
        lambda m: m.state_dict(),
        steps=3,
    )
    return [unit.name for unit in seen[0].units]


def test_unit_layout_is_the_same_on_ranks_that_own_different_tensors() -> None:
    names = run_distributed(_lopsided_table, 2)
    blocks = [f"transformer.h.{i}" for i in range(CFG.n_layer)]
    assert names[0] == names[1] == blocks + ["<root>"]


# ------------------------------------------------------------------------- async prefetching


def _async_bitwise(rank: int, world_size: int) -> None:
    for checkpointing in (False, True):
        variants = [(False, 2), (True, 1), (True, 3)]  # (async, prefetch depth)
        models = []
        for async_on, depth in variants:
            model, opt = build(
                "zero3",
                make_model(3),
                OPTIMIZERS["adamw"],
                evenness=0.5,
                enable_async_communication=async_on,
                prefetch_depth=depth,
            )
            model.gradient_checkpointing = checkpointing
            models.append((model, opt))
        for step in range(4):
            x, y = global_batch(step, 2 * world_size, 8, CFG.vocab_size)
            x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
            losses = []
            for model, opt in models:
                if step == 2:  # passes of other kinds and lengths must not derail prefetching
                    with torch.no_grad():
                        model(x)
                    model(x[:1])  # grad-enabled forward without a backward
                    # A pass through other layers than recorded: off script from its 2nd fetch.
                    model.module.forward = types.MethodType(_skip_blocks, model.module)
                    lm_loss(model(x), y).backward()
                    del model.module.forward
                loss = lm_loss(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            assert len(set(losses)) == 1, (checkpointing, step, losses)  # bitwise
        states = [m.state_dict() for m, _ in models]
        for key, value in states[0].items():
            assert all(torch.equal(value, s[key]) for s in states[1:]), key
        peaks = [m.fetch_stats.peak_bytes for m, _ in models]
        if world_size > 1:  # prefetching really happened: more layers in flight at once
            assert peaks[0] < peaks[1] <= peaks[2], peaks


def _skip_blocks(gpt: GPT2Model, idx: torch.Tensor) -> torch.Tensor:
    return gpt.lm_head(gpt.transformer.ln_f(gpt.transformer.wte(idx)))


@pytest.mark.parametrize("world_size", [2, 3])
def test_async_prefetch_is_bitwise_identical(world_size: int) -> None:
    run_distributed(_async_bitwise, world_size)


# ------------------------------------------------------------- memory and communication counts


def _memory(rank: int, world_size: int) -> None:
    for evenness, frozen in ((0.0, False), (1.0, True)):
        base = make_model(0)
        if frozen:  # owned and broadcast like the others, but no gradient, no optimizer state
            _freeze(base)
        # Without prefetch first (the default is on): one layer fetched at a time; per
        # tensor units, so that every count below is per layer and per tensor.
        model, opt = build(
            "zero3",
            base,
            OPTIMIZERS["adamw"],
            evenness=evenness,
            enable_async_communication=False,
            unit="tensor",
        )
        parts = model.param_part_table
        owned = parts.rank_bytes[rank]
        params = list(model.module.parameters())  # the tied parameter once
        trainable = _local_bytes(p for p in params if p.requires_grad)  # owned and trainable
        layers = [m for m in model.module.modules() if isinstance(m, CallbackModule)]
        uses = [p for m in layers for p in _params(m)]
        # An embedding's backward reads no parameter value, so it fetches nothing ([Note: full
        # units]); with a frozen weight it has no backward at all (token ids need no gradient).
        no_backward = [m for m in layers if isinstance(m, nn.Embedding)]
        # From the second step on (once the backward order is known), lm_head, the last layer
        # of forward and the first of backward, stays full from one to the other ([Note:
        # prefetch], keeps_after_forward): its tensors are broadcast once.
        assert layers[-1] is model.module.lm_head
        kept = len(_params(layers[-1]))
        n_broadcasts = 2 * len(uses) - sum(len(_params(m)) for m in no_backward)
        n_reduces = sum(p.requires_grad for p in uses)
        name_of = {id(p): name for name, p in model.module.named_parameters()}
        remote = [  # bytes a layer fetches from other ranks
            sum(parts.nbytes[name_of[id(p)]] for p in _params(m) if parts[name_of[id(p)]] != rank)
            for m in layers
        ]
        assert _local_bytes(params) == owned
        for step in range(2):
            comm.LEDGER.reset()
            x, y = global_batch(step, 2 * world_size, 8, CFG.vocab_size)
            loss = lm_loss(
                model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)
            )
            loss.backward()
            # Gradients exist on owners only, full size: this rank's share of the table.
            assert _local_bytes(p.grad for p in params if p.grad is not None) == trainable
            # Each use of a tensor (the tied one twice) is broadcast in forward and in backward
            # and its gradient reduced once, then one flag all-reduced ([Note: agreeing on
            # overflow]); nothing at all on one rank.
            broadcasts = n_broadcasts - (kept if step else 0)
            n_calls = {"broadcast": broadcasts, "reduce": n_reduces, "all_reduce": 1}
            n_calls = n_calls if world_size > 1 else {}
            assert dict(comm.LEDGER.calls) == n_calls, (evenness, frozen, step)
            # One layer at a time is fetched, then freed for real (no reference survives).
            assert model.fetch_stats.peak_bytes == max(remote)
            assert model.fetch_stats.live_bytes == 0 and _buffers_alive_after(model) == 0
            opt.step()
            opt.zero_grad(set_to_none=True)
            state = [v for s in opt.state.values() for k, v in s.items() if k != "step"]
            assert _local_bytes(state) == 2 * trainable  # exp_avg + exp_avg_sq
            assert _local_bytes(params) == owned
        # With prefetching, at most prefetch_depth + 1 layers are fetched at once.
        model.enable_async_communication = True
        for step in range(2):
            model(local_slice(x, rank, world_size)).sum().backward()
        assert model.fetch_stats.peak_bytes <= (model.prefetch_depth + 1) * max(remote)
        assert _buffers_alive_after(model) == 0


def _buffers_alive_after(model: Zero3, patience_s: float = 2.0) -> int:
    """Fetched buffers still alive, once gloo lets go: its worker thread may hold the last
    finished collective (and so its tensor) for a few milliseconds after ``wait()``."""
    deadline = time.monotonic() + patience_s
    while model.fetch_stats.buffers_alive() and time.monotonic() < deadline:
        time.sleep(0.001)
    return model.fetch_stats.buffers_alive()


def _params(layer: nn.Module) -> List[nn.Parameter]:
    """The parameters ``layer`` computes with (absent biases left out)."""
    return [getattr(layer, n) for n in layer.param_names if getattr(layer, n) is not None]


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_memory_is_the_owned_share(world_size: int) -> None:
    run_distributed(_memory, world_size)


# -------------------------------------------------------------------- gradient accumulation


def _no_sync(rank: int, world_size: int) -> None:
    reference = make_model(4)
    model, opt = build("zero3", copy.deepcopy(reference), OPTIMIZERS["sgd_momentum"], evenness=1.0)
    ref_opt = OPTIMIZERS["sgd_momentum"].reference(reference.parameters())
    trainable = sum(model.param_part_table.nbytes.values())  # every tensor is trainable
    for step in range(3):
        for micro in range(3):
            x, y = global_batch(10 * step + micro, 2 * world_size, 8, CFG.vocab_size)
            (lm_loss(reference(x), y) / 3).backward()
            reduces = comm.LEDGER.calls["reduce"]
            sync = micro == 2
            with contextlib.nullcontext() if sync else model.no_sync():
                logits = model(local_slice(x, rank, world_size))
                (lm_loss(logits, local_slice(y, rank, world_size)) / 3).backward()
            if not sync:  # no communication; every rank holds a full-size gradient buffer
                assert comm.LEDGER.calls["reduce"] == reduces
                assert model.no_sync_bytes == trainable
                assert all(p.grad is None for p in model.module.parameters())
            else:
                assert comm.LEDGER.calls["reduce"] > reduces or world_size == 1
                assert model.no_sync_bytes == 0
                # Owners (full local tensor) hold the reduced total; the others nothing.
                assert all((p.grad is not None) == (p.numel() > 0) for p in model.parameters())
        ref_opt.step()
        ref_opt.zero_grad()
        opt.step()
        opt.zero_grad()
    full = model.state_dict()
    for name, value in reference.state_dict().items():
        assert (full[name] - value).abs().max().item() <= PARAM_ATOL, name


@pytest.mark.parametrize("world_size", [2, 3])
def test_no_sync_accumulates_then_reduces_once(world_size: int) -> None:
    run_distributed(_no_sync, world_size)


# --------------------------------------------------------------- initialisation, state dicts


def _init_and_state_dict(rank: int, world_size: int) -> None:
    expected = make_model(5).state_dict()
    for evenness in (0.0, 1.0):
        torch.manual_seed(5)
        with torch.device("meta"):
            meta = GPT2Model(CFG)
        tensors = OrderedDict(meta.named_parameters())
        if evenness == 0.0:
            parts = zero3_table(meta, evenness)
        else:  # no ranks_map: world size from the process group, device from the backend
            parts, _ = zero3_partition_tensors(tensors, evenness_priority=evenness)
            assert parts.world_size == world_size and parts.devices == (None,) * world_size
        model = Zero3(meta, parts)
        assert model.device == torch.device("cpu")
        params = list(model.module.parameters())
        assert not any(p.is_meta for p in params) and _local_bytes(params) == parts.rank_bytes[rank]
        assert model.module.lm_head.weight is model.module.transformer.wte.weight  # still tied
        full = model.state_dict()
        assert list(full) == list(expected)  # plain keys, tied duplicate included
        assert all(torch.equal(full[k], v) for k, v in expected.items())  # owners' init only

        # Ranks that built different weights hold rank 0's by default (sync_module_states, as
        # FSDP and DDP); without it each owner keeps its own.
        synced = Zero3(make_model(100 + rank), parts).state_dict()
        rank0 = make_model(100).state_dict()
        assert all(torch.equal(synced[k], v) for k, v in rank0.items())
        owners = Zero3(make_model(100 + rank), parts, sync_module_states=False).state_dict()
        assert not all(torch.equal(owners[k], v) for k, v in rank0.items())

        # Round trip: load full tensors, keep only owned ones, give the same tensors back.
        model.load_state_dict(rank0)
        assert _local_bytes(model.module.parameters()) == parts.rank_bytes[rank]
        again = model.state_dict()
        assert all(torch.equal(again[k], v) for k, v in rank0.items())
        del rank0["lm_head.weight"]
        with pytest.raises(RuntimeError, match="missing keys.*lm_head.weight"):
            model.load_state_dict(rank0)
        rank0["lm_head.weight"] = torch.zeros(3)
        with pytest.raises(RuntimeError, match="size mismatch for lm_head.weight"):
            model.load_state_dict(rank0)

    # No table: the one zero3_partition_tensors makes for the model and the process group.
    default = Zero3(make_model(5))
    expected_table = zero3_partition_tensors(make_model(5).named_parameters())[0]
    assert dict(default.param_part_table) == dict(expected_table)
    assert all(torch.equal(t, expected[k]) for k, t in default.state_dict().items())


@pytest.mark.parametrize("world_size", [2, 3])
def test_meta_init_and_state_dict_round_trip(world_size: int) -> None:
    run_distributed(_init_and_state_dict, world_size)


# ------------------------------------------------------------------------------------ errors


class _NoInit(nn.Module):
    """On meta, ``proj`` initialises itself (``reset_parameters``); nothing sets ``scale``."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 3)
        self.scale = nn.Parameter(torch.ones(3))


def _errors(rank: int, world_size: int) -> None:
    model = make_model(0)
    other_size = zero3_partition_tensors(OrderedDict(model.named_parameters()), ["cpu"] * 3)[0]
    with pytest.raises(ValueError, match="made for 3 ranks but the process group has 2"):
        Zero3(make_model(0), other_size)
    no_bias = GPT2Model(dataclasses.replace(CFG, bias=False))
    with pytest.raises(ValueError, match="another model.*table names not in the model.*c_attn.b"):
        Zero3(no_bias, zero3_table(model))
    wider = GPT2Model(dataclasses.replace(CFG, vocab_size=70))
    with pytest.raises(ValueError, match="another model: sizes differ.*wte.weight"):
        Zero3(wider, zero3_table(model))
    with torch.device("meta"):
        meta = _NoInit()
    with pytest.raises(ValueError, match=r"\['scale'\] are on the meta device and nothing"):
        Zero3(meta, zero3_table(meta))

    parts = zero3_table(model, 0.0)
    with pytest.raises(ValueError, match="'transformer.wte.weight' is not managed by Zero3"):
        Zero3AdamW(make_model(0).named_parameters(), param_part_table=parts)
    zero3 = Zero3(model, parts)
    with pytest.raises(ValueError, match="made for 3 ranks but the process group has 2"):
        Zero3SGD(zero3.module.named_parameters(), param_part_table=other_size)
    with pytest.raises(ValueError, match="ranks_map names 3 ranks"):
        Zero3SGD(zero3.module.parameters(), param_part_table=parts, ranks_map=["cpu"] * 3)
    other_owners = zero3_table(model, 1.0)
    assert dict(other_owners) != dict(parts)
    with pytest.raises(ValueError, match="in param_part_table; pass the table the model was"):
        Zero3AdamW(zero3.module.named_parameters(), param_part_table=other_owners)


def test_errors_say_how_to_fix() -> None:
    run_distributed(_errors, 2)
