"""Specification: complex parameters train as with torch.optim and torch's DDP, and no
collective hands the backend a complex tensor (NCCL has no complex type).

torch.optim steps a complex tensor as its real view (real and imaginary parts each with their
own moments), and ``clip_grad_norm_`` takes the norm of the moduli. The oracle: torch.optim on
one process, torch's ``DistributedDataParallel`` + ``torch.optim.AdamW`` with
``torch.nn.utils.clip_grad_norm_`` on 2 ranks, for every wrapper (ZeRO-1/2 hold the complex
parameter in a bucket of its own dtype: [Note: ZeRO buckets by dtype]).
"""

import contextlib
import copy
from typing import Any, Dict, Iterator, List

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tests.build import adamw, build
from tests.harness import run_distributed
from tiny_fsdp.core import comm
from tiny_fsdp.core.optim import SGD, AdamW

# The same ops on the same values, but the fused CPU kernel against torch's foreach ops and,
# over ranks, another reduction order: float32 rounding.
ATOL = 1e-6
STEPS = 3
STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")


@pytest.mark.parametrize(
    "ours_cls, ref_cls, cfg",
    [
        (AdamW, torch.optim.AdamW, dict(lr=0.01)),
        (AdamW, torch.optim.AdamW, dict(lr=0.01, fused=False)),
        (AdamW, torch.optim.AdamW, dict(lr=0.01, amsgrad=True, maximize=True, weight_decay=0.1)),
        (SGD, torch.optim.SGD, dict(lr=0.01, momentum=0.9, nesterov=True)),
    ],
    ids=["AdamW", "AdamW-foreach", "AdamW-amsgrad", "SGD"],
)
def test_optimizer_steps_complex_tensors_as_torch_optim(
    ours_cls: type, ref_cls: type, cfg: Dict[str, Any]
) -> None:
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(4, 3, dtype=torch.complex64, generator=gen), torch.randn(5, generator=gen)]
    ours = [nn.Parameter(t.clone()) for t in start]
    ref = [nn.Parameter(t.clone()) for t in start]
    ours_opt, ref_opt = ours_cls(ours, **cfg), ref_cls(ref, **{**cfg, "fused": None})
    for _ in range(5):
        for a, b in zip(ours, ref):
            a.grad = torch.randn(a.shape, dtype=a.dtype, generator=gen)
            b.grad = a.grad.clone()
        ours_opt.step()
        ref_opt.step()
    for a, b in zip(ours, ref):
        assert (a - b).abs().max().item() <= ATOL


class ComplexHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 6)
        self.head = nn.Parameter(torch.randn(6, 3, dtype=torch.complex64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.body(x).to(torch.complex64) @ self.head).abs()


def _train(model: nn.Module, optimizer: Any, rank: int, max_norm: float, norm: float) -> None:
    gen = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        model(torch.randn(5, 8, generator=gen)).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm)
        optimizer.step()
        optimizer.zero_grad()


# What the wrappers' collectives reach in torch.distributed (gloo's path included).
_BACKEND = (
    *("broadcast", "all_reduce", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor"),
    *("isend", "irecv", "send", "recv"),  # gloo's path pairs sends and receives
)


@contextlib.contextmanager
def _complex_reaching_the_backend() -> Iterator[List[str]]:
    """The names of the torch.distributed calls given a complex tensor while inside."""
    seen: List[str] = []
    saved = {name: getattr(dist, name) for name in _BACKEND if hasattr(dist, name)}

    def spy(name: str, call: Any) -> Any:
        def spied(*args: Any, **kwargs: Any) -> Any:
            tensors = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
            if any(t.is_complex() for t in tensors):
                seen.append(name)
            return call(*args, **kwargs)

        return spied

    for name, call in saved.items():
        setattr(dist, name, spy(name, call))
    try:
        yield seen
    finally:
        for name, call in saved.items():
            setattr(dist, name, call)


def _wrappers_worker(rank: int, world_size: int) -> List[str]:
    torch.manual_seed(0)
    initial = ComplexHead()
    seen = []
    # Every wrapper with the L2 norm; the others' path (moduli, tiny_fsdp's clip_grad_norm_
    # alike for every wrapper) with one.
    for norm, strategies in [(2.0, STRATEGIES), (float("inf"), ("fsdp",))]:
        reference = DistributedDataParallel(copy.deepcopy(initial))
        _train(reference, torch.optim.AdamW(reference.parameters(), lr=0.01), rank, 0.05, norm)
        want = reference.module.state_dict()
        for strategy in strategies:
            with _complex_reaching_the_backend() as complex_calls:
                model, optimizer = build(strategy, copy.deepcopy(initial), adamw(lr=0.01))
                # clip_grad_norm_ is tiny_fsdp's on a wrapper (imported with tiny_fsdp.core).
                _train(model, optimizer, rank, 0.05, norm)
                got = model.state_dict()
            # NCCL takes no complex tensor, nor gloo in torch 2.8 ([Note: complex payloads]).
            assert not complex_calls, f"{strategy}: complex tensors given to {set(complex_calls)}"
            for key, value in want.items():
                gap = (got[key] - value).abs().max().item()
                assert gap <= ATOL, f"{strategy} norm {norm}: {key} differs by {gap:.2e}"
            seen.append(f"{strategy}-{norm}")
    return seen


def test_every_wrapper_trains_a_complex_parameter_as_torch_ddp() -> None:
    assert len(run_distributed(_wrappers_worker, 2)[0]) == 6


def test_a_reduction_without_meaning_on_complex_numbers_is_refused() -> None:
    with pytest.raises(ValueError, match="not defined on complex tensors"):
        comm.all_reduce(torch.ones(2, dtype=torch.complex64), op=dist.ReduceOp.MAX)
