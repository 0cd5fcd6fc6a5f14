"""Opt-in generic wrapper for a module that holds parameters but has no registered wrapper.

[Note: generic fallback]
``make_fallback_wrapper(module)`` changes the class of one instance to ``Fallback<Name>``, a
subclass of ``FallbackModule`` (a ``CallbackModule``) and of the module's own class, whose
``param_names`` are the module's *direct* parameters. Child modules are not touched:
``convert_module`` wraps them like any other layer, so each child keeps its own handler.

- forward: the handler's full parameters are put in place of the local ones (``_parameters``
  entries, aliases included) and the ORIGINAL class's ``forward`` runs, without autograd.
- backward: the backward fetch gives the full parameters again; the forward is recomputed with
  grad enabled on detached copies of the inputs and parameters, under the RNG and autocast state
  the forward saw (same dropout masks, same precision), and ``torch.autograd.grad`` pushes
  ``grad_output`` through it to the copies (the callback's gradients) and to the children's
  (local) parameters, whose wrappers fetch, compute and reduce on the way.
- the children's parameters are extra *inputs* of this module's Function, so their gradients
  leave the callback like input gradients and autograd accumulates them in the outer backward.
  ``autograd.grad`` itself accumulates nothing: hooks on ``.grad`` that strategies use (DDP's
  and ZeRO's post-accumulate hooks, which end their bucket cycle) fire once, in the outer pass.

Why recompute instead of keeping a graph (or a ``torch.func.vjp`` closure) from the forward:
such a graph holds the forward's full parameters until backward, the stray reference
[Note: callback layers] rules out, and is corrupted when a strategy frees or refills that storage
in between. ``torch.func`` is avoided for two more reasons: ``functional_call`` would re-enter this
very ``forward`` and run the module's hooks twice, and ``vjp`` refuses the converted children's
autograd.Functions (they have no ``setup_context``). The cost is one extra forward of the module,
hence the warning. Limits: ``forward`` must return one tensor; args and kwargs may be anything
(tensors anywhere in them get gradients, other values are kept as they are).
"""

import contextlib
import warnings
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Type

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from tiny_fsdp.core.module.base import CallbackModule

_FALLBACK_CLASSES: Dict[Type[nn.Module], Type["FallbackModule"]] = {}


class _Call:
    """A call's non-tensor part: the argument structure and every non-tensor value."""

    def __init__(self, leaves: List[Any], spec: Any) -> None:
        self.spec = spec
        self.is_tensor = [isinstance(leaf, torch.Tensor) for leaf in leaves]
        self.constants = [None if t else leaf for leaf, t in zip(leaves, self.is_tensor)]
        self.n_tensors = sum(self.is_tensor)

    @classmethod
    def split(cls, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple["_Call", List[Any]]:
        """``(call, tensors)``: the tensors anywhere in args / kwargs, in a fixed order."""
        leaves, spec = tree_flatten((args, kwargs))
        return cls(leaves, spec), [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
        """Inverse of ``split``: the ``(args, kwargs)`` with ``tensors`` put back in place."""
        it = iter(tensors)
        leaves = [next(it) if t else c for t, c in zip(self.is_tensor, self.constants)]
        return tree_unflatten(leaves, self.spec)


@contextlib.contextmanager
def _substituted(module: "FallbackModule", full: Sequence[torch.Tensor]) -> Iterator[None]:
    """Make every ``_parameters`` entry holding a handled parameter return its full tensor."""
    by_id = {id(module._parameters[n]): t for n, t in zip(module.param_names, full)}
    saved = dict(module._parameters)
    try:
        for name, p in saved.items():
            if p is not None and id(p) in by_id:
                module._parameters[name] = by_id[id(p)]
        yield
    finally:
        module._parameters.update(saved)


def _capture_state(device: torch.device) -> Tuple[Any, ...]:
    """What the recompute must replay: CPU and device RNG states, autocast (enabled, dtype)."""
    device_rng = None
    if device.type not in ("cpu", "meta"):
        device_rng = torch.get_device_module(device.type).get_rng_state(device)
    autocast = (torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type))
    return torch.get_rng_state(), device_rng, autocast


@contextlib.contextmanager
def _replaying(device: torch.device, state: Tuple[Any, ...]) -> Iterator[None]:
    cpu_rng, device_rng, (autocast_on, autocast_dtype) = state
    devices = [] if device_rng is None else [device]
    # fork_rng restores the caller's RNG afterwards: the recompute must not shift later draws.
    with torch.random.fork_rng(devices=devices, device_type=device.type):
        torch.set_rng_state(cpu_rng)
        if device_rng is not None:
            torch.get_device_module(device.type).set_rng_state(device_rng, device)
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_on):
            yield


