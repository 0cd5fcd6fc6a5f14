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
import uuid
from typing import Any, Dict, Optional

import torch
from torch import nn

from tiny_fsdp.checkpoint import format as fmt
from tiny_fsdp.checkpoint.adapters import (
    Adapter,
    export_param_groups,
    export_pieces,
    import_pieces,
)
from tiny_fsdp.checkpoint.agreement import all_ok, gather
from tiny_fsdp.checkpoint.kinds import save_full, save_sharded
from tiny_fsdp.checkpoint.format import CheckpointError, CheckpointReader
from tiny_fsdp.core.utils.arrival import every_rank_arrives

_EVERY_RANK = "Call it on every rank (each rank writes or reads its part), not only on rank 0."


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
    every_rank_arrives("save_checkpoint()", _EVERY_RANK)  # [Note: arrival check]
    adapter = Adapter(model, optimizer)
    rank, world = adapter.rank, adapter.world_size
    os.makedirs(path, exist_ok=True)  # every rank: shards may go to a node-local disk
    common = {
        "step": int(step),
        "extra": {} if extra is None else extra,
        "rng": gather(_rng_state()),
        "param_groups": None if optimizer is None else export_param_groups(adapter),
    }
    tag = gather(f"step{int(step):08d}-{uuid.uuid4().hex[:8]}")[0]  # rank 0's, on every rank
    pieces, scalars = export_pieces(adapter)
    if sharded:
        written, metadata = save_sharded(path, tag, adapter, pieces, scalars, common)
    else:
        written, metadata = save_full(path, tag, adapter, pieces, scalars, common)
    metadata.update(kind="sharded" if sharded else "full", step=int(step), world_size=world)
    metadata.update(strategy=type(model).__name__, saved_at=time.time())
    committed = all_ok(
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
    every_rank_arrives("load_checkpoint()", _EVERY_RANK)
    adapter = Adapter(model, optimizer)
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

    ok, message, exc = all_ok(load, "loading")
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
