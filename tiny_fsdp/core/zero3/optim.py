"""Optimizers for ``Zero3`` models: the project's AdamW / SGD, updating owned tensors only.

After a synchronised backward only a tensor's owner holds its (averaged) gradient, so only the
owner updates it and only the owner ever creates its optimizer state (``self.state[param]``):
optimizer memory is this rank's share of the table. ``state_dict()`` is therefore per rank
(save one file per rank); parameters are full and identical everywhere only through
``Zero3.state_dict()``.
"""

from typing import Any, Dict, Iterator, Mapping, Optional, Sequence, Tuple

import torch.distributed as dist
from torch import Tensor

from tiny_fsdp.core.optim import SGD, AdamW, normalize_param_group
from tiny_fsdp.core.utils.dist import require_process_group
from tiny_fsdp.core.zero3.runtime import ATTR, TensorInfo


class _Zero3Params:
    """Mixin: checks every group against the table; ``step`` updates owned tensors only."""

    takes_strategy_params = True

    # Each rank updates only its owned tensors ([Note: clipping over shards]).
    grads_are_sharded = True

    def __init__(
        self,
        params: Any,
        *args: Any,
        param_part_table: Optional[Mapping[str, int]] = None,
        ranks_map: Optional[Sequence[str]] = None,
        **kwargs: Any,
    ) -> None:
        require_process_group(type(self).__name__)
        self._rank, world_size = dist.get_rank(), dist.get_world_size()
        if ranks_map is not None and len(ranks_map) != world_size:
            raise ValueError(
                f"{type(self).__name__}: ranks_map names {len(ranks_map)} ranks but the process "
                f"group has {world_size}; pass the ranks_map the table was made with"
            )
        made_for = getattr(param_part_table, "world_size", None)
        if made_for is not None and made_for != world_size:
            raise ValueError(
                f"{type(self).__name__}: param_part_table was made for {made_for} ranks but the "
                f"process group has {world_size}; build it with zero3_partition_tensors(..., "
                "ranks_map=[one device per rank]) and wrap the model with the same table"
            )
        self._table = param_part_table
        super().__init__(params, *args, **kwargs)  # type: ignore[call-arg]

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        # torch.optim.Optimizer.__init__ registers its groups through here too.
        first = sum(len(g["params"]) for g in getattr(self, "param_groups", []))
        group = normalize_param_group(param_group, first_index=first)  # consumes iterators once
        named = list(zip(group["param_names"], group["params"]))
        what = type(self).__name__
        for name, param in named:
            info: Optional[TensorInfo] = getattr(param, ATTR, None)
            if info is None:
                raise ValueError(
                    f"{what}: parameter '{name}' is not managed by Zero3 (a plain model, or "
                    "another strategy's); wrap the model first, model = Zero3(model), and pass "
                    "model.named_parameters()"
                )
            if self._table is not None and self._table.get(info.name) != info.owner:
                raise ValueError(
                    f"{what}: parameter '{info.name}' is owned by rank {info.owner} in the "
                    f"model but by {self._table.get(info.name)} in param_part_table; pass the "
                    "table the model was wrapped with"
                )
        super().add_param_group(group)  # type: ignore[misc]

    def _tensors_to_update(self, group: Dict[str, Any]) -> Iterator[Tuple[Tensor, Tensor, dict]]:
        for param in group["params"]:
            if getattr(param, ATTR).owner != self._rank or param.grad is None:
                continue
            yield param, param.grad, self.state[param]  # type: ignore[attr-defined]


class Zero3AdamW(_Zero3Params, AdamW):
    """``AdamW`` for a ``Zero3`` model: ``Zero3AdamW(model.named_parameters(), lr=...)``;
    other arguments as ``AdamW``. ``param_part_table`` / ``ranks_map`` (optional): the ones
    the model was wrapped with, checked against the parameters' owners."""


class Zero3SGD(_Zero3Params, SGD):
    """``SGD`` for a ``Zero3`` model: ``Zero3SGD(model.named_parameters(), lr=...)``; other
    arguments as ``SGD``. ``param_part_table`` / ``ranks_map`` as ``Zero3AdamW``."""
