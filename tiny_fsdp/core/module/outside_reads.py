"""Parameters read outside their layer's forward: found, then fetched for the reader.

[Note: outside reads]
Under FSDP / ZeRO-3 a layer's parameter is a *local* tensor (a dim-0 shard, or empty on a rank
that does not own it) except while the layer computes. A module that reads a child's parameter
in its own forward (``F.linear(h, self.wte.weight)`` for a tied head, a parent scaling by a
child's 0-d ``logit_scale``) would compute with the local tensor: a wrong result on FSDP, a
crash on ZeRO-3. So ``OutsideReadWatch`` watches every forward:

- an op that consumes a local parameter while no wrapper layer is computing and no strategy
  code runs (``layer.strategy_code``) is a read *outside* the layer. The reader is the
  innermost module whose forward is running. The first forward of each ``training`` mode
  runs under a ``TorchFunctionMode`` that sees every op, with module hooks keeping the stack;
  there a local parameter handed to a module call as an argument (DeBERTa's encoder passing
  ``rel_embeddings.weight`` to its LayerNorm) is read by the caller: the callee may be a
  wrapper layer, whose autograd function would take the local tensor as its input, and in
  later forwards only the caller's swap makes the attribute it reads the full tensor.
- a later forward (where a read is one the first did not make: model code that starts reading
  at some step) costs next to nothing: no hook, no mode; for its duration each local parameter's
  class is ``_WatchedParam``, whose ``__torch_function__`` sees only the ops that consume one
  (a wrapper layer's own parameters pass straight through, strategy code too). On a read, the
  running modules are found on the stack of Python frames. A read inside a wrapper layer there
  is a parameter handed to it as an input, too late to resolve: it raises, on every rank
  alike, saying to hand it over in the first forward too.
- the parameter is added to the reader's ``GenericLayer`` (attached if it has none) as a
  *foreign* ``FullParam``: its owner layer's handler fetches it, it is filled and registered
  at once, and the op runs with the full tensor. From then on the reader's own hooks fetch it
  before every forward and backward of the reader, exactly like its own parameters, and its
  gradient goes through the owner's ``reduce_grads`` into the owner's local parameter.
- while the reader computes, every registration of the parameter (``wte.weight``, and a tied
  ``lm_head.weight`` too) points at the reader's full tensor; the owner's own forward, if it
  runs inside the reader's, sees its local parameter again (a hook on the owner suspends the
  swap for the duration of its forward).
- a read of a property only (T5's feed-forward compares its input's dtype with
  ``self.wo.weight.dtype``) fetches nothing: dtype and shape are answered from a storage-free
  stand-in with the full tensor's (the dtype the layer computes in, under mixed precision
  too: fetched once to learn it), device and ``requires_grad`` from the local parameter, in
  every forward, so the reader does not gather the weight a second time.

Every rank runs the same model code, so every rank finds the same reads and issues the same
collectives: nothing hangs. Limits: reads in backward (a custom ``autograd.Function`` reading a
parameter) are not seen; a parameter of a ``Parameter`` subclass keeps its class, so is watched
in the first forward only. A tied parameter that the watch finds read outside may not be shared
by two layers of one FSDP gather unit.
"""

import sys
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from tiny_fsdp.core.module.base import CallbackModule
from tiny_fsdp.core.module.full_param import FullParam
from tiny_fsdp.core.module.handler import TrainingPhase
from tiny_fsdp.core.module.generic import reader_layer
from tiny_fsdp.core.utils.tensor_queries import DTYPE_QUERIES, SHAPE_QUERIES, stand_in
from tiny_fsdp.core.module.layer import (
    in_strategy_code,
    is_layer,
    is_swapped,
    local_param,
    strategy_code,
    swap_in,
    swap_out,
)

Owner = Tuple[nn.Module, int]  # (layer, slot in its param_names)

