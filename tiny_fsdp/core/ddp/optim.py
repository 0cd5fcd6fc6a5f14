"""Optimizers for DDP-wrapped models: the project's AdamW / SGD, after a membership check.

DDP averages the gradients during backward, so every rank already holds the same full gradient
of every parameter and the plain update rule, run on every rank, keeps the replicas identical.
The only thing added is a guard: parameters of a model that was NOT wrapped would be updated
with this rank's local gradient and the replicas would silently drift apart.
"""

from typing import Any, Dict

from tiny_fsdp.core.ddp.ddp import is_ddp_param
from tiny_fsdp.core.optim import SGD, AdamW, normalize_param_group


class _RequireDDPParams:
    """Mixin: every parameter of every group must belong to a ``DDP``-wrapped model."""

    takes_strategy_params = True

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        # torch.optim.Optimizer.__init__ registers its groups through here too.
        first = sum(len(g["params"]) for g in getattr(self, "param_groups", []))
        group = normalize_param_group(param_group, first_index=first)  # consumes iterators once
        for name, param in zip(group["param_names"], group["params"]):
            if not is_ddp_param(param):
                raise ValueError(
                    f"{type(self).__name__}: parameter '{name}' does not belong to a DDP-wrapped "
                    "model; wrap the model first (model = DDP(model)) and pass "
                    "model.named_parameters() of the wrapper."
                )
        super().add_param_group(group)  # type: ignore[misc]


class DDPAdamW(_RequireDDPParams, AdamW):
    """``AdamW`` for the parameters of a ``DDP``-wrapped model (same arguments)."""


class DDPSGD(_RequireDDPParams, SGD):
    """``SGD`` for the parameters of a ``DDP``-wrapped model (same arguments)."""
