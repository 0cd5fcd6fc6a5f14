"""A model built on ``meta``, made real by its own initialisation, one module at a time.

[Note: meta buffers]
A model built on the ``meta`` device has no values at all, buffers included: BatchNorm's
running statistics, and the *non-persistent* ones that ``__init__`` computes and no checkpoint
holds (rotary ``inv_freq``, BERT's ``position_ids``). FSDP and ZeRO-3 materialise parameters
with ``init_parameter(name, tensor)`` ([Note: meta parameters]); for buffers they call
``materialize_buffers`` first, which, one module at a time, allocates the module's meta buffers
on the device and re-runs the model's own initialisation of that module, the first that exists
of:

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

[Note: tensors the model's init method sets]
Some models set a tensor only in a whole-model init method, called after wrapping: torchtitan's
``init_weights(buffer_device)`` recomputes the ``freqs_cis`` buffer there and draws its MoE
experts' raw 3-D parameters; timm's ``init_weights()`` draws a ViT's ``pos_embed``. No
per-module init knows them. When the model has such a method (``INIT_METHODS``, which the
wrapper runs with every parameter whole: [Note: apply with whole parameters]), a buffer or
parameter nothing initialises at wrap time is not refused: it is left unset (NaN) on the device,
so ``self.freqs_cis.device`` is real, and its path is kept by the wrapper (ZeRO-3: the union of
every owner's), the same list on every rank. The forward checks them, until one finds them all
set (however they were written: the init method, ``apply``, ``load_state_dict``): a tensor
still NaN where any rank holds it (one all-gather of the names: a ZeRO-3 rank holds only the
tensors it owns) makes every rank raise alike, naming the tensors and the method to call. A
tensor without NaN (integers) cannot be told set from unset: it passes the check.

[Note: meta parameters]
A parameter on ``meta`` is filled, at its full shape, by ``root.init_parameter(name, tensor)``
when the model has one (our GPT-2: values that depend on the name only). A model without it
(HuggingFace's, a ``torch.nn`` stack) gets ``ModuleInit``: the module holding the parameter is
initialised as the model would, ``root._init_weights(module)`` else
``module.reset_parameters()``, into NaN-filled scratch tensors (as for buffers), and the
parameter takes its scratch value; one still NaN was initialised by nothing, and the error
says what to add. A module's scratch lives until its last parameter is taken (parameters come
module by module), so a rank holds at most one module's full tensors besides its shards. The
values are draws of the model's own init, not those of a build on a real device with the same
seed (the random stream is consumed in another order), as with FSDP2's ``to_empty`` and an
init; a pretrained checkpoint is then loaded with ``load_state_dict``.
"""

import math
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from tiny_fsdp.core import comm
from tiny_fsdp.core.apply_whole import INIT_METHODS


class MetaInitError(ValueError):
    """A parameter or buffer on ``meta`` that nothing initialises."""


def has_meta_buffers(root: nn.Module) -> bool:
    return any(b is not None and b.is_meta for b in root.buffers())


@torch.no_grad()
def materialize_buffers(root: nn.Module, device: torch.device, what: str) -> List[str]:
    """Make every meta buffer of ``root`` real on ``device`` ([Note: meta buffers]). Returns
    the paths of those left unset for the model's init method ([Note: tensors the model's init
    method sets]); raises for them if the model has none."""
    names = {id(m): path for path, m in root.named_modules()}
    later = init_method_of(root)
    left: List[str] = []
    for module in root.modules():
        meta = [n for n, b in module._buffers.items() if b is not None and b.is_meta]
        if not meta:
            continue
        for name in meta:
            buffer = module._buffers[name]
            module._buffers[name] = _unset(buffer.shape, buffer.dtype, device)
        init = _init_of(root, module)
        paths = [f"{names[id(module)]}.{n}".lstrip(".") for n in meta]
        if init is not None:
            with _scratch_params(module, device):
                init()
            paths = [p for p, n in zip(paths, meta) if _is_nan(module._buffers[n])]
        if paths and later is None:
            raise MetaInitError(_missing(what, "buffers", paths, module))
        left += paths
    if dist.get_world_size() > 1:
        for buffer in root.buffers():
            comm.broadcast_into(buffer, src=0)
    return left


def init_method_of(root: nn.Module) -> Optional[str]:
    """The name of ``root``'s whole-model init method (``INIT_METHODS``), if it has one."""
    methods = ("init_weights", *sorted(INIT_METHODS - {"init_weights"}))  # torchtitan's first
    return next((m for m in methods if callable(getattr(root, m, None))), None)


