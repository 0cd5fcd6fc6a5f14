"""The parts of ``example/benchmark.py`` (the one benchmark entry point).

- ``runner.py``: which strategies run together (phases), building them, timing their steps
  and taking the memory probe ([Note: benchmark method] in ``example/benchmark.py``);
- ``pytorch.py``: PyTorch's counterparts (DDP, ZeroRedundancyOptimizer, FSDP2) and counting
  their traffic;
- ``report.py``: per-strategy figures and the markdown table;
- ``plots.py``: the PNG plots.
"""
