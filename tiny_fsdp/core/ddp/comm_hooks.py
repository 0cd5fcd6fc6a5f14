"""Communication hooks for DDP: torch DDP's ``register_comm_hook`` on our buckets.

[Note: DDP communication hooks]
``DDP.register_comm_hook(state, hook)`` takes the hooks written for torch's DDP (those of
``torch.distributed.algorithms.ddp_comm_hooks``: ``fp16_compress_hook``, ``bf16_compress_hook``,
PowerSGD, or a user's own) with torch's contract: ``hook(state, bucket)`` gets a bucket
(``bucket.buffer()``: the flat gradients of the bucket's parameters, this rank's SUM, not
divided by the world size; ``gradients()`` / ``parameters()``: per-parameter views and the
parameters, in the buffer's order; ``index()`` in launch order; ``is_last()``) and returns a
``torch.futures.Future`` whose value is the bucket's reduced gradient (the hook averages).

A bucket with a hook therefore takes its gradients undivided and hands the hook
``buffer[:numel]`` (the gradients, without the flags of [Note: gradient bucket layout]); the
flags go in an all-reduce of their own, issued just before the hook is called (a hook may
issue more collectives from its future's callbacks, on another thread: the flags must come
before all of them on every rank), so a parameter no rank had a gradient for still keeps
``.grad`` None. The future's value is copied into the gradients if the hook did not reduce in
place. Collectives a hook issues itself do not pass through ``comm``, so the ledger does not
count them; as under torch's DDP, the order of a hook's callback collectives against the next
bucket's is the hook's affair. Sparse gradients ([Note: sparse gradients]) take no hook, as in
torch's DDP.
"""

from typing import Any, Callable, List, Optional

import torch
from torch import nn

from tiny_fsdp.core import comm

Hook = Callable[[Any, Any], torch.futures.Future]


class HookBucket:
    """What a hook sees of one bucket: torch's ``dist.GradBucket`` methods."""

    def __init__(
        self,
        buffer: torch.Tensor,
        gradients: List[torch.Tensor],
        parameters: List[nn.Parameter],
        index: int,
        is_last: bool,
    ) -> None:
        self._buffer, self._gradients, self._parameters = buffer, gradients, parameters
        self._index, self._is_last = index, is_last

    def buffer(self) -> torch.Tensor:
        """The flat gradients (numel of the parameters,): this rank's sum, undivided."""
        return self._buffer

    def gradients(self) -> List[torch.Tensor]:
        """One view of ``buffer()`` per parameter, shaped like it."""
        return self._gradients

    def parameters(self) -> List[nn.Parameter]:
        return self._parameters

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._is_last

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer.copy_(buffer)


class HookWork:
    """The reduction of one bucket by a hook: the flags' all-reduce and the hook's future;
    ``wait`` leaves the reduced gradients in ``gradients`` (the bucket's buffer without the
    flags)."""

    def __init__(self, flags_work: Any, future: Any, gradients: torch.Tensor) -> None:
        if not (hasattr(future, "wait") and hasattr(future, "done")):
            raise TypeError(
                f"a DDP communication hook must return a torch.futures.Future, got "
                f"{type(future).__name__}"
            )
        self._flags_work, self._future = flags_work, future
        self._gradients = gradients
        self._done = False

    def is_completed(self) -> bool:
        return self._done or (self._future.done() and self._flags_work.is_completed())

    def wait(self) -> None:
        if self._done:
            return
        self._flags_work.wait()
        value = self._future.wait()
        if isinstance(value, (list, tuple)):  # a collective's future: [tensor]
            (value,) = value
        if value.data_ptr() != self._gradients.data_ptr():
            self._gradients.copy_(value.view(-1))
        self._done = True


class CommHook:
    """A torch DDP communication hook and its state, run on a bucket's gradients."""

    def __init__(self, state: Any, hook: Hook) -> None:
        if not callable(hook):
            raise TypeError(f"register_comm_hook: hook must be callable, got {hook!r}")
        self.state, self.hook = state, hook

    def launch(
        self,
        buffer: torch.Tensor,
        numel: int,
        views: List[torch.Tensor],
        params: List[nn.Parameter],
        index: int,
        is_last: bool,
    ) -> HookWork:
        """Run the hook on ``buffer[:numel]`` (the gradients; the rest are the flags, whose
        all-reduce is issued first: see the Note)."""
        gradients, flags = buffer[:numel], buffer[numel:]
        flags_work = comm.all_reduce(flags, async_op=True)
        bucket = HookBucket(gradients, views, params, index, is_last)
        return HookWork(flags_work, self.hook(self.state, bucket), gradients)


def check_one_hook(existing: Optional[CommHook], what: str) -> None:
    """Raise if a hook is registered already (torch's DDP takes one, once)."""
    if existing is not None:
        raise RuntimeError(f"{what}.register_comm_hook can only be called once")
