"""What a rank holds of each tensor, as a strategy describes it to the rest of the library.

[Note: strategy state]
Modules outside a strategy (``tiny_fsdp.checkpoint``, ``core/memory.py``) never read a strategy's
private attributes; they ask its wrapper (``DataParallelWrapper``) and its optimizer:

- ``wrapper.local_piece(param) -> LocalPiece | None``: the flat range ``[start, start + n)`` of the
  parameter's full tensor (row-major) that this rank holds, with ``local`` its live storage of
  ``n`` elements: the whole tensor (DDP, ZeRO-1/2, a ZeRO-3 owner), the real rows of a dim-0 shard
  (FSDP), or None (a ZeRO-3 rank that does not own it). Loading fills exactly these.
- ``wrapper.saved_piece(param)``: the part this rank writes when saving; over all ranks every
  element exactly once (replicated tensors: rank 0, or ZeRO-1/2's owned pieces, which balances
  the writes).
- ``wrapper.full_tensor(param)`` / ``full_shape(param)`` / ``load_full_(param, full)``: the full
  view behind ``state_dict()`` / ``load_state_dict()`` (a collective where the tensor is split);
  ``before_load()`` / ``after_load()``: drop what derives from the parameters about to change
  (FSDP's gathered and prefetched copies), re-derive it after (ZeRO-1/2's fp32 masters).
- ``wrapper.extra_state_tensors()``: tensors kept between steps that are neither a ``param.grad``
  nor optimizer state (DDP's buckets, ZeRO's gradient buffer or shard), by ledger category.
- ``optimizer.state_pieces(saving) -> [StatePiece]`` where an optimizer keys its state by other
  tensors than the parameters (ZeRO-1/2's master pieces). Without that method the state of each
  parameter is keyed by the parameter and shaped like its piece.
"""

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class LocalPiece:
    """Flat elements ``[start, start + local.numel())`` of a full tensor, held in ``local``."""

    start: int
    local: torch.Tensor


@dataclass
class StatePiece:
    """Optimizer state of flat elements ``[start, start + local.numel())`` of ``param``'s full
    tensor: ``optimizer.state[local]``, shaped like ``local``; ``master``: a separate
    higher-precision copy of the elements (saved as state key ``master``), or None."""

    param: torch.Tensor
    start: int
    local: torch.Tensor
    master: Optional[torch.Tensor] = None


def replicated_piece(param: torch.Tensor, rank: int, saving: bool) -> Optional[LocalPiece]:
    """A tensor every rank holds whole: loaded everywhere, saved by rank 0."""
    return None if saving and rank != 0 else LocalPiece(0, param.detach())
