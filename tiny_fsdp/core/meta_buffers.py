"""Buffers of a model built on ``meta``: made real by the model's own initialisation.

[Note: meta buffers]
A model built on the ``meta`` device has no values at all, buffers included: BatchNorm's
running statistics, and the *non-persistent* ones that ``__init__`` computes and no checkpoint
holds (rotary ``inv_freq``, BERT's ``position_ids``). FSDP and ZeRO-3 materialise parameters
with ``init_parameter(name, tensor)``; for buffers they call ``materialize_buffers`` first,
which, one module at a time, allocates the module's meta buffers on the device and re-runs the
model's own initialisation of that module, the first that exists of:

1. ``root.init_buffers(module)``: the model says how (our convention, like ``init_parameter``);
2. ``root._init_weights(module)``: HuggingFace ``transformers`` models, whose per-module init
   also recomputes rotary frequencies and position ids;
3. ``module.reset_parameters()``: ``torch.nn`` layers (BatchNorm resets its statistics).

During that call the module's parameters are swapped for scratch tensors of their full shape,
so an init that also draws weights writes into scratch, not into the model. Floating buffers
start as NaN: one still NaN afterwards was not initialised, and the error says what to add.
Then every buffer is broadcast from rank 0, so ranks agree even if an init draws random numbers.

Why re-run the model's init rather than build the buffers on rank 0 and broadcast only: a
non-persistent buffer's value exists nowhere but in the code that computes it, and building the
whole model on a real device is what ``meta`` is there to avoid.
"""

import math
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from tiny_fsdp.core import comm


def has_meta_buffers(root: nn.Module) -> bool:
    return any(b is not None and b.is_meta for b in root.buffers())


@torch.no_grad()
def materialize_buffers(root: nn.Module, device: torch.device, what: str) -> None:
    """Make every meta buffer of ``root`` real on ``device`` ([Note: meta buffers])."""
    names = {id(m): path for path, m in root.named_modules()}
    for module in root.modules():
        meta = [n for n, b in module._buffers.items() if b is not None and b.is_meta]
        if not meta:
            continue
        for name in meta:
            buffer = module._buffers[name]
            real = torch.empty(buffer.shape, dtype=buffer.dtype, device=device)
            if real.is_floating_point():
                real.fill_(math.nan)
            else:
                real.zero_()
            module._buffers[name] = real
        init = _init_of(root, module)
        paths = [f"{names[id(module)]}.{n}".lstrip(".") for n in meta]
        if init is None:
            raise ValueError(_missing(what, paths, module))
        with _scratch_params(module, device):
            init()
        unset = [p for p, n in zip(paths, meta) if _is_nan(module._buffers[n])]
        if unset:
            raise ValueError(_missing(what, unset, module))
    if dist.get_world_size() > 1:
        for buffer in root.buffers():
            comm.broadcast_into(buffer, src=0)


def _init_of(root: nn.Module, module: nn.Module) -> Optional[Callable[[], None]]:
    for owner, attr in ((root, "init_buffers"), (root, "_init_weights")):
        method = getattr(owner, attr, None)
        if callable(method):
            return lambda: method(module)
    reset = getattr(module, "reset_parameters", None)
    return reset if callable(reset) else None


class _scratch_params:
    """Swap ``module``'s direct parameters for scratch tensors of their full shape."""

    def __init__(self, module: nn.Module, device: torch.device) -> None:
        self.module = module
        self.device = device
        self.saved: Dict[str, nn.Parameter] = {}

    def __enter__(self) -> None:
        for name, param in self.module._parameters.items():
            if param is not None:
                self.saved[name] = param
                shape = _full_shape(param)
                scratch = torch.empty(shape, dtype=param.dtype, device=self.device)
                self.module._parameters[name] = nn.Parameter(scratch, param.requires_grad)

    def __exit__(self, *exc: object) -> None:
        self.module._parameters.update(self.saved)


def _full_shape(param: nn.Parameter) -> List[int]:
    return list(param.shape)  # called before parameters are sharded: still their full shape


def _is_nan(buffer: torch.Tensor) -> bool:
    return buffer.is_floating_point() and bool(torch.isnan(buffer).any())


def _missing(what: str, paths: List[str], module: nn.Module) -> str:
    cls = type(module)
    return (
        f"{what}: buffers {paths} are on the meta device and nothing initialises them "
        f"({cls.__module__}.{cls.__qualname__} has no reset_parameters(), the model no "
        "init_buffers(module) or _init_weights(module)). Add init_buffers(self, module) to "
        "the model (fill module's buffers in place, e.g. recompute rotary frequencies), or "
        "build the model on a real device."
    )
