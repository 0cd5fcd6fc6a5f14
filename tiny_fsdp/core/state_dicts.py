"""A wrapper's state dicts: the plain model's keys and full tensors, from what a rank holds.

``state_dict()`` / ``load_state_dict()`` of every strategy's wrapper are written once, here,
from what the strategy says it holds ([Note: strategy state]): ``manages``, ``full_tensor``,
``full_shape``, ``load_full_``, ``checkpoint_part``, ``before_load`` / ``after_load`` and
``gathers_full_tensors``, all of ``DataParallelWrapper`` (``wrapper.py``). The inner model's
own ``state_dict()`` is made the same full one by hooks ([Note: the inner model's state
dict]); torch's distributed checkpoint sees the plain model's keys ([Note: torch's distributed
checkpoint]).
"""

from collections import OrderedDict
from itertools import chain
from typing import Any, Dict, Iterator, List, Mapping, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from tiny_fsdp.core.ownership import owner_of
from tiny_fsdp.core.torch_checkpoint import for_torch_checkpoint
from tiny_fsdp.core.utils.arrival import every_rank_arrives


class IncompatibleKeys(NamedTuple):
    """What ``load_state_dict(strict=False)`` did not match (as ``torch.nn``'s result)."""

    missing_keys: List[str]
    unexpected_keys: List[str]


_STATE_DICT_FIX = (
    "It gathers the full tensors: call it on every rank, then save on rank 0 only "
    "(sd = model.state_dict(); if rank == 0: torch.save(sd, path)); likewise save_pretrained."
)


