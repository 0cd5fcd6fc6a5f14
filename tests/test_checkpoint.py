"""Specification of ``tiny_fsdp.checkpoint``: full and sharded checkpoints for every strategy.

- Moving a checkpoint between strategies and world sizes keeps every parameter and every
  optimizer state tensor bitwise identical (checked against each strategy's own full view, not
  against the checkpoint code).
- Resume is exact: 10 steps straight == 5 steps, save, load into fresh objects, 5 steps
  (losses and parameters bitwise; the model has dropout, so the RNG states must come back too),
  also under a bf16 policy, where ZeRO-1/2's fp32 masters of bf16 parameters must come back.
- Damaged checkpoints raise ``CheckpointError`` saying what is wrong; a failed save (on any rank)
  leaves the previous checkpoint loadable. One device needs no process group.

``_underscored`` functions run on every rank (``run_distributed``).
"""

import dataclasses
import io
import json
import os
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
from torch import nn

from example.model import GPT2Model, GPTConfigs
from example.strategies import decayed_names, param_groups
from tests.build import adamw, build, sgd
from tests.harness import run_distributed
from tests.parity import global_batch, lm_loss, local_slice
from tiny_fsdp.checkpoint import (
    CheckpointError,
    full_checkpoint_file,
    load_checkpoint,
    save_checkpoint,
)
from tiny_fsdp.core import comm
from tiny_fsdp.core.module import convert_module

# Dropout makes training consume the RNG, so exact resume needs the RNG states restored.
CFG = dataclasses.replace(GPTConfigs.gpt2_tiny, dropout=0.1)
BATCH_PER_RANK, SEQ_LEN = 2, 8
StateT = Tuple[Dict[str, torch.Tensor], Dict[str, Dict[str, Any]]]  # (params, optimizer state)
OPTIMIZERS = {"adamw": adamw(lr=1e-3), "sgd": sgd(lr=0.05, momentum=0.9)}


def build_gpt(
    strategy: str, optim: str, seed: int, precision: str = "fp32"
) -> Tuple[nn.Module, Any]:
    """A GPT-2 tiny under ``strategy`` with two param groups (decay / no decay), under the
    mixed-precision policy named ``precision``."""
    from tiny_fsdp.core import MixedPrecisionPolicy

    torch.manual_seed(seed)
    plain = GPT2Model(CFG)
    decay = decayed_names(plain)
    policy = MixedPrecisionPolicy.from_name(precision)
    return build(
        strategy,
        plain,
        OPTIMIZERS[optim],
        groups=lambda named: param_groups(named, decay, 0.1),
        **({} if policy is None else {"mixed_precision": policy}),
    )


def train(model: nn.Module, optimizer: Any, steps: range, rank: int, world: int) -> List[float]:
    """Steps of the global batch ``global_batch(step)``, this rank's slice; local losses."""
    losses = []
    for step in steps:
        x, y = global_batch(step, BATCH_PER_RANK * world, SEQ_LEN, CFG.vocab_size)
        loss = lm_loss(model(local_slice(x, rank, world)), local_slice(y, rank, world))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def full_state(strategy: str, model: nn.Module, optimizer: Any) -> StateT:
    """Full parameters and per-parameter optimizer state, from each strategy's OWN view
    (``state_dict()``, ``consolidate_state_dict``, shards / owners gathered here): an oracle
    independent of the checkpoint code. Collective; complete on rank 0."""
    params = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    inner = getattr(model, "module", model)
    names = {id(p): n for n, p in inner.named_parameters()}
    state: Dict[str, Dict[str, Any]] = {}
    if strategy in ("zero1", "zero2"):
        optimizer.consolidate_state_dict(to=0)
        if torch.distributed.get_rank() == 0:
            flat = [p for g in optimizer.param_groups for p in g["params"]]
            for index, entry in optimizer.state_dict()["state"].items():
                state[names[id(flat[index])]] = {k: v for k, v in entry.items() if k != "master"}
        return params, state
    local = {
        names[id(p)]: {k: v.detach().cpu().clone() for k, v in s.items()}
        for p, s in optimizer.state.items()
    }
    if strategy in ("single", "ddp"):
        return params, local
    everyone = comm.all_gather_object(local)
    for name in names.values():
        parts = [rank_state[name] for rank_state in everyone if name in rank_state]
        if not parts:
            continue
        if strategy == "zero3":  # exactly one owner
            assert len(parts) == 1, f"{name}: state on {len(parts)} ranks"
            state[name] = parts[0]
        else:  # fsdp: every rank holds its rows; 0-d values (step) are per parameter
            shape = params[name].shape
            state[name] = {
                k: torch.cat([p[k] for p in parts]).view(shape) if v.dim() else v
                for k, v in parts[0].items()
            }
    return params, state


