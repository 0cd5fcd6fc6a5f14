"""Tracing a few training steps: ``trace_step`` (one step, any loop) and ``StepTracer`` (the
examples' ``--trace DIR``), which gathers every rank's events on rank 0 and writes the files.

    with trace_step(model, optimizer) as recorder:   # forward, backward, optimizer.step()
        ...
    records = recorder.records(rank)                 # picklable; chrome.py / plot.py draw them
"""

import contextlib
import os
import sys
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from tiny_fsdp.core import comm
from tiny_fsdp.core.memory import allocated_bytes, memory_ledger
from tiny_fsdp.trace import recorder as _recorder
from tiny_fsdp.trace.chrome import chrome_trace, write_json
from tiny_fsdp.trace.hooks import attach_layer_hooks, attach_phase_hooks, saved_tensor_hooks
from tiny_fsdp.trace.recorder import Recorder


def transient_probe(model: nn.Module) -> Optional[Callable[[], Dict[str, int]]]:
    """The strategy's ``transient_bytes()`` (FSDP, ZeRO-3: gathered parameters and reductions
    in flight, ``{name: bytes}``), or None for strategies that keep no transient buffers."""
    probe = getattr(model, "transient_bytes", None)
    return probe if callable(probe) else None


def _model_device(model: nn.Module) -> torch.device:
    for param in model.parameters():
        if param.device.type != "meta":
            return param.device
    return torch.device("cpu")


@contextlib.contextmanager
def trace_step(
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    step: Optional[int] = None,
    device: Optional[torch.device] = None,
) -> Iterator[Recorder]:
    """Record what this rank does inside the block ([Note: trace recorder], [Note: trace
    hooks]). ``model``: the strategy's wrapper (or a plain module); ``optimizer``: its optimizer
    (the memory ledger reads it; ``optimizer.step`` becomes a span). Not reentrant."""
    if _recorder.ACTIVE is not None:
        raise RuntimeError("trace_step: a step is already being traced")
    device = torch.device(device) if device is not None else _model_device(model)
    # The allocator's count on CUDA only: on CPU, glibc's (mallinfo2) costs ~0.1 ms a call.
    allocated = (lambda: allocated_bytes(device)) if device.type == "cuda" else None
    recorder = Recorder(device, transient_probe(model), allocated)
    recorder.step = step
    inner = model.module if isinstance(getattr(model, "module", None), nn.Module) else model
    recorder.layer_names = {id(m): name for name, m in inner.named_modules() if name}

    def states() -> Dict[str, int]:
        return memory_ledger(model, optimizer).as_dict()

    layers = attach_layer_hooks(recorder, inner)  # named as in the plain model
    handles = attach_phase_hooks(recorder, optimizer, states)
    recorder.sample_states(states())
    interval = sys.getswitchinterval()
    sys.setswitchinterval(2e-4)  # completion marks get the GIL soon ([Note: trace recorder])
    _recorder.ACTIVE = recorder
    try:
        with saved_tensor_hooks(recorder):
            yield recorder
    finally:
        _recorder.ACTIVE = None
        sys.setswitchinterval(interval)
        for layer in layers:
            layer.remove()
        for handle in handles:
            handle.remove()
    recorder.sample_states(states())


def gather_records(records: Dict[str, Any]) -> Optional[List[Dict[str, Any]]]:
    """Every rank's ``records`` on rank 0 (rank order), None elsewhere; a collective."""
    if not (dist.is_available() and dist.is_initialized()):
        return [records]
    return comm.gather_object(records, dst=0)


def merge_records(parts: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """One rank's records of several traced steps as one."""
    merged: Dict[str, Any] = dict(rank=parts[0]["rank"], spans=[], comms=[], samples=[])
    for part in parts:
        for key in ("spans", "comms", "samples"):
            merged[key] += part[key]
    return merged


def write_trace(ranks: List[Dict[str, Any]], out_dir: str, name: str) -> List[str]:
    """``out_dir/<name>.trace.json`` and, if matplotlib is importable, ``out_dir/<name>.png``."""
    os.makedirs(out_dir, exist_ok=True)
    trace = chrome_trace(ranks, name)
    paths = [os.path.join(out_dir, f"{name}.trace.json")]
    write_json(trace, paths[0])
    try:
        import matplotlib  # noqa: F401  (a dev extra; tiny_fsdp.trace.plot imports it lazily)
    except ImportError:
        return paths
    from tiny_fsdp.trace.plot import plot_timeline

    paths.append(plot_timeline(trace, os.path.join(out_dir, f"{name}.png"), title=name))
    return paths


def parse_steps(spec: str, total: int) -> List[int]:
    """``--trace_steps``: "last", or comma-separated step indices (negative: from the end)."""
    if spec == "last":
        return [total - 1]
    steps = [int(s) for s in spec.split(",") if s.strip()]
    return sorted({s % total if s < 0 else s for s in steps})


class StepTracer:
    """``--trace DIR`` of the examples: trace ``steps``, then write ``DIR/<name>.*``.

    Call ``start(step)`` / ``stop()`` around every step (no-ops for untraced ones) and
    ``finish()`` on every rank after the loop (it gathers on rank 0)."""

    def __init__(
        self,
        out_dir: Optional[str],
        name: str,
        steps: Sequence[int],
        model: nn.Module,
        optimizer: Optional[torch.optim.Optimizer],
        rank: int,
    ) -> None:
        self.out_dir, self.name, self.steps = out_dir, name, set(steps)
        self.model, self.optimizer, self.rank = model, optimizer, rank
        self.parts: List[Dict[str, Any]] = []
        self._stack: Optional[contextlib.ExitStack] = None
        self._recorder: Optional[Recorder] = None

    def start(self, step: int) -> None:
        if self.out_dir is None or step not in self.steps:
            return
        self._stack = contextlib.ExitStack()
        self._recorder = self._stack.enter_context(trace_step(self.model, self.optimizer, step))

    def stop(self) -> None:
        if self._stack is None:
            return
        self._stack.close()
        self.parts.append(self._recorder.records(self.rank))
        self._stack = self._recorder = None

    def finish(self) -> List[str]:
        """Gather on rank 0 and write; the written paths (rank 0), else []."""
        if self.out_dir is None:
            return []
        mine = merge_records(self.parts) if self.parts else dict(rank=self.rank, spans=[],
                                                                 comms=[], samples=[])  # fmt: skip
        ranks = gather_records(mine)
        return [] if ranks is None else write_trace(ranks, self.out_dir, self.name)
