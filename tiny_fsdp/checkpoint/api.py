"""``save_checkpoint`` / ``load_checkpoint``: full or sharded, any strategy, any world size.

[Note: checkpoint kinds]
Both kinds store the same things: model, optimizer state and param groups, ``step`` (also the
data position: batches are a pure function of (seed, step)), ``extra`` (user values) and every
rank's RNG states (python, torch CPU, CUDA if initialised); both load into any strategy at any
world size ([Note: checkpoint pieces]).

- full: rank 0 writes one file, ``{"model": plain state dict, "optimizer": {"state": {param
  name: {key: full tensor}}, "param_groups": [...]}, ...}``, loadable by plain PyTorch:
  ``GPT2Model(cfg).load_state_dict(torch.load(full_checkpoint_file(path))["model"])``. Each full
  tensor is assembled on rank 0 one at a time: every rank writes its pieces into a zero tensor
  and a SUM-reduce to rank 0 adds them (pieces cover each element exactly once, so the sum is
  exact); a tensor held by rank 0 alone needs no collective.
- sharded: every rank writes only its own pieces, rank 0 a small common file and the metadata;
  no full tensor is ever built. Loading, a rank opens only the files whose pieces overlap the
  slices it holds.

Every rank calls both functions. They end with one exchange of each rank's outcome, so an error
on one rank (a full disk, a corrupted shard only it reads) raises ``CheckpointError`` on every
rank instead of leaving the others hanging in the next collective. Without a process group
(one device) there are no collectives at all.
"""

import os
import random
import time
import traceback
import uuid
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from tiny_fsdp.checkpoint import format as fmt
from tiny_fsdp.checkpoint.adapters import (
    Adapter,
    Piece,
    export_param_groups,
    export_pieces,
    import_pieces,
    make_adapter,
)
from tiny_fsdp.checkpoint.format import CheckpointError, CheckpointReader


def save_checkpoint(
    path: str,
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    *,
    step: int = 0,
    extra: Optional[Dict[str, Any]] = None,
    sharded: bool = False,
) -> None:
    """Save to directory ``path`` (created; an earlier checkpoint there is replaced atomically).

    ``extra``: plain Python values and tensors (what ``torch.load(weights_only=True)`` reads).
    Call on every rank. Raises ``CheckpointError`` on every rank if any rank fails; the
    previous checkpoint at ``path`` then stays intact ([Note: checkpoint directory]).
    """
    adapter = make_adapter(model, optimizer)
    rank, world = adapter.rank, adapter.world_size
    os.makedirs(path, exist_ok=True)  # every rank: shards may go to a node-local disk
    common = {
        "step": int(step),
        "extra": {} if extra is None else extra,
        "rng": _gather(_rng_state()),
        "param_groups": None if optimizer is None else export_param_groups(adapter),
    }
    tag = _gather(f"step{int(step):08d}-{uuid.uuid4().hex[:8]}")[0]  # rank 0's, on every rank
    pieces, scalars = export_pieces(adapter)
    if sharded:
        written, metadata = _save_sharded(path, tag, adapter, pieces, scalars, common)
    else:
        written, metadata = _save_full(path, tag, adapter, pieces, scalars, common)
    metadata.update(kind="sharded" if sharded else "full", step=int(step), world_size=world)
    metadata.update(strategy=type(model).__name__, saved_at=time.time())
    committed = _all_ok(
        lambda: fmt.write_metadata(path, metadata) if rank == 0 else None, "committing"
    )
    if not committed[0]:
        fmt.remove_files(path, written)
        raise CheckpointError(committed[1]) from committed[2]
    if rank == 0:
        fmt.remove_stale_files(path, set(metadata["files"]))


def load_checkpoint(
    path: str, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None
) -> Dict[str, Any]:
    """Load a checkpoint of either kind into ``model`` (and ``optimizer``); call on every rank.

    Returns ``{"step", "extra", "kind", "world_size" (of the save), "rng_restored",
    "files_read"}``. RNG states are restored, per rank, when the world size is the one saved
    (a different world size has no matching per-rank streams). On error the model and
    optimizer may be partly loaded: load again before training.
    """
    adapter = make_adapter(model, optimizer)
    result: Dict[str, Any] = {}

    def load() -> None:
        reader = CheckpointReader(path)
        if optimizer is not None and reader.optional("param_groups") is None:
            raise CheckpointError(f"checkpoint '{path}' has no optimizer state to load")
        import_pieces(adapter, reader)
        meta = reader.metadata
        rng = reader.optional("rng")
        same_world = meta["world_size"] == adapter.world_size and rng is not None
        if same_world:
            _set_rng_state(rng[adapter.rank])
        result.update(step=meta["step"], extra=reader.optional("extra"), kind=meta["kind"])
        result.update(world_size=meta["world_size"], rng_restored=same_world)
        result.update(files_read=list(reader.files_read))

    ok, message, exc = _all_ok(load, "loading")
    if not ok:
        raise CheckpointError(message) from exc
    return result


def full_checkpoint_file(path: str) -> str:
    """The data file of the full checkpoint at ``path`` (for ``torch.load``)."""
    metadata = fmt.read_metadata(path)
    if metadata["kind"] != "full":
        raise CheckpointError(f"'{path}' holds a {metadata['kind']} checkpoint, not a full one")
    return os.path.join(path, metadata["locations"]["model"][0])


def has_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, fmt.METADATA_FILE))


# -------------------------------------------------------------------- the two kinds


def _save_sharded(path, tag, adapter: Adapter, pieces, scalars, common) -> Tuple[list, dict]:
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

    ok, message, exc = _all_ok(write, "writing")
    if not ok:
        fmt.remove_files(path, mine)
        raise CheckpointError(message) from exc
    everyone = _gather((shard, index, sorted(scalars.items(), key=lambda kv: kv[0]), records))
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


def _save_full(path, tag, adapter: Adapter, pieces, scalars, common) -> Tuple[list, dict]:
    rank = adapter.rank
    index = [(p.tid, p.shape, str(p.data.dtype), p.start, p.stop) for p in pieces]
    everyone = _gather((index, scalars))  # metadata and the small scalars only
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

    ok, message, exc = _all_ok(write, "writing")
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


# -------------------------------------------------------------------- helpers


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


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _gather(obj: Any) -> List[Any]:
    """Every rank's ``obj`` in rank order (``[obj]`` without a process group)."""
    if not _distributed():
        return [obj]
    from tiny_fsdp.core import comm

    return comm.all_gather_object(obj)


def _all_ok(action: Callable[[], Any], what: str) -> Tuple[bool, str, Optional[Exception]]:
    """Run ``action`` on every rank: (ok everywhere, message naming each failed rank and its
    error, this rank's exception or None). One exchange: every rank learns every outcome."""
    local: Optional[Exception] = None
    try:
        action()
    except Exception as exc:
        local = exc
    error = None if local is None else _describe(local)
    errors = {r: e for r, e in enumerate(_gather(error)) if e is not None}
    if not errors:
        return True, "", None
    lines = "\n".join(f"  rank {r}: {e}" for r, e in errors.items())
    return False, f"{what} the checkpoint failed on rank(s) {sorted(errors)}:\n{lines}", local


def _describe(exc: Exception) -> str:
    if isinstance(exc, CheckpointError):
        return str(exc)
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()


def _rng_state() -> Dict[str, Any]:
    state: Dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # the current device's
    return state


def _set_rng_state(state: Dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
