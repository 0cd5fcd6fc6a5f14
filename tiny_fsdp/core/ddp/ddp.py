"""DDP: every rank holds the whole model and the gradients are averaged over ranks in backward.

[Note: DDP backward]
DDP's backward is the shared engine ([Note: bucketed backward]) with ``AllReduceBuckets`` as its
gradient store. At wrap time (and after a change of ``requires_grad``: [Note: trainable set after
wrapping]) the trainable parameters (a tied parameter counts once) are grouped into flat buckets
in reverse order ([Note: gradient bucket layout]); each parameter's ``.grad`` lives in its bucket
slot. A hook divides the gradient by the world size in its slot; a bucket's reduction is one
in-place all-reduce that leaves the averages in ``.grad``.
Without ``enable_async_communication`` every bucket is reduced at the end of backward.

Parameters unused in a forward: the end of backward still sends their slot, so every rank issues
the same collectives. A rank without a gradient sends zeros, so ``param.grad`` becomes the sum of
the other ranks' gradients divided by the world size, exactly the single-device gradient of the
global batch. If NO rank had a gradient, ``param.grad`` stays None (optimizers skip it, as on one
device).

Gradient accumulation: inside ``no_sync()`` autograd keeps accumulating into ``param.grad`` (the
bucket slot) and the next synchronised backward sends the accumulated total. As with ``torch``'s
DDP, a backward after a synchronised one (no ``zero_grad`` between) adds onto the averaged
``param.grad``. The model's modules are used as they are ([Note: replicated strategies]); mixed
precision: [Note: DDP mixed precision].
"""

import weakref
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Joinable

from tiny_fsdp.core import comm
from tiny_fsdp.core.bucketed_backward import BucketedBackward
from tiny_fsdp.core.ddp.bucket import AllReduceBuckets, GradBucket
from tiny_fsdp.core.ddp.comm_hooks import CommHook, Hook, check_one_hook
from tiny_fsdp.core.ddp.join import DDPJoinHook, JoinContext
from tiny_fsdp.core.ddp.mixed_precision import ParamCast
from tiny_fsdp.core.ownership import owner_of
from tiny_fsdp.core.pickling import HookObject, Inert
from tiny_fsdp.core.precision import MixedPrecisionPolicy, owned_model_check
from tiny_fsdp.core.replicated import ReplicatedWrapper, broadcast_module_buffers
from tiny_fsdp.core.sparse_grads import sparse_grad_params
from tiny_fsdp.core.wrap_checks import check_module


def is_ddp_param(tensor: torch.Tensor) -> bool:
    """True if ``tensor`` is a parameter of a live ``DDP``-wrapped module."""
    return isinstance(owner_of(tensor), DDP)


