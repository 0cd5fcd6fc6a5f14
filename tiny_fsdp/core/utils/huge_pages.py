"""Large CPU buffers: reused from this process's earlier ones, else faulting in 2 MiB pages.

[Note: huge pages for transient buffers]
FSDP and ZeRO-3 allocate their gathered parameters and gradient buffers anew in every step and
free them as soon as they are used: that is the memory they save. On a GPU the caching
allocator hands the same memory back. On the CPU, glibc serves a block over 32 MiB with a fresh
``mmap``, whose every 4 KiB page faults and is zeroed on first touch: on the 2-core development
machine, allocating and filling 51 MB (GPT-2's embedding) took 34 ms, filling it again 5 ms.
So, on the CPU, a block from ``empty``:

- of at least ``CACHE_BYTES`` (32 MiB, above which glibc always maps afresh), is one that an
  earlier ``empty`` made and nothing uses any more, of the same byte size, when there is one
  ([Note: reusing large CPU blocks]);
- else, of at least ``MIN_BYTES``, a new block that the kernel is asked to back with 2 MiB pages
  (``madvise(MADV_HUGEPAGE)``, what PyTorch does for every allocation under
  ``THP_MEM_ALLOC_ENABLE=1``): 9 ms instead of 34 for the 51 MB above. Linux with transparent
  huge pages in ``madvise`` or ``always`` mode; elsewhere, or if the call fails, plain pages.

[Note: reusing large CPU blocks]
The blocks of ``CACHE_BYTES`` or more that ``empty`` made are kept, as a GPU's caching allocator
keeps freed memory: a unit's gathered parameters (FSDP's all-gather output and copy-out, ZeRO-3's
broadcast buffer: ``storage.Memory``), its gradient buffer and the embedding's gradient take the
blocks the step before freed, their pages already in place (one block serves several of them in
turn where their sizes match: FSDP's all-gather output and the same unit's gradient buffer). A
block is free when the only reference to its storage is the cache's own
(``torch._C._storage_Use_Count``, which PyTorch's CUDA-graph trees use to tell a storage still in
use): a buffer a collective in flight still reads, a view, a tensor autograd saved, a ``.grad``
that is a slice of it keep it taken, so memory in use is never handed out.

A request takes the smallest free block of its size up to 2 MiB larger, so buffers a few bytes
apart share blocks (an HF Llama with a 50,304 x 256 embedding, 2 ranks: the embedding's
gradient, 51,511,296 bytes, and the root unit's reduce-scatter output, padded, 51,511,808); if
there is none, a new block of its size is made. A step asks for the same sizes step after step,
so the cache holds, per size, as many blocks as were in use at once. The free blocks of a size
no one asks for any more (a model that went) are released at the next new block, once more
requests than twice the longest run between two requests of one size (a step, or a round of
models taking turns) have passed since its last. An earlier rule took blocks of exactly the
size asked for and released every free block whenever it made a new one: two sizes asked for in
turn then took each other's blocks, and that Llama's FSDP step made its blocks afresh (the
embedding gradient's ``zero_`` took 137 ms where 5 ms do on pages in place).

The cost: between two uses a block stays *reserved* (counted by ``allocated_bytes`` and the
RSS), also while the step's other tensors reach their peak, which torch allocates elsewhere
(on a GPU they would take the free blocks). ``release_free()`` hands the free blocks back to the
OS, as ``torch.cuda.empty_cache()``. Measured on the development machine (2 ranks, gpt2_mini,
batch 4 x 256, 12 rounds alternating step by step in one run, load 2.0-2.6, which spreads
these ratios by a few hundredths): FSDP's step went from 1.092 to 1.010 x our DDP's, ZeRO-3's
from 1.040 to 1.032 (in a second run, with the gradient buffers alone reused already: FSDP
1.016 -> 1.029, ZeRO-3 1.077 -> 1.002); the forward, which starts with the root unit's gather,
took 30-75 ms less. The benchmark's peak per rank (the most bytes allocated in a step, a
strategy's own reserved blocks included: [Note: benchmark method]) rose under FSDP from 994 to
1,044 MiB (1,097 until the embedding's backward stopped holding the root unit, [Note: full
units]): at its peak, at the end of the forward, the block of the root unit's all-gather output
waits for the next step. Under ZeRO-3 it rose from 1,003 to 1,101 MiB: two reserved 49 MiB
blocks (the root unit's gradient buffer and the embedding's gradient) wait at its peak. Both
rises are within the bound on the reduction buffers in flight ((in_flight_limit + 1) x the
largest reduction input, 148 MiB here: [Note: asynchronous reduction]), though the blocks are
not all reduction buffers: that memory buys the speed. A block that would add one more to those
waiting through the peak asks for a new one instead (``reuse=False``): ZeRO-3's receive buffer
on 2 ranks ([Note: collectives on gloo]), a third block of the root unit's size, live at the end
of the backward with its gradient buffer and the embedding's gradient; cached, it raised
ZeRO-3's peak to 1,151 MiB, and its steps took no less CPU time than with a new block each.
"""

import ctypes
import sys
import threading
from typing import Callable, Dict, List, Optional, Sequence, Union

import torch