_CALL_IMPL = nn.Module._call_impl.__code__  # the frame of a module's call, hooks and forward
_T = torch.Tensor
# A read of these properties gets the full tensor's answer, without fetching its values:
_SHAPE_AND_DTYPE = SHAPE_QUERIES | DTYPE_QUERIES
# ... and these are the local parameter's own (the same as the full tensor's).
_AS_LOCAL = {
    _T.device.__get__,
    _T.requires_grad.__get__,
    _T.is_cuda.__get__,
    _T.is_leaf.__get__,
    _T.layout.__get__,
    _T.get_device,
}


class OutsideReadWatch:
    """Watches every forward of ``root`` ([Note: outside reads])."""

    def __init__(self, root: nn.Module) -> None:
        self.root = root
        self._seen: set = set()  # training modes already watched
        self.found: List[Tuple[str, str]] = []  # (parameter path, reader path), for messages
        self._names = {id(m): path or "<root>" for path, m in root.named_modules()}
        self._slots: Optional[List[Tuple[nn.Module, int, str]]] = None  # see owners()
        # id(local parameter) -> (it, its stand_in_of())
        self._stand_ins: Dict[int, Tuple[nn.Parameter, torch.Tensor]] = {}

    def __call__(self, forward: Callable[[], Any]) -> Any:
        """Run ``forward()``: the first of its ``training`` mode with every module watched, a
        later one with only the ops that consume a local parameter looked at."""
        if self.root.training in self._seen:
            return _LaterForward(self).run(forward)
        self._seen.add(self.root.training)
        return _FirstForward(self).run(forward)

    # ---------------------------------------------------------------- model facts
    def owners(self) -> Dict[int, Tuple[nn.Parameter, Owner]]:
        """id(local parameter) -> (parameter, its first layer and slot); looked up at every
        forward (a strategy may replace a local parameter), through the layers listed once."""
        if self._slots is None:  # the layers are fixed once the model is wrapped
            self._slots = [
                (layer, slot, name)
                for layer in self.root.modules()
                if is_layer(layer)
                for slot, name in enumerate(layer.param_names)
            ]
        found: Dict[int, Tuple[nn.Parameter, Owner]] = {}
        for layer, slot, name in self._slots:
            local = local_param(layer, name)
            if local is not None:
                found.setdefault(id(local), (local, (layer, slot)))
        return found

    def stand_in_of(self, local: nn.Parameter, owner: Owner) -> torch.Tensor:
        """A tensor of no storage with the dtype, shape and device ``local``'s layer computes
        with (fetched once: the owner's mixed precision decides the dtype)."""
        kept = self._stand_ins.get(id(local))
        if kept is not None and kept[0] is local:
            return kept[1]
        layer, slot = owner
        with strategy_code(), torch.no_grad(), torch.inference_mode(False):
            fetched = layer.param_handler.fetch(layer, TrainingPhase.FORWARD)
            try:
                full = fetched[slot]
                made = stand_in(full.shape, full.dtype, full.device)
            finally:
                del fetched
                layer.param_handler.release(layer, TrainingPhase.FORWARD)
        self._stand_ins[id(local)] = (local, made)
        return made

    def running_modules(self) -> List[nn.Module]:
        """The modules of ``root`` whose forward is running, innermost first."""
        running, frame = [], sys._getframe(1)
        while frame is not None:
            if frame.f_code is _CALL_IMPL:
                module = frame.f_locals.get("self")
                if id(module) in self._names:
                    running.append(module)
            frame = frame.f_back
        return running

    def holders(self, param: nn.Parameter) -> List[Tuple[nn.Module, str]]:
        return [
            (module, attr)
            for module in self.root.modules()
            for attr, p in module._parameters.items()
            if p is param
        ]

    def param_path(self, param: nn.Parameter) -> str:
        for name, p in self.root.named_parameters(remove_duplicate=False):
            if p is param:
                return name
        return "?"

    def module_path(self, module: nn.Module) -> str:
        return self._names.get(id(module), type(module).__name__)


