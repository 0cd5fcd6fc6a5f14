"""Shared optimizer machinery: param-group normalisation and the step loop.

[Note: one update rule]
Each optimizer's math lives in exactly one plain function that updates a list of tensors in
place, ``rule_(params, grads, states, *, hyper-parameters) -> None`` (see ``sgd_update_`` and
``adamw_update_``). Each line of the rule is one ``torch._foreach_*`` op over the whole list, so
on CUDA a step launches a few kernels per batch of tensors instead of a dozen per tensor (a GPT-2
has ~150 tensors), as torch.optim's default there does (AdamW on the CPU runs torch's fused
kernel instead, one pass for the whole rule: [Note: fused AdamW on the CPU]). The rule is
elementwise and treats each tensor on its own: updating a tensor alone, within any list, or as
slices each with its own state dict gives the same result bit for bit. This is what lets every
data-parallel strategy reuse the same rule and differ only in WHICH tensors it feeds it:

* DDP: the full parameters, after all-reducing their grads;
* ZeRO-1/2: only the parameters (or dim-0 shards of them) this rank owns;
* ZeRO-3 / FSDP: flat fp32 master shards with their reduce-scattered grad shards.

``BaseOptimizer.step`` asks ``_tensors_to_update(group)`` for ``(param, grad, state)`` triples
(a strategy's optimizer overrides only that method) and hands them to the rule in batches
(``update_batches``) of one device and dtype, so CUDA's multi-tensor kernels apply. A batch holds
at most ``UPDATE_BATCH_BYTES`` of parameters (a larger tensor alone), which bounds the rule's
temporaries (AdamW: one denominator per tensor, and a gradient cast to the parameters' dtype) by
``max(UPDATE_BATCH_BYTES, largest tensor)`` each, where ``torch.optim.AdamW``'s foreach step
makes one the size of all its parameters. A batch is large enough that a GPU's time for it
outlasts the host's for issuing its ~10 calls: GPT-2 124M's step (AdamW, fp32 gradients, one
H200, two runs) took 3.9-4.5 ms in 32 MiB batches, 3.2-3.4 in 64, 3.0-3.2 in 128, 3.4 in 256
and 3.8-3.9 in 512 (torch.optim.AdamW's foreach step: 3.8-3.9). On the CPU, where a
``_foreach_*`` op runs the per-tensor kernels one after another, a batch holds at most
``CPU_UPDATE_BATCH_BYTES`` (``batch_limit``): small tensors share a call, large ones go alone.
The rule never modifies a ``grad`` (it may be a communication buffer) and keeps everything it
needs between steps in ``state``, which by default is ``self.state[param]`` so ``state_dict``
round-trips exactly like ``torch.optim``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, Iterator, Optional, Union

import torch
from torch import Tensor

from tiny_fsdp.core.torch_checkpoint import for_torch_checkpoint, refuse_torch_checkpoint

NamedParam = tuple[str, Tensor]
Update = tuple[Tensor, Tensor, dict]  # (param, grad, state) of one tensor the rule updates

#: The most parameter bytes one call of an update rule gets on an accelerator, and on the CPU
#: ([Note: one update rule]; ``batch_limit``).
UPDATE_BATCH_BYTES = 128 * 2**20
CPU_UPDATE_BATCH_BYTES = 512 * 2**10


def batch_limit(device: torch.device) -> int:
    """The most parameter bytes per call of the update rule for tensors on ``device``.

    ``UPDATE_BATCH_BYTES`` on an accelerator. On the CPU a ``torch._foreach_*`` op runs the
    per-tensor kernels one after another, so batching saves only the per-call overhead, which
    counts for small tensors, while a large batch keeps more temporaries alive and out of the
    caches: ``CPU_UPDATE_BATCH_BYTES`` (AdamW's foreach ops, one thread, every tensor alone vs
    512 KiB batches: gpt2_bytes' 52 tensors 4.9 vs 3.1 ms, gpt2_mini's 76.0 vs 76.2 ms; 2 MiB
    batches: 4.0 and 77.2 ms. Its fused kernel, the CPU default for fp32, keeps no temporaries:
    4.7 / 2.3 / 1.9 ms and 17.8 / 16.8 / 16.9 ms).
    """
    return CPU_UPDATE_BATCH_BYTES if device.type == "cpu" else UPDATE_BATCH_BYTES


#: Key of the rank tag in the state dict of an optimizer of one rank's part.
LOCAL_STATE_KEY = "tiny_fsdp_local_state"


def _rank_and_world() -> dict[str, int]:
    from torch import distributed as dist

    if dist.is_available() and dist.is_initialized():
        return {"rank": dist.get_rank(), "world_size": dist.get_world_size()}
    return {"rank": 0, "world_size": 1}


ParamsT = Union[Iterable[Tensor], Iterable[NamedParam], Iterable[dict[str, Any]]]


def _split_names(items: list[Any]) -> tuple[list[Tensor], Optional[list[str]]]:
    """Split ``[Tensor]`` or ``[(name, Tensor)]`` into tensors and names (None if unnamed)."""
    tensors: list[Tensor] = []
    names: list[str] = []
    for item in items:
        if isinstance(item, tuple):
            if len(item) != 2 or not isinstance(item[0], str):
                raise TypeError(f"named params must be (str, Tensor) pairs, got {item!r}")
            names.append(item[0])
            item = item[1]
        if not isinstance(item, Tensor):
            raise TypeError(f"optimizer can only optimize Tensors, got {torch.typename(item)}")
        tensors.append(item)
    if names and len(names) != len(tensors):
        raise ValueError("all params of a group must be given with names, or all without")
    return tensors, (names or None)


def normalize_param_group(group: dict[str, Any], first_index: int = 0) -> dict[str, Any]:
    """Return a copy of ``group`` with ``params`` a list of Tensors and ``param_names`` filled.

    ``group["params"]`` may hold Tensors or ``(name, Tensor)`` pairs (e.g. from
    ``model.named_parameters()``). Unnamed params get ``f"param{i}"`` where ``i`` is their flat
    index across all groups (``first_index`` + position), which matches the integer ids used by
    ``state_dict()``. Idempotent: normalising a normalised group changes nothing.
    """
    if not isinstance(group, dict):
        raise TypeError(f"param_group must be a dict, got {type(group)}")
    params = group["params"]
    if isinstance(params, Tensor):
        params = [params]
    elif isinstance(params, set):
        # Set order differs between runs, which would scramble state_dict ids.
        raise TypeError("params must be an ordered collection, not a set")
    tensors, names = _split_names(list(params))
    given = group.get("param_names")
    if names is not None and given is not None and list(given) != names:
        raise ValueError("params given both as (name, param) pairs and with different param_names")
    if names is None:
        if given is not None:
            names = list(given)
            if len(names) != len(tensors) or not all(isinstance(n, str) for n in names):
                raise ValueError(
                    f"param_names must be {len(tensors)} strings, got {names!r} "
                    f"for {len(tensors)} params"
                )
        else:
            names = [f"param{first_index + i}" for i in range(len(tensors))]
    return {**group, "params": tensors, "param_names": names}


def normalize_param_groups(params: ParamsT) -> list[dict[str, Any]]:
    """Turn any accepted ``params`` form into a list of normalised group dicts.

    Accepted: Tensors, ``(name, Tensor)`` pairs (``model.named_parameters()``), or group dicts
    whose ``params`` are either of those.
    """
    if isinstance(params, Tensor):
        raise TypeError("params should be an iterable of Tensors or dicts, got a single Tensor")
    if isinstance(params, set):
        raise TypeError("params must be an ordered collection, not a set")
    items = list(params)
    if not items:
        raise ValueError("optimizer got an empty parameter list")
    n_dicts = sum(isinstance(item, dict) for item in items)
    if n_dicts == 0:
        items = [{"params": items}]
    elif n_dicts != len(items):
        raise TypeError("params must be all param-group dicts or no dicts at all")
    groups = []
    n_seen = 0
    for group in items:
        groups.append(normalize_param_group(group, first_index=n_seen))
        n_seen += len(groups[-1]["params"])
    return groups


def reject_strategy_params(optimizer: str, group: dict[str, Any]) -> None:
    """Raise ValueError if a parameter of ``group`` belongs to a wrapper whose ranks each update
    only their local part ([Note: ownership tag]): a plain optimizer would update it wrongly."""
    from tiny_fsdp.core.ownership import owner_of

    for name, param in zip(group["param_names"], group["params"]):
        owner = owner_of(param)
        if owner is not None and owner.updates_local_part:
            kind = type(owner).__name__
            article = "an" if kind[0] in "AEFHILMNORSX" else "a"
            raise ValueError(
                f"{optimizer}: parameter '{name}' belongs to {article} {kind}-wrapped model, "
                "whose optimizer updates only this rank's part; use "
                f"{kind}AdamW / {kind}SGD with the wrapped model's parameters"
            )


def update_batches(
    updates: Iterable[Update], limit: Callable[[torch.device], int] = batch_limit
) -> Iterator[tuple[list[Tensor], list[Tensor], list[dict]]]:
    """Group ``(param, grad, state)`` triples into ``(params, grads, states)`` lists, one call of
    an update rule each: the params of a batch share a device and dtype and hold at most
    ``limit(device)`` bytes together (a larger tensor gets a batch of its own)."""
    batches: dict[tuple[torch.device, torch.dtype], tuple[list, list, list]] = {}
    batch_bytes: dict[tuple[torch.device, torch.dtype], int] = {}
    for param, grad, state in updates:
        key = (param.device, param.dtype)
        nbytes = param.numel() * param.element_size()
        if key in batches and batch_bytes[key] + nbytes > limit(param.device):
            yield batches.pop(key)
        if key not in batches:
            batches[key], batch_bytes[key] = ([], [], []), 0
        params, grads, states = batches[key]
        params.append(param)
        grads.append(grad)
        states.append(state)
        batch_bytes[key] += nbytes
    yield from batches.values()


def as_real(tensor: Tensor) -> Tensor:
    """A complex tensor as its real view (..., 2), as torch.optim steps complex parameters;
    any other tensor as it is."""
    return torch.view_as_real(tensor) if tensor.is_complex() else tensor


def sum_of_squares(tensors: list[Tensor]) -> Tensor:
    """Sum of the squares of every element of ``tensors`` (all on one device), a 0-d float32.

    On an accelerator one ``_foreach_norm`` per list (as torch's ``clip_grad_norm_`` there),
    not a square and a sum per tensor. On the CPU a square and a sum per tensor: torch's CPU
    norm kernel accumulates in float32 one element after another (relative error 8e-4 on a 13M
    element gradient, measured) where ``sum`` adds pairwise (3e-8).
    """
    tensors = [as_real(t) for t in tensors]  # |z|^2 = re^2 + im^2
    if tensors[0].device.type == "cpu":
        return torch.stack([t.float().square().sum() for t in tensors]).sum()
    return torch.stack(torch._foreach_norm(tensors, 2.0, dtype=torch.float32)).square().sum()


class BaseOptimizer(torch.optim.Optimizer):
    """``torch.optim.Optimizer`` whose step applies one update rule to batches of tensors.

    Subclasses implement ``_check_hyperparams`` and ``_update_``; strategies that update other
    tensors than ``param`` itself override ``_tensors_to_update``. Every group carries
    ``param_names`` (list of str, same length as ``params``).
    """

    #: True when each rank's ``_tensors_to_update`` yields only its own part of the model
    #: (FSDP shards, ZeRO owned tensors), so a global gradient norm needs a sum over ranks.
    grads_are_sharded: bool = False
    #: True for a strategy's own optimizer, which checks its parameters itself.
    takes_strategy_params: bool = False

    def __init__(self, params: ParamsT, defaults: dict[str, Any]) -> None:
        self._check_hyperparams(defaults)
        self._grad_scale = 1.0  # set by clip_grad_norm_, applied and reset by the next step
        super().__init__(normalize_param_groups(params), defaults)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Scale the next step's gradients so their global L2 norm is at most ``max_norm``.

        Same arithmetic as ``torch.nn.utils.clip_grad_norm_`` on the single-device model:
        ``coef = min(1, max_norm / (norm + 1e-6))``. The norm is taken over exactly the tensors
        the next ``step`` updates, so each parameter (a tied one too) counts once, and summed
        over ranks when they are sharded ([Note: clipping over shards]). Call it on every rank
        after backward and before ``step``; returns the total norm (a 0-d float32 tensor).

        [Note: clipping over shards]
        Every strategy's optimizer yields, across all ranks together, each trainable element
        exactly once (sharded strategies) or every element on every rank (DDP, one device). So
        sum of squares: local, then an all-reduce when ``grads_are_sharded``, over the ranks of
        ``_norm_group()`` (HSDP: one shard group, whose ranks hold each element once; the
        replicas hold the same). Padding rows are zero and do not change the sum.
        """
        grads = [
            grad.detach()
            for group in self.param_groups
            for _, grad, _ in self._tensors_to_update(group)
        ]
        device = grads[0].device if grads else self._default_device()
        total = sum_of_squares(grads) if grads else torch.zeros((), device=device)
        if self.grads_are_sharded:
            from tiny_fsdp.core import comm  # the optimizers import nothing distributed otherwise

            comm.all_reduce(total, group=self._norm_group())
        norm = total.sqrt()
        self._grad_scale = min(1.0, max_norm / (norm.item() + 1e-6))
        return norm

    def _norm_group(self) -> Any:
        """The process group whose ranks together hold each element once (None: all ranks)."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's state dict; when it holds this rank's part only, tagged with the rank.

        [Note: local optimizer state]
        The state of an FSDP or ZeRO-3 optimizer covers this rank's shards or owned tensors
        (``grads_are_sharded``): loaded on another rank, or at another world size, it would
        give every parameter another's moments, silently (the torch DDP habit ``if rank == 0:
        torch.save(optimizer.state_dict(), path)``, then every rank loads the file). So
        ``state_dict()`` records the rank and world size it was taken on, and
        ``load_state_dict`` refuses any other, pointing to one file per rank or to
        ``tiny_fsdp.checkpoint`` (any world size). ZeRO-1/2 optimizers consolidate instead.
        """
        state = super().state_dict()
        if self.grads_are_sharded:
            if for_torch_checkpoint():
                return self._torch_checkpoint_form(state)
            state[LOCAL_STATE_KEY] = _rank_and_world()
        return state

    def _torch_checkpoint_form(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` (this rank's part) as torch's distributed checkpoint must see it to save
        every rank's part; refused where the strategy has no such form ([Note: torch's
        distributed checkpoint])."""
        refuse_torch_checkpoint(type(self).__name__)

    def _from_torch_checkpoint_form(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """``_torch_checkpoint_form``'s inverse: this rank's part, checked."""
        refuse_torch_checkpoint(type(self).__name__)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch.optim's ``load_state_dict``; a state of one rank's part loads on that rank
        only ([Note: local optimizer state]), or comes in the form torch's distributed
        checkpoint loads, which says whose part each tensor is."""
        if self.grads_are_sharded and for_torch_checkpoint():
            state_dict = self._from_torch_checkpoint_form(state_dict)
        elif self.grads_are_sharded:
            saved = state_dict.get(LOCAL_STATE_KEY)
            here = _rank_and_world()
            if saved != here:
                taken = "has no rank tag"
                if saved is not None:
                    taken = f"is rank {saved['rank']}'s part (of {saved['world_size']} ranks)"
                raise ValueError(
                    f"{type(self).__name__}.load_state_dict: the state {taken}; this is rank "
                    f"{here['rank']} (of {here['world_size']}). Each rank's optimizer state is "
                    "its own shards: save state_dict() on every rank (one file per rank) and "
                    "load each rank's own, or use tiny_fsdp.checkpoint.save_checkpoint / "
                    "load_checkpoint (any number of ranks)"
                )
            state_dict = {k: v for k, v in state_dict.items() if k != LOCAL_STATE_KEY}
        super().load_state_dict(state_dict)

    def _default_device(self) -> torch.device:
        for group in self.param_groups:
            for p in group["params"]:
                return p.device
        return torch.device("cpu")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Normalise names, fill defaults, validate hyper-parameters, then register the group."""
        n_existing = sum(len(g["params"]) for g in self.param_groups)
        group = normalize_param_group(param_group, first_index=n_existing)
        if not self.takes_strategy_params:
            reject_strategy_params(type(self).__name__, group)
        for key, value in self.defaults.items():
            group.setdefault(key, value)
        self._check_hyperparams(group)
        super().add_param_group(group)

    def _check_hyperparams(self, hyper: dict[str, Any]) -> None:
        """Raise ValueError (naming the bad value) for invalid hyper-parameters."""

    def _tensors_to_update(self, group: dict[str, Any]) -> Iterator[Update]:
        """Yield ``(tensor, grad, state)`` for every tensor the rule should update in ``group``.

        Default: each parameter with a gradient, its ``.grad`` and ``self.state[param]``.
        """
        for param in group["params"]:
            if param.grad is None:
                continue
            if param.grad.is_sparse:
                raise RuntimeError(
                    f"{type(self).__name__} does not support sparse gradients (an embedding "
                    "built with sparse=True): give those parameters to torch.optim.SparseAdam "
                    "or torch.optim.SGD, or build the embedding with sparse=False"
                )
            yield param, param.grad, self.state[param]

    def _update_(
        self, params: list[Tensor], grads: list[Tensor], states: list[dict], group: dict[str, Any]
    ) -> None:
        """Apply the update rule to a batch of tensors with the hyper-parameters of ``group``."""
        raise NotImplementedError

    def _batch_limit(self, group: dict[str, Any], device: torch.device) -> int:
        """The most parameter bytes per call of the rule for ``group``'s tensors on ``device``."""
        return batch_limit(device)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One optimisation step over all groups; returns ``closure()`` if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        scale, self._grad_scale = self._grad_scale, 1.0
        for group in self.param_groups:
            limit = functools.partial(self._batch_limit, group)
            for params, grads, states in update_batches(self._tensors_to_update(group), limit):
                if scale != 1.0:
                    grads = torch._foreach_mul(grads, scale)
                self._update_(params, grads, states, group)
        return loss
