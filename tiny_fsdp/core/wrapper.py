"""What every strategy's model wrapper has in common.

A wrapper holds the user's model as ``self.module`` (converted in place to tiny_fsdp layers),
forwards calls to it, and exposes the switches users know from PyTorch DDP / FSDP:

- ``require_backward_grad_sync`` (bool, default True) and the ``no_sync()`` context: while
  False, backward accumulates gradients locally and communicates nothing; the next synchronised
  backward reduces the accumulated total.
- ``enable_async_communication`` (bool): overlap communication with computation (prefetch /
  asynchronous reductions). Results are identical on and off.
- ``gradient_checkpointing`` (bool): recompute each block in backward (forwarded to the model).

``state_dict()`` / ``load_state_dict()`` use the plain model's keys and full tensors.
"""

import contextlib
from typing import Any, Iterator

from torch import nn

from tiny_fsdp.core.module import convert_module
from tiny_fsdp.core.utils.dist import require_process_group


class DataParallelWrapper(nn.Module):
    """Base class of ``DDP``, ``Zero1``, ``Zero2``, ``Zero3`` and ``FSDP`` model wrappers."""

    def __init__(self, module: nn.Module, enable_async_communication: bool = False) -> None:
        require_process_group(type(self).__name__)
        super().__init__()
        self.module = convert_module(module)
        self.require_backward_grad_sync = True
        self.enable_async_communication = enable_async_communication

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally inside the block; the next synced backward reduces them."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    @property
    def gradient_checkpointing(self) -> bool:
        return bool(getattr(self.module, "gradient_checkpointing", False))

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, value: bool) -> None:
        if not hasattr(self.module, "gradient_checkpointing"):
            raise AttributeError(
                f"{type(self.module).__name__} has no 'gradient_checkpointing' attribute to set"
            )
        self.module.gradient_checkpointing = value