def assert_same(a: StateT, b: StateT, what: str) -> None:
    for part, x, y in (("parameters", a[0], b[0]), ("optimizer state", a[1], b[1])):
        assert set(x) == set(y), f"{what}: {part} names differ: {set(x) ^ set(y)}"
        for name in x:
            xs, ys = (
                (x[name], y[name]) if part == "optimizer state" else ({"": x[name]}, {"": y[name]})
            )
            assert set(xs) == set(ys), f"{what}: {name} state keys {set(xs)} vs {set(ys)}"
            for key in xs:
                # Bitwise: a move copies values, it computes nothing.
                assert (
                    torch.equal(xs[key], ys[key]) and xs[key].dtype == ys[key].dtype
                ), f"{what}: {part} {name} {key} differs"


# ------------------------------------------------------------------------ moving checkpoints

# (strategy on 2 ranks, then on 3 ranks, then on 1 rank, checkpoint kind, optimizer)
CHAINS = [
    ("fsdp", "zero3", "ddp", "sharded", "adamw"),
    ("fsdp", "zero3", "ddp", "full", "adamw"),
    ("zero2", "fsdp", "zero1", "sharded", "sgd"),
    ("zero3", "zero1", "fsdp", "full", "adamw"),
    ("ddp", "zero2", "zero3", "sharded", "adamw"),
    ("zero1", "ddp", "fsdp", "full", "sgd"),
]


def _stage(
    rank: int, world: int, strategy: str, optim: str, kind: str, load: Optional[str], save: str
) -> Tuple[StateT, Optional[dict]]:
    """Build (seeded differently per stage), then train 3 steps or load; save; full state."""
    model, optimizer = build_gpt(strategy, optim, seed=world)
    info = None
    if load is None:
        train(model, optimizer, range(3), rank, world)
    else:
        info = load_checkpoint(load, model, optimizer)
    save_checkpoint(save, model, optimizer, step=3, sharded=kind == "sharded")
    return full_state(strategy, model, optimizer), info


@pytest.mark.parametrize("chain", CHAINS, ids=lambda c: "->".join(c[:3]) + f"-{c[3]}-{c[4]}")
def test_move_between_strategies_and_world_sizes(chain, tmp_path) -> None:
    *strategies, kind, optim = chain
    states, load = [], None
    for world, strategy in zip((2, 3, 1), strategies):
        save = str(tmp_path / f"{strategy}_{world}")
        results = run_distributed(_stage, world, strategy, optim, kind, load, save)
        state, info = results[0]
        if info is not None:
            assert info["step"] == 3 and info["kind"] == kind
            assert not info["rng_restored"]  # other world size: no per-rank streams to restore
        states.append(state)
        load = save
    assert states[0][1], "the optimizer has state after 3 steps"
    for state, strategy in zip(states[1:], strategies[1:]):
        assert_same(states[0], state, f"{strategies[0]}@2 -> {strategy}")
    # And without a process group, into a plain single-device model.
    model, optimizer = build_gpt("single", optim, seed=5)
    load_checkpoint(load, model, optimizer)
    assert_same(states[0], full_state("single", model, optimizer), "-> one device")


