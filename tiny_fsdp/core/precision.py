"""Mixed precision: compute and communicate in a low-precision dtype, keep fp32 master weights.

[Note: mixed precision]
A ``MixedPrecisionPolicy(param_dtype, reduce_dtype)`` given to a strategy wrapper means:

- the parameters the module holds (full tensors, shards, owned tensors) stay in their own dtype
  (fp32): they are the master weights, and the optimizer state built from them is fp32 too;
- ``fetch`` hands the layer its parameters cast to ``param_dtype``, so the layer math (never
  rewritten) runs in ``param_dtype``; floating-point model inputs (also inside the containers
  they come in) are cast to ``param_dtype`` by the wrapper (unless ``cast_forward_inputs=False``),
  so activations and their gradients are
  ``param_dtype`` as well, and its floating outputs to ``output_dtype`` if given;
- gradients come out of the layer in ``param_dtype``, are reduced across ranks in
  ``reduce_dtype`` and autograd accumulates the result into the fp32 ``local_param.grad``
  (autograd casts a gradient to its leaf's dtype), so tied weights and ``no_sync`` accumulation
  add in fp32.

DDP runs the user's modules without layer wrappers, so it casts by giving each parameter a
``param_dtype`` copy as its data for a step instead ([Note: DDP mixed precision]); the rest holds.
The casts hook the inner model's forward, so a call that reaches it otherwise than through the
wrapper (a method of the model: ``model.generate``, ``model.loss``; ``model.module(x)``) computes
under the policy too; under DDP they act for DDP's own model only (``register_forward_casts``'s
``owner``; what that means for copies: [Note: DDP mixed precision]).
Where the cast happens decides what travels: FSDP casts its shard before the all-gather and
ZeRO-3's owner broadcasts a cast copy, so parameter bytes on the wire halve with bf16; DDP and
ZeRO-3 reduce gradients of ``reduce_dtype``. ZeRO-1/2 already keep parameters in low precision
with fp32 master shards in the optimizer, so there the policy casts the stored parameters to
``param_dtype`` (``reduce_dtype`` must equal it). Compute the loss in fp32
(``logits.float()``): a softmax over a large vocabulary in bf16 loses the small probabilities.

FSDP2's ``torch.distributed.fsdp.MixedPrecisionPolicy`` has the same four fields with the same
meaning, so every wrapper (and ``apply_mixed_precision``) takes it as it is (``as_policy``); its
default, ``param_dtype=None``, computes in the parameters' own dtype: no policy.

Single device: ``apply_mixed_precision(model, policy)`` gives every layer a
``MixedPrecisionHandler``: the same casts without communication, i.e. the reference that the
distributed bf16 runs are compared with.

[Note: batch norm under a policy]
torch's ``batch_norm`` takes a low-precision input with weight, bias and running statistics all
in fp32 (the mixed-type kernel ``torch.autocast`` uses) or all in the input's dtype, but not
``param_dtype`` weights next to fp32 statistics, which is what a policy hands a BatchNorm: its
parameters are cast, its buffers are not (running averages kept in fp32, as they should be).
FSDP2 fails there ("Expected running_mean to have type BFloat16 but got Float"; FSDP1 kept
BatchNorm out of its policy). Here, while a ``_BatchNorm`` module (``BatchNorm1d/2d/3d``,
``SyncBatchNorm``, their subclasses) runs under a low-precision policy, its ``F.batch_norm``
call gets weight and bias in its running statistics' dtype (``BatchNormStatsDtype``, a torch
function mode entered by a forward pre-hook and left by a forward hook that also runs when the
forward raises): the layer computes as under ``torch.autocast``, from the ``param_dtype``
parameters, and its gradients flow back through that cast to them as every layer's do. Its
output keeps the input's dtype. Nothing changes where the dtypes already agree (no policy, a
copy of the model). ``SyncBatchNorm``'s multi-rank training path calls other kernels and is not
covered.
"""

import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.overrides import TorchFunctionMode

from tiny_fsdp.core.module.base import CallbackModule
from tiny_fsdp.core.module.handler import ParamHandler, Params, TrainingPhase
from tiny_fsdp.core.pickling import HookObject, Inert
from tiny_fsdp.core.utils.tree import map_tensors

