"""Casting a list of tensors at once.

[Note: casts in one launch]
A training step casts whole lists of tensors: DDP's compute copies of every parameter before a
forward ([Note: DDP mixed precision]) and the update rule's low-precision gradients for fp32
masters ([Note: ZeRO optimizer step]). ``t.to(dtype)`` tensor by tensor costs a dispatch, an
allocation and a kernel launch per tensor: host work that a fast GPU waits for (GPT-2 124M, bf16,
one H200: 148 such casts a step in each place). On an accelerator ``cast_all`` allocates one
flat buffer, views it in the tensors' shapes and fills it with one ``torch._foreach_copy_``, a
multi-tensor kernel for the whole list. The values are ``.to``'s bit for bit (one rounding of
each element either way); the casts are contiguous and share one storage, freed with the last of
them. On the CPU, where a foreach copy runs tensor by tensor anyway and a large fresh buffer
costs page faults ([Note: huge pages for transient buffers]), and for tensors that are not
contiguous (``.to`` keeps their strides) or not strided (sparse), each tensor is cast alone.
"""

from typing import List, Sequence

import torch
from torch import Tensor

from tiny_fsdp.core.utils.storage import packed_views


def joins_by_default(device: torch.device) -> bool:
    """Whether ``cast_all`` casts a list on ``device`` together: off the CPU."""
    return device.type != "cpu"


@torch.no_grad()
def cast_all(tensors: Sequence[Tensor], dtype: torch.dtype) -> List[Tensor]:
    """``[t.to(dtype) for t in tensors]`` with the same values (a tensor already of ``dtype``
    is returned as is), in one multi-tensor copy where ``joins_by_default`` says so ([Note:
    casts in one launch]). No autograd: for parameters' data and gradients."""
    out = list(tensors)
    todo = [i for i, t in enumerate(out) if t.dtype != dtype]
    if not todo:
        return out
    device = out[todo[0]].device
    joint = []
    if joins_by_default(device):
        joint = [i for i in todo if out[i].device == device and _flat(out[i])]
    if len(joint) < 2:
        joint = []
    for i in set(todo).difference(joint):
        out[i] = out[i].to(dtype)
    if joint:
        flat = torch.empty(sum(out[i].numel() for i in joint), dtype=dtype, device=device)
        casts = packed_views(flat, [out[i].shape for i in joint])
        torch._foreach_copy_(casts, [out[i] for i in joint])
        for i, cast in zip(joint, casts):
            out[i] = cast
    return out


def _flat(tensor: Tensor) -> bool:
    """Strided and contiguous: a view of a flat buffer can hold it as it is."""
    return tensor.layout == torch.strided and tensor.is_contiguous()


def cast_like(tensors: Sequence[Tensor], likes: Sequence[Tensor]) -> List[Tensor]:
    """``[t.to(like.dtype) for t, like in zip(tensors, likes)]``, as ``cast_all`` where the
    ``likes`` share one dtype (an update rule's batch: a gradient to its parameter's dtype)."""
    dtypes = {like.dtype for like in likes}
    if len(dtypes) == 1:
        return cast_all(tensors, dtypes.pop())
    return [t.to(like.dtype) for t, like in zip(tensors, likes)]
