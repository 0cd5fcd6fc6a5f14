"""Optimizers that are not tiny_fsdp's (``torch.optim``, other libraries) on a wrapped model.

[Note: optimizers of other libraries]
A rank's ``model.parameters()`` are what it holds ([Note: strategy state]); a wrapper says which
by its ``local_params``. Whether another library's optimizer steps them right depends on how its
update rule reads them:

- ``"replicas"`` (DDP): full tensors with averaged gradients: any optimizer is right.
- ``"flat_buffer"`` (ZeRO-1/2): the reduced gradients live in the wrapper's store, so only the
  strategy's own optimizers can step: refused, naming ``Zero1Optimizer(...,
  optimizer_class=...)``, which steps this rank's share with a torch.optim class's rule
  ([Note: torch.optim rules on pieces]).
- ``"dim0_shards"`` (FSDP): a rule that works element by element (``ELEMENTWISE``:
  torch.optim's SGD, Adam, AdamW, ...) steps a shard as it would the shard's rows of the full
  tensor. A rule that reads a whole tensor (``PER_TENSOR``: Adafactor's column statistics,
  Muon's orthogonalisation) or all parameters at once (``ACROSS_TENSORS``: LBFGS's dot
  products) would see only this rank's rows and train wrong, silently: refused, naming ZeRO-3
  (whole tensors) or DDP.
- ``"owned_tensors"`` (ZeRO-3): whole tensors on their owner, an empty placeholder elsewhere:
  element-wise and per-tensor rules are right; across-tensor ones are refused. (Muon's own
  constructor refuses a placeholder, which is 1-D: give it this rank's tensors,
  ``[p for p in model.parameters() if p.numel()]``.)

Under torch's distributed checkpoint a shard's state must be a DTensor (FSDP) and ZeRO-3's
has no such form ([Note: torch's distributed checkpoint]): the check also puts state-dict hooks
on the optimizer that give, or refuse, that form.

torch.optim's classes are known (``rule_kind``; exact classes: a subclass may change the
rule). Another class steps with a warning, once per class and strategy, saying which rules are
right. A global step pre-hook checks each optimizer at its first step and again when its
parameters change; tiny_fsdp's own optimizers (``takes_strategy_params``) are not checked.
"""

import warnings
import weakref
from typing import Any, Dict, List, Set, Tuple

from torch.optim.optimizer import register_optimizer_step_pre_hook

from tiny_fsdp.core.optim.torch_rule import rule_kind, rule_name
from tiny_fsdp.core.ownership import owner_of
from tiny_fsdp.core.torch_checkpoint import for_torch_checkpoint, refuse_torch_checkpoint

# Optimizers checked -> how many parameters they had then.
_CHECKED: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()
_WARNED: Set[Tuple[type, str]] = set()
_HOOK: List[Any] = []  # the global step pre-hook, once registered
_STATE_DICT_HOOKED: "weakref.WeakSet[Any]" = weakref.WeakSet()


def install() -> None:
    """Register the global optimizer step pre-hook (once per process)."""
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_check_optimizer))


def _check_optimizer(optimizer: Any, args: Any, kwargs: Any) -> None:
    if getattr(optimizer, "takes_strategy_params", False):
        return
    n_params = sum(len(group["params"]) for group in optimizer.param_groups)
    if _CHECKED.get(optimizer) == n_params:
        return
    owners: Dict[str, Any] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            owner = owner_of(param)
            if owner is not None:
                owners.setdefault(owner.local_params, owner)
    for layout, owner in owners.items():
        _check(optimizer, layout, type(owner).__name__)
    _hook_state_dicts(optimizer, set(owners))
    _CHECKED[optimizer] = n_params


def _hook_state_dicts(optimizer: Any, layouts: Set[str]) -> None:
    """Give ``optimizer``'s state dict its form under torch's distributed checkpoint, once."""
    if optimizer in _STATE_DICT_HOOKED:
        return
    if "owned_tensors" in layouts:
        optimizer.register_state_dict_post_hook(_refused_under_torch_checkpoint)
    elif "dim0_shards" in layouts:
        optimizer.register_state_dict_post_hook(_shards_as_dtensors)
        optimizer.register_load_state_dict_pre_hook(_dtensors_as_shards)
    else:
        return
    _STATE_DICT_HOOKED.add(optimizer)


def _refused_under_torch_checkpoint(optimizer: Any, state_dict: Dict[str, Any]) -> None:
    if for_torch_checkpoint():
        refuse_torch_checkpoint(type(optimizer).__name__ + " over a Zero3 model")


def _shards_as_dtensors(optimizer: Any, state_dict: Dict[str, Any]) -> Any:
    if not for_torch_checkpoint():
        return None
    from tiny_fsdp.core.fsdp import dtensor_state  # imports the FSDP package

    return dtensor_state.to_dtensors(state_dict, optimizer.param_groups, padded=True)


def _dtensors_as_shards(optimizer: Any, state_dict: Dict[str, Any]) -> Any:
    if not for_torch_checkpoint():
        return None
    from tiny_fsdp.core.fsdp import dtensor_state

    return dtensor_state.from_dtensors(
        state_dict, optimizer.param_groups, padded=True, what=type(optimizer).__name__
    )


def _check(optimizer: Any, layout: str, kind: str) -> None:
    name, rule = type(optimizer).__name__, rule_kind(type(optimizer))
    if layout == "flat_buffer":
        raise RuntimeError(
            f"{name} steps parameters of a {kind} model: their reduced gradients reach only "
            f"tiny_fsdp's {kind} optimizers: {kind}Optimizer(model.named_parameters(), "
            f"optimizer_class={rule_name(type(optimizer))}, lr=...) steps "
            f"this rank's share with {name}'s rule (as ZeroRedundancyOptimizer's "
            f"optimizer_class), {kind}AdamW / {kind}SGD with tiny_fsdp's own"
        )
    if layout == "dim0_shards" and rule in ("per_tensor", "across_tensors"):
        reads = "whole tensors" if rule == "per_tensor" else "all parameters at once"
        use = "Zero3 (each rank holds whole tensors) or DDP" if rule == "per_tensor" else "DDP"
        raise RuntimeError(
            f"{name} steps the parameters of an {kind} model, which are this rank's dim-0 "
            f"shards; its update reads {reads}, so it would see only this rank's rows and "
            f"train wrong. Use {use} for {name}; element-wise optimizers (torch.optim's SGD, "
            "Adam, AdamW, ...) are right on shards."
        )
    if layout == "owned_tensors" and rule == "across_tensors":
        raise RuntimeError(
            f"{name} steps the parameters of a {kind} model, of which this rank holds the "
            "tensors it owns (empty placeholders for the others); its update reads all "
            f"parameters at once, so it would see only this rank's and train wrong. Use DDP."
        )
    if rule == "unknown" and layout in ("dim0_shards", "owned_tensors"):
        if (type(optimizer), layout) in _WARNED:
            return
        _WARNED.add((type(optimizer), layout))
        holds = (
            "its dim-0 shards: an update that works element by element is right on them, one "
            "that reads a whole tensor (a norm, row or column statistics) or several is not "
            "(use Zero3 or DDP for such a rule)"
            if layout == "dim0_shards"
            else "the whole tensors it owns and empty placeholders for the others: an update "
            "per element or per tensor is right, one that reads several tensors at once is "
            "not (use DDP for such a rule)"
        )
        warnings.warn(
            f"{name} steps the parameters of a {kind} model; a rank holds {holds} "
            "([Note: optimizers of other libraries]).",
            stacklevel=4,
        )
