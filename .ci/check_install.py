"""Run inside the environment that README command 1 set up (``pip install -e .`` only): every
module of ``tiny_fsdp`` and ``example`` imports with the declared dependencies, and the install
put no top-level ``example`` package into site-packages."""

import importlib
import importlib.util
import os
import pkgutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Outside the repository only the library is importable.
probe = "import importlib.util as u, tiny_fsdp.models; print(u.find_spec('example') is None)"
with tempfile.TemporaryDirectory() as elsewhere:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=elsewhere, env=env, capture_output=True, text=True
    )
if out.returncode != 0 or out.stdout.strip() != "True":
    sys.exit(f"outside the repository: 'example' is importable or tiny_fsdp is not\n{out}")

# From the repository root, every module of the library and of the examples imports.
sys.path.insert(0, ROOT)
names = []
for package in ("tiny_fsdp", "example"):
    root = importlib.import_module(package)
    names.append(package)
    names += [m.name for m in pkgutil.walk_packages(root.__path__, prefix=package + ".")]
for name in names:
    importlib.import_module(name)
print(f"check_install: {len(names)} modules of tiny_fsdp and example import")
