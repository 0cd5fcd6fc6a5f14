"""Optimizers over FSDP shards: the project's update rules applied to each rank's real rows.

Every parameter an FSDP model exposes is this rank's zero-padded dim-0 shard, and its ``.grad``
is the reduce-scattered average gradient of that shard, so the plain update rule applied to
(shard, shard grad) is exactly the single-device update of those rows ([Note: one update
rule]). Only the *real* rows are updated (``shard[:valid_rows]``), so padding rows stay zero
whatever the hyper-parameters (weight decay, maximize, eps=0), and optimizer state covers the
real rows only. A rank whose shard is all padding updates empty views and keeps empty state.
"""

from typing import Any, Dict, Iterator, Tuple

from torch import Tensor

from tiny_fsdp.core.fsdp import dtensor_state
from tiny_fsdp.core.fsdp.sharded_param import shard_info
from tiny_fsdp.core.optim import SGD, AdamW, BaseOptimizer


class _ShardUpdates(BaseOptimizer):
    """Mixin: reject non-shards at construction; feed the rule the real rows of each shard."""

    takes_strategy_params = True

    grads_are_sharded = True  # each rank yields its own rows: clip_grad_norm_ sums over ranks

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for name, param in zip(group["param_names"], group["params"]):
            if shard_info(param) is None:
                self.param_groups.pop()  # leave the optimizer as it was
                raise TypeError(
                    f"{type(self).__name__} got parameter '{name}' (shape {tuple(param.shape)}) "
                    "that is not an FSDP shard: wrap the model with FSDP(model) first and pass "
                    "the wrapped model's parameters."
                )

    def _norm_group(self) -> Any:
        """The shard group: its ranks hold each element once ([Note: hybrid sharding])."""
        groups = {id(shard_info(p).group): shard_info(p).group for p in self._all_params()}
        if len(groups) > 1:
            raise ValueError(
                f"{type(self).__name__}: parameters from FSDP models with different meshes; "
                "use one optimizer per model"
            )
        return next(iter(groups.values()), None)

    def _all_params(self) -> Iterator[Tensor]:
        for group in self.param_groups:
            yield from group["params"]

    def _torch_checkpoint_form(self, state: Dict[str, Any]) -> Dict[str, Any]:
        """Rows as ``Shard(0)`` DTensors ([Note: torch's distributed checkpoint])."""
        return dtensor_state.to_dtensors(state, self.param_groups, padded=False)

    def _from_torch_checkpoint_form(self, state_dict: Dict[str, Any]) -> Dict[str, Any]:
        """This rank's rows of each DTensor, checked (any world size)."""
        return dtensor_state.from_dtensors(
            state_dict, self.param_groups, padded=False, what=type(self).__name__
        )

    def _tensors_to_update(self, group: Dict[str, Any]) -> Iterator[Tuple[Tensor, Tensor, dict]]:
        for param, grad, state in super()._tensors_to_update(group):
            info = shard_info(param)
            rows = info.valid_rows
            if rows == info.shard_rows:  # no padding: the whole shard (no slice op per step)
                yield param.detach(), grad, state
            else:
                yield param.detach()[:rows], grad[:rows], state


class FSDPAdamW(_ShardUpdates, AdamW):
    """``AdamW`` over FSDP shards; same arguments as ``tiny_fsdp.core.optim.AdamW``."""


class FSDPSGD(_ShardUpdates, SGD):
    """``SGD`` over FSDP shards; same arguments as ``tiny_fsdp.core.optim.SGD``."""
