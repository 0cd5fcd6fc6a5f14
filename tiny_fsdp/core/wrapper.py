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
- ``mixed_precision`` (``MixedPrecisionPolicy`` or None; FSDP2's policy is taken as well): layers
  compute in the policy's dtype, parameters stay fp32 masters ([Note: mixed precision], [Note:
  DDP mixed precision]); floating inputs are cast on entry.
  ``half()`` / ``bfloat16()`` / ``double()`` / ``to(dtype)`` raise and point to the policy
  (``float()`` too, unless it would change nothing).
- Moves: a wrapper's parameters are tied to the strategy's buffers (flat buffers, shards), so
  ``to(device)`` / ``cuda()`` / ``cpu()`` that would replace any tensor raise and say to move
  the model before wrapping (one that changes nothing is a no-op), and ``to_empty()``, which
  would wipe every value (FSDP / ZeRO-3 have already materialised a meta model), raises too.

``state_dict()`` / ``load_state_dict()`` use the plain model's keys and full tensors; they are
written once, in ``state_dicts.py``, from what each strategy says it holds ([Note: strategy
state]).

[Note: wrap-time checks]
Every strategy runs the same checks, here, before it touches the model; it only declares what it
needs (class attributes): whether it materialises a model built on ``meta`` (each parameter's
device is checked against the backend),
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
from typing import (
    Any,
    Callable,
    Dict,
    Iterator,
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
from tiny_fsdp.core.count_methods import COUNT_METHODS, full_shape_method
from tiny_fsdp.core.local_state import LocalPiece, replicated_piece
from tiny_fsdp.core.module import convert_module
from tiny_fsdp.core.ownership import TAG_PREFIX, owner_of, tag_owner
from tiny_fsdp.core.pickling import HookObject, refuse_pickling
from tiny_fsdp.core.precision import (
    MixedPrecisionPolicy,
    as_policy,
    check_master_dtypes,
    low_precision_error,
    register_forward_casts,
)
from tiny_fsdp.core.state_dicts import FullStateDicts
from tiny_fsdp.core.utils.arrival import announce_exit, every_rank_arrives
from tiny_fsdp.core.utils.dist import check_backend_device, require_process_group
from tiny_fsdp.core.utils.lockstep import mark_lockstep
from tiny_fsdp.core.utils.recompute import gradient_checkpointing, set_gradient_checkpointing
from tiny_fsdp.core.utils.tree import map_tensors
from tiny_fsdp.core.wrap_checks import (
    check_module,
    check_no_max_norm_embeddings,
    check_no_shared_storage,
    check_not_wrapped,
    check_same_model_on_all_ranks,
)


class DataParallelWrapper(FullStateDicts, nn.Module):
    """Base class of ``DDP``, ``Zero1``, ``Zero2``, ``Zero3`` and ``FSDP`` model wrappers.

    A strategy declares what it needs ([Note: wrap-time checks]) and what it holds ([Note:
    strategy state]); the defaults describe a replicated strategy (every rank holds every
    tensor whole).
    """

    #: The strategy fetches parameters through tiny_fsdp layers, so the model is converted in
    #: place (``convert_module``) at wrap time. Strategies that never fetch a parameter
    #: (``ReplicatedWrapper``) train the modules as they are ([Note: replicated strategies]).
    converts_layers: bool = True
    #: The strategy initialises a model built on ``meta`` itself.
    materializes_meta: bool = False
    #: The strategy gives every parameter storage of its own (flat buffers, shards).
    separates_storage: bool = False
    #: The parameters keep their dtype under a mixed-precision policy (DDP casts them per
    #: forward): the policy is the wrapper's, and a copy of the model computes as stored.
    keeps_parameter_dtype: bool = False
    #: Each rank updates only its local part: the strategy's own optimizer is required.
    updates_local_part: bool = False
    #: ``full_tensor`` is a collective, so ``state_dict()`` is one that every rank must call.
    gathers_full_tensors: bool = False
    #: What a rank's ``model.parameters()`` are, for another library's optimizer ([Note:
    #: optimizers of other libraries]): "replicas", "flat_buffer", "dim0_shards" or
    #: "owned_tensors".
    local_params: str = "replicas"
    #: Where the forward moves the tensors it is given (None: where they are): DDP's
    #: ``device_ids``, the GPU FSDP's and ZeRO-3's layers compute on (as FSDP2's root).
    input_device: Optional[torch.device] = None

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
        mixed_precision = as_policy(mixed_precision)  # the subclasses read self.mixed_precision
        if self.converts_layers:
            module = convert_module(module, registered_layers)
        self.module = module
        self._check_and_claim()
        check_master_dtypes(self.module, mixed_precision)
        self.mixed_precision = mixed_precision
        self.install_forward_casts()  # hooks the inner model
        self.require_backward_grad_sync = True
        self.enable_async_communication = enable_async_communication
        self.install_state_dict_hooks()  # state_dicts.py
        if self.gathers_full_tensors:
            self.module.register_forward_pre_hook(_ArrivalCheck(type(self).__name__))
            mark_lockstep(self.module)  # [Note: forwards in lockstep]

    def install_forward_casts(self) -> None:
        """The policy's input and output casts on the inner model ([Note: mixed precision])."""
        owner = self if self.keeps_parameter_dtype else None
        register_forward_casts(self.module, self.mixed_precision, owner)

    def _check_and_claim(self) -> None:
        """[Note: wrap-time checks]; then every parameter is tagged as this wrapper's."""
        what = type(self).__name__
        check_not_wrapped(self.module, what)
        check_no_max_norm_embeddings(self.module, what)
        named = list(self.module.named_parameters())
        check_backend_device(named, what, allow_meta=self.materializes_meta)
        if self.separates_storage:
            check_no_shared_storage(self.module, what)
        check_same_model_on_all_ranks(self.module, what)
        self.claim(param for _, param in named)

    def inputs_to_device(self, args: tuple, kwargs: dict) -> Tuple[tuple, dict]:
        """``args`` / ``kwargs`` with every tensor (also inside containers) on
        ``input_device``, or as they are if it is None."""
        device = self.input_device
        if device is None:
            return args, kwargs
        return map_tensors((args, kwargs), lambda t: t.to(device, non_blocking=True))

    def claim(self, params: Any, changed: Optional[bool] = None) -> None:
        """Tag ``params`` as managed by this wrapper (also new objects made at wrap time);
        ``changed``: the strategy has given them storage of its own (flat buffer views, shards),
        so the model stays refused once this wrapper is gone (None: as their tags say;
        [Note: ownership tag])."""
        for param in params:
            tag_owner(param, self, changed)

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

    def __reduce_ex__(self, protocol: Any) -> Any:
        # [Note: pickling a wrapped model]
        refuse_pickling(
            type(self).__name__, whole=True, module_is_plain=not self.gathers_full_tensors
        )

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
        ``apply`` ([Note: apply with whole parameters]); one that counts them
        (``model.num_parameters()``: ``COUNT_METHODS``) sees full shapes ([Note: counting
        methods])."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None:
                raise
            value = getattr(module, name)
            if name in INIT_METHODS and callable(value):
                return whole_method(self, value, name)
            if name in COUNT_METHODS and callable(value):
                return full_shape_method(self, value)  # [Note: counting methods]
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


_FORWARD_FIX = (
    "Each forward gathers parameters from every rank: evaluate and generate on every rank, with "
    "as many forwards on each (HuggingFace's generate sees to that itself), and print or save "
    "on rank 0 only."
)


class _ArrivalCheck(HookObject):
    """Forward pre-hook of the inner model of a gathering strategy: a forward without gradients
    (evaluation, generation: the torch DDP habit runs them on rank 0 alone) first waits for
    every rank ([Note: arrival check]); training forwards, which every rank runs, skip it."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __call__(self, module: nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled():
            every_rank_arrives(f"{self.kind} forward without gradients", _FORWARD_FIX)

    def __reduce__(self) -> Any:
        refuse_pickling(self.kind)  # [Note: pickling a wrapped model]