class DDP(ReplicatedWrapper, Joinable):
    """Distributed data parallel: replicate ``module``, average gradients over ranks.

    Args:
        module: any ``nn.Module``, used as it is ([Note: replicated strategies]). Rank 0's
            parameters and buffers are broadcast to every rank at construction.
        bucket_cap_mb: maximum gradient bytes (MiB) per all-reduce bucket.
        enable_async_communication: overlap bucket all-reduces with backward ([Note: bucketed
            backward]); False reduces the same buckets at the end of backward (bitwise the
            same result).
        mixed_precision: the model computes with ``param_dtype`` copies of the fp32 parameters
            and the buckets are of ``reduce_dtype``, so the all-reduced bytes halve with bf16;
            ``param.grad`` stays fp32 ([Note: DDP mixed precision]).
        broadcast_buffers: rank 0's buffers before each forward, as torch's DDP ([Note:
            replicated strategies]).
        device_ids, output_device: as torch's DDP for a module on one GPU: ``[d]``, the device
            the module is on; inputs (tensors inside tuples, lists, dicts) move there before
            forward. Refused for a CPU module, as torch does.
        find_unused_parameters: accepted so torch DDP code runs unchanged; parameters a forward
            did not use are always found (the module docstring), ``True`` or not.
        process_group, gradient_as_bucket_view, static_graph: torch DDP's, accepted so its
            scripts run unchanged. Gradients average over every rank: a ``process_group``
            that leaves ranks out is refused (HSDP: ``FSDP(model, mesh=hsdp_mesh())``). fp32
            gradients are always views of their bucket slots (torch's
            ``gradient_as_bucket_view=True``); the buckets follow each step's graph, static or
            not.

    ``state_dict()`` / ``load_state_dict()`` use the plain model's keys (no ``module.`` prefix).
    Uneven inputs: ``with model.join(): ...`` ([Note: DDP join]).
    """

    keeps_parameter_dtype = True  # [Note: DDP mixed precision]

    def __init__(
        self,
        module: nn.Module,
        bucket_cap_mb: Optional[float] = 25.0,
        enable_async_communication: bool = True,
        mixed_precision: Optional[MixedPrecisionPolicy] = None,
        broadcast_buffers: bool = True,
        *,
        device_ids: Optional[Sequence[Union[int, torch.device]]] = None,
        output_device: Optional[Union[int, torch.device]] = None,
        find_unused_parameters: bool = True,
        process_group: Optional[dist.ProcessGroup] = None,
        gradient_as_bucket_view: bool = True,
        static_graph: bool = False,
    ) -> None:
        _check_every_rank(process_group)
        bucket_cap_mb = 25.0 if bucket_cap_mb is None else bucket_cap_mb  # torch's default
        if not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0:
            raise ValueError(
                f"bucket_cap_mb must be a positive number, got {bucket_cap_mb!r} (torch DDP's "
                "device_ids is a keyword here: DDP(model, device_ids=[rank]))"
            )
        check_module(module, type(self).__name__)  # read below, before the base class checks
        input_device = _input_device(list(module.parameters()), device_ids, output_device)
        super().__init__(module, enable_async_communication, mixed_precision, broadcast_buffers)
        Joinable.__init__(self)
        self._join_hook: Optional[DDPJoinHook] = None
        self.input_device = input_device
        params = list(self.module.parameters())  # deduplicated: a tied parameter appears once
        _broadcast_module_states(self.module, src=0)

        self.bucket_cap_mb = bucket_cap_mb
        self.world_size = dist.get_world_size()
        self._cast: Optional[ParamCast] = None
        self._compute_copy_hooks: List[Any] = []
        self._calls: List[bool] = []  # calls of the inner model in progress: returned yet?
        if self.mixed_precision is not None:
            self._cast = ParamCast(params, self.mixed_precision.param_dtype)
            self._hook_compute_copies()
        self._backward: Optional[BucketedBackward] = None
        self._comm_hook: Optional[CommHook] = None
        self._build_buckets()

    def register_comm_hook(self, state: Any, hook: Hook) -> None:
        """Reduce each gradient bucket with ``hook(state, bucket)``, a communication hook
        written for torch's DDP (``fp16_compress_hook``, PowerSGD, your own), with torch's
        contract ([Note: DDP communication hooks]). Call once, before training."""
        check_one_hook(self._comm_hook, type(self).__name__)
        self._comm_hook = CommHook(state, hook)
        self._backward.store.set_comm_hook(self._comm_hook)

    # ------------------------------------------------------------ uneven inputs

    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> JoinContext:
        """torch DDP's context for uneven inputs: a rank whose data ran out shadows the others'
        collectives until every rank is done ([Note: DDP join]). ``divide_by_initial_world_size``:
        average over every rank (a finished one gives zeros) or over the ranks with data;
        ``throw_on_early_termination``: raise on every rank as soon as one runs out instead."""
        if not divide_by_initial_world_size and self._comm_hook is not None:
            raise ValueError(
                "DDP.join(divide_by_initial_world_size=False) with a communication hook: the "
                "hook divides the gradients itself; keep the default (True)"
            )
        return JoinContext(
            [self],
            enable,
            throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size,
        )

    def join_hook(self, **kwargs: Any) -> DDPJoinHook:
        """torch's ``Joinable`` API: what this rank runs for the model once it has joined."""
        self._join_hook = DDPJoinHook(self, kwargs.get("divide_by_initial_world_size", True))
        return self._join_hook

    @property
    def join_device(self) -> torch.device:
        return next((p.device for p in self.module.parameters()), torch.device("cpu"))

    @property
    def join_process_group(self) -> Any:
        return dist.group.WORLD

    def backward_synchronises(self) -> bool:
        """A backward of the forward now starting reduces gradients."""
        return torch.is_grad_enabled() and self.require_backward_grad_sync and self._trainable

    def set_gradient_divisor(self, divisor: int) -> None:
        """Divide the gradients of the coming backwards by ``divisor`` ([Note: DDP join])."""
        self._backward.store.set_divisor(divisor)

    def reduce_without_gradients(self) -> None:
        """The collectives of a synchronised backward, contributing no gradient."""
        self._backward.reduce_without_gradients()

    def sync_module_states(self, src: int) -> None:
        """Give every rank rank ``src``'s parameters and buffers; the next forward broadcasts
        the buffers on every rank alike (ranks that joined at different iterations saw other
        forwards last)."""
        if self._cast is not None:
            self._cast.to_master()
        _broadcast_module_states(self.module, src)
        self._sync_buffers_before_forward = True

    def _build_buckets(self) -> None:
        """Buckets and backward engine over the trainable parameters and those that had a
        bucket slot before (frozen at wrap time: none; [Note: trainable set after wrapping])."""
        had = self._bucketed_ids()
        members = [p for p in self.module.parameters() if p.requires_grad or id(p) in had]
        self._trainable = bool(members)
        policy = self.mixed_precision
        reduce_dtype = None if policy is None else policy.reduce_dtype
        store = AllReduceBuckets(
            members,
            int(self.bucket_cap_mb * 2**20),
            self.world_size,
            reduce_dtype,
            self._cast,
            sparse=sparse_grad_params(self.module),
        )
        store.set_comm_hook(self._comm_hook)
        self.buckets: List[GradBucket] = store.buckets
        if self._backward is not None:
            self._backward.remove()
        self._backward = BucketedBackward(self, store)

    def after_copy(self) -> None:
        if self._backward is not None:  # its hooks on this copy call the original's engine
            self._backward.remove()
        self._backward = None
        self._build_buckets()
        if self._cast is not None:  # the copied hooks act for the original wrapper only
            self.install_forward_casts()
            self._hook_compute_copies()

    def _hook_compute_copies(self) -> None:
        """Every call of the inner model (through this wrapper, a method of the model,
        ``model.module(x)``) computes with the compute copies ([Note: DDP mixed precision])."""
        for handle in self._compute_copy_hooks:
            handle.remove()
        self._compute_copy_hooks = [
            self.module.register_forward_pre_hook(_ComputeCopies(self, "begin"), prepend=True),
            self.module.register_forward_hook(_ComputeCopies(self, "returned")),
            # always_call: also when the forward raised (then "returned" did not run).
            self.module.register_forward_hook(_ComputeCopies(self, "end"), always_call=True),
        ]

    def _forward_begins(self) -> None:
        self._calls.append(False)
        self._cast.to_compute()  # until the end of backward ([Note: DDP mixed precision])

    def _forward_returned(self) -> None:
        self._calls[-1] = True

    def _forward_ends(self) -> None:
        returned = self._calls.pop() if self._calls else False
        if self._calls:
            return  # the model called itself: the outer call decides
        if not returned:  # the forward raised: no backward follows
            self._cast.to_master(attach_grads=False)
        elif not (torch.is_grad_enabled() and self._trainable):
            self._cast.to_master()  # no backward follows

    def _bucketed_ids(self) -> Set[int]:
        return set() if self._backward is None else {id(p) for p in self._backward.store.params}

    def has_place(self, param: torch.Tensor) -> bool:
        return id(param) in self._bucketed_ids()  # only when requires_grad flags changed

    def take_trainable(self, names: List[str]) -> None:
        self._build_buckets()

    def extra_state_tensors(self) -> Dict[str, Sequence[torch.Tensor]]:
        # Flat all-reduce buckets (gradients / N and one flag per parameter), kept between steps.
        # With fp32 buckets the gradients are views of them: the ledger counts them as grads.
        return {"buffers": [bucket.buffer for bucket in self.buckets]}

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.follow_trainable_set()  # before the compute copies: buckets take master dtypes
        if self._join_config.enable and self._join_hook is not None:
            self._join_hook.begin_iteration()  # inside join(): [Note: DDP join]
        args, kwargs = self.inputs_to_device(args, kwargs)
        return super().forward(*args, **kwargs)  # the inner model's hooks cast the parameters

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        if self._cast is not None:
            self._cast.to_master()  # the fp32 masters, also after a forward without backward
        return super().state_dict(*args, **kwargs)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        if self._cast is not None:
            self._cast.to_master()  # load into the masters, not into the compute copies
        return super().load_state_dict(state_dict, strict, assign)


