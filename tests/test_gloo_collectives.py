"""Specification of the reduce-scatter and the reduce on gloo ([Note: collectives on gloo]).

On a gloo group, ``comm.reduce_scatter`` (SUM) of 2 ranks is one send and one receive (in place,
into this rank's chunk of the input, the receive goes to a buffer of the chunk's size, which
``comm.reduce_scatter_receive_bytes`` reports). Every rank must get, bit for bit, c_0 + c_1 of
the two ranks' chunk ``rank`` (in place too), in fp32 and bf16, with several reduce-scatters in
flight at once (they pair up in issue order) and when two threads wait for one (a traced
step's waiter thread and the caller): a gloo send or receive waited for twice would wait for a
message that never comes. On 3 ranks (reduces) the same sum up to the rounding of another order
of its additions, and the future of a reduce-scatter made of reduces completes when they have
(a traced step on CUDA marks a collective's end by it). A rank that fails while the others
wait in one makes them raise at the collective timeout: ``tests/test_failure.py`` (FSDP on 2
ranks, failing in backward with reductions in flight).

``comm.reduce`` (SUM) on 2 ranks is one send and one receive: the destination must get, bit for
bit, a_0 + a_1 in the ``output`` it names or in place, to either rank, with reduces and
reduce-scatters in flight at once; on 3 ranks gloo's reduce, the same sum up to the order of
its additions. ``comm.reduces_into_output`` says which of the two a group does. In place,
the destination's receive buffer is not one the block cache keeps (an occasional reduce, a
checkpoint's, leaves no block reserved).
"""

import threading
from typing import List

import torch
import torch.distributed as dist

from tests.harness import run_distributed
from tiny_fsdp.core import comm

CHUNK = 7  # elements per rank: odd, so no size is a multiple of a vector width


def _rank_order_sums(inputs: List[torch.Tensor], rank: int, world_size: int) -> List[tuple]:
    """What every input's reduce-scatter must leave on ``rank``: (the rank-order sum of every
    rank's chunk ``rank``, the sum of their magnitudes), from all the ranks' inputs."""
    sums = []
    for x in inputs:
        every = [torch.empty_like(x) for _ in range(world_size)]
        dist.all_gather(every, x)
        chunks = [other.view(world_size, -1)[rank] for other in every]
        total = chunks[0].clone()
        for chunk in chunks[1:]:
            total = total + chunk
        sums.append((total, sum(chunk.float().abs() for chunk in chunks)))
    return sums


def _reduce_scatters_in_flight(rank: int, world_size: int) -> None:
    torch.manual_seed(rank)
    for dtype in (torch.float32, torch.bfloat16):
        for in_place in (False, True):
            inputs = [torch.randn(world_size * CHUNK).to(dtype) for _ in range(3)]
            expected = _rank_order_sums(inputs, rank, world_size)
            outputs = [
                x.view(world_size, CHUNK)[rank] if in_place else torch.empty(CHUNK, dtype=dtype)
                for x in inputs
            ]
            receives = in_place and world_size == 2
            for o, x in zip(outputs, inputs):
                nbytes = comm.reduce_scatter_receive_bytes(o, x)
                assert nbytes == (CHUNK * o.element_size() if receives else 0), (in_place, nbytes)
            works = [comm.reduce_scatter(o, x, async_op=True) for o, x in zip(outputs, inputs)]
            if world_size > 2:  # reduces: their future completes (a trace on CUDA listens)
                torch.futures.wait_all([work.get_future() for work in works])
            for work in reversed(works):  # waited for in any order: they travel in issue order
                work.wait()
            for output, (want, magnitude) in zip(outputs, expected):
                assert output.dtype == dtype
                if world_size == 2:  # one addition: a + b and b + a are the same bits
                    assert torch.equal(output, want), (dtype, in_place, output, want)
                else:  # gloo's reduce adds in an order of its own. Each order's N - 1
                    # roundings err by at most (N - 1) u sum|c_i| (u: the dtype's unit
                    # roundoff), so two orders differ by at most twice that.
                    u = torch.finfo(dtype).eps / 2
                    bound = 2 * (world_size - 1) * u * magnitude
                    assert ((output.float() - want.float()).abs() <= bound).all()


