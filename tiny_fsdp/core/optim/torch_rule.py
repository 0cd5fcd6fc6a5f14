"""A ``torch.optim`` class's update rule applied to the tensors a strategy's optimizer yields.

[Note: torch.optim rules on pieces]
ZeRO-1/2 update *pieces*: flat slices of this rank's elements of the parameters ([Note: ZeRO
flat layout]), with their reduced gradients in the strategy's store. A rule that works element
by element (torch.optim's SGD, Adam, AdamW, ...: ``ELEMENTWISE``) gives each element the same
update whether it sees the whole tensor or a slice, so ``TorchRule`` runs the class's own
``step`` on *stand-ins*: an ``nn.Parameter`` per piece that aliases the piece's master (same
storage: the update lands in place), whose ``.grad`` is the piece's gradient for the length of
the step (cast to the master's dtype where it differs), and whose state IS the piece's
``self.state[master]`` (the same dict), so checkpoints, clipping and LR schedulers work on this
optimizer's groups and state as with the project's own rules. One instance of the class is kept
per group, on the stand-ins of the group seen so far (one without a gradient this step is
skipped by the class, as torch.optim skips a ``.grad`` of None); the group's hyper-parameters
are copied into it before each step.
State the class makes in its constructor (Adagrad's ``sum``) seeds an empty piece state.

A rule that reads a whole tensor (Adafactor's column statistics, Muon's orthogonalisation) or
all parameters at once (LBFGS) would see slices and train wrong: refused. A class this module
does not know steps with a warning saying so.
"""

from __future__ import annotations

import inspect
import sys
import warnings
from typing import Any, Dict, Type

import torch
from torch import Tensor, nn

from .base import BaseOptimizer, ParamsT

ELEMENTWISE = {
    "SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Rprop", "Adagrad",
    "Adadelta", "ASGD", "SparseAdam",
}  # fmt: skip
PER_TENSOR = {"Adafactor", "Muon"}
ACROSS_TENSORS = {"LBFGS"}


def rule_kind(cls: type) -> str:
    """How optimizer class ``cls`` reads tensors: ``"elementwise"``, ``"per_tensor"``,
    ``"across_tensors"`` (torch.optim's own classes, exactly: a subclass may change the rule)
    or ``"unknown"``."""
    if not cls.__module__.startswith("torch.optim"):
        return "unknown"
    name = cls.__name__
    if name in ELEMENTWISE:
        return "elementwise"
    if name in PER_TENSOR:
        return "per_tensor"
    return "across_tensors" if name in ACROSS_TENSORS else "unknown"


def rule_name(cls: type) -> str:
    """``torch.optim.Adam`` for torch's classes, else the class's module and name."""
    if cls.__module__.startswith("torch.optim"):
        return f"torch.optim.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def _user_stacklevel() -> int:
    """``warnings.warn``'s stacklevel, called here, of the first caller outside tiny_fsdp."""
    frame, level = sys._getframe(2), 2  # 1: the function that warns
    while frame is not None and frame.f_globals.get("__name__", "").startswith("tiny_fsdp."):
        frame, level = frame.f_back, level + 1
    return level


class TorchRule(BaseOptimizer):
    """Steps what ``_tensors_to_update`` yields with ``optimizer_class``'s rule ([Note:
    torch.optim rules on pieces]); ``defaults`` are that class's keyword arguments."""

    def __init__(
        self, params: ParamsT, optimizer_class: Type[torch.optim.Optimizer], **defaults: Any
    ) -> None:
        if not (
            isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)
        ):
            raise TypeError(
                f"{type(self).__name__}: optimizer_class must be a torch.optim.Optimizer class "
                f"(e.g. torch.optim.Adam), got {optimizer_class!r}"
            )
        name, kind = optimizer_class.__name__, rule_kind(optimizer_class)
        if kind in ("per_tensor", "across_tensors"):
            reads = "whole tensors" if kind == "per_tensor" else "all parameters at once"
            raise ValueError(
                f"{type(self).__name__}: {name}'s update reads {reads}, but this optimizer "
                "steps flat slices of the parameters (this rank's share), so it would train "
                f"wrong; use {name} with DDP" + (" or Zero3" if kind == "per_tensor" else "")
            )
        if kind == "unknown":
            warnings.warn(
                f"{type(self).__name__} steps flat slices of the parameters with {name}: right "
                "if its update works element by element, wrong if it reads a whole tensor "
                "(a norm, row or column statistics) or several ([Note: torch.optim rules on "
                "pieces]).",
                stacklevel=_user_stacklevel(),
            )
        self.optimizer_class = optimizer_class
        self._arguments = set(inspect.signature(optimizer_class).parameters) - {"params"}
        # The class's full defaults (its constructor checks the values).
        probe = optimizer_class([torch.zeros(1, requires_grad=True)], **defaults)
        self._instances: Dict[int, torch.optim.Optimizer] = {}  # id(group) -> its instance
        self._instances_state: Any = None  # the state dict the instances' states belong to
        self._stand_ins: Dict[int, nn.Parameter] = {}  # id(master) -> its stand-in
        super().__init__(params, dict(probe.defaults))

    @property
    def rule(self) -> str:
        """The rule's name (checkpoints record it)."""
        return rule_name(self.optimizer_class)

    def _instance(self, params: list[Tensor], group: dict[str, Any]) -> torch.optim.Optimizer:
        """An instance of the class on ``params`` with ``group``'s hyper-parameters (its
        constructor checks those it takes as arguments)."""
        instance = self.optimizer_class(
            params, **{k: v for k, v in group.items() if k in self._arguments}
        )
        instance.param_groups[0].update({k: group[k] for k in self.defaults})
        return instance

    def _check_hyperparams(self, hyper: dict[str, Any]) -> None:
        if "params" in hyper:  # a group
            self._instance([torch.zeros(1, requires_grad=True)], hyper)

    def _batch_limit(self, group: dict[str, Any], device: torch.device) -> int:
        return 2**62  # one call per group, device and dtype: the class batches as it likes

    def _stand_in(self, master: Tensor) -> nn.Parameter:
        stand_in = self._stand_ins.get(id(master))
        if stand_in is None:
            stand_in = self._stand_ins[id(master)] = nn.Parameter(master, requires_grad=True)
        return stand_in

    def _update_(
        self, params: list[Tensor], grads: list[Tensor], states: list[dict], group: dict[str, Any]
    ) -> None:
        if self._instances_state is not self.state:  # state replaced (loaded): start afresh
            self._instances.clear()
            self._instances_state = self.state
        stand_ins = [self._stand_in(p) for p in params]
        instance = self._instances.get(id(group))
        held = {id(p) for p in instance.param_groups[0]["params"]} if instance else set()
        if instance is None or any(id(s) not in held for s in stand_ins):
            # Every stand-in of the group seen so far: those without a gradient this step
            # are skipped by the class, as torch.optim skips a .grad of None.
            known = [] if instance is None else instance.param_groups[0]["params"]
            new = [s for s in stand_ins if id(s) not in held]
            instance = self._instances[id(group)] = self._instance(known + new, group)
            for stand_in, state in zip(stand_ins, states):
                if not state:  # what the constructor made (Adagrad's sum), else nothing
                    state.update(instance.state.get(stand_in, {}))
        else:
            instance.param_groups[0].update({k: group[k] for k in self.defaults})
        for stand_in, grad, state in zip(stand_ins, grads, states):
            instance.state[stand_in] = state
            stand_in.grad = grad if grad.dtype == stand_in.dtype else grad.to(stand_in.dtype)
        try:
            instance.step()
        finally:
            for stand_in in stand_ins:
                stand_in.grad = None
