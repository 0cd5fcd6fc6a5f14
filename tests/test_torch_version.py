"""Specification: the torch tiny_fsdp asks for is the one it is tested with ([Note: supported
torch]); an older torch is told apart at import, not deep inside a step."""

import os
import re
import subprocess
import sys

import tiny_fsdp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _import_with_torch(version: str) -> subprocess.CompletedProcess:
    """``import tiny_fsdp`` in a fresh interpreter whose torch reports ``version``."""
    code = f"import torch; torch.__version__ = {version!r}; import tiny_fsdp"
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_setup_py_asks_for_the_torch_the_suite_is_tested_with() -> None:
    with open(os.path.join(ROOT, "setup.py")) as f:
        asked = re.search(r'"torch>=(\d+)\.(\d+)"', f.read())
    assert asked is not None
    assert (int(asked.group(1)), int(asked.group(2))) == tiny_fsdp.TESTED_TORCH


def test_an_untested_torch_imports_with_a_warning_and_one_without_the_functions_raises() -> None:
    tested = ".".join(map(str, tiny_fsdp.TESTED_TORCH))
    untested = _import_with_torch("2.8.0+cpu")
    assert untested.returncode == 0, untested.stderr
    assert f"tiny_fsdp is tested with torch >= {tested}; with 2.8.0+cpu" in untested.stderr
    too_old = _import_with_torch("2.5.1")
    assert too_old.returncode != 0
    assert f"ImportError: tiny_fsdp needs torch >= {tested}; found 2.5.1" in too_old.stderr
    current = _import_with_torch("2.13.0+cpu")
    assert current.returncode == 0 and "tested with torch" not in current.stderr, current.stderr
