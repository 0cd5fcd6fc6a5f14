from setuptools import find_packages, setup

setup(
    name="tiny_fsdp",
    version="0.1.0",
    description="Small, readable data-parallel training strategies (DDP, ZeRO-1/2/3, FSDP).",
    license="Apache-2.0",
    # Only the library is installed. The examples run from the repository (each script puts the
    # repository root on sys.path), so no top-level ``example`` package lands in site-packages.
    packages=find_packages(include=["tiny_fsdp", "tiny_fsdp.*"]),
    package_data={"tiny_fsdp.plan": ["presets/*.json"]},  # the planner's hardware presets
    python_requires=">=3.10",  # torch 2.9 (the oldest tested) asks for it
    # Everything the library and the examples import at run time (the examples' data reader
    # uses numpy). Tests, lint and plots are in the dev extras.
    # torch: the oldest release the test suite passed on ([Note: supported torch] in tiny_fsdp).
    install_requires=["torch>=2.9", "numpy", "tqdm"],
    extras_require={
        "dev": [
            "pytest",
            "pytest-timeout",
            "hypothesis",
            "black",
            "flake8",
            "matplotlib",
            "transformers",  # tests/test_any_model.py, tests/test_hf_weights.py (skipped without)
        ],
    },
)
