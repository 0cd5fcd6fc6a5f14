"""Specification: the transient buffers of FSDP and ZeRO-3 (gathered parameters, gradient
buffers) are plain tensors; on the CPU a large one reuses a block an earlier one freed, which
nothing else still uses, else a new block that, on Linux, faults in 2 MiB pages ([Note: huge
pages for transient buffers], [Note: reusing large CPU blocks] in
``tiny_fsdp/core/utils/huge_pages.py``)."""

import contextlib
import re
import sys
from typing import Tuple
from pathlib import Path

import pytest
import torch

from tests.build import adamw, build
from tests.harness import run_distributed
from example.model import GPTConfigs
from tests.parity import global_batch, lm_loss, local_slice, make_model
from tiny_fsdp.core.utils import huge_pages
from tiny_fsdp.core.utils.storage import Memory

LARGE = huge_pages.CACHE_BYTES // 4  # float32 elements of the smallest block the cache keeps
CPU = torch.device("cpu")

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _huge_page_kib(address: int) -> int:
    """AnonHugePages of the mapping holding ``address`` in this process."""
    mapping = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        span = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            start, stop = (int(s, 16) for s in span.groups())
            mapping = start <= address < stop
        elif mapping and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def test_empty_is_torch_empty() -> None:
    for shape, dtype in ((5, torch.float32), ((3, 2_000_000), torch.bfloat16)):
        tensor = huge_pages.empty(shape, dtype, torch.device("cpu"))
        expected = torch.empty(shape, dtype=dtype)
        assert (tensor.shape, tensor.dtype, tensor.device) == (
            expected.shape,
            expected.dtype,
            expected.device,
        )
        assert tensor.is_contiguous()
    assert huge_pages.empty(7, torch.float32, torch.device("meta")).is_meta


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text(),
    reason="needs Linux with transparent huge pages",
)
def test_a_large_cpu_buffer_faults_in_huge_pages() -> None:
    tensor = huge_pages.empty(64 * 2**20 // 4, torch.float32, torch.device("cpu"))  # 64 MiB
    tensor.fill_(1.0)  # first touch: the pages are made now
    page = 2 * 2**20
    first_whole_page = -(-tensor.data_ptr() // page) * page  # advised from there on
    assert _huge_page_kib(first_whole_page) >= 2048, "no 2 MiB page behind the buffer"


def test_a_freed_large_block_is_handed_out_again_in_any_shape_and_dtype() -> None:
    first = huge_pages.empty(LARGE, torch.float32, CPU)
    address = first.data_ptr()
    del first
    again = huge_pages.empty((2, LARGE), torch.bfloat16, CPU)  # the same byte size
    assert again.data_ptr() == address
    assert again.shape == (2, LARGE) and again.dtype == torch.bfloat16 and again.is_contiguous()
    del again
    huge_pages.release_free()


def test_a_block_asked_for_without_reuse_is_neither_taken_from_the_cache_nor_kept() -> None:
    huge_pages.release_free()
    cached = huge_pages.empty(LARGE, torch.float32, CPU)
    address = cached.data_ptr()
    del cached  # a free block of this size
    fresh = huge_pages.empty(LARGE, torch.float32, CPU, reuse=False)
    assert fresh.data_ptr() != address
    del fresh
    assert huge_pages.free_bytes() == LARGE * 4  # the cached block alone
    huge_pages.release_free()


def test_a_block_still_used_anywhere_is_never_handed_out() -> None:
    taken = huge_pages.empty(LARGE, torch.float32, CPU)
    other = huge_pages.empty(LARGE, torch.float32, CPU)  # while the first is alive
    assert other.data_ptr() != taken.data_ptr()
    address = taken.data_ptr()
    view = taken[1:]  # a view keeps the block
    del taken, other
    assert huge_pages.empty(LARGE, torch.float32, CPU).data_ptr() != address
    del view
    weight = torch.ones(LARGE, requires_grad=True)
    saved = huge_pages.empty(LARGE, torch.float32, CPU)
    address = saved.data_ptr()
    loss = (saved * weight).sum()  # autograd saves the block for backward (a C++ reference)
    del saved
    assert huge_pages.empty(LARGE, torch.float32, CPU).data_ptr() != address
    del loss
    assert huge_pages.empty(LARGE, torch.float32, CPU).data_ptr() == address  # free now
    huge_pages.release_free()


def test_buffers_a_few_bytes_apart_share_blocks() -> None:
    huge_pages.release_free()
    padded = huge_pages.empty(LARGE + 128, torch.float32, CPU)  # e.g. padded to the world size
    address = padded.data_ptr()
    del padded
    exact = huge_pages.empty(LARGE, torch.float32, CPU)
    assert exact.data_ptr() == address
    assert exact.untyped_storage().nbytes() == (LARGE + 128) * 4  # the block's own size
    del exact
    huge_pages.release_free()


def test_sizes_a_step_asks_for_in_turn_keep_their_blocks() -> None:
    huge_pages.release_free()
    addresses = set()
    for _ in range(4):  # a step: one size, then another while the first is free again
        for numel in (LARGE, 2 * LARGE):
            buffer = huge_pages.empty(numel, torch.float32, CPU)
            addresses.add(buffer.data_ptr())
            del buffer
    assert len(addresses) == 2, "a block was released and made again"
    assert huge_pages.release_free() == 3 * LARGE * 4


def test_free_blocks_go_back_to_the_os_on_request_and_when_their_size_is_no_longer_asked_for():
    huge_pages.release_free()
    huge_pages.empty(LARGE, torch.float32, CPU)  # made, then free at once
    assert huge_pages.release_free() == LARGE * 4
    assert huge_pages.release_free() == 0
    for _ in range(3):  # a step asks for two sizes: the longest run between two of one is 2
        huge_pages.empty(LARGE, torch.float32, CPU)
        huge_pages.empty(2 * LARGE, torch.float32, CPU)
    for _ in range(4):  # then a third alone: its first block is new, the others are kept
        huge_pages.empty(3 * LARGE, torch.float32, CPU)
    held = huge_pages.empty(4 * LARGE, torch.float32, CPU)  # new: the first two sizes go
    assert huge_pages.release_free() == 3 * LARGE * 4  # the third size's block, free
    del held
    assert huge_pages.release_free() == 4 * LARGE * 4


def test_free_bytes_counts_the_blocks_nothing_uses() -> None:
    huge_pages.release_free()
    held = huge_pages.empty(LARGE, torch.float32, CPU)
    huge_pages.empty(2 * LARGE, torch.float32, CPU)  # free at once
    assert huge_pages.free_bytes() == 2 * LARGE * 4
    del held
    assert huge_pages.free_bytes() == 3 * LARGE * 4
    huge_pages.release_free()
    assert huge_pages.free_bytes() == 0


def test_small_and_non_cpu_buffers_are_plain_torch_empty() -> None:
    huge_pages.release_free()
    small = huge_pages.empty(LARGE // 2, torch.float32, CPU)
    assert huge_pages.release_free() == 0  # not cached
    assert small.numel() == LARGE // 2
    assert huge_pages.empty(LARGE, torch.float32, torch.device("meta")).is_meta
    with torch.device("meta"):  # a default device does not move an explicit CPU request
        assert huge_pages.empty(LARGE, torch.float32, CPU).device == CPU
    huge_pages.release_free()


def _halves(buffer: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    return buffer[: buffer.numel() // 2], buffer[buffer.numel() // 2 :]


def test_a_large_unit_buffer_takes_a_freed_block_and_makes_its_views_on_it() -> None:
    huge_pages.release_free()
    memory = Memory(LARGE, torch.float32, CPU, _halves)
    assert not memory.holds_memory and memory.nbytes == LARGE * 4
    first, second = memory.allocate()
    assert memory.holds_memory and first.data_ptr() == memory.buffer.data_ptr()
    with pytest.raises(RuntimeError, match="unsharded again"):
        memory.allocate()  # a prefetch-order bug must not write over parameters in use
    address = memory.buffer.data_ptr()
    memory.free()
    assert not memory.holds_memory and memory.buffer.numel() == LARGE  # shape kept
    assert huge_pages.empty(LARGE, torch.float32, CPU).data_ptr() != address  # views held
    del first, second
    other = huge_pages.empty(LARGE, torch.float32, CPU)  # the block is free now: reused
    assert other.data_ptr() == address
    assert memory.allocate()[0].data_ptr() != address  # taken by other: a new block
    memory.free()
    huge_pages.release_free()


def test_a_small_unit_buffer_keeps_the_views_it_made_once() -> None:
    memory = Memory(LARGE // 2, torch.float32, CPU, _halves)
    views = memory.allocate()
    memory.free()
    assert memory.allocate() is views and memory.holds_memory  # the same objects, memory back
    memory.free()
    assert views[0].untyped_storage().nbytes() == 0


def _cached_blocks_train_bitwise_alike(rank: int, world_size: int) -> None:
    """FSDP, ZeRO-3 and one device's layers (its Embedding's gradient), default arguments,
    with every transient buffer from the cache (CACHE_BYTES = 0) and with none: the same bits.
    Steps cover an accumulation under no_sync and a zero_grad that keeps ``.grad`` (the next
    backward adds to gradients that view a block)."""
    runs = {}
    default = huge_pages.CACHE_BYTES
    try:
        for cache_bytes in (default, 0):
            huge_pages.CACHE_BYTES = cache_bytes
            for name in ("fsdp", "zero3", "single"):
                model, opt = build(name, make_model(5), adamw(lr=1e-3, weight_decay=0.1))
                losses = []
                for step in range(4):
                    x, y = global_batch(step, 4 * world_size, 8, GPTConfigs.gpt2_tiny.vocab_size)
                    if name != "single":
                        x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
                    if step == 1:
                        with model.no_sync() if name != "single" else contextlib.nullcontext():
                            lm_loss(model(x[:2]), y[:2]).backward()
                    loss = lm_loss(model(x), y)
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=step != 2)
                    losses.append(loss.item())
                runs[cache_bytes, name] = losses, model.state_dict()
            if cache_bytes == 0:
                assert huge_pages.release_free() > 0  # the buffers did come from the cache
    finally:
        huge_pages.CACHE_BYTES = default
        huge_pages.release_free()
    for name in ("fsdp", "zero3", "single"):
        (losses, state), (cached_losses, cached_state) = runs[default, name], runs[0, name]
        assert losses == cached_losses, name  # bitwise: the same math on other memory
        assert all(torch.equal(state[k], cached_state[k]) for k in state), name


def test_training_with_every_buffer_from_the_cache_is_bitwise_the_same() -> None:
    run_distributed(_cached_blocks_train_bitwise_alike, 2)