class _ComputeCopies(HookObject):
    """A forward pre-hook (``"begin"``) or hook (``"returned"``, ``"end"``) of DDP's inner
    model that takes and gives back the compute copies; it acts on that wrapper's model while
    the wrapper lives (held weakly), and pickles as ``Inert`` ([Note: pickling a wrapped
    model])."""

    def __init__(self, wrapper: DDP, when: str) -> None:
        self.applies, self.wrapper = owned_model_check(wrapper), weakref.ref(wrapper)
        self.when = when

    def __call__(self, module: nn.Module, args: Any, output: Any = None) -> None:
        if self.applies(module):
            wrapper = self.wrapper()
            if self.when == "begin":
                wrapper._forward_begins()
            elif self.when == "returned":
                wrapper._forward_returned()
            else:
                wrapper._forward_ends()

    def __reduce__(self) -> Any:
        return Inert, ()


def _input_device(
    params: List[nn.Parameter],
    device_ids: Optional[Sequence[Union[int, torch.device]]],
    output_device: Optional[Union[int, torch.device]],
) -> Optional[torch.device]:
    """The GPU that torch DDP's ``device_ids`` / ``output_device`` name, checked; else None."""
    if not device_ids and output_device is None:
        return None
    named = [_as_device(d) for d in device_ids or []]
    devices = {p.device for p in params}
    if len(named) != 1 or named[0].type != "cuda" or devices != {named[0]}:
        raise ValueError(
            f"DDP: device_ids={list(device_ids or [])} (output_device={output_device}) work only "
            f"for a module on the one GPU they name; the parameters are on "
            f"{sorted(map(str, devices))}. Move the module there first (model.to(device)), or "
            "leave device_ids out for a CPU module, as with torch's DDP"
        )
    if output_device is not None and _as_device(output_device) != named[0]:
        raise ValueError(f"DDP: output_device={output_device} is not device_ids[0]={named[0]}")
    return named[0]


def _as_device(device: Union[int, str, torch.device]) -> torch.device:
    """``torch.device`` of an index (a GPU, as torch DDP reads it), a string or a device."""
    return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)


@torch.no_grad()
def _check_every_rank(group: Optional[dist.ProcessGroup]) -> None:
    """Refuse a ``process_group`` that leaves ranks out: DDP averages over every rank."""
    if group is None or dist.get_world_size(group) == dist.get_world_size():
        return
    raise ValueError(
        f"DDP(process_group=...) with {dist.get_world_size(group)} of "
        f"{dist.get_world_size()} ranks: tiny_fsdp's DDP averages gradients over every rank "
        "(leave process_group out); for replicas of shards across nodes use "
        "FSDP(model, mesh=hsdp_mesh())"
    )


@torch.no_grad()
def _broadcast_module_states(module: nn.Module, src: int) -> None:
    """Give every rank rank ``src``'s parameters and buffers."""
    for param in module.parameters():
        comm.broadcast_into(param.detach(), src=src)
    broadcast_module_buffers(module, src=src)
