"""The generic path: a module with parameters but no registered wrapper, forward run once.

[Note: generic layer]
``attach_generic(module)`` makes a module a *layer* ([Note: param handler]) without changing its
class or its ``forward``: ``module.param_names`` lists its direct parameters (those no
descendant also holds: a parameter belongs to the innermost module holding it), and a
``GenericLayer`` hangs on it through module hooks. With the single-device handler
(``LOCAL_HANDLER``) the hooks do nothing: the module computes with its own parameters, as in
plain PyTorch. Under a strategy that fetches (FSDP, ZeRO-3, a mixed precision handler):

- Each parameter the layer computes with has a ``FullParam``: the local parameter (what the
  strategy keeps: full, dim-0 shard, or empty), and one *full* ``nn.Parameter`` object of the
  full shape whose storage is empty (``untyped_storage().resize_(0)``) except while needed.
  The object lives as long as the layer, so every autograd graph that saved it (or a view of
  it) keeps pointing at the same storage.
- pre-forward hook: ``unshard(FORWARD)``: the owner layer's handler fetches, the storage is
  resized and the fetched values copied in through ``.data`` (autograd's version counter does
  not move, so graphs saved earlier stay valid), then the handler releases at once (the copy
  is ours). The module's ``_parameters`` entries are swapped to the full objects (``layer.py``)
  and its ``forward`` runs once, unchanged.
- post-forward hook: the local parameters are registered again; one
  ``register_multi_grad_hook(mode="any")`` over the tensors of the output (tensors, tuples,
  lists, dicts, dataclasses, ``ModelOutput``) runs ``unshard(BACKWARD)`` before the first of
  the module's backward ops; then the storage is freed.
- gradients: autograd accumulates into ``full.grad``; a post-accumulate-grad hook takes it
  (``full.grad = None``). Once every trainable full parameter of the layer has its gradient
  (one accumulation per backward, whatever the number of calls), one
  ``handler.reduce_grads(owner, grads)`` per owner turns them into local gradients, which are
  added into ``local.grad`` in the local dtype (None from the handler: the strategy delivers
  it itself, [Note: param handler]); the storage is then freed. Whatever is left (frozen
  parameters, parameters a forward did not use) is reduced and freed at the end of backward
  (a callback queued on the autograd engine).

Why not re-run the forward in backward (the old fallback) or keep the fetched tensors: the
first costs a second forward and calls modules with side effects (BatchNorm statistics) twice;
the second holds every layer's full parameters from forward to backward.

Cases: a module called twice fetches per call in forward and once in backward (the second
output's hook finds the storage full). Gradient checkpointing (non-reentrant) recomputes the
forward inside backward: the hooks run again on the same full objects; a layer filled by its
backward hook is ``held`` and not freed by the recompute's post-forward. Tied parameters keep
one local object. Mixed precision: the handler fetches ``param_dtype`` tensors, so the full
objects are in that dtype, and gradients are cast back to the local dtype.

A module whose forward returns one of its full parameters (or a view of it) cannot be
handled: the storage is freed right after the forward; ``UnsupportedModuleError`` says what
to do. Parameters read outside their layer's forward are ``outside_reads.py``'s.
"""

import dataclasses
from collections.abc import Mapping
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

from tiny_fsdp.core.module.full_param import FullParam
from tiny_fsdp.core.module.handler import LOCAL_HANDLER, TrainingPhase
from tiny_fsdp.core.module.layer import strategy_code, swap_in, swap_out
from tiny_fsdp.core.utils.weak_hooks import weak_hook

FORWARD, BACKWARD = TrainingPhase.FORWARD, TrainingPhase.BACKWARD

# A module's GenericLayer is its attribute: the layer holds the module (hooks, holders), a cycle
# the collector frees with the model, where a global weak-keyed map, whose values would hold
# their keys, kept every wrapped module alive for good. A deep copy of the module copies it.
_LAYER = "_tiny_fsdp_generic_layer"


class UnsupportedModuleError(TypeError):
    """A module that no tiny_fsdp path can train; the message says what to do."""