def check_set(what: str, root: nn.Module, paths: List[str]) -> None:
    """Raise on every rank if any of ``paths`` (tensors left for the init method) is still NaN
    where some rank holds it ([Note: tensors the model's init method sets]). A collective."""

    def local(path: str) -> torch.Tensor:
        owner, _, name = path.rpartition(".")
        return getattr(root.get_submodule(owner), name)

    mine = [path for path in paths if _is_nan(local(path))]
    every = comm.all_gather_object(mine) if dist.get_world_size() > 1 else [mine]
    unset = [path for path in paths if any(path in ranks for ranks in every)]
    if unset:
        raise MetaInitError(
            f"{what}: {unset} were on the meta device and nothing initialised them when the "
            f"model was wrapped. Call the model's {init_method_of(root)}() on the wrapped "
            "model, on every rank, before the first forward (as torchtitan calls init_weights("
            "buffer_device=...) after fully_shard), or add init_buffers(self, module) / "
            "init_parameter(self, name, tensor) to the model."
        )


PARAM_RESETS = ("reset_parameters", "_reset_parameters")  # nn.MultiheadAttention: the latter


def _init_of(
    root: nn.Module,
    module: nn.Module,
    methods: Tuple[str, ...] = ("init_buffers", "_init_weights"),
    resets: Tuple[str, ...] = ("reset_parameters",),
) -> Optional[Callable[[], None]]:
    """The model's own init of ``module``: the first of ``root``'s ``methods``, else the first
    of ``module``'s ``resets``."""
    for attr in methods:
        method = getattr(root, attr, None)
        if callable(method):
            return lambda: method(module)
    for attr in resets:
        reset = getattr(module, attr, None)
        if callable(reset):
            return reset
    return None


class _on_meta:
    """Swap every parameter under ``owner`` except ``keep``'s direct ones for a meta tensor."""

    def __init__(self, owner: nn.Module, keep: nn.Module, shapes: "FullShapes") -> None:
        self.shapes = shapes
        self.saved = [
            (module, attr, param)
            for module in owner.modules()
            if module is not keep
            for attr, param in module._parameters.items()
            if param is not None and not param.is_meta
        ]

    def __enter__(self) -> None:
        for module, attr, param in self.saved:
            shape = _full_shape(self.shapes, module, attr, param)
            meta = torch.empty(shape, dtype=param.dtype, device="meta")
            module._parameters[attr] = nn.Parameter(meta, param.requires_grad)

    def __exit__(self, *exc: object) -> None:
        for module, attr, param in self.saved:
            module._parameters[attr] = param


class _scratch_params:
    """Swap ``module``'s direct parameters for scratch tensors of their full shape (floating
    ones NaN-filled, so that what an init leaves alone can be told)."""

    def __init__(
        self, module: nn.Module, device: torch.device, shapes: Optional["FullShapes"] = None
    ) -> None:
        self.module = module
        self.device = device
        self.shapes = shapes
        self.saved: Dict[str, nn.Parameter] = {}
        self.scratch: Dict[str, torch.Tensor] = {}

    def __enter__(self) -> Dict[str, torch.Tensor]:
        for name, param in self.module._parameters.items():
            if param is not None:
                self.saved[name] = param
                shape = _full_shape(self.shapes, self.module, name, param)
                scratch = _unset(shape, param.dtype, self.device)
                self.scratch[name] = scratch
                self.module._parameters[name] = nn.Parameter(scratch, param.requires_grad)
        return self.scratch

    def __exit__(self, *exc: object) -> None:
        self.module._parameters.update(self.saved)


FullShapes = Dict[Tuple[int, str], torch.Size]  # (id(module), attribute) -> full shape


def full_shapes(root: nn.Module) -> FullShapes:
    """Every parameter's shape, recorded before any is sharded."""
    return {
        (id(module), attr): param.shape
        for module in root.modules()
        for attr, param in module._parameters.items()
        if param is not None
    }


def _full_shape(
    shapes: Optional[FullShapes], module: nn.Module, attr: str, param: nn.Parameter
) -> torch.Size:
    return param.shape if shapes is None else shapes[(id(module), attr)]


