"""Specification: the transient buffers of FSDP and ZeRO-3 (gathered parameters, gradient
buffers) are plain tensors that, on Linux CPUs, fault in 2 MiB pages ([Note: huge pages for
transient buffers] in ``tiny_fsdp/core/utils/huge_pages.py``)."""

import re
import sys
from pathlib import Path

import pytest
import torch

from tiny_fsdp.core.utils import huge_pages

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
