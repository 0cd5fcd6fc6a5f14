"""Parameters read outside their layer's forward: found once, then fetched for the reader.

[Note: outside reads]
Under FSDP / ZeRO-3 a layer's parameter is a *local* tensor (a dim-0 shard, or empty on a rank
that does not own it) except while the layer computes. A module that reads a child's parameter
in its own forward (``F.linear(h, self.wte.weight)`` for a tied head, a parent scaling by a
child's 0-d ``logit_scale``) would compute with the local tensor: a wrong result on FSDP, a
crash on ZeRO-3. So the strategy watches the model's first forward (per ``training`` mode)
with ``OutsideReadWatch``:

- a ``TorchFunctionMode`` sees every torch op; one that consumes a local parameter while no
  wrapper layer is computing and no strategy code runs (``layer.strategy_code``) is a read
  *outside* the layer. The reader is the innermost module whose forward is running (module
  hooks keep the stack during the watch). A local parameter handed to a module call as an
  argument (DeBERTa's encoder passing ``rel_embeddings.weight`` to its LayerNorm) is read by
  the caller: the callee may be a wrapper layer, which the watch does not look into, and in
  later forwards only the caller's swap makes the attribute it reads the full tensor.
- the parameter is added to the reader's ``GenericLayer`` (attached if it has none) as a
  *foreign* ``FullParam``: its owner layer's handler fetches it, it is filled and registered
  at once, and the op runs with the full tensor. From then on the reader's own hooks fetch it
  before every forward and backward of the reader, exactly like its own parameters, and its
  gradient goes through the owner's ``reduce_grads`` into the owner's local parameter.
- while the reader computes, every registration of the parameter (``wte.weight``, and a tied
  ``lm_head.weight`` too) points at the reader's full tensor; the owner's own forward, if it
  runs inside the reader's, sees its local parameter again (a hook on the owner suspends the
  swap for the duration of its forward).

Every rank runs the same model code, so every rank finds the same reads and issues the same
collectives: nothing hangs. Limits: a read that only happens in a later forward with the same
``training`` mode is not seen (data-dependent reads of parameters); reads in backward (a custom
``autograd.Function`` reading a parameter) are not seen. A tied parameter that the watch finds
read outside may not be shared by two layers of one FSDP gather unit.
"""

from typing import Any, Callable, Dict, Iterable, List, Tuple

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from tiny_fsdp.core.module.base import CallbackModule
from tiny_fsdp.core.module.full_param import FullParam
from tiny_fsdp.core.module.generic import reader_layer
from tiny_fsdp.core.module.layer import (
    in_strategy_code,
    is_layer,
    is_swapped,
    local_param,
    swap_in,
    swap_out,
)

Owner = Tuple[nn.Module, int]  # (layer, slot in its param_names)


class OutsideReadWatch:
    """Watches the first forward per ``training`` mode of ``root`` ([Note: outside reads])."""

    def __init__(self, root: nn.Module) -> None:
        self.root = root
        self._seen: set = set()  # training modes already watched
        self.found: List[Tuple[str, str]] = []  # (parameter path, reader path), for messages
        self._names = {id(m): path or "<root>" for path, m in root.named_modules()}

    def __call__(self, forward: Callable[[], Any]) -> Any:
        """Run ``forward()``, watched if this ``training`` mode was never watched."""
        if self.root.training in self._seen:
            return forward()
        self._seen.add(self.root.training)
        return _Watch(self).run(forward)

    # ---------------------------------------------------------------- model facts
    def owners(self) -> Dict[int, Tuple[nn.Parameter, Owner]]:
        """id(local parameter) -> (parameter, its first layer and slot)."""
        found: Dict[int, Tuple[nn.Parameter, Owner]] = {}
        for layer in self.root.modules():
            if is_layer(layer):
                for slot, name in enumerate(layer.param_names):
                    local = local_param(layer, name)
                    if local is not None:
                        found.setdefault(id(local), (local, (layer, slot)))
        return found

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


class _Watch(TorchFunctionMode):
    """One watched forward: a module stack and the op interceptor."""

    def __init__(self, watch: OutsideReadWatch) -> None:
        super().__init__()
        self.watch = watch
        self.owners = watch.owners()
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
            new_args = tuple(self._resolve(a) for a in args)
            new_kwargs = {k: self._resolve(v) for k, v in kwargs.items()}
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
            args = tuple(self._resolve(a) for a in args)
            kwargs = {k: self._resolve(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)

    def _reading(self) -> bool:
        """True while model code of a module that is not a wrapper layer runs."""
        return bool(
            self.stack and not in_strategy_code() and not isinstance(self.stack[-1], CallbackModule)
        )

    def _resolve(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            entry = self.owners.get(id(value))
            return value if entry is None else self._full_for_reader(*entry)
        if type(value) in (list, tuple) and any(isinstance(v, torch.Tensor) for v in value):
            return type(value)(self._resolve(v) for v in value)
        return value

    def _full_for_reader(self, local: nn.Parameter, owner: Owner) -> torch.Tensor:
        """The reader's full tensor of ``local``, added to the reader on first sight."""
        reader = self.stack[-1]
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
