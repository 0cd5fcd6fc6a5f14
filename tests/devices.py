"""Devices a single-process test runs on: the CPU always, CUDA where a GPU is present (the cases
``pytest -m cuda`` selects, part of the GPU check)."""

import pytest
import torch

NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CPU_AND_CUDA = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, NEEDS_CUDA])]
