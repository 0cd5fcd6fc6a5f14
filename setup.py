from setuptools import find_packages, setup

setup(
    name="tiny_fsdp",
    version="0.1.0",
    description="Small, readable data-parallel training strategies (DDP, ZeRO-1/2/3, FSDP).",
    license="Apache-2.0",
    packages=find_packages(include=["tiny_fsdp", "tiny_fsdp.*", "example", "example.*"]),
    python_requires=">=3.9",
    install_requires=["torch>=2.4", "tqdm"],
    extras_require={
        "dev": ["pytest", "pytest-timeout", "hypothesis", "black", "flake8", "matplotlib"],
    },
)