class LayoutNet(nn.Module):
    """Parameters in the layouts people give them: a ``channels_last`` conv weight and a
    weight stored transposed (strides (1, 5)); neither is contiguous."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.proj = nn.Parameter(torch.randn(5, 4).t())  # (4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x).mean((2, 3)) @ self.proj  # (B, 3, H, W) -> (B, 5)


def _layout_net(strategy: str) -> Tuple[nn.Module, Any]:
    torch.manual_seed(0)
    plain = LayoutNet().to(memory_format=torch.channels_last)
    assert not plain.conv.weight.is_contiguous() and not plain.proj.is_contiguous()
    return build(strategy, plain, OPTIMIZERS["adamw"])


def _move_layouts(rank: int, world: int, path: str) -> Dict[str, StateT]:
    """Train ZeRO-3 3 steps, save (full, then sharded), load into every strategy."""
    model, optimizer = _layout_net("zero3")
    for step in range(3):
        g = torch.Generator().manual_seed(step * world + rank)
        x = torch.randn(2, 3, 6, 6, generator=g).contiguous(memory_format=torch.channels_last)
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    states = {"source": full_state("zero3", model, optimizer)}
    for kind in ("full", "sharded"):
        save_checkpoint(f"{path}/{kind}", model, optimizer, step=3, sharded=kind == "sharded")
        for strategy in ("ddp", "zero1", "zero2", "zero3", "fsdp"):
            loaded, loaded_optimizer = _layout_net(strategy)
            load_checkpoint(f"{path}/{kind}", loaded, loaded_optimizer)
            states[f"{kind} -> {strategy}"] = full_state(strategy, loaded, loaded_optimizer)
    return states


def test_parameters_of_any_layout_move_between_strategies(tmp_path) -> None:
    """A transposed or ``channels_last`` parameter is saved and loaded by its values, not its
    memory order ([Note: contiguous payloads] in tiny_fsdp/core/comm.py)."""
    states = run_distributed(_move_layouts, 2, str(tmp_path))[0]
    source = states.pop("source")
    assert source[1], "the optimizer has state after 3 steps"
    for what, state in states.items():
        assert_same(source, state, what)


# ------------------------------------------------------------------------------ exact resume


def _resume(
    rank: int, world: int, strategy: str, optim: str, kind: str, path: str, precision: str = "fp32"
) -> dict:
    model, optimizer = build_gpt(strategy, optim, seed=0, precision=precision)
    torch.manual_seed(1000 + rank)  # per-rank dropout streams
    straight = train(model, optimizer, range(10), rank, world)
    expected = full_state(strategy, model, optimizer)

    model, optimizer = build_gpt(strategy, optim, seed=0, precision=precision)
    torch.manual_seed(1000 + rank)
    first = train(model, optimizer, range(5), rank, world)
    save_checkpoint(
        path, model, optimizer, step=5, extra={"note": "half"}, sharded=kind == "sharded"
    )
    del model, optimizer
    # Fresh, other values and RNG.
    model, optimizer = build_gpt(strategy, optim, seed=123, precision=precision)
    info = load_checkpoint(path, model, optimizer)
    assert (info["step"], info["extra"], info["rng_restored"]) == (5, {"note": "half"}, True)
    second = train(model, optimizer, range(info["step"], 10), rank, world)
    assert first + second == straight, f"rank {rank}: losses {first + second} vs {straight}"
    assert_same(expected, full_state(strategy, model, optimizer), f"{strategy} resumed")
    return info


@pytest.mark.parametrize("kind", ["full", "sharded"])
@pytest.mark.parametrize(
    "strategy,world,optim,precision",
    [
        ("ddp", 2, "adamw", "fp32"),
        ("zero1", 2, "adamw", "fp32"),
        ("zero2", 2, "sgd", "fp32"),
        ("zero3", 2, "adamw", "fp32"),
        ("zero3", 3, "sgd", "fp32"),
        ("fsdp", 2, "adamw", "fp32"),
        ("fsdp", 3, "sgd", "fp32"),
        # bf16 compute: ZeRO-1/2 store bf16 parameters, the fp32 masters must come back too.
        ("zero1", 2, "adamw", "bf16"),
        ("zero2", 2, "adamw", "bf16"),
        ("fsdp", 2, "adamw", "bf16"),
    ],
)
def test_resume_is_exact(strategy, world, optim, precision, kind, tmp_path) -> None:
    infos = run_distributed(_resume, world, strategy, optim, kind, str(tmp_path), precision)
    if kind == "sharded" and strategy in ("zero3", "fsdp"):
        # Same world size: a rank reads the common file and its own shard, nothing else.
        for rank, info in enumerate(infos):
            assert len(info["files_read"]) == 2, info["files_read"]
            assert info["files_read"][0].startswith("common-")
            assert info["files_read"][1].endswith(f"-{rank:05d}-of-{world:05d}.pt")


def _with_torch_adam(strategy: str, seed: int) -> Tuple[nn.Module, torch.optim.Optimizer]:
    """13 rows on 2 ranks: FSDP's second shard has a padding row."""
    torch.manual_seed(seed)
    model, _ = build(strategy, nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5)), None)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _adam_steps(model: nn.Module, optimizer: Any, steps: range, rank: int) -> List[float]:
    losses = []
    for step in steps:
        x = torch.randn(4, 7, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _torch_optimizer_resume(rank: int, world: int, path: str) -> List[str]:
    seen = []
    for kind in ("full", "sharded"):
        model, optimizer = _with_torch_adam("fsdp", seed=0)
        _adam_steps(model, optimizer, range(2), rank)
        save_checkpoint(f"{path}/{kind}", model, optimizer, step=2, sharded=kind == "sharded")
        straight = _adam_steps(model, optimizer, range(2, 4), rank)
        for strategy in ("fsdp", "ddp"):
            resumed, resumed_optimizer = _with_torch_adam(strategy, seed=1)
            load_checkpoint(f"{path}/{kind}", resumed, resumed_optimizer)
            losses = _adam_steps(resumed, resumed_optimizer, range(2, 4), rank)
            # FSDP: the same run bit for bit; DDP averages the gradients by another
            # collective (all-reduce): float32 rounding.
            tol = 0.0 if strategy == "fsdp" else 1e-6
            assert losses == pytest.approx(straight, abs=tol, rel=0), (kind, strategy)
            expected = model.state_dict()
            for key, value in resumed.state_dict().items():
                gap = (value - expected[key]).abs().max().item()
                assert gap <= tol, f"{kind} -> {strategy}: {key} differs by {gap:.2e}"
            seen.append(f"{kind} -> {strategy}")
    return seen


def test_an_optimizer_of_another_library_resumes_from_padded_shards(tmp_path) -> None:
    """torch.optim.Adam keys its state by FSDP's padded shards; the checkpoint keeps the real
    rows only, and a load fills a state shaped like the shard (padding rows zero)."""
    seen = run_distributed(_torch_optimizer_resume, 2, str(tmp_path))[0]
    assert len(seen) == 4, seen


@pytest.mark.parametrize("kind", ["full", "sharded"])
def test_resume_is_exact_on_one_device_without_process_group(kind, tmp_path) -> None:
    assert not torch.distributed.is_initialized()
    _resume(0, 1, "single", "adamw", kind, str(tmp_path))


def test_full_checkpoint_is_plain_pytorch(tmp_path) -> None:
    model, optimizer = build_gpt("single", "adamw", seed=0)
    train(model, optimizer, range(2), 0, 1)
    save_checkpoint(str(tmp_path), model, optimizer, step=2)
    saved = torch.load(full_checkpoint_file(str(tmp_path)))  # weights_only=True by default
    plain = GPT2Model(CFG)
    plain.load_state_dict(saved["model"])  # strict: every key, tied lm_head.weight included
    for name, value in plain.state_dict().items():
        assert torch.equal(value, model.state_dict()[name]), name
    state = saved["optimizer"]["state"]["transformer.wte.weight"]  # the tied weight, once
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"} and "lm_head.weight" not in state
    assert state["exp_avg"].shape == plain.transformer.wte.weight.shape
    assert saved["optimizer"]["param_groups"][0]["weight_decay"] == 0.1


# ------------------------------------------------------------------- damage and failed saves


def _data_files(path: str) -> List[str]:
    return sorted(f for f in os.listdir(path) if f.endswith(".pt"))


def _damage(path: str, how: str) -> None:
    meta_file = os.path.join(path, "checkpoint.json")
    victim = os.path.join(path, _data_files(path)[-1])
    if how == "truncated":
        with open(victim, "r+b") as f:
            f.truncate(os.path.getsize(victim) // 2)
    elif how == "corrupted":
        with open(victim, "r+b") as f:  # same size, one byte flipped
            f.seek(os.path.getsize(victim) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
    elif how == "wrong version":
        with open(meta_file) as f:
            meta = json.load(f)
        meta["format_version"] = 99
        with open(meta_file, "w") as f:
            json.dump(meta, f)
    elif how == "garbled metadata":
        with open(meta_file, "r+b") as f:
            f.truncate(10)
    elif how == "missing file":
        os.remove(victim)
    elif how == "no checkpoint":
        os.remove(meta_file)


DAMAGES = {  # how -> what the message must say
    "truncated": "truncated",
    "corrupted": "corrupted: its sha256",
    "wrong version": "format version 99, but this tiny_fsdp reads version 1",
    "garbled metadata": "not valid JSON",
    "missing file": "is missing",
    "no checkpoint": "no checkpoint at",
}


@pytest.mark.parametrize("kind", ["full", "sharded"])
@pytest.mark.parametrize("how", list(DAMAGES))
def test_damaged_checkpoint_raises_a_clear_error(how, kind, tmp_path) -> None:
    model, optimizer = build_gpt("single", "adamw", seed=0)
    train(model, optimizer, range(1), 0, 1)
    save_checkpoint(str(tmp_path), model, optimizer, step=1, sharded=kind == "sharded")
    _damage(str(tmp_path), how)
    with pytest.raises(CheckpointError, match=DAMAGES[how]):
        load_checkpoint(str(tmp_path), model, optimizer)


def test_checkpoint_of_another_model_is_refused(tmp_path) -> None:
    model, optimizer = build_gpt("single", "adamw", seed=0)
    save_checkpoint(str(tmp_path), model, None, step=0)
    other = convert_module(GPT2Model(dataclasses.replace(CFG, n_embd=20, n_head=2)))
    with pytest.raises(CheckpointError, match="shape"):
        load_checkpoint(str(tmp_path), other)
    with pytest.raises(CheckpointError, match="no optimizer state"):
        load_checkpoint(str(tmp_path), model, optimizer)


def _failing_save(original_save):
    """``torch.save`` failing midway into real files (pickling a tensor also calls torch.save,
    into a BytesIO: that must keep working, e.g. for ``all_gather_object``)."""

    def save(obj, f, *args, **kwargs):
        if isinstance(f, io.BytesIO):
            return original_save(obj, f, *args, **kwargs)
        f.write(b"half of a checkpoint")  # a partial file on disk, then the failure
        raise OSError("No space left on device (simulated)")

    return save


@pytest.mark.parametrize("kind", ["full", "sharded"])
def test_failed_save_keeps_the_previous_checkpoint(kind, tmp_path, monkeypatch) -> None:
    path = str(tmp_path)
    model, optimizer = build_gpt("single", "adamw", seed=0)
    train(model, optimizer, range(1), 0, 1)
    save_checkpoint(path, model, optimizer, step=1, sharded=kind == "sharded")
    good_files = _data_files(path)
    expected = full_state("single", model, optimizer)
    train(model, optimizer, range(1, 2), 0, 1)
    monkeypatch.setattr(torch, "save", _failing_save(torch.save))
    with pytest.raises(CheckpointError, match="No space left on device"):
        save_checkpoint(path, model, optimizer, step=2, sharded=kind == "sharded")
    monkeypatch.undo()
    assert sorted(os.listdir(path)) == sorted(good_files + ["checkpoint.json"])  # no leftovers
    fresh, fresh_optimizer = build_gpt("single", "adamw", seed=9)
    assert load_checkpoint(path, fresh, fresh_optimizer)["step"] == 1
    assert_same(expected, full_state("single", fresh, fresh_optimizer), "after a failed save")
    # The next successful save replaces it and removes its files.
    save_checkpoint(path, model, optimizer, step=2, sharded=kind == "sharded")
    assert not set(good_files) & set(os.listdir(path))


def _rank_failures(rank: int, world: int, path: str) -> List[str]:
    """A save failing on rank 1 only, then a shard damaged: every rank raises, nobody hangs."""
    messages = []
    model, optimizer = build_gpt("fsdp", "adamw", seed=0)
    train(model, optimizer, range(1), rank, world)
    save_checkpoint(path, model, optimizer, step=1, sharded=True)
    expected = full_state("fsdp", model, optimizer)
    train(model, optimizer, range(1, 2), rank, world)
    original = torch.save
    if rank == 1:
        torch.save = _failing_save(original)
    try:
        save_checkpoint(path, model, optimizer, step=2, sharded=True)
    except CheckpointError as exc:
        messages.append(str(exc))
    finally:
        torch.save = original
    info = load_checkpoint(path, model, optimizer)
    assert info["step"] == 1
    assert_same(expected, full_state("fsdp", model, optimizer), f"rank {rank} after failed save")
    comm.all_gather_object(None)  # every rank has loaded before rank 0 damages a shard
    if rank == 0:
        shard = [f for f in _data_files(path) if f.endswith(f"-00001-of-{world:05d}.pt")][0]
        _damage_file(os.path.join(path, shard))
    comm.all_gather_object(None)
    try:
        load_checkpoint(path, model, optimizer)
    except CheckpointError as exc:
        messages.append(str(exc))
    return messages


def _damage_file(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 1)


def test_failure_on_one_rank_raises_on_every_rank(tmp_path) -> None:
    for rank, messages in enumerate(run_distributed(_rank_failures, 2, str(tmp_path))):
        assert len(messages) == 2, f"rank {rank}: {messages}"
        save_error, load_error = messages
        assert "writing the checkpoint failed on rank(s) [1]" in save_error
        assert "No space left on device" in save_error
        # FSDP at the same world size: only rank 1 reads shard 1, yet both ranks raise.
        assert "loading the checkpoint failed on rank(s) [1]" in load_error
        assert "truncated" in load_error
