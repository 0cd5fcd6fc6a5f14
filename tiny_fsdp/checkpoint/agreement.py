"""Every rank learns every rank's outcome: how checkpoint errors reach all ranks, never a hang."""

import traceback
from typing import Any, Callable, List, Optional, Tuple

import torch.distributed as dist

from tiny_fsdp.checkpoint.format import CheckpointError


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def gather(obj: Any) -> List[Any]:
    """Every rank's ``obj`` in rank order (``[obj]`` without a process group)."""
    if not is_distributed():
        return [obj]
    from tiny_fsdp.core import comm

    return comm.all_gather_object(obj)


def all_ok(action: Callable[[], Any], what: str) -> Tuple[bool, str, Optional[Exception]]:
    """Run ``action`` on every rank: (ok everywhere, message naming each failed rank and its
    error, this rank's exception or None). One exchange: every rank learns every outcome."""
    local: Optional[Exception] = None
    try:
        action()
    except Exception as exc:
        local = exc
    error = None if local is None else describe(local)
    errors = {r: e for r, e in enumerate(gather(error)) if e is not None}
    if not errors:
        return True, "", None
    lines = "\n".join(f"  rank {r}: {e}" for r, e in errors.items())
    return False, f"{what} the checkpoint failed on rank(s) {sorted(errors)}:\n{lines}", local


def describe(exc: Exception) -> str:
    if isinstance(exc, CheckpointError):
        return str(exc)
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()