_LOW_PRECISION = (torch.float16, torch.bfloat16)
_CAST_HOOKS_ATTR = "_tiny_fsdp_mp_cast_hooks"


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes of a mixed-precision run ([Note: mixed precision]).

    Attributes:
        param_dtype: dtype the layers compute with: parameters are cast to it when fetched
            (before the all-gather / broadcast in sharded strategies); floating inputs too.
        reduce_dtype: dtype in which gradients are averaged across ranks. ``None`` (default)
            means ``param_dtype``. fp32 trades bandwidth for a more exact average.
        output_dtype: floating-point tensors the wrapped model returns are cast to it (FSDP2's
            field: e.g. fp32 logits for the loss); ``None`` (default) leaves them as computed.
        cast_forward_inputs: cast the floating-point tensors the model is called with to
            ``param_dtype`` (True, default; FSDP2's field), or leave them to the model.

    Master weights, ``.grad`` and optimizer state always stay in the parameters' own dtype.
    """

    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: Optional[torch.dtype] = None
    output_dtype: Optional[torch.dtype] = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        if self.reduce_dtype is None:
            object.__setattr__(self, "reduce_dtype", self.param_dtype)  # frozen: set once here
        for field_name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, field_name)
            if field_name == "output_dtype" and value is None:
                continue
            if not isinstance(value, torch.dtype) or not value.is_floating_point:
                raise ValueError(
                    f"MixedPrecisionPolicy.{field_name} must be a floating-point torch.dtype "
                    f"(e.g. torch.bfloat16), got {value!r}"
                )

    @classmethod
    def from_name(cls, name: str) -> Optional["MixedPrecisionPolicy"]:
        """``"fp32"`` -> None (no policy); ``"bf16"`` / ``"fp16"`` -> that dtype everywhere."""
        dtypes = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
        if name not in dtypes:
            raise ValueError(f"unknown precision {name!r}; choose one of {sorted(dtypes)}")
        dtype = dtypes[name]
        return None if dtype is None else cls(dtype, dtype)


def as_policy(value: Any) -> Optional[MixedPrecisionPolicy]:
    """A wrapper's ``mixed_precision`` argument as a ``MixedPrecisionPolicy`` or None.

    Takes ours, None, or FSDP2's ``torch.distributed.fsdp.MixedPrecisionPolicy``, whose fields
    and meaning are the same, so an FSDP2 script keeps its policy ([Note: mixed precision]):
    FSDP2's defaults (``param_dtype=None``: compute in the parameters' dtype) mean no policy.
    Raises TypeError for anything else (FSDP1's ``MixedPrecision``, a dtype, a name), saying
    what to pass.
    """
    if value is None or isinstance(value, MixedPrecisionPolicy):
        return value
    fsdp2, fsdp1 = _torch_policy_classes()
    if fsdp2 is not None and isinstance(value, fsdp2):
        if value.param_dtype is None:
            if value.reduce_dtype is None and value.output_dtype is None:
                return None
            raise ValueError(
                f"{value} leaves param_dtype=None (compute in the parameters' dtype) but sets "
                "other fields; give param_dtype too (torch.float32 to compute in fp32)"
            )
        return MixedPrecisionPolicy(
            value.param_dtype, value.reduce_dtype, value.output_dtype, value.cast_forward_inputs
        )
    hint = "MixedPrecisionPolicy(param_dtype=torch.bfloat16) from tiny_fsdp.core"
    if isinstance(value, str):
        hint = f"MixedPrecisionPolicy.from_name({value!r}) from tiny_fsdp.core"
    elif fsdp1 is not None and isinstance(value, fsdp1):
        hint += (
            " (FSDP1's MixedPrecision has no counterpart: buffers keep their dtype, gradients "
            "land in fp32 .grad; FSDP2's MixedPrecisionPolicy is taken as it is)"
        )
    raise TypeError(f"mixed_precision must be a policy or None, got {value!r}; pass {hint}")


def _torch_policy_classes() -> Tuple[Optional[type], Optional[type]]:
    """FSDP2's ``MixedPrecisionPolicy`` and FSDP1's ``MixedPrecision`` (None where absent)."""
    try:
        from torch.distributed import fsdp
    except ImportError:  # a build without torch.distributed
        return None, None
    return getattr(fsdp, "MixedPrecisionPolicy", None), getattr(fsdp, "MixedPrecision", None)


def cast_params(params: Params, dtype: torch.dtype) -> Params:
    """``params`` cast to ``dtype`` (a tensor already of that dtype is returned as is)."""
    return tuple(None if p is None else p.to(dtype) for p in params)


def cast_grads(grads: Params, dtype: torch.dtype) -> Params:
    """``grads`` cast to ``dtype`` (None entries stay None)."""
    return tuple(None if g is None else g.to(dtype) for g in grads)


def cast_inputs(args: Tuple[Any, ...], kwargs: dict, dtype: torch.dtype) -> Tuple[tuple, dict]:
    """Floating-point tensors among ``args`` / ``kwargs`` cast to ``dtype``, also inside the
    tuples, lists, dicts and dataclasses they come in (a batch dict, a list of images), as
    FSDP2 casts them.

    Integer inputs (token ids) are left alone; a layer whose input is already ``dtype`` gets it
    unchanged. Without this, the first ``Linear`` of a model fed fp32 data would mix dtypes.
    """

    def cast(value: torch.Tensor) -> torch.Tensor:
        return value.to(dtype) if value.is_floating_point() else value

    return map_tensors(args, cast), map_tensors(kwargs, cast)


class MixedPrecisionHandler(ParamHandler):
    """Single-device mixed precision: cast copies in, gradients cast to ``reduce_dtype`` out.

    ``fetch``: the layer's parameters cast to ``param_dtype``, once per forward: the layer
    keeps the cast for its backward (``reuses_forward_fetch``, [Note: callback layers]), as
    ``torch.autocast`` keeps its casts in the graph. ``reduce_grads``: the ``param_dtype``
    gradients cast to ``reduce_dtype`` (nothing to reduce on one device); autograd accumulates
    them into the fp32 ``.grad``.
    """

    reuses_forward_fetch = True

    def __init__(self, policy: MixedPrecisionPolicy) -> None:
        self.policy = policy

    def fetch(self, module: nn.Module, phase: TrainingPhase) -> Params:
        local = super().fetch(module, phase)
        return cast_params(local, self.policy.param_dtype)

    def reduce_grads(self, module: nn.Module, grads: Params) -> Params:
        return cast_grads(grads, self.policy.reduce_dtype)


def apply_mixed_precision(model: nn.Module, policy: MixedPrecisionPolicy) -> nn.Module:
    """Single-device mixed precision on a converted model (``convert_module(model)``), in place.

    Every layer wrapper gets a ``MixedPrecisionHandler`` (it must still have the default
    single-device handler) and the root casts its floating inputs to ``policy.param_dtype``.
    Parameters stay fp32: the optimizer (``tiny_fsdp.core.optim``) updates them as masters.
    """
    layers = [m for m in model.modules() if isinstance(m, CallbackModule)]
    if not layers:
        raise ValueError(
            "apply_mixed_precision needs tiny_fsdp layers: call convert_module(model) first"
        )
    policy = as_policy(policy)
    if policy is None:
        return model  # FSDP2's default policy: nothing to cast
    handler = MixedPrecisionHandler(policy)
    for layer in layers:
        if type(layer.param_handler) is not ParamHandler:
            raise ValueError(
                f"{type(layer).__name__} already has a {type(layer.param_handler).__name__}; "
                "a strategy wrapper takes the policy itself (mixed_precision=...)"
            )
        layer.param_handler = handler
    check_master_dtypes(model, policy)
    register_forward_casts(model, policy)
    return model


def register_forward_casts(
    model: nn.Module, policy: Optional[MixedPrecisionPolicy], owner: Any = None
) -> None:
    """Make ``model`` cast its floating inputs to ``policy.param_dtype`` and its floating
    outputs to ``policy.output_dtype``, where the policy asks (None: remove the casts).
    ``owner``: the wrapper whose policy it is, if the model's own parameters do not carry it
    (DDP): the casts then act only on a call of that wrapper's model, while the wrapper lives
    (not on a copy of the model); None: on every call."""
    for handle in getattr(model, _CAST_HOOKS_ATTR, ()):
        handle.remove()
    handles = []
    if policy is not None and policy.cast_forward_inputs:
        cast_in = ForwardCast(policy.param_dtype, True, owner)
        handles.append(model.register_forward_pre_hook(cast_in, with_kwargs=True))
    if policy is not None and policy.output_dtype is not None:
        cast_out = ForwardCast(policy.output_dtype, False, owner)
        handles.append(model.register_forward_hook(cast_out))
    if policy is not None and policy.param_dtype in _LOW_PRECISION:
        stats_dtype = BatchNormStatsDtype()  # [Note: batch norm under a policy]
        for module in model.modules():
            if isinstance(module, _BatchNorm):
                handles.append(module.register_forward_pre_hook(stats_dtype.enter))
                handles.append(module.register_forward_hook(stats_dtype.leave, always_call=True))
    setattr(model, _CAST_HOOKS_ATTR, handles)


class BatchNormStatsDtype(HookObject):
    """The pre-hook (``enter``) and hook (``leave``) of a BatchNorm under a low-precision
    policy: in between, ``F.batch_norm`` gets weight and bias in the running statistics' dtype
    ([Note: batch norm under a policy])."""

    def __init__(self) -> None:
        self._local = threading.local()  # per thread: a backward's recompute has its own

    def enter(self, module: nn.Module, args: tuple) -> None:
        mode = _StatsDtypeMode()
        mode.__enter__()
        self._modes().append(mode)

    def leave(self, module: nn.Module, args: tuple, output: Any) -> None:
        modes = self._modes()
        if modes:  # entered by ``enter`` (not if a pre-hook before it raised)
            modes.pop().__exit__(None, None, None)

    def _modes(self) -> List[TorchFunctionMode]:
        if not hasattr(self._local, "modes"):
            self._local.modes = []
        return self._local.modes

    def __reduce__(self) -> Any:  # a thread-local does not pickle: a pickled model gets a new one
        return (BatchNormStatsDtype, ())


class _StatsDtypeMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = dict(kwargs or {})
        if func is F.batch_norm:
            args = list(args)
            running_mean = args[1] if len(args) > 1 else kwargs.get("running_mean")
            if running_mean is not None:
                for index, name in ((3, "weight"), (4, "bias")):
                    if index < len(args) and args[index] is not None:
                        args[index] = args[index].to(running_mean.dtype)  # itself if of it
                    elif kwargs.get(name) is not None:
                        kwargs[name] = kwargs[name].to(running_mean.dtype)
        return func(*args, **kwargs)


class ForwardCast(HookObject):
    """A forward pre-hook with kwargs that casts a call's floating inputs to ``dtype``
    (``inputs``), or a forward hook that casts its floating outputs. With an ``owner`` (held
    weakly) it acts only on the owner's model while the owner lives, and pickles as ``Inert``
    ([Note: pickling a wrapped model]); without one it pickles as itself."""

    def __init__(self, dtype: torch.dtype, inputs: bool, owner: Any = None) -> None:
        self.dtype, self.inputs, self.owned = dtype, inputs, owner is not None
        self.applies = owned_model_check(owner)

    def __call__(self, module: nn.Module, args: tuple, kwargs_or_output: Any) -> Any:
        if not self.applies(module):
            return None
        if self.inputs:
            return cast_inputs(args, kwargs_or_output, self.dtype)
        return map_tensors(kwargs_or_output, self._cast_floating)

    def _cast_floating(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.dtype) if t.is_floating_point() else t

    def __reduce__(self) -> Any:
        return (Inert, ()) if self.owned else (ForwardCast, (self.dtype, self.inputs))


def owned_model_check(owner: Any) -> Callable[[nn.Module], bool]:
    """``applies(module)``: True if ``module`` is the model of ``owner``, a wrapper held by a
    weak reference, while it lives (a hook must not keep its wrapper alive, nor act on a copy
    of the model); always True without an owner."""
    if owner is None:
        return _always
    ref = weakref.ref(owner)

    def applies(module: nn.Module) -> bool:
        wrapper = ref()
        return wrapper is not None and wrapper.module is module

    return applies


def _always(module: nn.Module) -> bool:
    return True


def check_master_dtypes(model: nn.Module, policy: Optional[MixedPrecisionPolicy]) -> None:
    """Raise if a policy is given but the parameters are not fp32 masters (e.g. after .half())."""
    if policy is None:
        return
    low = sorted({str(p.dtype) for p in model.parameters() if p.dtype in _LOW_PRECISION})
    if low:
        raise ValueError(
            f"mixed precision keeps fp32 master weights, but the model has {low} parameters; "
            "build it in fp32 (do not call .half() / .bfloat16()) and let the policy cast"
        )


def low_precision_error(what: str) -> TypeError:
    """The error a strategy wrapper raises for ``.half()`` / ``.bfloat16()`` / ``.to(dtype)``."""
    return TypeError(
        f"{what} on a tiny_fsdp wrapper is not supported: casting the master weights would lose "
        "them and desynchronise the strategy's buffers. Pass mixed_precision="
        "MixedPrecisionPolicy(param_dtype=torch.bfloat16) (tiny_fsdp.core.precision) to the "
        "wrapper instead: layers compute in bf16, weights and optimizer state stay fp32."
    )
