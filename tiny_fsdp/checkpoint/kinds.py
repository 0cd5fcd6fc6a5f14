"""The two kinds of checkpoint, written from this rank's pieces ([Note: checkpoint kinds] in
``api.py``): sharded (each rank its own pieces) and full (rank 0 assembles full tensors)."""

from typing import Any, Dict, List, Optional, Tuple

import torch

from tiny_fsdp.checkpoint import format as fmt
from tiny_fsdp.checkpoint.adapters import Adapter, Piece
from tiny_fsdp.checkpoint.agreement import all_ok, gather
from tiny_fsdp.checkpoint.format import CheckpointError


def save_sharded(path, tag, adapter: Adapter, pieces, scalars, common) -> Tuple[list, dict]:
    rank, world = adapter.rank, adapter.world_size
    shard = f"shard-{tag}-{rank:05d}-of-{world:05d}.pt"
    stored = {f"{p.tid}@{p.start}": _cpu_copy(p.data) for p in pieces}
    index = [
        (p.tid, p.shape, str(p.data.dtype), p.start, p.stop, f"{p.tid}@{p.start}") for p in pieces
    ]
    mine: List[str] = []
    records: Dict[str, Any] = {}

    def write() -> None:
        mine.append(shard)  # listed first: removed on failure even if half written
        records[shard] = fmt.save_data_file(path, shard, {"pieces": stored, "scalars": scalars})
        if rank == 0:
            mine.append(f"common-{tag}.pt")
            records[mine[-1]] = fmt.save_data_file(path, mine[-1], common)

    ok, message, exc = all_ok(write, "writing")
    if not ok:
        fmt.remove_files(path, mine)
        raise CheckpointError(message) from exc
    everyone = gather((shard, index, sorted(scalars.items(), key=lambda kv: kv[0]), records))
    tensors: Dict[str, Dict[str, Any]] = {}
    scalar_locations: Dict[str, Dict[str, list]] = {}
    files: Dict[str, Any] = {}
    for name, entries, rank_scalars, rank_records in everyone:
        files.update(rank_records)
        for tid, shape, dtype, start, stop, key in entries:
            entry = tensors.setdefault(tid, {"shape": list(shape), "dtype": dtype, "pieces": []})
            entry["pieces"].append([name, ["pieces", key], start, stop])
        for param, values in rank_scalars:
            for key in values:  # equal wherever present: the reader picks any copy
                copies = scalar_locations.setdefault(param, {}).setdefault(key, [])
                copies.append([name, ["scalars", param, key]])
    _check_cover(tensors)
    common_file = f"common-{tag}.pt"
    locations = {k: [common_file, [k]] for k in ("extra", "rng", "param_groups")}
    return mine, dict(files=files, tensors=tensors, scalars=scalar_locations, locations=locations)


