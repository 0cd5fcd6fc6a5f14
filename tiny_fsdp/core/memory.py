"""Memory ledger: the bytes of parameters, gradients and optimizer state that a rank holds.

[Note: memory ledger]
``memory_ledger(model, optimizer)`` counts the tensors themselves, not a formula, so it measures
what a strategy really keeps. It looks at:

- ``params``: every parameter's local data (``param.data``: a full tensor, a dim-0 shard, a view
  of a flat buffer, or an empty placeholder on a rank that does not own it; a DTensor's local
  shard);
- ``grads``: every ``param.grad``;
- ``optimizer``: every tensor in ``optimizer.state``, and the state *keys* that are not the
  model's parameters (master copies: a low-precision strategy updates fp32 masters, not params);
- the optional hook ``extra_state_tensors() -> {category: [tensors]}`` of the model wrapper and
  of the optimizer, for what the generic walk cannot see: a gradient shard that is not any
  ``param.grad``, persistent communication buckets (category ``buffers``), ...

Each tensor is charged by its *storage*, and each storage once, in the order params, grads,
optimizer, buffers. So the views of one flat buffer count once, as the whole buffer (padding
included), and a tied parameter counts once. Call it after ``optimizer.step()`` and before
``zero_grad()``: that is when gradients and optimizer state both exist.

Transient memory (gathered parameters, activations, staging buffers of one backward) is not model
state and is not counted here; ``peak_growth`` measures it.

[Note: allocation meters]
``allocated_bytes(device)`` is what is allocated now: the CUDA caching allocator's count, or on
CPU glibc's in-use heap (``mallinfo2``: small chunks + mmapped chunks, so memory the allocator
caches after ``free`` does not count, unlike RSS). ``peak_growth(device, fn)`` is the highest
value above the start while ``fn`` runs: CUDA's peak statistics, or on CPU a thread sampling
every 0.2 ms (a spike shorter than that can be missed). Both are per process, so they see every
tensor and buffer, also those of PyTorch's own strategies that the ledger cannot reach.
"""

import ctypes
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Set, Tuple

import torch
from torch import nn

CATEGORIES = ("params", "grads", "optimizer", "buffers")
ExtraTensors = Dict[str, Sequence[torch.Tensor]]


