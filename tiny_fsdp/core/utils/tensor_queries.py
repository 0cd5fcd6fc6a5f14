"""Questions about a tensor that its metadata answers, not its values.

A rank of FSDP / ZeRO-3 holds a part of each parameter; code that only asks a parameter's shape
(a count of parameters) or dtype (T5's feed-forward) can be answered with the full tensor's,
from a storage-free stand-in of its shape (``stand_in``), without fetching anything ([Note:
outside reads], [Note: counting methods]).
"""

from typing import Sequence

import torch

_T = torch.Tensor

#: Functions (as ``__torch_function__`` receives them) whose answer is the tensor's shape or
#: a count of its elements.
SHAPE_QUERIES = frozenset(
    {
        _T.shape.__get__,
        _T.ndim.__get__,
        _T.nbytes.__get__,
        _T.size,
        _T.dim,
        _T.numel,
        _T.nelement,
        _T.__len__,
    }
)

#: ... whose answer is the tensor's dtype or a function of it.
DTYPE_QUERIES = frozenset(
    {
        _T.dtype.__get__,
        _T.itemsize.__get__,
        _T.element_size,
        _T.is_floating_point,
        _T.is_complex,
    }
)


def stand_in(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of ``shape``, ``dtype`` and ``device`` holding one element (all of it expanded):
    answers ``SHAPE_QUERIES`` and ``DTYPE_QUERIES`` as a tensor of that shape would."""
    return torch.empty((), dtype=dtype, device=device).expand(tuple(shape))