class GenericLayer:
    """Hooks and full tensors of one module on the generic path ([Note: generic layer])."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.params: List[FullParam] = []
        self.held = False  # filled by a backward hook: kept full until this backward ends
        self._queued = False  # end-of-backward callback queued
        self._depth = 0  # nested calls of the module's forward
        self._pending: Dict[int, torch.Tensor] = {}  # index in params -> full gradient
        # First: the module's own pre-hooks (nn.utils.weight_norm deriving ``weight`` from
        # ``weight_g`` / ``weight_v``) then read full parameters.
        module.register_forward_pre_hook(self._pre_forward, prepend=True)
        module.register_forward_hook(self._post_forward, always_call=True)

    def add_param(self, name: str, owner: nn.Module, slot: int) -> FullParam:
        """Compute with ``owner``'s parameter at ``slot``, registered where it is now held."""
        param = FullParam(name, owner, slot)
        self.params.append(param)
        return param

    # ---------------------------------------------------------------- state
    @property
    def depth(self) -> int:
        """How many calls of the module's forward are running (0: not computing)."""
        return self._depth

    @property
    def active(self) -> bool:
        """False with single-device handlers: the module then computes with its own params."""
        return any(p.owner.param_handler is not LOCAL_HANDLER for p in self.params)

    def unshard(self, phase: TrainingPhase, params: Optional[List[FullParam]] = None) -> None:
        """Fill the full tensors (default: all not filled yet) from their owners' handlers:
        fetch, copy, release at once (the copy is ours)."""
        if params is None:
            params = [p for p in self.params if not p.is_full]
        by_owner: Dict[int, Tuple[nn.Module, List[FullParam]]] = {}
        for param in params:
            by_owner.setdefault(id(param.owner), (param.owner, []))[1].append(param)
        # The full tensor objects outlive this forward: made under
        # torch.inference_mode() (evaluation first) they would be inference tensors, which a
        # later training forward cannot save for backward. So they are made with it off.
        with strategy_code(), torch.inference_mode(False):
            for owner, members in by_owner.values():
                handler = owner.param_handler
                fetched = handler.fetch(owner, phase)
                try:
                    for param in members:
                        if param.fill(fetched[param.slot]) and param.full.requires_grad:
                            # [Note: tensor hooks hold their owner weakly]
                            hook = weak_hook(self._take_grad, self.params.index(param))
                            param.full.register_post_accumulate_grad_hook(hook)
                finally:
                    del fetched
                    handler.release(owner, phase)

    def reshard(self) -> None:
        for param in self.params:
            param.free()

    def swap_in(self, params: Optional[List[FullParam]] = None) -> None:
        """Point the holders' registrations at the full tensors (default: every parameter)."""
        for param in self.params if params is None else params:
            for holder, attr in param.holders:
                swap_in(holder, attr, param.full)

    def add_while_computing(self, param: FullParam) -> None:
        """``param`` was just added while the module's forward runs: fill and register it now,
        and have the post-forward hook treat this call as one of ours."""
        if self._depth == 0:  # the pre-forward hook did nothing (nothing to fetch then)
            self._depth = 1
            self.unshard(FORWARD)
            self.swap_in()
        else:
            self.unshard(FORWARD, [param])
            self.swap_in([param])

    # ---------------------------------------------------------------- hooks
    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        if not self.active:
            return
        self._depth += 1
        if self._depth > 1:  # the module calls itself: already full and swapped
            return
        if torch._C._current_graph_task_id() == -1:  # not a recomputation inside backward
            self.held = False  # (left over only by a backward that raised)
        if not self.held:  # a forward fetches afresh: the step may have changed them
            self.reshard()
        self.unshard(FORWARD)
        self.swap_in()

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._depth == 0:
            return
        self._depth -= 1
        if self._depth:
            return
        for param in self.params:
            for holder, attr in param.holders:
                swap_out(holder, attr)
        tensors = list(output_tensors(output))
        self._check_no_alias(tensors)
        needing = [t for t in tensors if t.requires_grad]
        if needing and torch.is_grad_enabled():
            torch.autograd.graph.register_multi_grad_hook(needing, self._pre_backward, mode="any")
        if not self.held:
            self.reshard()

    def _pre_backward(self, grad: Optional[torch.Tensor]) -> None:
        if not self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            self._queued = True
        self.held = True
        self.unshard(BACKWARD)

    def _take_grad(self, index: int, full: torch.Tensor) -> None:
        """Post-accumulate-grad hook of parameter ``index``'s full tensor."""
        grad, full.grad = full.grad, None
        if grad is None:
            return
        if grad.is_sparse:  # reduced dense ([Note: sparse gradients])
            grad = grad.to_dense()
        previous = self._pending.get(index)
        self._pending[index] = grad if previous is None else previous + grad
        trainable = [p for p in self.params if p.local.requires_grad]
        if len(self._pending) == len(trainable):
            with strategy_code():
                self._reduce()
            if len(trainable) == len(self.params):  # no frozen tensor still in use
                self.reshard()

    def _finish_backward(self) -> None:
        self._queued = False
        if self._pending:
            with strategy_code():
                self._reduce()
        self.held = False
        self.reshard()

    # ---------------------------------------------------------------- gradients
    def _reduce(self) -> None:
        """One ``reduce_grads`` per owner; local gradients added into ``local.grad``."""
        by_owner: Dict[int, Tuple[nn.Module, List[Tuple[FullParam, torch.Tensor]]]] = {}
        for index, grad in self._pending.items():
            param = self.params[index]
            by_owner.setdefault(id(param.owner), (param.owner, []))[1].append((param, grad))
        self._pending = {}
        for owner, members in by_owner.values():
            grads: List[Optional[torch.Tensor]] = [None] * len(owner.param_names)
            for param, grad in members:
                grads[param.slot] = grad
            reduced = owner.param_handler.reduce_grads(owner, tuple(grads))
            for param, _ in members:
                if reduced[param.slot] is not None:
                    _accumulate(param.local, reduced[param.slot])

    def _check_no_alias(self, tensors: List[torch.Tensor]) -> None:
        storages = {
            p.full.untyped_storage().data_ptr(): p for p in self.params if p.full is not None
        }
        for tensor in tensors:
            param = storages.get(tensor.untyped_storage().data_ptr())
            if param is not None and tensor.untyped_storage().size():
                cls = type(self.module)
                raise UnsupportedModuleError(
                    f"{cls.__module__}.{cls.__qualname__}.forward returns its parameter "
                    f"'{param.name}' (or a view of it). Under FSDP / ZeRO-3 a parameter is only "
                    "full while its module computes, so it cannot leave the forward. Return a "
                    f"computed tensor (e.g. `self.{param.name} * 1`), read it from the parent "
                    "instead, or register a wrapper for this class (docs/extending.md)."
                )