@dataclass(frozen=True)
class MemoryReport:
    """Bytes one rank holds, per category ([Note: memory ledger])."""

    params: int = 0
    grads: int = 0
    optimizer: int = 0
    buffers: int = 0  # persistent communication buffers that are none of the three above

    @property
    def model_states(self) -> int:
        """Parameters + gradients + optimizer state: what the ZeRO formulas predict."""
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        return self.model_states + self.buffers

    def as_dict(self) -> Dict[str, int]:
        return asdict(self)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` stored on this rank (a DTensor's local shard, else the tensor)."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _storage_key(tensor: torch.Tensor) -> Optional[Tuple[str, int, int]]:
    """(device, address, bytes) of the storage behind ``tensor``; None if it holds no memory."""
    tensor = local_tensor(tensor)
    if tensor.device.type == "meta":
        return None
    storage = tensor.untyped_storage()
    nbytes = storage.nbytes()
    if nbytes == 0:
        return None
    return (str(tensor.device), storage.data_ptr(), nbytes)


def storage_bytes(tensors: Iterable[torch.Tensor], seen: Optional[Set[tuple]] = None) -> int:
    """Bytes of the distinct storages behind ``tensors``, skipping (and adding to) ``seen``."""
    seen = set() if seen is None else seen
    total = 0
    for tensor in tensors:
        key = _storage_key(tensor)
        if key is not None and key not in seen:
            seen.add(key)
            total += key[2]
    return total


def memory_ledger(
    model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None
) -> MemoryReport:
    """Bytes of parameters / gradients / optimizer state / buffers this rank holds.

    ``model``: a strategy wrapper or a plain module; ``optimizer``: its optimizer, or None. For
    an optimizer that wraps a local one (``ZeroRedundancyOptimizer``), pass the local one
    (``.optim``). See [Note: memory ledger] for what is counted.
    """
    params = list(model.parameters())  # a tied parameter appears once
    found: Dict[str, List[torch.Tensor]] = {c: [] for c in CATEGORIES}
    found["params"] += [p.detach() for p in params]
    found["grads"] += [p.grad for p in params if p.grad is not None]
    if optimizer is not None:
        found["optimizer"] += list(_optimizer_tensors(optimizer, params))
    for owner in (model, optimizer):
        for category, tensors in _extra_tensors(owner).items():
            if category not in found:
                raise ValueError(
                    f"{type(owner).__name__}.extra_state_tensors() returned category "
                    f"{category!r}; use one of {CATEGORIES}"
                )
            found[category] += [t for t in tensors if t is not None]
    seen: Set[tuple] = set()
    return MemoryReport(**{c: storage_bytes(found[c], seen) for c in CATEGORIES})


def _optimizer_tensors(
    optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]
) -> Iterator[torch.Tensor]:
    """State values, and state keys that are not model parameters (master copies)."""
    param_storages = {_storage_key(p) for p in params}
    for key, state in optimizer.state.items():
        if torch.is_tensor(key) and _storage_key(key) not in param_storages:
            yield key.detach()
        for value in state.values():
            if torch.is_tensor(value):
                yield value


def _extra_tensors(owner: object) -> ExtraTensors:
    """``owner.extra_state_tensors()`` if it has one, else a built-in adapter, else nothing."""
    if owner is None:
        return {}
    hook = getattr(owner, "extra_state_tensors", None)
    if callable(hook):
        return hook()
    for cls, adapter in _adapters():
        if isinstance(owner, cls):
            return adapter(owner)
    return {}


# [Note: memory adapters]
# Until the strategies implement ``extra_state_tensors()`` themselves, these adapters say what
# each one keeps outside ``param.grad`` / ``optimizer.state``, from the wrappers' public
# attributes. A wrapper with its own hook wins. Imported lazily: the strategies import ``core``.


def _ddp_extra(ddp: nn.Module) -> ExtraTensors:
    # Flat all-reduce buckets (gradients and one flag per parameter), kept between steps. With
    # fp32 buckets the gradients are views of them: already counted as grads, flags included.
    return {"buffers": [bucket.buffer for bucket in ddp.buckets]}


def _zero_extra(wrapper: nn.Module) -> ExtraTensors:
    # ZeRO-1: the full gradient buffer (param.grad are views of it, or None after zero_grad).
    # ZeRO-2: the reduced gradient shard, which no param.grad points to.
    if wrapper.stage == 1:
        return {"grads": [wrapper.grad_buffer.data]}
    return {"grads": [wrapper.grad_shard]}


def _adapters() -> List[Tuple[type, Callable[[nn.Module], ExtraTensors]]]:
    from tiny_fsdp.core.ddp import DDP
    from tiny_fsdp.core.zero import ZeroWrapper

    return [(DDP, _ddp_extra), (ZeroWrapper, _zero_extra)]


# ------------------------------------------------------------------ allocation meters


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks "
                "fsmblks uordblks fordblks keepcost".split()]  # fmt: skip


try:
    _LIBC: Optional[ctypes.CDLL] = ctypes.CDLL("libc.so.6")
    _LIBC.mallinfo2.restype = _MallInfo2
except (OSError, AttributeError):  # not glibc >= 2.33: no CPU figures
    _LIBC = None


def allocated_bytes(device: torch.device) -> Optional[int]:
    """Bytes allocated now on ``device`` ([Note: allocation meters]); None if unknown."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    if device.type != "cpu" or _LIBC is None:
        return None
    info = _LIBC.mallinfo2()
    return info.uordblks + info.hblkhd


def peak_growth(device: torch.device, fn: Callable[[], Any]) -> Optional[int]:
    """Run ``fn``; return the highest ``allocated_bytes`` above its start value meanwhile."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    base = allocated_bytes(device)
    if base is None:
        fn()
        return None
    peak, done = [base], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], allocated_bytes(device))
            time.sleep(0.0002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        fn()
    finally:
        done.set()
        sampler.join()
    return max(peak[0], allocated_bytes(device)) - base


def trim_heap() -> None:
    """Give the CPU heap's free memory back to the OS (glibc), so RSS shows what is in use."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
