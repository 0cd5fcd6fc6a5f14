"""Per-rank timelines of a training step: compute spans, collectives and memory, as a Chrome
trace (Perfetto) and a PNG.

- ``recorder.py``: what one rank records, and ``ACTIVE`` ([Note: trace recorder]);
- ``hooks.py``: the hooks a traced step installs ([Note: trace hooks]);
- ``session.py``: ``trace_step`` (one step of any loop) and ``StepTracer`` (``--trace DIR``);
- ``chrome.py``: the Chrome trace JSON ([Note: chrome trace layout]);
- ``plot.py``: the PNGs (imports matplotlib, a dev extra, only when called).

The library's hot paths import only ``recorder`` (for ``ACTIVE``); the rest loads on first use.
"""

from typing import Any

__all__ = ["StepTracer", "trace_step", "write_trace"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from tiny_fsdp.trace import session

        return getattr(session, name)
    raise AttributeError(f"module 'tiny_fsdp.trace' has no attribute {name!r}")