@torch.no_grad()
def _accumulate(local: nn.Parameter, grad: torch.Tensor) -> None:
    """``local.grad += grad`` in the local dtype (a new tensor if there is none yet)."""
    if local.grad is None:
        local.grad = grad.to(local.dtype, copy=True).view(local.shape)
    else:
        local.grad.add_(grad.view(local.shape))


def output_tensors(value: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Tensors in a structured output: tensors, lists, tuples, dicts, dataclasses."""
    if isinstance(value, torch.Tensor):
        yield value
    elif depth > 8 or value is None or isinstance(value, (str, bytes, int, float, bool)):
        return
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from output_tensors(item, depth + 1)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from output_tensors(item, depth + 1)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from output_tensors(getattr(value, f.name, None), depth + 1)


def generic_layer(module: nn.Module) -> Optional[GenericLayer]:
    """The ``GenericLayer`` attached to ``module``, or None."""
    return module.__dict__.get(_LAYER)


def reader_layer(module: nn.Module) -> GenericLayer:
    """The module's ``GenericLayer``, attached (with no parameter yet) if it has none: a module
    reading other layers' parameters in its forward ([Note: outside reads])."""
    layer = generic_layer(module)
    if layer is None:
        layer = module.__dict__[_LAYER] = GenericLayer(module)
    return layer


def own_param_names(module: nn.Module) -> Tuple[str, ...]:
    """Direct parameters of ``module`` that no descendant also holds (innermost holder owns)."""
    inner = {id(p) for child in module.children() for p in child.parameters()}
    return tuple(name for name, p in module.named_parameters(recurse=False) if id(p) not in inner)


def attach_generic(module: nn.Module) -> Optional[GenericLayer]:
    """Make ``module`` a layer on the generic path ([Note: generic layer]); None if it holds no
    parameter of its own. Idempotent."""
    layer = generic_layer(module)
    if layer is not None:
        return layer
    names = own_param_names(module)
    if not names:
        return None
    module.param_names = names
    module.param_handler = LOCAL_HANDLER
    layer = module.__dict__[_LAYER] = GenericLayer(module)
    for slot, name in enumerate(names):
        param = layer.add_param(name, module, slot)
        param.holders = [
            (module, attr) for attr, p in module._parameters.items() if p is param.local
        ]
    return layer
