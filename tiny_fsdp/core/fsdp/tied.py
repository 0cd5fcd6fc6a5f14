"""One reduce-scatter for a parameter that several layers of one gather unit use (a tied weight).

[Note: tied reduction]
With per-block units (FSDP2's layout), GPT-2's ``wte`` and ``lm_head`` fall in the same root
unit and share one weight. Reducing each layer's part separately would move that (large) weight
twice per step. Instead every user adds its full gradient into one padded (world_size, numel)
buffer, and the user that completes the count (all of the unit's layers that hold the
parameter) launches the reduce-scatter of the sum, delivered into ``.grad`` at the end of the
backward like every other part ([Note: asynchronous reduction]). Under ``no_sync`` the completed
sum is kept and the next passes add to it, like the per-layer accumulation buffers.

Limit: if, in a pass, some user's backward does not run (its output did not reach the loss),
the count is never completed and those contributions would be lost; the next forward raises
instead of training on a silently wrong gradient.

Mixed precision: the sum is kept in the parameter's dtype (fp32, as autograd would sum into
``.grad``) and cast to the policy's ``reduce_dtype`` just before the reduce-scatter.
"""

from typing import Dict, List, Sequence

import torch
from torch import nn

from tiny_fsdp.core.fsdp.sharded_param import shard_info
from tiny_fsdp.core.fsdp.state import FSDPState


class TiedReduction:
    """Sum-then-reduce for the parameters used by >= 2 of ``layers`` ([Note: tied reduction])."""

    def __init__(self, layers: Sequence[nn.Module], state: FSDPState) -> None:
        self.state = state
        users: Dict[int, int] = {}
        for layer in layers:
            params = {id(p): p for p in (getattr(layer, n) for n in layer.param_names)}
            for pid, param in params.items():  # a layer counts once per parameter
                if param is not None:
                    users[pid] = users.get(pid, 0) + 1
        self.users = {pid: n for pid, n in users.items() if n > 1}  # id(param) -> layers using it
        self._sums: Dict[int, List] = {}  # id(param) -> [padded sum (world, numel), count]

    def __contains__(self, param: nn.Parameter) -> bool:
        return id(param) in self.users

    def add(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        """Add one user's full ``grad``; the last user launches the reduce-scatter of the sum."""
        info, world = shard_info(param), self.state.world_size
        entry = self._sums.get(id(param))
        if entry is None:
            entry = [grad.new_empty(world, info.shard_numel, dtype=param.dtype), 0]
            self._sums[id(param)] = entry
            info.copy_in(grad, entry[0], accumulate=False)
            self.state.track_accumulated(_nbytes(entry[0]))
        else:
            info.copy_in(grad, entry[0], accumulate=True)
        entry[1] += 1
        if entry[1] < self.users[id(param)]:
            return
        entry[1] = 0  # this pass is complete
        if not self.state.require_grad_sync:
            return  # keep the sum: the next synchronised pass adds to it and reduces
        buffer = self._sums.pop(id(param))[0]
        self.state.track_accumulated(-_nbytes(buffer))
        buffer = buffer.to(self.state.reduce_dtype(buffer.dtype))  # no copy without a policy
        buffer.div_(self.state.grad_divisor)  # SUM of grad / world == average, on every backend
        reduced = buffer.new_empty(info.shard_numel)
        self.state.launch_reduce_scatter(
            reduced, buffer.view(-1), [(param, reduced.view(info.shard_shape))]
        )

    def check_complete(self) -> None:
        """Raise if a pass left a tied gradient sum incomplete ([Note: tied reduction])."""
        partial = [pid for pid, (_, count) in self._sums.items() if count]
        if partial:
            for pid in partial:
                self.state.track_accumulated(-_nbytes(self._sums.pop(pid)[0]))
            raise RuntimeError(
                "FSDP: in the last backward, a parameter shared by several layers of one gather "
                "unit got gradients from only some of them (a layer's output did not reach the "
                "loss), so its gradient would be incomplete. Use unit='layer', or make every "
                "layer that uses the tied weight take part in the loss."
            )


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