class FullStateDicts:
    """The state-dict methods of ``DataParallelWrapper`` (mixed in before ``nn.Module``)."""

    def install_state_dict_hooks(self) -> None:
        """Called once by the wrapper's ``__init__``, with ``self.module`` set."""
        self._local_state_dicts = 0  # > 0 while local_state_dict() runs
        self.register_load_state_dict_pre_hook(_keys_under_module_hook)  # as a submodule
        if self.gathers_full_tensors:  # [Note: the inner model's state dict]
            self.module.register_state_dict_post_hook(_full_tensors_hook)
            self.module.register_load_state_dict_pre_hook(_load_full_tensors_hook)
            self.module.register_load_state_dict_post_hook(_after_load_hook)

    def state_dict(
        self, *, destination: Optional[Dict] = None, prefix: str = "", keep_vars: bool = False
    ) -> Dict[str, Any]:
        """Full tensors under the plain model's keys (tied keys included). Call on every rank:
        a strategy that splits tensors gathers them, after every rank has arrived ([Note:
        arrival check])."""
        entries = self.local_state_dict(keep_vars=keep_vars)
        if self.gathers_full_tensors:
            every_rank_arrives(f"{type(self).__name__}.state_dict()", _STATE_DICT_FIX)
            self._make_full_(entries, "", keep_vars)
        out = OrderedDict() if destination is None else destination
        for key, value in entries.items():
            out[prefix + key] = value
        return out

    def top_level_names(self) -> List[str]:
        """The first components of ``state_dict()``'s keys: the model's children, parameters
        and buffers (its keys are the plain model's, without ``module.``)."""
        inner = self.module
        named = chain(
            inner.named_children(),
            inner.named_parameters(recurse=False),
            inner.named_buffers(recurse=False),
        )
        return [name for name, _ in named]

    def _fqn_modifiers(self) -> Dict[str, str]:
        """torch's distributed checkpoint's contract for a module whose state-dict keys skip a
        child: every top-level name of ``state_dict()`` lives under ``module`` ([Note: torch's
        distributed checkpoint])."""
        return {name: "module" for name in self.top_level_names()}

    def named_modules(
        self, memo: Optional[set] = None, prefix: str = "", remove_duplicate: bool = True
    ) -> Iterator[Tuple[str, nn.Module]]:
        """``nn.Module``'s (the model's modules under ``module.``, as torch DDP's), except for
        torch's distributed checkpoint, which names parameters by the plain model's keys as it
        does under torch DDP and FSDP2: there the model's modules come under the wrapper's own
        prefix, so ``named_parameters()`` says ``a.weight``, also from a ``torch.compile``
        module around the wrapper ([Note: torch's distributed checkpoint])."""
        if not for_torch_checkpoint():
            yield from super().named_modules(memo, prefix, remove_duplicate)
            return
        memo = set() if memo is None else memo
        if self in memo:
            return
        if remove_duplicate:
            memo.add(self)
        yield prefix, self
        yield from self.module.named_modules(memo, prefix, remove_duplicate)

    def local_state_dict(self, keep_vars: bool = False) -> Dict[str, Any]:
        """The inner model's own state dict: what this rank holds (shards, owned tensors)."""
        self._local_state_dicts += 1
        try:
            return self.module.state_dict(keep_vars=keep_vars)
        finally:
            self._local_state_dicts -= 1

    def managed_entries(self) -> List[Tuple[str, nn.Parameter]]:
        """(state-dict key, parameter) of the inner model's parameters this strategy holds
        parts of, in state-dict order (the same on every rank). Keys, not parameter names: a
        module's state-dict hooks may rename them (torch's ``checkpoint_wrapper`` drops its
        ``_checkpoint_wrapped_module.``); a tied parameter appears under each of its keys."""
        return [
            (key, value)
            for key, value in self.local_state_dict(keep_vars=True).items()
            if isinstance(value, nn.Parameter) and self.manages(value)
        ]

    def _make_full_(self, entries: Dict[str, Any], prefix: str, keep_vars: bool) -> None:
        """Replace, in place, the entries of the parameters this strategy splits (keys
        ``prefix`` + ``managed_entries``' keys) by their full tensors: collectives, in
        state-dict order on every rank; a tied parameter is gathered once. For torch's
        distributed checkpoint, by ``checkpoint_part`` (FSDP: this rank's rows, no gather)."""
        full: Dict[int, torch.Tensor] = {}
        parts = for_torch_checkpoint()  # DCP saves each rank's part: [Note: torch's ...]
        for key, param in self.managed_entries():
            key = prefix + key
            if key not in entries:
                continue
            if id(param) not in full:
                tensor = self.checkpoint_part(param) if parts else self.full_tensor(param)
                full[id(param)] = param if keep_vars and tensor is param else tensor
            entries[key] = full[id(param)]

    @torch.no_grad()
    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> IncompatibleKeys:
        """Load full tensors under the plain model's keys (the same dict on every rank); each
        rank keeps what it holds of every tensor. A state dict saved from torch's
        ``DistributedDataParallel`` (every key ``module.``-prefixed) loads as well."""
        what = type(self).__name__
        if assign:
            raise _assign_error(what)
        own = self.local_state_dict(keep_vars=True)
        state_dict = _without_ddp_prefix(state_dict, own)
        missing = [key for key in own if key not in state_dict]
        unexpected = [key for key in state_dict if key not in own]
        if strict and (missing or unexpected):
            raise RuntimeError(
                f"{what}.load_state_dict: missing keys {missing}, unexpected keys {unexpected}. "
                f"Keys are the plain model's (e.g. {next(iter(own), '')!r}), without 'module.'."
            )
        for key, target in own.items():
            if key in state_dict and torch.is_tensor(target):
                expected = self.full_shape(target) if self.manages(target) else target.shape
                if tuple(state_dict[key].shape) != tuple(expected):
                    raise RuntimeError(
                        f"{what}.load_state_dict: size mismatch for {key}: shape "
                        f"{tuple(state_dict[key].shape)} in the state dict, {tuple(expected)} "
                        "in the model"
                    )
        self.before_load()
        for key, target in own.items():
            if key not in state_dict:
                continue
            source = state_dict[key]
            if not torch.is_tensor(target):
                continue
            source = source.to(target.device, target.dtype)
            if self.manages(target):
                self.load_full_(target, source)
            else:
                target.copy_(source)
        self.after_load()
        return IncompatibleKeys(missing, unexpected)

    def save_pretrained(self, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
        """A HuggingFace model's ``save_pretrained``, given the full tensors (its own
        ``state_dict()`` would hold shards under FSDP / ZeRO-3). The state dict gathers there,
        so every rank calls it; rank 0 writes."""
        save = self.module.save_pretrained  # AttributeError for a model that has none
        kwargs.setdefault("state_dict", self.state_dict())
        kwargs["is_main_process"] = kwargs.get("is_main_process", True) and dist.get_rank() == 0
        return save(save_directory, *args, **kwargs)


def _without_ddp_prefix(state_dict: Mapping[str, Any], own: Mapping[str, Any]) -> Mapping[str, Any]:
    """``state_dict`` with torch DDP's ``module.`` prefix taken off its keys, when every key
    has it and no key of the model does (torch's ``consume_prefix_in_state_dict_if_present``)."""
    prefix = "module."
    if not state_dict or not all(key.startswith(prefix) for key in state_dict):
        return state_dict
    if any(key.startswith(prefix) for key in own):
        return state_dict
    return OrderedDict((key[len(prefix) :], value) for key, value in state_dict.items())


def _assign_error(what: str) -> ValueError:
    # New parameter objects would lose the strategy's hooks, views and shards.
    return ValueError(
        f"{what}.load_state_dict does not support assign=True: the parameters are real from "
        "wrap time on (a meta model is materialised then), so leave assign out and the values "
        "are copied into them"
    )


def _wrapper_of(module: nn.Module) -> Optional[FullStateDicts]:
    """The live wrapper whose inner model ``module`` is, found through its parameters' owner
    tags (so the hooks below serve a copy of the wrapper too: [Note: copying a wrapped
    model]); None for a module no wrapper holds (a copy of the inner model alone)."""
    for param in module.parameters():
        owner = owner_of(param)
        return owner if owner is not None and owner.module is module else None
    return None


def _full_tensors_hook(
    module: nn.Module, state_dict: Dict[str, Any], prefix: str, metadata: Any
) -> None:
    """State-dict post-hook of the inner model of a gathering strategy.

    [Note: the inner model's state dict]
    torch DDP code saves ``model.module.state_dict()`` (keys without ``module.``). Under FSDP
    and ZeRO-3 the inner model's parameters are this rank's shards or owned tensors, so that
    dict would hold pieces, found only when the checkpoint fails to load. This hook makes it
    the same full state dict as the wrapper's (after the arrival check: a collective that every
    rank calls). The strategy's own reads of what a rank holds go through
    ``local_state_dict()``, which the hook leaves alone, as it leaves a copy of the inner model
    alone. Loading is the mirror: ``model.module.load_state_dict`` of full tensors keeps what
    this rank holds of each (a pre-hook loads it and leaves torch a copy of the parameter onto
    itself), then the strategy re-derives what depends on them.
    """
    wrapper = _wrapper_of(module)
    if wrapper is None or wrapper._local_state_dicts:
        return
    what = f"model.module.state_dict() of a {type(wrapper).__name__} model"
    every_rank_arrives(what, _STATE_DICT_FIX)
    wrapper._make_full_(state_dict, prefix, keep_vars=False)


def _keys_under_module_hook(
    wrapper: "FullStateDicts", state_dict: Dict[str, Any], prefix: str, *args: Any
) -> None:
    """Load-state-dict pre-hook of a wrapper loaded as a submodule (of ``torch.compile``'s
    module, of a container): the state dict its ``state_dict()`` wrote has the plain model's
    keys under ``prefix``, where torch's recursion looks for them under ``prefix + "module."``;
    a key already there (torch DDP's layout) stays. Loading the wrapper itself
    (``load_state_dict``) does not come here."""
    top = set(wrapper.top_level_names())
    for key in [k for k in state_dict if k.startswith(prefix)]:
        rest = key[len(prefix) :]
        if rest.split(".", 1)[0] in top:
            state_dict[f"{prefix}module.{rest}"] = state_dict.pop(key)


@torch.no_grad()
def _load_full_tensors_hook(
    module: nn.Module,
    state_dict: Dict[str, Any],
    prefix: str,
    metadata: Any,
    strict: bool,
    missing: List[str],
    unexpected: List[str],
    error_msgs: List[str],
) -> None:
    """Load-state-dict pre-hook of the inner model of a gathering strategy ([Note: the inner
    model's state dict]): each full tensor goes into what this rank holds of it."""
    wrapper = _wrapper_of(module)
    if wrapper is None:
        return
    if (metadata or {}).get("assign_to_params_buffers", False):
        raise _assign_error(f"model.module of a {type(wrapper).__name__} model")
    wrapper.before_load()
    for key, param in wrapper.managed_entries():
        key = prefix + key
        if key not in state_dict:
            continue
        source, full_shape = state_dict[key], tuple(wrapper.full_shape(param))
        if tuple(source.shape) != full_shape:
            error_msgs.append(
                f"size mismatch for {key}: copying a param with shape {source.shape} from "
                f"checkpoint, the shape in current model is {torch.Size(full_shape)}."
            )
        else:
            wrapper.load_full_(param, source.to(param.device, param.dtype))
        state_dict[key] = param.detach()  # torch's own copy is then onto itself


def _after_load_hook(module: nn.Module, incompatible_keys: Any) -> None:
    wrapper = _wrapper_of(module)
    if wrapper is not None:
        wrapper.after_load()