class FallbackModule(CallbackModule):
    """Callbacks that run ``original_cls.forward`` with full parameters ([Note: generic fallback]).

    ``param_names`` is set per instance (instances of one class may differ, e.g. bias or not).
    """

    original_cls: Type[nn.Module]

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        # Tensors go to the Function as inputs (autograd tracks them); the rest rides in ``call``.
        call, tensors = _Call.split(args, kwargs)
        inner = _descendant_params(self)
        local_params = tuple(getattr(self, name) for name in self.param_names)
        n_inputs = 1 + len(tensors) + len(inner)
        return self.function.apply(self, n_inputs, call, *tensors, *inner, *local_params)

    def _run_original(self, call: _Call, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        args, kwargs = call.rebuild(tensors)
        out = self.original_cls.forward(self, *args, **kwargs)
        if not isinstance(out, torch.Tensor):
            raise TypeError(
                f"the generic fallback of {self.original_cls.__qualname__} supports a forward "
                f"that returns one tensor, got {type(out).__name__}; register a wrapper for it"
            )
        return out

    def forward_callback(self, ctx: Any, call: _Call, *inputs: torch.Tensor) -> torch.Tensor:
        tensors, ctx.inner = inputs[: call.n_tensors], inputs[call.n_tensors :]
        ctx.call = call
        ctx.save_for_backward(*tensors)
        ctx.device = ctx.params[0].device
        ctx.replay_state = _capture_state(ctx.device)
        with _substituted(self, ctx.params):
            return self._run_original(call, tensors)

    def backward_callback(self, ctx: Any, grad_output: torch.Tensor) -> Any:
        n = ctx.call.n_tensors
        input_needs = ctx.needs_input_grad[3 : 3 + n]
        inner_needs = ctx.needs_input_grad[3 + n :]
        inputs = [t.detach().requires_grad_(w) for t, w in zip(ctx.saved_tensors, input_needs)]
        params = [p.detach().requires_grad_(w) for p, w in zip(ctx.params, ctx.param_needs_grad)]
        # Gradients wanted, in the order of the Function's inputs: inputs, inner, own params.
        sources = [*zip(inputs, input_needs), *zip(ctx.inner, inner_needs)]
        sources += list(zip(params, ctx.param_needs_grad))
        wanted = [t for t, w in sources if w]
        with torch.enable_grad(), _replaying(ctx.device, ctx.replay_state):
            with _substituted(self, params):
                out = self._run_original(ctx.call, inputs)
            found: Sequence[Optional[torch.Tensor]] = [None] * len(wanted)
            if wanted and out.requires_grad:  # else nothing in the recompute needs a gradient
                # autograd.grad, not backward: nothing is accumulated into .grad in this inner
                # pass: hooks on leaves fire once, in the outer backward ([Note: generic fallback]).
                found = torch.autograd.grad(out, wanted, grad_output, allow_unused=True)
        it = iter(found)
        grads = [next(it) if w else None for _, w in sources]
        return (None, *grads[: len(grads) - len(params)]), tuple(grads[len(grads) - len(params) :])


def _descendant_params(module: nn.Module) -> Tuple[torch.Tensor, ...]:
    """Trainable parameters of the children (each once): their wrappers compute their gradients
    inside this module's backward, and this module hands them on as gradients of its inputs."""
    found: Dict[int, torch.Tensor] = {}
    for child in module.children():
        for p in child.parameters():
            if p.requires_grad:
                found.setdefault(id(p), p)
    return tuple(found.values())


def _fallback_class(cls: Type[nn.Module]) -> Type[FallbackModule]:
    """One ``Fallback<Name>`` class per original class (hence one autograd.Function per class)."""
    if cls not in _FALLBACK_CLASSES:
        name = f"Fallback{cls.__name__}"
        _FALLBACK_CLASSES[cls] = type(name, (FallbackModule, cls), {"original_cls": cls})
    return _FALLBACK_CLASSES[cls]


def make_fallback_wrapper(module: nn.Module, path: str = "") -> None:
    """Turn ``module`` in place into a ``Fallback<Name>`` wrapper of its direct parameters.

    Parameter objects, ``state_dict`` keys and children are unchanged. Warns (naming ``path``,
    the module's path in its model, and its type) because the fallback recomputes the forward
    in backward. No-op on a module that already is a ``CallbackModule``.
    """
    if isinstance(module, CallbackModule):
        return
    names: List[str] = [name for name, _ in module.named_parameters(recurse=False)]
    if not names:
        raise ValueError(f"{type(module).__qualname__} holds no parameters of its own to wrap")
    cls = type(module)
    module.__class__ = _fallback_class(cls)
    module.param_names = tuple(names)
    warnings.warn(
        f"tiny_fsdp: module '{path or '<root>'}' of type {cls.__module__}.{cls.__qualname__} has "
        "no registered wrapper and uses the generic fallback, which is slower (its forward runs "
        "again in backward); register a wrapper for it (see docs/extending.md).",
        stacklevel=2,
    )
