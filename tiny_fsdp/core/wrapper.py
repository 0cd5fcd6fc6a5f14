"""What every strategy's model wrapper has in common.

A wrapper holds the user's model as ``self.module`` (converted in place to tiny_fsdp layers if
the strategy's class declares ``converts_layers``; DDP and ZeRO-1/2 take it as it is), forwards
calls and the attributes it lacks (``model.generate``) to it, and exposes the switches users
know from PyTorch DDP / FSDP:

- ``require_backward_grad_sync`` (bool, default True) and the ``no_sync()`` context: while
  False, backward accumulates gradients locally and communicates nothing; the next synchronised
  backward reduces the accumulated total.
- ``enable_async_communication`` (bool): overlap communication with computation (prefetch /
  asynchronous reductions; FSDP and ZeRO-3 default to on). Results are identical on and off.
- ``gradient_checkpointing`` (bool): recompute each block in backward (forwarded to the model).
- ``mixed_precision`` (``MixedPrecisionPolicy`` or None): layers compute in the policy's dtype,
  parameters stay fp32 masters ([Note: mixed precision], [Note: DDP mixed precision]); floating
  inputs are cast on entry.
  ``half()`` / ``bfloat16()`` / ``double()`` / ``to(dtype)`` raise and point to the policy
  (``float()`` too, unless it would change nothing).
- Moves: a wrapper's parameters are tied to the strategy's buffers (flat buffers, shards), so
  ``to(device)`` / ``cuda()`` / ``cpu()`` that would replace any tensor raise and say to move
  the model before wrapping (one that changes nothing is a no-op), and ``to_empty()``, which
  would wipe every value (FSDP / ZeRO-3 have already materialised a meta model), raises too.

``state_dict()`` / ``load_state_dict()`` use the plain model's keys and full tensors; they are
written once, here, from what each strategy says it holds ([Note: strategy state]).

[Note: wrap-time checks]
Every strategy runs the same checks, here, before it touches the model; it only declares what it
needs (class attributes): the ``collectives`` it issues on parameters (checked against the
backend and each parameter's device), whether it materialises a model built on ``meta``,
whether it gives each parameter storage of its own (two distinct parameters sharing storage
would be untied), and whether each rank updates only its local part (plain optimizers are then
refused). The checks: the model is a module whose parameters have shapes (no lazy module before
its first forward); a parameter may belong to one live wrapper only ([Note: ownership tag]);
every rank must hold the same model (names, shapes, dtypes), or collectives would pair unrelated
tensors; no embedding may rescale its rows inside the forward ([Note: embeddings with max_norm]
in ``wrap_checks.py``). The wrapper then tags every parameter as its own.
"""

import contextlib
import copy
from collections import OrderedDict
from itertools import chain
from typing import (
    Any,
    Callable,
    Dict,
    Iterator,
    List,
    Mapping,
    NamedTuple,
    Optional,
    Sequence,
    Tuple,
)

import torch
import torch.distributed as dist
from torch import nn

from tiny_fsdp.core import foreign_optimizers
from tiny_fsdp.core.apply_whole import INIT_METHODS, apply_whole, whole_method
from tiny_fsdp.core.clip import HeldGrads, clip_grad_norm_
from tiny_fsdp.core.local_state import LocalPiece, replicated_piece
from tiny_fsdp.core.module import convert_module
from tiny_fsdp.core.ownership import TAG_PREFIX, owner_of, tag_owner
from tiny_fsdp.core.precision import (
    MixedPrecisionPolicy,
    check_master_dtypes,
    low_precision_error,
    register_forward_casts,
)
from tiny_fsdp.core.torch_checkpoint import for_torch_checkpoint
from tiny_fsdp.core.utils.arrival import announce_exit, every_rank_arrives
from tiny_fsdp.core.utils.dist import check_backend_device, require_process_group
from tiny_fsdp.core.utils.lockstep import mark_lockstep
from tiny_fsdp.core.utils.recompute import gradient_checkpointing, set_gradient_checkpointing
from tiny_fsdp.core.wrap_checks import (
    check_module,
    check_no_max_norm_embeddings,
    check_no_shared_storage,
    check_not_wrapped,
    check_same_model_on_all_ranks,
)


class IncompatibleKeys(NamedTuple):
    """What ``load_state_dict(strict=False)`` did not match (as ``torch.nn``'s result)."""

    missing_keys: List[str]
    unexpected_keys: List[str]


_STATE_DICT_FIX = (
    "It gathers the full tensors: call it on every rank, then save on rank 0 only "
    "(sd = model.state_dict(); if rank == 0: torch.save(sd, path)); likewise save_pretrained."
)