class _Reads:
    """Resolves a local parameter that model code reads to the reader's full tensor."""

    def __init__(self, watch: OutsideReadWatch) -> None:
        super().__init__()
        self.watch = watch
        self.owners = watch.owners()

    def _resolve(self, value: Any, reader: nn.Module) -> Any:
        if isinstance(value, torch.Tensor):
            entry = self.owners.get(id(value))
            return value if entry is None else self._full_for_reader(reader, *entry)
        if type(value) in (list, tuple) and any(isinstance(v, torch.Tensor) for v in value):
            return type(value)(self._resolve(v, reader) for v in value)
        return value

    def _call(self, func: Callable[..., Any], args: tuple, kwargs: dict, reader: nn.Module) -> Any:
        """``func`` with every local parameter among its arguments resolved for ``reader``;
        a property of the tensor (dtype, shape) is answered without fetching it."""
        if func in _SHAPE_AND_DTYPE and args and id(args[0]) in self.owners:
            return func(self.watch.stand_in_of(*self.owners[id(args[0])]), *args[1:], **kwargs)
        if func in _AS_LOCAL:
            return func(*args, **kwargs)
        args = tuple(self._resolve(a, reader) for a in args)
        kwargs = {k: self._resolve(v, reader) for k, v in kwargs.items()}
        return func(*args, **kwargs)

    def _full_for_reader(
        self, reader: nn.Module, local: nn.Parameter, owner: Owner
    ) -> torch.Tensor:
        """The reader's full tensor of ``local``, added to the reader on first sight."""
        layer = reader_layer(reader)
        for param in layer.params:
            if param.local is local:
                return param.full  # read again in the same forward
        param = FullParam(self.watch.param_path(local), owner[0], owner[1])
        param.holders = self.watch.holders(local)
        layer.params.append(param)
        _suspend_in_owners(param)
        layer.add_while_computing(param)
        self.watch.found.append((param.name, self.watch.module_path(reader)))
        return param.full