def test_reduce_scatter_on_gloo_is_the_sum_of_every_rank_chunk() -> None:
    for world_size in (2, 3):
        run_distributed(_reduce_scatters_in_flight, world_size)


def _waited_by_two_threads(rank: int, world_size: int) -> bool:
    torch.manual_seed(rank)
    x = torch.randn(world_size * CHUNK)
    ((expected, _),) = _rank_order_sums([x], rank, world_size)
    output = torch.empty(CHUNK)
    work = comm.reduce_scatter(output, x, async_op=True)
    waiter = threading.Thread(target=work.wait)
    waiter.start()
    work.wait()
    waiter.join(timeout=60)
    assert not waiter.is_alive(), "the second wait waited for a message that never comes"
    work.wait()  # and again, once done
    assert torch.equal(output, expected)
    return work.is_completed()


def test_a_reduce_scatter_waited_for_by_two_threads_completes_once() -> None:
    assert run_distributed(_waited_by_two_threads, 2, timeout=90) == [True, True]


def _rank_order_totals(inputs: List[torch.Tensor], world_size: int) -> List[tuple]:
    """What every input's reduce must leave on its destination: (the rank-order sum of every
    rank's input, the sum of their magnitudes)."""
    return _rank_order_sums([x.repeat(world_size) for x in inputs], 0, world_size)


def _reduces_in_flight(rank: int, world_size: int) -> bool:
    torch.manual_seed(rank)
    for dtype in (torch.float32, torch.bfloat16):
        for where in ("apart", "in place", "not given"):
            inputs = [torch.randn(world_size * CHUNK).to(dtype) for _ in range(4)]
            expected = _rank_order_totals(inputs, world_size)
            dsts = [i % world_size for i in range(len(inputs))]  # every rank receives some
            outputs = [torch.empty_like(x) if where == "apart" else x for x in inputs]
            reduces, scatters = [], []
            for x, output, dst in zip(inputs, outputs, dsts):
                kw = {} if where == "not given" else {"output": output}
                reduces.append(comm.reduce(x, dst=dst, async_op=True, **kw))
                ones = torch.ones(world_size * CHUNK, dtype=dtype)  # a reduce-scatter between
                scattered = torch.empty(CHUNK, dtype=dtype)
                scatters.append((scattered, comm.reduce_scatter(scattered, ones, async_op=True)))
            for work in reversed(reduces):  # waited for in any order: they travel in issue order
                work.wait()
            for scattered, work in scatters:
                work.wait()
                assert torch.equal(scattered, torch.full_like(scattered, world_size))
            for output, dst, (want, magnitude) in zip(outputs, dsts, expected):
                if dst != rank:
                    continue
                assert output.dtype == dtype
                if world_size == 2:  # one addition: a + b and b + a are the same bits
                    assert torch.equal(output, want), (dtype, where, output, want)
                else:  # another order of the additions: see _reduce_scatters_in_flight
                    u = torch.finfo(dtype).eps / 2
                    bound = 2 * (world_size - 1) * u * magnitude
                    assert ((output.float() - want.float()).abs() <= bound).all()
    return comm.reduces_into_output(torch.empty(1))


def test_reduce_on_gloo_leaves_the_sum_in_the_output_of_the_destination() -> None:
    assert run_distributed(_reduces_in_flight, 2) == [True, True]
    assert run_distributed(_reduces_in_flight, 3) == [False] * 3
    assert run_distributed(_reduces_in_flight, 1) == [False]  # the identity, into the output


def _large_reduce_in_place(rank: int, world_size: int) -> int:
    from tiny_fsdp.core.utils import huge_pages

    huge_pages.release_free()
    x = torch.full((huge_pages.CACHE_BYTES // 4,), float(rank + 1))  # a block the cache keeps
    comm.reduce(x, dst=0)
    assert rank != 0 or torch.equal(x, torch.full_like(x, 3.0))
    return huge_pages.free_bytes()


def test_a_reduce_in_place_leaves_no_cached_block_behind() -> None:
    assert run_distributed(_large_reduce_in_place, 2) == [0, 0]
