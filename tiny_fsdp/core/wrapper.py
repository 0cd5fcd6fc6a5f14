"""What every strategy's model wrapper has in common.

A wrapper holds the user's model as ``self.module`` (converted in place to tiny_fsdp layers),
forwards calls to it, and exposes the switches users know from PyTorch DDP / FSDP:

- ``require_backward_grad_sync`` (bool, default True) and the ``no_sync()`` context: while
  False, backward accumulates gradients locally and communicates nothing; the next synchronised
  backward reduces the accumulated total.
- ``enable_async_communication`` (bool): overlap communication with computation (prefetch /
  asynchronous reductions; FSDP and ZeRO-3 default to on). Results are identical on and off.
- ``gradient_checkpointing`` (bool): recompute each block in backward (forwarded to the model).
- ``mixed_precision`` (``MixedPrecisionPolicy`` or None): layers compute in the policy's dtype,
  parameters stay fp32 masters ([Note: mixed precision]); floating inputs are cast on entry.
  ``half()`` / ``bfloat16()`` / ``double()`` / ``to(dtype)`` raise and point to the policy
  (``float()`` too, unless it would change nothing).

``state_dict()`` / ``load_state_dict()`` use the plain model's keys and full tensors.
"""

import contextlib
from typing import Any, Iterator, Mapping, Optional

import torch
from torch import nn

from tiny_fsdp.core.module import convert_module
from tiny_fsdp.core.precision import (
    MixedPrecisionPolicy,
    check_master_dtypes,
    low_precision_error,
    register_input_cast,
)
from tiny_fsdp.core.utils.dist import require_process_group


def check_same_model_on_all_ranks(module: nn.Module, what: str) -> None:
    """Raise on every rank if the ranks' parameters / buffers differ in name, shape or dtype.

    Mismatched models would otherwise pair unrelated tensors in the collectives.
    """
    from tiny_fsdp.core import comm

    signature = [
        (name, tuple(t.shape), str(t.dtype), bool(t.requires_grad))
        for name, t in [*module.named_parameters(), *module.named_buffers()]
    ]
    signatures = comm.all_gather_object(signature)
    for rank, other in enumerate(signatures):
        if other != signatures[0]:
            diff = sorted(set(other) ^ set(signatures[0]))[:4]
            raise ValueError(
                f"{what}: rank {rank}'s model differs from rank 0's (name, shape, dtype, "
                f"requires_grad); e.g. {diff}. Build the same model on every rank."
            )


def check_no_shared_storage(module: nn.Module, what: str) -> None:
    """Raise if two distinct parameters share storage: sharding each on its own unties them."""
    seen = {}
    for name, param in module.named_parameters():  # a tied Parameter (one object) comes once
        if param.device.type == "meta" or param.numel() == 0:
            continue
        key = (param.device, param.untyped_storage().data_ptr())
        if key in seen:
            raise ValueError(
                f"{what}: parameters '{seen[key]}' and '{name}' share storage but are distinct "
                f"Parameter objects, which {what} would shard separately (untying them). Tie "
                "them by assigning one Parameter to both modules (e.g. b.weight = a.weight)."
            )
        seen[key] = name


class DataParallelWrapper(nn.Module):
    """Base class of ``DDP``, ``Zero1``, ``Zero2``, ``Zero3`` and ``FSDP`` model wrappers."""

    def __init__(
        self,
        module: nn.Module,
        enable_async_communication: bool = False,
        mixed_precision: Optional[MixedPrecisionPolicy] = None,
    ) -> None:
        require_process_group(type(self).__name__)
        super().__init__()
        if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecisionPolicy):
            raise TypeError(
                f"mixed_precision must be a MixedPrecisionPolicy or None, got {mixed_precision!r}"
            )
        self.module = convert_module(module)
        check_master_dtypes(self.module, mixed_precision)
        self.mixed_precision = mixed_precision
        register_input_cast(self.module, mixed_precision)  # hooks the inner model: every forward
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

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The plain model's state dict; sharded strategies override it to gather full tensors."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load a plain-model state dict on this rank (load the same one on every rank)."""
        if assign:
            # New parameter objects would lose the strategy's hooks, views and shards.
            raise ValueError(f"{type(self).__name__}.load_state_dict does not support assign=True")
        return self.module.load_state_dict(state_dict, strict=strict)

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

    # A wrapper's parameters are fp32 masters tied to the strategy's buffers: casting them in
    # place would silently break both. Mixed precision is a policy, not a cast.
    def half(self) -> "DataParallelWrapper":
        raise low_precision_error(f"{type(self).__name__}.half()")

    def bfloat16(self) -> "DataParallelWrapper":
        raise low_precision_error(f"{type(self).__name__}.bfloat16()")

    def double(self) -> "DataParallelWrapper":
        raise low_precision_error(f"{type(self).__name__}.double()")

    def float(self) -> "DataParallelWrapper":
        # A no-op on fp32 parameters; ZeRO-1/2 under a policy store bf16 views of a flat buffer.
        if any(p.is_floating_point() and p.dtype != torch.float32 for p in self.parameters()):
            raise low_precision_error(f"{type(self).__name__}.float()")
        return self

    def to(self, *args: Any, **kwargs: Any) -> "DataParallelWrapper":
        _, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if dtype is not None:
            raise low_precision_error(f"{type(self).__name__}.to({dtype})")
        return super().to(*args, **kwargs)
