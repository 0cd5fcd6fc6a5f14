"""Specification: torch's distributed checkpoint (torchtitan's way: ``get_state_dict``,
``dcp.save`` / ``dcp.load``, ``set_state_dict``) with tiny_fsdp's wrappers ([Note: torch's
distributed checkpoint] in ``tiny_fsdp/core/torch_checkpoint.py``).

- FSDP's parameters and optimizer state (tiny_fsdp's optimizers and ``torch.optim``'s) reach DCP
  as each rank's rows: nothing is gathered, the full state DCP assembles is torch DDP +
  ``torch.optim.AdamW``'s on the same data, it loads at another world size exactly, and
  training resumed from it is training continued. Keys and layout are FSDP2's: checkpoints move
  between FSDP2 and our FSDP.
- ZeRO-1/2/3 optimizer state has no DTensor form: ``get_state_dict`` raises on every rank,
  before ``dcp.save`` could write one rank's part. Every wrapper's model state round-trips, and
  loads from a full state dict broadcast from rank 0.
"""

import copy
from typing import Any, Dict, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from tests.harness import run_distributed

FULL = StateDictOptions(full_state_dict=True)  # on every rank
StateT = Tuple[Dict[str, torch.Tensor], Dict[str, Dict[str, torch.Tensor]]]


class Net(nn.Module):
    """Rows that do not split evenly over 2 or 3 ranks, a 0-d parameter and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 7), nn.Linear(7, 5)
        self.scale = nn.Parameter(torch.tensor(0.5))
        self.register_buffer("offset", torch.arange(5.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 4) -> (B, 5)
        return self.b(torch.tanh(self.a(x))) * self.scale + self.offset


class Pair(nn.Module):
    """Two uneven layers and no 0-d parameter (which FSDP2 refuses)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 7), nn.Linear(7, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 4) -> (B, 5)
        return self.b(torch.tanh(self.a(x)))


def _build(wrapper: str, optim: str, seed: int, net: type = Net) -> Tuple[nn.Module, Any]:
    from tiny_fsdp import core

    torch.manual_seed(seed)
    model = getattr(core, wrapper)(net())
    if optim == "torch":
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, getattr(core, wrapper + "AdamW")(model.named_parameters(), lr=1e-2)


def _step(model: nn.Module, optimizer: Any, step: int, rank: int) -> float:
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * step + rank))
    loss = model(x).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def _full(model: nn.Module, optimizer: Any) -> StateT:
    """Full model and optimizer state, as DCP gathers them: the plain model's keys."""
    weights = get_model_state_dict(model, options=FULL)
    optim = get_optimizer_state_dict(model, optimizer, options=FULL)["state"]
    return {k: v.clone() for k, v in weights.items()}, copy.deepcopy(optim)


