"""Checkpoints for every strategy: full or sharded, exact resume, any world size, atomic.

    save_checkpoint(path, model, optimizer, step=step, extra={...}, sharded=False)
    info = load_checkpoint(path, model, optimizer)  # {"step", "extra", ...}

See [Note: checkpoint kinds] (api.py), [Note: checkpoint pieces] (adapters.py) and
[Note: checkpoint directory] (format.py).
"""

from tiny_fsdp.checkpoint.api import (
    full_checkpoint_file,
    has_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from tiny_fsdp.checkpoint.format import FORMAT_VERSION, CheckpointError, CheckpointReader

__all__ = [
    "CheckpointError",
    "CheckpointReader",
    "FORMAT_VERSION",
    "full_checkpoint_file",
    "has_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
]
