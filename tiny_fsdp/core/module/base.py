"""Base class of the layer wrappers: forward and backward through one autograd.Function per class.

[Note: callback layers]
A wrapper such as ``tiny_fsdp.core.module.Linear`` is a subclass of the ``torch.nn`` layer with the
same constructor, parameters and ``state_dict`` keys. Its ``forward`` calls ``cls.function``, an
``autograd.Function`` made once when the wrapper class is defined. That Function:

1. forward: ``ctx.params = handler.fetch(module, FORWARD)``, then
   ``out = module.forward_callback(ctx, *inputs)``, then ``handler.release(module, FORWARD)``;
2. backward: ``ctx.params = handler.fetch(module, BACKWARD)`` (or the forward's, kept, when
   the handler says ``reuses_forward_fetch``; or ``handler.describe(module)``, shape and dtype
   without values, for a layer whose ``backward_reads_params`` is False), then
   ``grad_inputs, grad_params = module.backward_callback(ctx, grad_output)``, then
   ``handler.release(module, BACKWARD)`` and
   ``handler.reduce_grads(module, grad_params)`` gives the local parameters' gradients, which
   the Function returns to autograd; a None there is a gradient the strategy delivers into
   ``.grad`` itself at the end of the backward ([Note: param handler]).

``FORWARD`` and ``BACKWARD`` are the members of ``TrainingPhase``. ``ctx.params`` holds the full
parameters only for the duration of one callback, so a strategy that frees them after use is never
defeated by a stray reference. The exception is a handler whose fetch makes copies that stay valid
(single-device mixed precision's casts): with ``reuses_forward_fetch`` the forward's are kept in
the graph for the layer's backward, one cast per step as ``torch.autocast`` (which also keeps its
casts in the graph), and dropped by the backward or with the graph; a forward that records no
graph keeps nothing. ``ctx.param_needs_grad`` says which parameter gradients are wanted
(frozen parameters and absent biases get ``None``). The layer math lives only in the callbacks;
strategies only provide the handler (see [Note: param handler]).

[Note: autocast]
Under ``torch.autocast`` a wrapper computes as the ``torch.nn`` layer does: its forward callback
calls the same ops, which autocast casts alike. The backward callback of a forward that ran under
autocast runs under that autocast (what ``torch.amp.custom_bwd`` does for any custom Function), so
a matmul of a bf16 ``grad_output`` with an fp32 weight computes in bf16 as the forward did,
wherever ``backward()`` is called. That of a forward without autocast runs under its caller's
state, as a torch layer's backward ops do: inside an autocast region (a ``backward()`` called
there) autocast casts them. A parameter gradient is then cast to the dtype of the full parameter,
as autograd's cast node does for a plain layer (an input gradient autograd casts itself). An op
autocast does not list (``aten.convolution_backward``) gets its operands in ``grad_output``'s dtype
from the layer; a layer saves an input in the dtype its op really computed in.
"""

import contextlib
from typing import Any, ContextManager, Dict, Optional, Sequence, Tuple

import torch
from torch import nn

from tiny_fsdp.core.module.handler import (
    LOCAL_HANDLER,
    ParamHandler,
    TrainingPhase,
    layer_params,
)
from tiny_fsdp.core.utils.engine import will_run
from tiny_fsdp.trace import recorder as _trace


class CallbackFunction(torch.autograd.Function):
    """Runs a wrapped layer's callbacks between its handler's fetch and release."""

    @staticmethod
    def forward(ctx: Any, module: "CallbackModule", n_inputs: int, *args: Any) -> torch.Tensor:
        local_params = args[n_inputs:]
        handler = module.param_handler
        ctx.module = module
        ctx.param_present = tuple(p is not None for p in local_params)
        # What autograd found for the parameters (False for None); read from the parameters
        # themselves it would cost an attribute access through a tensor subclass each.
        needs = ctx.needs_input_grad
        ctx.param_needs_grad = needs[len(needs) - len(local_params) :]
        ctx.autocast = _autocast_state(args)
        ctx.params = handler.fetch(module, TrainingPhase.FORWARD)
        rec = _trace.ACTIVE  # a traced step records the layer math alone ([Note: trace hooks])
        span = None if rec is None else rec.begin_layer(module, "forward")
        try:
            out = module.forward_callback(ctx, *args[:n_inputs])
        finally:
            if span is not None:
                rec.end(span)
            reuse = handler.reuses_forward_fetch and any(needs)
            ctx.forward_params = ctx.params if reuse else None
            del ctx.params
            handler.release(module, TrainingPhase.FORWARD)
        return out

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        module = ctx.module
        if torch.is_grad_enabled():  # autograd runs backward in grad mode for create_graph only
            raise NotImplementedError(
                f"{type(module).__name__}: a backward with create_graph=True (a gradient "
                "penalty, a Hessian-vector product) through a tiny_fsdp layer: its backward is "
                "written by hand with fetched parameters, so the terms of the second derivative "
                "through the parameters would be lost ([Note: backward for inputs only]). Wrap "
                "the model with DDP, Zero1 or Zero2, or pass registered_layers=False to FSDP / "
                "Zero3: then the model's own modules compute"
            )
        handler = module.param_handler
        needs_grad = ctx.param_needs_grad
        ctx.param_needs_grad = _accumulated_this_backward(ctx, needs_grad)
        kept, ctx.forward_params = ctx.forward_params, None
        described = kept is None and not module.backward_reads_params
        if kept is not None:
            ctx.params = kept
        elif described:  # the values are not read: nothing to fetch or release
            ctx.params = handler.describe(module)
        else:
            ctx.params = handler.fetch(module, TrainingPhase.BACKWARD)
        rec = _trace.ACTIVE
        span = None if rec is None else rec.begin_layer(module, "backward")
        try:
            with _autocast_as_in_forward(ctx.autocast):
                grad_inputs, grad_params = module.backward_callback(ctx, grad_output)
            grad_params = tuple(map(_in_dtype_of, grad_params, ctx.params))
        finally:
            if span is not None:
                rec.end(span)
            del ctx.params
            if not described:
                handler.release(module, TrainingPhase.BACKWARD)
            wanted, ctx.param_needs_grad = ctx.param_needs_grad, needs_grad
        if not any(wanted):  # no parameter gradient goes anywhere: nothing to reduce
            return (None, None, *grad_inputs, *(None for _ in grad_params))
        local_grads = handler.reduce_grads(module, tuple(grad_params))
        return (None, None, *grad_inputs, *local_grads)