class _FirstForward(_Reads, TorchFunctionMode):
    """The first forward of a ``training`` mode: a module stack kept by hooks, every op seen."""

    def __init__(self, watch: OutsideReadWatch) -> None:
        super().__init__(watch)
        self.stack: List[nn.Module] = []

    def run(self, forward: Callable[[], Any]) -> Any:
        handles = []
        for module in self.watch.root.modules():
            handles.append(
                module.register_forward_pre_hook(self._push, prepend=True, with_kwargs=True)
            )
            handles.append(module.register_forward_hook(self._pop, always_call=True))
        try:
            with self:
                return forward()
        finally:
            for handle in handles:
                handle.remove()

    def _push(self, module: nn.Module, args: Any, kwargs: Dict[str, Any]) -> Any:
        # A parameter handed to a module as an argument is read by the caller (DeBERTa's
        # encoder passing ``rel_embeddings.weight`` to its LayerNorm): the caller's full tensor.
        resolved = None
        if self._reading():
            reader = self.stack[-1]
            new_args = tuple(self._resolve(a, reader) for a in args)
            new_kwargs = {k: self._resolve(v, reader) for k, v in kwargs.items()}
            if _changed(args, new_args) or _changed(kwargs.values(), new_kwargs.values()):
                resolved = (new_args, new_kwargs)
        self.stack.append(module)
        return resolved

    def _pop(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.stack and self.stack[-1] is module:
            self.stack.pop()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if self._reading():
            return self._call(func, args, kwargs, self.stack[-1])
        return func(*args, **kwargs)

    def _reading(self) -> bool:
        """True while model code of a module that is not a wrapper layer runs."""
        return bool(
            self.stack and not in_strategy_code() and not isinstance(self.stack[-1], CallbackModule)
        )


class _LaterForward(_Reads):
    """Every later forward: no hook, no mode; each local parameter is a ``_WatchedParam`` for
    the forward's duration, so only ops that consume one are looked at. One outside strategy
    code is a read that started in this forward: the running modules are then found on the
    stack of Python frames (``nn.Module._call_impl``)."""

    def run(self, forward: Callable[[], Any]) -> Any:
        # A subclass of Parameter keeps its class (and is not watched after the first forward).
        watched = [p for p, _ in self.owners.values() if type(p) is nn.Parameter]
        for param in watched:
            param.__class__ = _WatchedParam
            _LATER[id(param)] = self
        try:
            return forward()
        finally:
            for param in watched:
                param.__class__ = nn.Parameter
                _LATER.pop(id(param), None)

    def read(self, func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        running = self.watch.running_modules()
        if not running or isinstance(running[0], CallbackModule):
            if _own(running, args, self.owners):  # a wrapper layer's own parameters
                return func(*args, **kwargs)
            raise RuntimeError(_LATE_INPUT.format(name=self._local_names(args, kwargs)))
        return self._call(func, args, kwargs, running[0])

    def _local_names(self, args: tuple, kwargs: dict) -> str:
        values = [*args, *kwargs.values()]
        return ", ".join(
            self.watch.param_path(v)
            for v in values
            if isinstance(v, torch.Tensor) and id(v) in self.owners
        )


_LATER: Dict[int, _LaterForward] = {}  # id(local parameter) -> the forward watching it now


class _WatchedParam(nn.Parameter):
    """A local parameter while a later forward runs ([Note: outside reads]); ops return plain
    tensors, as on a ``Parameter``."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            if func not in _AS_LOCAL and not in_strategy_code():
                watch = _watcher([*args, *kwargs.values()])
                if watch is not None:
                    return watch.read(func, args, kwargs)
            return func(*args, **kwargs)


def _watcher(values: Iterable[Any]) -> Optional[_LaterForward]:
    """The forward watching a local parameter among ``values`` (tensors, lists, tuples)."""
    for value in values:
        if isinstance(value, torch.Tensor):
            watch = _LATER.get(id(value))
        elif type(value) in (list, tuple):
            watch = _watcher(value)
        else:
            continue
        if watch is not None:
            return watch
    return None


_LATE_INPUT = (
    "tiny_fsdp: parameter {name} was handed to a layer as an input in a forward after the first "
    "of this training mode; it was not handed over in the first one, where such reads are found "
    "and fetched in full for the module that reads them ([Note: outside reads]). A rank holds "
    "only its part of it here, so the layer would compute with that part: read it in the first "
    "forward too (in training and in eval mode), or wrap with DDP / Zero1 / Zero2"
)


def _own(running: List[nn.Module], args: tuple, owners: Dict[int, Any]) -> bool:
    """Whether every local parameter in ``args`` is one of the innermost layer's own."""
    if not running:
        return False
    layer = running[0]
    own = {id(local_param(layer, name)) for name in layer.param_names}
    return all(id(a) in own for a in args if isinstance(a, torch.Tensor) and id(a) in owners)


def _changed(before: Iterable[Any], after: Iterable[Any]) -> bool:
    return any(a is not b for a, b in zip(before, after))


def _suspend_in_owners(param: FullParam) -> None:
    """Let every layer holding ``param`` compute with its local parameter even while a reader
    has the registration swapped (hooks on the holder, around its own hooks)."""
    for holder, attr in param.holders:
        if not is_layer(holder):
            continue
        stash: List[bool] = []

        def suspend(module: nn.Module, args: Any, attr: str = attr, stash: list = stash) -> None:
            swapped = is_swapped(module, attr) and module._parameters[attr] is param.full
            stash.append(swapped)
            if swapped:
                swap_out(module, attr)

        def resume(
            module: nn.Module, args: Any, output: Any, attr: str = attr, stash: list = stash
        ) -> None:
            if stash and stash.pop():
                swap_in(module, attr, param.full)

        holder.register_forward_pre_hook(suspend, prepend=True)
        holder.register_forward_hook(resume, always_call=True)
