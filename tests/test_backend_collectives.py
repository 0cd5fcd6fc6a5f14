"""Specification: the backend's own all-gather, reduce-scatter and reduce, the calls NCCL gets.

On gloo the library builds those three collectives from broadcasts and sends ([Note:
collectives on gloo]); every other backend, NCCL on several GPUs included, gets torch's own
``all_gather_into_tensor``, ``reduce_scatter_tensor`` and ``reduce`` (``comm.py``), and ZeRO-1/2
gather their buckets with one all-gather instead of a broadcast per owner. Gloo implements
those calls too, so here, with the gloo-built path switched off (``gloo_collectives.is_gloo`` /
``uses_gloo`` answer False, and the gloo-built functions raise if anything still reaches them),
every wrapper with default arguments trains as one device with ``torch.optim`` does on the
global batch, at 2 and 3 ranks (uneven shards) and as HSDP on a 2 x 2 mesh: the code a multi-GPU
NCCL run executes, minus its CUDA streams (``pytest -m cuda`` runs those). The ledger shows the
backend's collectives were the ones issued.
"""

import contextlib
from typing import Dict, Iterator, List

import pytest

from tests.build import adamw, build
from tests.harness import run_distributed
from tests.parity import check_parity
from tiny_fsdp.core import comm, gloo_collectives

STRATEGIES = ["ddp", "zero1", "zero2", "zero3", "fsdp"]
OPTIM = adamw(lr=1e-3, weight_decay=0.1)
# The kinds each wrapper issues with the backend's collectives (the gloo-built path would show
# broadcasts where ZeRO-1/2 gather their buckets, and no all-gather at all there).
ISSUES = {
    "ddp": {"all_reduce", "broadcast"},
    "zero1": {"all_gather", "all_reduce", "broadcast", "reduce_scatter"},
    "zero2": {"all_gather", "all_reduce", "broadcast", "reduce_scatter"},
    "zero3": {"all_reduce", "broadcast", "reduce"},
    "fsdp": {"all_gather", "all_reduce", "broadcast", "reduce_scatter"},
    "hsdp": {"all_gather", "all_reduce", "broadcast", "reduce_scatter"},
}


@contextlib.contextmanager
def backend_collectives() -> Iterator[None]:
    """Torch's own collectives on gloo too, as on NCCL; the gloo-built ones fail if called."""
    names = ("is_gloo", "uses_gloo", "all_gather", "reduce_scatter", "reduce")
    saved = {name: getattr(gloo_collectives, name) for name in names}

    def built(*args: object, **kwargs: object) -> None:
        raise AssertionError("a gloo-built collective ran with the backend's collectives on")

    gloo_collectives.is_gloo = lambda group: False
    gloo_collectives.uses_gloo = lambda tensor, group: False
    for name in ("all_gather", "reduce_scatter", "reduce"):
        setattr(gloo_collectives, name, built)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(gloo_collectives, name, value)


def _parity_worker(rank: int, world_size: int, strategies: List[str]) -> Dict[str, List[str]]:
    issued = {}
    with backend_collectives():
        for strategy in strategies:
            kw = {}
            if strategy == "hsdp":
                from tiny_fsdp.core.fsdp import hsdp_mesh

                kw["mesh"] = hsdp_mesh(2, node_local=False)
            comm.LEDGER.reset()
            check_parity(
                rank,
                world_size,
                lambda m: build("fsdp" if strategy == "hsdp" else strategy, m, OPTIM, **kw),
                lambda m: OPTIM.reference(m.parameters()),
                lambda m: m.state_dict(),
                steps=3,
            )
            issued[strategy] = sorted(k for k, n in comm.LEDGER.calls.items() if n)
    return issued


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_wrapper_trains_as_one_device_with_the_backends_own_collectives(world_size):
    issued = run_distributed(_parity_worker, world_size, STRATEGIES)[0]
    for strategy in STRATEGIES:
        assert set(issued[strategy]) == ISSUES[strategy], (strategy, issued[strategy])


def test_hsdp_trains_as_one_device_with_the_backends_own_collectives():
    issued = run_distributed(_parity_worker, 4, ["hsdp"])[0]
    assert set(issued["hsdp"]) == ISSUES["hsdp"], issued["hsdp"]
