"""The consolidated (world-size independent) optimizer state of ZeRO-1/2 optimizers.

[Note: consolidated ZeRO state]
``consolidate_state_dict(to)`` (every rank) gathers the pieces of every state tensor, bucket by
bucket, and rank ``to`` keeps ``{"format", "optimizer", "state", "param_groups"}`` with, per
optimizer parameter index (as ``torch.optim``), full tensors shaped like the parameter: ``master``
(the master value) and the rule's state (``exp_avg``, ``exp_avg_sq``, ``step``; or
``momentum_buffer``). Nothing depends on the world size, the bucket size or the stage, so
``load_state_dict`` (every rank) slices its own pieces out at any world size, then writes the
masters into the parameters and all-gathers them, so parameters and masters never disagree.
"""

from collections import defaultdict
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence

import torch
from torch import Tensor

from tiny_fsdp.core import comm
from tiny_fsdp.core.zero.flat_buffer import FlatBuffer, ShardBuffer, gather_bucket
from tiny_fsdp.core.zero.zero import ZeroWrapper

if TYPE_CHECKING:
    from tiny_fsdp.core.zero.optim import OwnedPiece

FORMAT = "tiny_fsdp.zero12.v1"
#: The project's rules whose state is a torch.optim class's, under the same keys and meaning
#: (``Zero1AdamW``'s state resumes in ``Zero1Optimizer(..., torch.optim.AdamW)`` and back).
SAME_STATE = {"AdamW": "torch.optim.AdamW", "SGD": "torch.optim.SGD"}

PieceState = Mapping[Tensor, Dict[str, Any]]  # an owned piece's master -> its rule's state


@torch.no_grad()
def consolidate(
    wrapper: ZeroWrapper,
    pieces: Sequence["OwnedPiece"],
    state: PieceState,
    param_groups: List[Dict[str, Any]],
    rule: str,
    master_dtypes: Sequence[torch.dtype],
    to: int,
) -> Optional[Dict[str, Any]]:
    """The consolidated state on rank ``to``, None elsewhere (call on every rank);
    ``master_dtypes[g]``: the masters' (and state's) dtype of the layout's group g."""
    # Each parameter's state keys (None: a sharded tensor) and 0-d values (``step``), from
    # every rank that owns a piece of it; metadata, so not through the counted collectives.
    meta: Dict[int, Dict[str, Any]] = {}
    for op in pieces:
        meta[op.opt_index] = {k: v if _is_scalar(v) else None for k, v in state[op.master].items()}
    merged: Dict[int, Dict[str, Any]] = defaultdict(dict)
    for rank_meta in comm.all_gather_object(meta):
        for i, entry in rank_meta.items():
            merged[i].update(entry)
    keys = ["master", *sorted({k for e in merged.values() for k, v in e.items() if v is None})]
    keep = wrapper.rank == to
    full = {key: _gather_buckets(wrapper, key, pieces, state, master_dtypes, keep) for key in keys}
    if not keep:
        return None
    out: Dict[int, Dict[str, Any]] = {}
    groups = []
    index = 0
    for group in param_groups:
        for p in group["params"]:
            layout_index = wrapper.index_of(p)
            if layout_index is not None:  # else frozen at wrap time: no state
                slot = wrapper.layout.slots[layout_index]
                lo = slot.start - wrapper.layout.buckets[slot.bucket].start
                entry = merged[index]
                out[index] = {
                    k: full[k][slot.bucket][lo : lo + slot.numel].view(slot.shape).clone()
                    for k in keys
                    if k == "master" or (k in entry and entry[k] is None)
                }
                out[index].update({k: v for k, v in entry.items() if v is not None})
            index += 1
        first = index - len(group["params"])
        saved = {k: v for k, v in group.items() if k != "params"}
        groups.append({**saved, "params": list(range(first, index))})
    return {"format": FORMAT, "optimizer": rule, "state": out, "param_groups": groups}


def _gather_buckets(
    wrapper: ZeroWrapper,
    key: str,
    pieces: Sequence["OwnedPiece"],
    state: PieceState,
    dtypes: Sequence[torch.dtype],
    keep: bool,
) -> List[Tensor]:
    """State ``key`` of every rank's pieces, one full tensor (bucket numel,) per bucket of the
    layout, on the CPU where ``keep`` (else empty): each rank fills its chunks, then one
    all-gather per bucket."""
    layout = wrapper.layout
    device = wrapper.param_buffer.bucket(0).device
    shard = ShardBuffer(layout, dtypes, device)
    for op in pieces:
        value = op.master if key == "master" else state[op.master].get(key)
        if value is not None:
            shard.piece(op.piece).copy_(value)
    full = FlatBuffer(layout, dtypes, device)
    for b in range(len(layout.buckets)):
        full.chunk(b, wrapper.rank).copy_(shard.chunk(b))
        gather_bucket(full.bucket(b), wrapper.rank, layout.world_size, async_op=False)
    return [t.cpu() for t in full.tensors] if keep else []


@torch.no_grad()
def slice_pieces(
    pieces: Sequence["OwnedPiece"], saved: Mapping[int, Dict[str, Any]]
) -> Dict[Tensor, Dict[str, Any]]:
    """Copy each owned piece's master out of the ``saved`` consolidated state; return the
    pieces' rule state (master -> {key: value}), sliced likewise."""
    state = {}
    for op in pieces:
        entry = saved.get(op.opt_index)
        if entry is None:
            continue
        lo, hi = op.piece.param_start, op.piece.param_start + op.piece.numel
        op.master.copy_(entry["master"].reshape(-1)[lo:hi])
        state[op.master] = {
            k: (
                v.clone()
                if _is_scalar(v)
                else v.reshape(-1)[lo:hi].to(op.master.device, op.master.dtype).clone()
            )
            for k, v in entry.items()
            if k != "master"
        }
    return state


def check_loadable(
    cls: str, rule: str, param_groups: List[Dict[str, Any]], state_dict: Mapping[str, Any]
) -> None:
    """Raise ValueError unless ``state_dict`` is a consolidated ``rule`` state for these groups."""
    if not isinstance(state_dict, Mapping) or state_dict.get("format") != FORMAT:
        got = sorted(state_dict)[:6] if isinstance(state_dict, Mapping) else type(state_dict)
        raise ValueError(
            f"{cls}.load_state_dict expects a state saved by consolidate_state_dict() + "
            f"state_dict() of a tiny_fsdp ZeRO-1/2 optimizer (format '{FORMAT}'); got {got}"
        )
    if _state_kind(state_dict["optimizer"]) != _state_kind(rule):
        raise ValueError(f"{cls}: cannot load the state of a {state_dict['optimizer']} optimizer")
    saved = [len(g["params"]) for g in state_dict["param_groups"]]
    mine = [len(g["params"]) for g in param_groups]
    if saved != mine:
        raise ValueError(f"{cls}: saved groups hold {saved} parameters, this optimizer {mine}")
    params = [(n, p) for g in param_groups for n, p in zip(g["param_names"], g["params"])]
    for index, (name, p) in enumerate(params):
        entry = state_dict["state"].get(index)
        if entry is not None and entry["master"].shape != p.shape:
            raise ValueError(
                f"{cls}: saved parameter {index} has shape {tuple(entry['master'].shape)}, "
                f"'{name}' has {tuple(p.shape)}"
            )


def _state_kind(rule: str) -> str:
    return SAME_STATE.get(rule, rule)


def _is_scalar(value: Any) -> bool:
    return not isinstance(value, Tensor) or value.dim() == 0