MIN_BYTES = 4 * 2**20  # smaller blocks come from glibc's heap, already faulted in
CACHE_BYTES = 32 * 2**20  # glibc maps every larger block afresh (its largest mmap threshold)
_PAGE = 2 * 2**20
_MADV_HUGEPAGE = 14
_madvise: Optional[Callable[..., int]] = None
_tried = False
_SLACK = 2 * 2**20  # a request takes a block of its size up to this many bytes larger
_blocks: Dict[int, List[torch.UntypedStorage]] = {}  # bytes -> blocks empty made, free or not
_asked: Dict[int, int] = {}  # bytes -> the number of the last request blocks of them serve
_requests = 0
_longest_run = 0  # most requests seen between two of one size
_lock = threading.Lock()


def empty(
    shape: Union[int, Sequence[int]],
    dtype: torch.dtype,
    device: torch.device,
    reuse: bool = True,
) -> torch.Tensor:
    """``torch.empty(shape, dtype, device)``; on the CPU, a large block is a free one of this
    process's earlier blocks, else a new one in huge pages ([Note: huge pages for transient
    buffers]). ``reuse=False``: a new block, not kept for later requests."""
    size = torch.Size([shape] if isinstance(shape, int) else shape)
    nbytes = size.numel() * dtype.itemsize
    if not (reuse and reuses(nbytes, device)):
        tensor = torch.empty(size, dtype=dtype, device=device)
        advise(tensor)
        return tensor
    with _lock:  # taken (a tensor on it) before another thread may look for a free block
        storage = _take(nbytes)
        return torch.empty((0,), dtype=dtype, device="cpu").set_(storage, 0, size)


def reuses(nbytes: int, device: Union[str, torch.device]) -> bool:
    """Whether ``empty`` gives a block of ``nbytes`` on ``device`` from the cache."""
    return torch.device(device).type == "cpu" and nbytes >= CACHE_BYTES and _USE_COUNT is not None


def release_free() -> int:
    """Hand the free cached blocks back to the OS ([Note: reusing large CPU blocks]); returns
    their bytes. The cache starts learning the step's sizes over."""
    global _longest_run
    with _lock:
        released = _release_free()
        _longest_run = 0
        for nbytes in set(_asked) - set(_blocks):
            del _asked[nbytes]
        return released


def free_bytes() -> int:
    """Bytes of the cached blocks nothing uses ([Note: reusing large CPU blocks])."""
    with _lock:
        return sum(n for n, blocks in _blocks.items() for b in blocks if _is_free(b))


def _take(nbytes: int) -> torch.UntypedStorage:
    global _requests
    _requests += 1
    fitting = sorted(size for size in _blocks if nbytes <= size < nbytes + _SLACK)
    for size in fitting:  # the smallest free block that fits
        _asked_for(size)
        for storage in _blocks[size]:
            if _is_free(storage):
                return storage
    _release_free(lambda size: _requests - _asked[size] > 2 * _longest_run > 0)
    _asked_for(nbytes)
    block = torch.empty(nbytes, dtype=torch.uint8, device="cpu")
    advise(block)
    storage = block.untyped_storage()
    _blocks.setdefault(nbytes, []).append(storage)
    return storage


def _asked_for(nbytes: int) -> None:
    """Note a request that blocks of ``nbytes`` serve."""
    global _longest_run
    if nbytes in _asked:
        _longest_run = max(_longest_run, _requests - _asked[nbytes])
    _asked[nbytes] = _requests


def _release_free(stale: Callable[[int], bool] = lambda size: True) -> int:
    """Drop the free blocks of the sizes ``stale`` picks; returns their bytes."""
    released = 0
    for nbytes, blocks in list(_blocks.items()):
        if not stale(nbytes):
            continue
        kept = [storage for storage in blocks if not _is_free(storage)]
        released += nbytes * (len(blocks) - len(kept))
        if kept:
            _blocks[nbytes] = kept
        else:
            del _blocks[nbytes]
    return released


def _is_free(storage: torch.UntypedStorage) -> bool:
    """Whether the cache's reference is the only one to ``storage``."""
    return _USE_COUNT(storage._cdata) == 1


def advise(tensor: torch.Tensor) -> None:
    """Ask for huge pages behind ``tensor``'s memory, not yet touched (a new CPU block)."""
    nbytes = tensor.numel() * tensor.element_size()
    if tensor.device.type != "cpu" or nbytes < MIN_BYTES:
        return
    madvise = _libc_madvise()
    if madvise is None:
        return
    start = tensor.data_ptr()
    first = -(-start // _PAGE) * _PAGE  # the whole 2 MiB pages inside the block
    last = (start + nbytes) // _PAGE * _PAGE
    if last > first and madvise(first, last - first, _MADV_HUGEPAGE) != 0:
        _disable()


_USE_COUNT: Optional[Callable[[int], int]] = getattr(torch._C, "_storage_Use_Count", None)


def _libc_madvise() -> Optional[Callable[..., int]]:
    global _madvise, _tried
    if not _tried:
        _tried = True
        if sys.platform.startswith("linux"):
            try:
                madvise = ctypes.CDLL(None, use_errno=True).madvise
                madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                madvise.restype = ctypes.c_int
                _madvise = madvise
            except (OSError, AttributeError):
                _madvise = None
    return _madvise


def _disable() -> None:
    global _madvise
    _madvise = None  # e.g. a kernel without transparent huge pages: stop asking