def _dcp_save(model: nn.Module, optimizer: Any, path: str) -> None:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def _dcp_load(model: nn.Module, optimizer: Any, path: str) -> None:
    """torchtitan's resume: the state dicts to fill, ``dcp.load`` into them, then set."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    loaded = {"model": model_sd, "optim": optim_sd}
    dcp.load(loaded, checkpoint_id=path)
    set_state_dict(
        model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"]
    )


def _save(rank: int, world: int, optim: str, path: str) -> Dict[str, Any]:
    """FSDP 2 steps, DCP save; a fresh pair loads it and steps on alongside the original.
    Also torch DDP + torch.optim.AdamW on the same data: the oracle for the saved state."""
    from torch.nn.parallel import DistributedDataParallel

    model, optimizer = _build("FSDP", optim, seed=0)
    torch.manual_seed(0)
    reference = DistributedDataParallel(Net())
    reference_optim = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for step in range(2):
        _step(model, optimizer, step, rank)
        _step(reference, reference_optim, step, rank)
    model_sd = get_model_state_dict(model)
    local = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in model_sd.items()}
    parts = {k: (type(model_sd[k]).__name__, tuple(v.shape)) for k, v in local.items()}
    _dcp_save(model, optimizer, path)

    resumed, resumed_optim = _build("FSDP", optim, seed=1)
    _dcp_load(resumed, resumed_optim, path)
    saved = _full(model, optimizer)
    continued = [_step(model, optimizer, step, rank) for step in (2, 3)]
    again = [_step(resumed, resumed_optim, step, rank) for step in (2, 3)]
    return {
        "parts": parts,
        "saved": saved,
        "torch_ddp": _full(reference, reference_optim),
        "continued": (continued, _full(model, optimizer)),
        "resumed": (again, _full(resumed, resumed_optim)),
    }


def _load(rank: int, world: int, optim: str, path: str) -> Tuple[StateT, StateT]:
    """DCP load; then the same state as a full state dict on rank 0, broadcast to a fresh
    optimizer (pytorch/examples' FSDP2 way). Both full states."""
    model, optimizer = _build("FSDP", optim, seed=2)
    _dcp_load(model, optimizer, path)
    state = _full(model, optimizer)
    full = get_optimizer_state_dict(model, optimizer, options=FULL)
    # Full plain tensors where each rank's rows are expected (no full_state_dict option).
    with pytest.raises(ValueError, match="is a plain tensor"):
        set_optimizer_state_dict(model, optimizer, full)
    optimizer = type(optimizer)(model.parameters(), lr=1e-2)  # no state yet
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_optimizer_state_dict(model, optimizer, full if rank == 0 else {}, options=options)
    return state, _full(model, optimizer)


def _assert_equal(a: StateT, b: StateT, what: str, atol: float = 0.0) -> None:
    (model_a, optim_a), (model_b, optim_b) = a, b
    assert model_a.keys() == model_b.keys() and optim_a.keys() == optim_b.keys(), what
    for key, value in model_a.items():
        torch.testing.assert_close(model_b[key], value, atol=atol, rtol=0, msg=f"{what}: {key}")
    for name, state in optim_a.items():
        assert state.keys() == optim_b[name].keys(), (what, name)
        for key, value in state.items():
            other = optim_b[name][key].reshape(value.shape)  # a 0-d parameter's state: one row
            torch.testing.assert_close(other, value, atol=atol, rtol=0, msg=f"{what}: {name}/{key}")


@pytest.mark.parametrize("optim", ["tiny_fsdp", "torch"])
def test_fsdp_optimizer_state_saved_by_every_rank_loads_at_another_world_size(
    optim, tmp_path
) -> None:
    path = str(tmp_path / "checkpoint")
    ranks = run_distributed(_save, 2, optim, path)
    # The model as each rank's rows (7 rows: 4 + 3), gathered by no one; a 0-d one whole.
    for rank, rows in enumerate((4, 3)):
        assert ranks[rank]["parts"] == {
            "a.weight": ("DTensor", (rows, 4)),
            "a.bias": ("DTensor", (rows,)),
            "b.weight": ("DTensor", (3 - rank, 7)),
            "b.bias": ("DTensor", (3 - rank,)),
            "scale": ("Tensor", ()),
            "offset": ("Tensor", (5,)),
        }
    first = ranks[0]
    assert first["saved"][1]["a.weight"]["exp_avg"].shape == (7, 4), "the full state, not a shard"
    # Bit for bit with torch.optim.AdamW on both sides (measured); our AdamW's fused CPU kernel
    # rounds the moments (~1e-2) otherwise than torch's foreach ops: measured <= 1e-8, atol 1e-7.
    atol = 0.0 if optim == "torch" else 1e-7
    _assert_equal(first["torch_ddp"], first["saved"], "FSDP vs torch DDP", atol=atol)
    (continued, at_end), (resumed, resumed_end) = first["continued"], first["resumed"]
    assert resumed == continued
    _assert_equal(at_end, resumed_end, "resumed vs continued")
    # Before [Note: torch's distributed checkpoint], one rank's moments stood for every rank's.
    for state, broadcast in run_distributed(_load, 3, optim, path):
        _assert_equal(first["saved"], state, "saved at 2 ranks, loaded at 3")
        _assert_equal(first["saved"], broadcast, "loaded at 3, broadcast from rank 0")


def _zero_refuses(rank: int, world: int) -> Dict[str, str]:
    refused = {}
    for wrapper, optim in (
        ("Zero1", "tiny_fsdp"),
        ("Zero2", "tiny_fsdp"),
        ("Zero3", "tiny_fsdp"),
        ("Zero3", "torch"),
    ):
        model, optimizer = _build(wrapper, optim, seed=0)
        _step(model, optimizer, 0, rank)
        if wrapper == "Zero1":
            optimizer.consolidate_state_dict(to=0)  # rank 0 could state_dict(); DCP still refused
        with pytest.raises(RuntimeError, match="tiny_fsdp.checkpoint.save_checkpoint") as error:
            get_state_dict(model, optimizer)
        refused[f"{wrapper}/{optim}"] = str(error.value).split(":")[0]
    return refused


def test_zero_optimizer_state_is_refused_on_every_rank() -> None:
    refused = run_distributed(_zero_refuses, 2)
    assert (
        refused[0]
        == refused[1]
        == {
            "Zero1/tiny_fsdp": "Zero1AdamW",
            "Zero2/tiny_fsdp": "Zero2AdamW",
            "Zero3/tiny_fsdp": "Zero3AdamW",
            "Zero3/torch": "AdamW over a Zero3 model",
        }
    )


def _build_fsdp2(seed: int) -> Tuple[nn.Module, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = Pair()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))  # not CUDA's, where a GPU is seen
    for layer in (model.a, model.b, model):
        fully_shard(layer, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _build_torch_ddp(seed: int) -> Tuple[nn.Module, Any]:
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(seed)
    model = DistributedDataParallel(Pair())
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _between_torch_and_ours(rank: int, world: int, path: str) -> Dict[str, float]:
    """Save under one, load under the other, 2 more steps; the gap to the saver's own 2."""
    ours = lambda seed: _build("FSDP", "torch", seed, Pair)  # noqa: E731
    our_ddp = lambda seed: _build("DDP", "torch", seed, Pair)  # noqa: E731

    def compiled(seed: int) -> Tuple[nn.Module, Any]:
        model, optimizer = ours(seed)
        return torch.compile(model), optimizer

    gaps = {}
    for name, save_with, load_with in (
        ("FSDP2 -> ours", _build_fsdp2, ours),
        ("ours -> FSDP2", ours, _build_fsdp2),
        ("torch.compile(ours) -> FSDP2", compiled, _build_fsdp2),
        ("FSDP2 -> torch.compile(ours)", _build_fsdp2, compiled),
        ("torch DDP -> our DDP", _build_torch_ddp, our_ddp),
        ("our DDP -> torch DDP", our_ddp, _build_torch_ddp),
        ("torch DDP -> our FSDP", _build_torch_ddp, ours),
        ("our FSDP -> torch DDP", ours, _build_torch_ddp),
    ):
        model, optimizer = save_with(0)
        for step in range(2):
            _step(model, optimizer, step, rank)
        _dcp_save(model, optimizer, f"{path}/{name}")
        continued = [_step(model, optimizer, step, rank) for step in (2, 3)]
        model, optimizer = load_with(1)
        _dcp_load(model, optimizer, f"{path}/{name}")
        resumed = [_step(model, optimizer, step, rank) for step in (2, 3)]
        gaps[name] = max(abs(a - b) for a, b in zip(continued, resumed))
    return gaps


def test_checkpoints_move_between_fsdp2_or_torch_ddp_and_ours(tmp_path) -> None:
    """The same keys (the plain model's) and the same DTensor layout as FSDP2: its checkpoint
    resumes under our FSDP and ours under it, as the saver would have gone on (bit for bit:
    the same sums of the same two ranks); also with our FSDP inside torch.compile's module, and
    between torch's DDP and our DDP or FSDP (whole tensors one way, Shard(0) DTensors the other)."""
    for gaps in run_distributed(_between_torch_and_ours, 2, str(tmp_path)):
        assert set(gaps.values()) == {0.0} and len(gaps) == 8, gaps


def _model_round_trip(rank: int, world: int, path: str) -> Dict[str, float]:
    """Every wrapper: DCP save / load; then a full state dict on rank 0 only, broadcast."""
    torch.manual_seed(3)
    plain = Net().state_dict()
    gaps = {}
    for wrapper in ("DDP", "Zero1", "Zero2", "Zero3", "FSDP"):
        model, optimizer = _build(wrapper, "tiny_fsdp", seed=0)
        _step(model, optimizer, 0, rank)
        dcp.save(get_model_state_dict(model), checkpoint_id=f"{path}/{wrapper}")
        fresh, _ = _build(wrapper, "tiny_fsdp", seed=1)
        loaded = get_model_state_dict(fresh)
        dcp.load(loaded, checkpoint_id=f"{path}/{wrapper}")
        set_model_state_dict(fresh, loaded)
        trained, restored = model.state_dict(), fresh.state_dict()
        gaps[wrapper] = max((trained[k] - restored[k]).abs().max().item() for k in trained)
        # FSDP2's example: rank 0 reads a full state dict and broadcasts it (rank 1 held
        # nothing under our keys before [Note: torch's distributed checkpoint]: it raised).
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(fresh, plain if rank == 0 else {}, options=options)
        restored = fresh.state_dict()
        gaps[wrapper + " broadcast"] = max(
            (plain[k] - restored[k]).abs().max().item() for k in plain
        )
    return gaps


def test_every_wrappers_model_state_round_trips(tmp_path) -> None:
    for gaps in run_distributed(_model_round_trip, 2, str(tmp_path)):
        assert set(gaps.values()) == {0.0} and len(gaps) == 10, gaps
