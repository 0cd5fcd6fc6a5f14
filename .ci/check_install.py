"""Run inside the environment that README command 1 set up (``pip install -e .`` only): every
module of ``tiny_fsdp`` and ``example`` imports with the declared dependencies, and the install
put no top-level ``example`` package into site-packages.

The only exception: a module of the examples whose one purpose is an optional package (the
``hf:`` models and benchmark need ``transformers``, and say so) may fail for that package alone.
"""

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
OPTIONAL = ("transformers",)
optional = []
for name in names:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        if not (name.startswith("example.") and e.name and e.name.split(".")[0] in OPTIONAL):
            raise
        optional.append(f"{name} (needs {e.name.split('.')[0]})")
print(f"check_install: {len(names) - len(optional)} modules of tiny_fsdp and example import")
if optional:
    print("  optional, not installed:", ", ".join(optional))
