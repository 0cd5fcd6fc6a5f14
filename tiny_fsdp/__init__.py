"""tiny_fsdp: data-parallel training strategies (DDP, ZeRO-1/2/3, FSDP) side by side.

[Note: supported torch]
``setup.py`` asks for torch >= ``TESTED_TORCH``: the oldest release the whole test suite has
passed on (CPU, gloo: 2.9.1, 2.10.0, 2.11.0, 2.13.0). An older torch from 2.6 on imports with a
warning: most of the library runs, not all of it. With 2.8.0, 12 tests fail; among them, when a
rank raises mid-step under ``fail_fast(timeout_s=2)``, the others still wait after 90 s. Before
2.6 the functions tiny_fsdp stands in for (``torch.nn.utils.get_total_norm``,
``clip_grads_with_norm_``) and ``torch.compiler.set_stance`` do not exist, so importing it raises.
"""

import re
import warnings

import torch

__version__ = "0.1.0"

TESTED_TORCH = (2, 9)  # the oldest torch the test suite passed on ([Note: supported torch])
_IMPORTABLE_TORCH = (2, 6)


def _major_minor(version: str) -> tuple:
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else TESTED_TORCH


_FOUND, _TESTED = _major_minor(str(torch.__version__)), ".".join(map(str, TESTED_TORCH))
if _FOUND < _IMPORTABLE_TORCH:
    raise ImportError(
        f"tiny_fsdp needs torch >= {_TESTED}; found {torch.__version__} (pip install -U torch)"
    )
if _FOUND < TESTED_TORCH:
    warnings.warn(
        f"tiny_fsdp is tested with torch >= {_TESTED}; with {torch.__version__} parts of it may "
        "fail ([Note: supported torch] in tiny_fsdp/__init__.py)",
        stacklevel=2,
    )