def _accumulated_this_backward(ctx: Any, needs_grad: Tuple[bool, ...]) -> Tuple[bool, ...]:
    """Which of the layer's parameters this backward accumulates a gradient into ([Note:
    backward for inputs only]: the others are neither computed nor reduced)."""
    present = ctx.param_present
    # One (node, input index) per tensor argument of forward; the parameters come last.
    edges = ctx.next_functions
    k = len(edges) - sum(present)
    accumulated = []
    for needs, here in zip(needs_grad, present):
        accumulated.append(here and needs and will_run(edges[k][0]))
        k += here  # an absent parameter (None) has no edge
    return tuple(accumulated)


# (device type, enabled, dtype: None when disabled, a dtype that does not apply then)
AutocastState = Optional[Tuple[str, bool, Optional[torch.dtype]]]
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None)  # None: ask the device


def _autocast_state(args: Sequence[Any]) -> AutocastState:
    """The autocast state for the device of the first tensor in ``args`` ([Note: autocast]);
    None where autocast is off on every device (the usual case: a MixedPrecisionPolicy casts
    without it; one query, where the device's state costs a device lookup and two queries on
    every layer call) or does not know the device (``meta``)."""
    if _any_autocast is not None and not _any_autocast():
        return None
    device_type = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
    available = _AUTOCAST_AVAILABLE.get(device_type)
    if available is None:
        available = _AUTOCAST_AVAILABLE[device_type] = torch.amp.is_autocast_available(device_type)
    return _autocast_state_of(device_type) if available else None


_AUTOCAST_AVAILABLE: Dict[str, bool] = {}  # device type -> whether autocast knows it


def _autocast_as_in_forward(state: AutocastState) -> ContextManager:
    """The forward's autocast, where the forward ran under one the backward's caller is not in;
    else the caller's state, as for a torch layer's backward ops ([Note: autocast])."""
    if state is None or not state[1] or _autocast_state_of(state[0]) == state:
        return contextlib.nullcontext()
    device_type, _, dtype = state
    return torch.autocast(device_type, dtype=dtype)


def _autocast_state_of(device_type: str) -> AutocastState:
    if not torch.is_autocast_enabled(device_type):
        return device_type, False, None
    return device_type, True, torch.get_autocast_dtype(device_type)


def _in_dtype_of(
    grad: Optional[torch.Tensor], param: Optional[torch.Tensor]
) -> Optional[torch.Tensor]:
    """``grad`` in the dtype of the full parameter it is the gradient of."""
    if grad is None or param is None or grad.dtype == param.dtype:
        return grad
    return grad.to(param.dtype)


class CallbackModule(nn.Module):
    """Mixin for layer wrappers. Subclasses set ``param_names`` and write the two callbacks.

    Attributes:
        param_names: names of the layer's parameters, in the order of ``ctx.params``.
        param_handler: how parameters are fetched / released / reduced ([Note: param handler]);
            a class default for single-device training, set per instance by a strategy.
        function: the ``autograd.Function`` of this class, created once per subclass.
        backward_reads_params: False where ``backward_callback`` reads only the shape, dtype
            and device of ``ctx.params`` (an embedding's scatter of rows): a strategy may then
            hand it tensors of that description without gathering their values.
    """

    param_names: Tuple[str, ...] = ()
    param_handler: ParamHandler = LOCAL_HANDLER
    backward_reads_params = True
    function: type

    @classmethod
    def implements(cls, module: nn.Module) -> bool:
        """Whether this wrapper computes what ``module`` (an instance of the torch class it
        replaces) computes; ``convert_module`` leaves any other to the generic path. Not when
        a parameter is computed rather than held (``nn.utils.weight_norm`` makes ``weight`` a
        tensor that a forward pre-hook derives from ``weight_g`` / ``weight_v``)."""
        return all(name in module._parameters for name in cls.param_names)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # One Function class per wrapper class: defined once, named after the layer in traces.
        cls.function = type(f"{cls.__name__}Function", (CallbackFunction,), {})

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.function.apply(self, len(inputs), *inputs, *layer_params(self))

    def forward_callback(self, ctx: Any, *inputs: torch.Tensor) -> torch.Tensor:
        """Compute the output from ``inputs`` and ``ctx.params``; save what backward needs."""
        raise NotImplementedError

    def backward_callback(
        self, ctx: Any, grad_output: torch.Tensor
    ) -> Tuple[Tuple[Optional[torch.Tensor], ...], Tuple[Optional[torch.Tensor], ...]]:
        """Return ``(grad_inputs, grad_params)``; ``grad_params`` follows ``param_names``."""
        raise NotImplementedError
