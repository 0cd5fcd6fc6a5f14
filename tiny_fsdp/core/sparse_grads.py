"""Sparse gradients under DDP: ``nn.Embedding`` / ``nn.EmbeddingBag`` with ``sparse=True``.

[Note: sparse gradients]
An embedding built with ``sparse=True`` gives its weight a sparse COO gradient: only the rows
its batch looked up, as ``(indices (1, nnz), values (nnz, dim))``. Optimizers made for it
(``torch.optim.SparseAdam``, ``SGD`` and ``Adagrad`` take sparse gradients too) update only
those rows, and ``SparseAdam`` refuses a dense gradient. What each strategy does:

- DDP keeps them sparse, as torch's DDP does: the weight of such a module (found at wrap time,
  as torch's DDP finds it) has no slot in a dense bucket but a ``SparseGradReduction`` of its
  own, the last in launch order. Its reduction gathers every rank's coalesced ``(indices,
  values / N)`` (three all-gathers: the counts, then indices and values padded to the largest
  count, in rank order) and sums them into one coalesced sparse tensor, the same on every rank:
  ``.grad`` is the average over ranks, sparse, with the rows any rank looked up. A rank whose
  forward did not use the module sends nothing; if no rank did, ``.grad`` stays None. The
  counts are read on the host, so this reduction is synchronous.
- Every other sparse gradient (ZeRO-1/2, whose gradients live in dense flat buffers; FSDP and
  ZeRO-3, which reduce dense shards; under DDP a sparse gradient from a module not built with
  ``sparse=True``, e.g. ``F.embedding(..., sparse=True)`` in a model's own code) is made dense
  when it arrives and reduced as every other gradient: the same values, so ``SGD`` and
  ``Adagrad`` train alike; ``SparseAdam`` then refuses the dense ``.grad`` and says so.
  FSDP's and ZeRO-3's ``Embedding`` layer computes the dense gradient directly.
"""

from typing import List, Optional, Set

import torch
from torch import nn

from tiny_fsdp.core import comm


def sparse_grad_params(module: nn.Module) -> Set[int]:
    """``id``s of the parameters whose gradients are sparse: the weights of ``module``'s
    ``nn.Embedding`` / ``nn.EmbeddingBag`` built with ``sparse=True``."""
    return {
        id(m.weight)
        for m in module.modules()
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
    }


def densify_grad(param: torch.Tensor) -> None:
    """``param.grad`` made dense in place of a sparse one ([Note: sparse gradients])."""
    if param.grad is not None and param.grad.is_sparse:
        param.grad = param.grad.to_dense()


class SparseGradReduction:
    """The gradient of ``param`` averaged over ranks as a sparse tensor ([Note: sparse
    gradients]); the verbs are ``GradBucket``'s. ``dtype``: the values' dtype in the reduction
    (mixed precision's ``reduce_dtype``), else the gradient's."""

    def __init__(
        self, param: nn.Parameter, world_size: int, dtype: Optional[torch.dtype] = None
    ) -> None:
        self.params: List[nn.Parameter] = [param]
        self.world_size = world_size
        self.divisor = world_size  # of a gradient added (DDP's join may lower it)
        self.dtype = dtype
        self._local: Optional[torch.Tensor] = None  # coalesced, divided by the world size
        self._average: Optional[torch.Tensor] = None
        self.launched = False

    def add_grad(self, grad: Optional[torch.Tensor]) -> None:
        """Take this rank's gradient (None: this rank looked nothing up)."""
        if grad is not None and not grad.is_sparse:
            raise RuntimeError(
                f"a parameter of shape {tuple(grad.shape)} held by an embedding built with "
                "sparse=True got a dense gradient (is it also used by another module, e.g. "
                "tied to an output layer?); build the embedding with sparse=False"
            )
        if grad is not None:
            grad = grad.coalesce().to(self.dtype or grad.dtype) / self.divisor
        self._local = grad

    def launch(self, async_op: bool) -> None:
        """Gather every rank's rows and sum them (synchronous, see the Note)."""
        assert not self.launched, "launch a reduction once per backward"
        param, n = self.params[0], self.world_size
        local = self._local
        if local is None:  # no rows: an empty sparse tensor of the right shape
            dtype = self.dtype or param.dtype
            values = torch.zeros((0, *param.shape[1:]), dtype=dtype, device=param.device)
            indices = torch.zeros((1, 0), dtype=torch.long, device=param.device)
            local = torch.sparse_coo_tensor(indices, values, param.shape, is_coalesced=True)
        indices, values = local.indices(), local.values()
        counts = torch.tensor([indices.shape[1], int(self._local is not None)])
        all_counts = torch.empty(2 * n, dtype=counts.dtype, device=param.device)
        comm.all_gather(all_counts, counts.to(param.device))
        all_counts = all_counts.view(n, 2).tolist()
        self.launched = True
        if not any(has for _, has in all_counts):
            return  # no rank had a gradient: .grad stays None
        most = max(count for count, _ in all_counts)
        gathered_indices = _gather_padded(indices, most, dim=1, n=n)  # (n, sparse_dim, most)
        gathered_values = _gather_padded(values, most, dim=0, n=n)  # (n, most, *dense)
        indices = torch.cat([gathered_indices[r, :, :c] for r, (c, _) in enumerate(all_counts)], 1)
        values = torch.cat([gathered_values[r, :c] for r, (c, _) in enumerate(all_counts)])
        average = torch.sparse_coo_tensor(indices, values, param.shape, check_invariants=False)
        self._average = average.coalesce()

    def is_done(self) -> bool:
        return True

    def finish(self) -> Optional[torch.Tensor]:
        """The average (None if no rank had a gradient); resets for the next backward."""
        assert self.launched, "finish a reduction only after launching it"
        average = self._average
        self.reset()
        return average

    def reset(self) -> None:
        self._local = self._average = None
        self.launched = False


def _gather_padded(tensor: torch.Tensor, length: int, dim: int, n: int) -> torch.Tensor:
    """Every rank's ``tensor``, padded with zeros to ``length`` along ``dim``, stacked in rank
    order: shape ``(n, *tensor.shape)`` with ``length`` at ``dim``."""
    shape = list(tensor.shape)
    shape[dim] = length
    padded = tensor.new_zeros(shape)
    padded.narrow(dim, 0, tensor.shape[dim]).copy_(tensor)
    out = tensor.new_empty([n, *shape])
    comm.all_gather(out.view(-1), padded.view(-1))
    return out