def _unset(shape: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor no init has written yet: NaN where the dtype has one (see ``_is_nan``), else 0."""
    tensor = torch.empty(shape, dtype=dtype, device=device)
    return (
        tensor.fill_(math.nan)
        if tensor.is_floating_point() or tensor.is_complex()
        else tensor.zero_()
    )


def _is_nan(tensor: torch.Tensor) -> bool:
    floating = tensor.is_floating_point() or tensor.is_complex()
    return floating and bool(torch.isnan(tensor).any())


def agree_on_every_rank(message: Optional[str], unset: List[str]) -> List[str]:
    """Raise ``MetaInitError`` on every rank if ``message`` is set on any (ZeRO-3 initialises a
    tensor on its owner only: the others must not walk on into a collective); else return the
    union of every rank's ``unset`` paths ([Note: tensors the model's init method sets])."""
    mine = (message, unset)
    every = comm.all_gather_object(mine) if dist.get_world_size() > 1 else [mine]
    failed = [m for m, _ in every if m]
    if failed:
        raise MetaInitError(failed[0])
    return sorted({path for _, paths in every for path in paths})


class ModuleInit:
    """``init_parameter(name, tensor)`` for a model without one ([Note: meta parameters])."""

    def __init__(self, root: nn.Module, device: torch.device, what: str) -> None:
        self.root = root
        self.device = device
        self.what = what
        self._shapes = full_shapes(root)  # before the strategy shards anything
        self._module: Optional[str] = None  # the module whose scratch values are held
        self._values: Dict[str, torch.Tensor] = {}
        self._later = init_method_of(root) is not None
        #: parameters left unset (NaN) for the model's init method, in the order met
        self.unset: List[str] = []

    @torch.no_grad()
    def __call__(self, name: str, tensor: torch.Tensor) -> None:
        module_name, _, attr = name.rpartition(".")
        if module_name != self._module:
            self._values = self._initialise(module_name)
            self._module = module_name
        tensor.copy_(self._values.pop(attr))

    def _initialise(self, module_name: str) -> Dict[str, torch.Tensor]:
        """The module's parameters as the model's init leaves them: the module's own init,
        then each ancestor's, innermost first (as ``__init__`` and ``model.apply`` run them:
        a parent may override its children, e.g. MultiheadAttention zeroes its ``out_proj``
        bias), the ancestors seeing every other parameter on ``meta``, where an init is a
        no-op."""
        module = self.root.get_submodule(module_name)
        parts = module_name.split(".") if module_name else []
        chain = [self.root.get_submodule(".".join(parts[:i])) for i in range(len(parts), -1, -1)]
        inits = [(owner, _init_of(self.root, owner, ("_init_weights",), PARAM_RESETS))
                 for owner in chain]  # fmt: skip
        attrs = [attr for attr, param in module._parameters.items() if param is not None]
        with _scratch_params(module, self.device, self._shapes):
            for owner, init in inits:
                if init is None:
                    continue
                if owner is module:
                    init()
                else:
                    with _on_meta(owner, module, self._shapes):
                        init()
            values = {attr: module._parameters[attr].detach() for attr in attrs}
        initialised = any(init is not None for _, init in inits)
        unset = [a for a, value in values.items() if _is_nan(value) or not initialised]
        unset = self._paths(module_name, unset)
        if unset and not self._later:  # [Note: tensors the model's init method sets]
            raise MetaInitError(_missing(self.what, "parameters", unset, module))
        self.unset += unset
        return values

    @staticmethod
    def _paths(module_name: str, attrs: List[str]) -> List[str]:
        return [f"{module_name}.{attr}".lstrip(".") for attr in attrs]


def _missing(what: str, kind: str, paths: List[str], module: nn.Module) -> str:
    """The error for ``kind`` ("buffers" or "parameters") at ``paths`` that nothing initialised
    in ``module``, with the method the model can add."""
    cls = type(module)
    hook, how = {
        "buffers": (
            "init_buffers(self, module)",
            "fill module's buffers in place, e.g. recompute rotary frequencies",
        ),
        "parameters": ("init_parameter(self, name, tensor)", "fill the full-shape tensor in place"),
    }[kind]
    return (
        f"{what}: {kind} {paths} are on the meta device and nothing initialises them (the "
        f"model has no {hook.replace('self, ', '')} or _init_weights(module), "
        f"{cls.__module__}.{cls.__qualname__} no reset_parameters() that sets them). Add "
        f"{hook} to the model ({how}), or build the model on a real device."
    )