def save_full(path, tag, adapter: Adapter, pieces, scalars, common) -> Tuple[list, dict]:
    rank = adapter.rank
    index = [(p.tid, p.shape, str(p.data.dtype), p.start, p.stop) for p in pieces]
    everyone = gather((index, scalars))  # metadata and the small scalars only
    tensors: Dict[str, Dict[str, Any]] = {}
    owners: Dict[str, set] = {}
    for r, (entries, _) in enumerate(everyone):
        for tid, shape, dtype, start, stop in entries:
            entry = tensors.setdefault(tid, {"shape": list(shape), "dtype": dtype, "pieces": []})
            entry["pieces"].append([None, None, start, stop])
            owners.setdefault(tid, set()).add(r)
    _check_cover(tensors)
    full: Dict[str, torch.Tensor] = {}
    for tid in sorted(tensors):  # the same order on every rank: the reduces pair up
        full_tensor = _assemble(tid, tensors[tid], owners[tid], pieces, adapter)
        if full_tensor is not None:
            full[tid] = full_tensor
    name = f"full-{tag}.pt"
    merged: Dict[str, Dict[str, Any]] = {}
    for _, rank_scalars in everyone:  # the first rank's value wins; they are equal
        for param, values in rank_scalars.items():
            for key, value in values.items():
                merged.setdefault(param, {}).setdefault(key, value)
    written: List[str] = []
    records: Dict[str, Any] = {}

    def write() -> None:
        if rank != 0:
            return
        written.append(name)
        payload = _full_payload(adapter, full, merged, common)
        records[name] = fmt.save_data_file(path, name, payload)

    ok, message, exc = all_ok(write, "writing")
    if not ok:
        fmt.remove_files(path, written)
        raise CheckpointError(message) from exc
    scalar_locations = {
        param: {key: [[name, ["optimizer", "state", param, key]]] for key in values}
        for param, values in merged.items()
    }
    for tid, entry in tensors.items():
        what, rest = tid.split("/", 1)
        where = ["model", rest] if what == "model" else ["optimizer", "state", *rest.rsplit("/", 1)]
        entry["pieces"] = [[name, where, 0, _numel(entry["shape"])]]
    locations = {
        "model": [name, ["model"]],
        "extra": [name, ["extra"]],
        "rng": [name, ["rng"]],
        "param_groups": [name, ["optimizer", "param_groups"]],
    }
    if common["param_groups"] is None:
        del locations["param_groups"]
    files = records if rank == 0 else {}
    return written, dict(
        files=files, tensors=tensors, scalars=scalar_locations, locations=locations
    )


def _full_payload(adapter: Adapter, full, scalars, common) -> Dict[str, Any]:
    model = {key: full[f"model/{name}"] for key, name in adapter.model_keys().items()}
    state: Dict[str, Dict[str, Any]] = {}
    for tid, value in full.items():
        if tid.startswith("optim/"):
            param, key = tid[len("optim/") :].rsplit("/", 1)
            state.setdefault(param, {})[key] = value
    for param, values in scalars.items():
        state.setdefault(param, {}).update(values)
    optimizer = None
    if common["param_groups"] is not None:
        optimizer = {"state": state, "param_groups": common["param_groups"]}
    return {
        "model": model,
        "optimizer": optimizer,
        "step": common["step"],
        "extra": common["extra"],
        "rng": common["rng"],
    }


def _assemble(tid, entry, owners, pieces: List[Piece], adapter: Adapter) -> Optional[torch.Tensor]:
    """The full tensor ``tid`` on rank 0 (None elsewhere), built from every rank's pieces."""
    shape, dtype = tuple(entry["shape"]), getattr(torch, entry["dtype"].replace("torch.", ""))
    mine = [p for p in pieces if p.tid == tid]
    if owners == {0}:  # rank 0 holds it all: no collective
        if adapter.rank != 0:
            return None
        device = mine[0].data.device
    else:
        device = adapter.device  # where the backend can reduce (CUDA for NCCL)
    flat = torch.zeros(_numel(shape), dtype=dtype, device=device)
    for p in mine:
        flat[p.start : p.stop].copy_(p.data)
    if owners != {0}:
        from tiny_fsdp.core import comm

        comm.reduce(flat, dst=0)  # zeros elsewhere: the sum is each element's one value
    return flat.view(shape).cpu() if adapter.rank == 0 else None


def _check_cover(tensors: Dict[str, Dict[str, Any]]) -> None:
    """Raise unless every tensor's pieces cover it exactly once ([Note: checkpoint pieces])."""
    for tid, entry in tensors.items():
        ranges = sorted((p[2], p[3]) for p in entry["pieces"] if p[3] > p[2])
        end = 0
        for start, stop in ranges:
            end = stop if start == end else -1  # -1: a hole or an overlap
        if end != _numel(entry["shape"]):
            raise CheckpointError(
                f"internal error: the ranks' pieces of '{tid}' do not cover it exactly once: "
                f"{ranges} of {_numel(entry['shape'])} elements"
            )


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _cpu_copy(t: torch.Tensor) -> torch.Tensor:
    # A compact copy: torch.save of a view would write its whole (e.g. flat-buffer) storage.
    return t.detach().cpu() if t.device.type != "cpu" else t.detach().clone()