class DataParallelWrapper(nn.Module):
    """Base class of ``DDP``, ``Zero1``, ``Zero2``, ``Zero3`` and ``FSDP`` model wrappers.

    A strategy declares what it needs ([Note: wrap-time checks]) and what it holds ([Note:
    strategy state]); the defaults describe a replicated strategy (every rank holds every
    tensor whole).
    """

    #: The strategy fetches parameters through tiny_fsdp layers, so the model is converted in
    #: place (``convert_module``) at wrap time. Strategies that never fetch a parameter
    #: (``ReplicatedWrapper``) train the modules as they are ([Note: replicated strategies]).
    converts_layers: bool = True
    #: Collectives the strategy issues on parameters (checked against backend and devices).
    collectives: Tuple[str, ...] = ("broadcast", "all_reduce")
    #: The strategy initialises a model built on ``meta`` itself.
    materializes_meta: bool = False
    #: The strategy gives every parameter storage of its own (flat buffers, shards).
    separates_storage: bool = False
    #: Each rank updates only its local part: the strategy's own optimizer is required.
    updates_local_part: bool = False
    #: ``full_tensor`` is a collective, so ``state_dict()`` is one that every rank must call.
    gathers_full_tensors: bool = False
    #: What a rank's ``model.parameters()`` are, for another library's optimizer ([Note:
    #: optimizers of other libraries]): "replicas", "flat_buffer", "dim0_shards" or
    #: "owned_tensors".
    local_params: str = "replicas"

    def __init__(
        self,
        module: nn.Module,
        enable_async_communication: bool = False,
        mixed_precision: Optional[MixedPrecisionPolicy] = None,
        registered_layers: bool = True,
    ) -> None:
        require_process_group(type(self).__name__)
        check_module(module, type(self).__name__)
        super().__init__()
        foreign_optimizers.install()
        announce_exit()  # [Note: arrival check]
        if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecisionPolicy):
            raise TypeError(
                f"mixed_precision must be a MixedPrecisionPolicy or None, got {mixed_precision!r}"
            )
        if self.converts_layers:
            module = convert_module(module, registered_layers)
        self.module = module
        self._check_and_claim()
        check_master_dtypes(self.module, mixed_precision)
        self.mixed_precision = mixed_precision
        register_forward_casts(self.module, mixed_precision)  # hooks the inner model
        self.require_backward_grad_sync = True
        self.enable_async_communication = enable_async_communication
        self._local_state_dicts = 0  # > 0 while local_state_dict() runs
        self.register_load_state_dict_pre_hook(_keys_under_module_hook)  # as a submodule
        if self.gathers_full_tensors:  # [Note: the inner model's state dict]
            self.module.register_state_dict_post_hook(_full_tensors_hook)
            self.module.register_load_state_dict_pre_hook(_load_full_tensors_hook)
            self.module.register_load_state_dict_post_hook(_after_load_hook)
            self.module.register_forward_pre_hook(_arrival_hook(type(self).__name__))
            mark_lockstep(self.module)  # [Note: forwards in lockstep]

    def _check_and_claim(self) -> None:
        """[Note: wrap-time checks]; then every parameter is tagged as this wrapper's."""
        what = type(self).__name__
        check_not_wrapped(self.module, what)
        check_no_max_norm_embeddings(self.module, what)
        named = list(self.module.named_parameters())
        check_backend_device(named, what, self.collectives, allow_meta=self.materializes_meta)
        if self.separates_storage:
            check_no_shared_storage(self.module, what)
        check_same_model_on_all_ranks(self.module, what)
        self.claim(param for _, param in named)

    def claim(self, params: Any) -> None:
        """Tag ``params`` as managed by this wrapper (also new objects made at wrap time)."""
        for param in params:
            tag_owner(param, self)

    def __deepcopy__(self, memo: Dict[int, Any]) -> "DataParallelWrapper":
        """An independent wrapped model with copies of what this rank holds (an EMA model,
        ``torch.optim.swa_utils.AveragedModel(model)``, a teacher), on the same ranks.

        [Note: copying a wrapped model]
        ``nn.Parameter``'s own deepcopy drops the attributes the strategies put on parameters
        (FSDP's shard geometry, ZeRO-3's owner table entry), without which the copy cannot
        fetch a full tensor. So each parameter is copied first with them (the geometry is
        immutable: shared; hooks are not copied, as torch does not), then the rest as usual;
        the copies are tagged as the new wrapper's, and the strategy re-attaches what it hooks
        on parameters (``after_copy``). No collective: each rank copies its part; every rank
        must copy (its next forward gathers)."""
        for param in self.module.parameters():
            if id(param) not in memo:
                # Through the storage memo: a view of a flat buffer (ZeRO-1/2) stays one.
                clone = nn.Parameter(copy.deepcopy(param.detach(), memo), param.requires_grad)
                tags = {k: v for k, v in param.__dict__.items() if k.startswith(TAG_PREFIX)}
                clone.__dict__.update(tags)
                memo[id(param)] = clone
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            new.__dict__[key] = copy.deepcopy(value, memo)
        for param in new.module.parameters():
            tag_owner(param, new)
        new.after_copy()
        return new

    def after_copy(self) -> None:
        """This wrapper was just deep-copied from another ([Note: copying a wrapped model]):
        hook its own parameters where the original hooked the original's."""

    def manages(self, tensor: torch.Tensor) -> bool:
        """True if ``tensor`` is a parameter of this wrapper's model."""
        return owner_of(tensor) is self

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def apply(self, fn: Callable[[nn.Module], None]) -> "DataParallelWrapper":
        """torch's ``Module.apply`` (``fn`` on every submodule, children first), with every
        parameter whole, as with FSDP1's ``apply``: initialising after wrapping gives what one
        device gets ([Note: apply with whole parameters]). A collective where the strategy
        splits tensors: call it on every rank, with the same seed."""
        apply_whole(self, fn)
        return self

    def __getattr__(self, name: str) -> Any:
        """An attribute the wrapper lacks is the model's (``model.config``,
        ``model.generate(...)``), as with torch's FSDP; the wrapper's own come first. A method
        of the model that calls the model trains as a call through the wrapper does (the hooks
        are on the model's layers and parameters); one that initialises the parameters
        (``model.init_weights()``: ``INIT_METHODS``) runs with every parameter whole, as
        ``apply`` ([Note: apply with whole parameters])."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None:
                raise
            value = getattr(module, name)
            if name in INIT_METHODS and callable(value):
                return whole_method(self, value, name)
            return value

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally inside the block; the next synced backward reduces them."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """FSDP2's switch for gradient accumulation: False is ``no_sync()`` until set back to
        True. One wrapper holds the whole model, so the switch is for all of it: ``recurse``
        must stay True (FSDP2's False would leave the submodules' own setting)."""
        if not recurse:
            raise ValueError(
                f"{type(self).__name__}.set_requires_gradient_sync(recurse=False): one wrapper "
                "holds the whole model here, with one switch for all of it; call it with "
                "recurse=True (the default)"
            )
        self.require_backward_grad_sync = bool(requires_gradient_sync)

    def register_comm_hook(self, state: Any, hook: Any) -> None:
        """torch DDP's communication hooks: ``DDP`` runs them ([Note: DDP communication
        hooks]); the other strategies reduce by collectives of their own and refuse."""
        raise NotImplementedError(
            f"{type(self).__name__}.register_comm_hook: communication hooks replace DDP's "
            "gradient all-reduce; this strategy reduces its gradients with collectives of its "
            "own. Use DDP for a hook; to halve the gradient traffic here, pass "
            "mixed_precision=MixedPrecisionPolicy(torch.bfloat16) (gradients reduced in bf16)."
        )

    def join(self, *args: Any, **kwargs: Any) -> Any:
        """torch DDP's ``join()`` for uneven inputs: DDP has it ([Note: DDP join]); the other
        strategies raise, with what to do instead."""
        raise NotImplementedError(
            f"{type(self).__name__}.join (torch DDP's uneven-inputs context) is implemented "
            "for DDP only: under this strategy every rank must run the same number of forward "
            "and backward passes, or the ranks wait for each other. Give every rank as many "
            "batches (torch.utils.data.DistributedSampler pads the dataset to a multiple of the "
            "world size; drop_last=True on the DataLoader drops the uneven tail)."
        )

    # ------------------------------------------------------------ what this rank holds
    # [Note: strategy state]. Defaults: a replicated strategy; sharded ones override.

    def full_tensor(self, param: torch.Tensor) -> torch.Tensor:
        """``param``'s full tensor (a collective where it is split: call on every rank)."""
        return param.detach()

    def full_shape(self, param: torch.Tensor) -> Tuple[int, ...]:
        return tuple(param.shape)

    def load_full_(self, param: torch.Tensor, full: torch.Tensor) -> None:
        """Set what this rank holds of ``param`` from its full tensor ``full``."""
        param.detach().copy_(full)

    def checkpoint_part(self, param: torch.Tensor) -> torch.Tensor:
        """``param`` as torch's distributed checkpoint saves it: its full tensor, unless the
        strategy has a DTensor form of its part (FSDP) ([Note: torch's distributed
        checkpoint]). ``load_full_`` takes that form back."""
        return self.full_tensor(param)

    def local_piece(self, param: torch.Tensor) -> Optional[LocalPiece]:
        return LocalPiece(0, param.detach())

    def saved_piece(self, param: torch.Tensor) -> Optional[LocalPiece]:
        return replicated_piece(param, dist.get_rank(), saving=True)

    def held_grads(self, params: Sequence[torch.Tensor]) -> HeldGrads:
        """The gradients of ``params`` (this wrapper's) that this rank holds, for a norm over
        ranks ([Note: clipping with torch's function])."""
        return HeldGrads([p.grad for p in params if p.grad is not None], sharded=False)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of every parameter by their total norm over all ranks (as torch
        FSDP's method; the same as ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)``
        once tiny_fsdp is imported). Call it on every rank; returns the norm."""
        return clip_grad_norm_(self.parameters(), max_norm, norm_type)

    def before_load(self) -> None:
        """Parameters are about to be overwritten: drop what was derived from them."""

    def after_load(self) -> None:
        """Parameters were overwritten: re-derive what depends on them."""

    def extra_state_tensors(self) -> Dict[str, Sequence[torch.Tensor]]:
        """Tensors kept between steps besides ``param.grad`` and optimizer state, by category
        of the memory ledger ([Note: memory ledger])."""
        return {}

    # ------------------------------------------------------------ state dicts

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

    @property
    def gradient_checkpointing(self) -> bool:
        """The model recomputes its blocks in backward (set it: the model's attribute, or a
        HuggingFace model's ``activation_checkpointing_enable``; ``utils/recompute.py``)."""
        return gradient_checkpointing(self.module)

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, value: bool) -> None:
        set_gradient_checkpointing(self.module, value)

    # A wrapper's parameters are fp32 masters tied to the strategy's buffers: casting them in
    # place would silently break both. Mixed precision is a policy, not a cast.
    def half(self) -> "DataParallelWrapper":
        raise low_precision_error(f"{type(self).__name__}.half()")

    def bfloat16(self) -> "DataParallelWrapper":
        raise low_precision_error(f"{type(self).__name__}.bfloat16()")

    def double(self) -> "DataParallelWrapper":
        raise low_precision_error(f"{type(self).__name__}.double()")

    def float(self) -> "DataParallelWrapper":
        # A no-op on fp32 parameters; ZeRO-1/2 under a policy store bf16 views of a flat buffer.
        if any(p.is_floating_point() and p.dtype != torch.float32 for p in self.parameters()):
            raise low_precision_error(f"{type(self).__name__}.float()")
        return self

    def to(self, *args: Any, **kwargs: Any) -> "DataParallelWrapper":
        _, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if dtype is not None:
            raise low_precision_error(f"{type(self).__name__}.to({dtype})")
        return super().to(*args, **kwargs)

    def _apply(self, fn: Any, recurse: bool = True) -> "DataParallelWrapper":
        """``to(device)``, ``cuda()``, ``cpu()``...: allowed only where they change nothing."""
        for name, tensor in [*self.module.named_parameters(), *self.module.named_buffers()]:
            if fn(tensor) is not tensor:
                raise RuntimeError(
                    f"{type(self).__name__}: cannot move or replace '{name}' ({tensor.device}) "
                    "after wrapping: the strategy's buffers hold the parameters. Move the model "
                    "before wrapping it (model.to(device), then wrap)."
                )
        return self

    def to_empty(self, *, device: Any, recurse: bool = True) -> "DataParallelWrapper":
        raise RuntimeError(
            f"{type(self).__name__}.to_empty() would wipe every parameter. A model built on "
            "meta is materialised when FSDP / Zero3 wrap it (by model.init_parameter or the "
            "model's own init, [Note: meta parameters]); load a checkpoint with "
            "load_state_dict(). DDP and ZeRO-1/2 take a real model: to_empty() and initialise "
            "it before wrapping."
        )


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


def _wrapper_of(module: nn.Module) -> Optional[DataParallelWrapper]:
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
    wrapper: "DataParallelWrapper", state_dict: Dict[str, Any], prefix: str, *args: Any
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


_FORWARD_FIX = (
    "Each forward gathers parameters from every rank: evaluate and generate on every rank, with "
    "as many forwards on each (HuggingFace's generate sees to that itself), and print or save "
    "on rank 0 only."
)


def _arrival_hook(kind: str) -> Any:
    """Forward pre-hook of the inner model of a gathering strategy: a forward without gradients
    (evaluation, generation: the torch DDP habit runs them on rank 0 alone) first waits for
    every rank ([Note: arrival check]); training forwards, which every rank runs, skip it."""

    def hook(module: nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled():
            every_rank_arrives(f"{kind} forward without gradients", _FORWARD_FIX)

    return hook
