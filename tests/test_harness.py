"""Specification of the multi-process test harness in ``tests/harness.py``.

The ``_underscored`` functions run inside the workers; they are module-level so that the
workers can import them by name.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time

import pytest
import torch
import torch.distributed as dist

from tests.harness import (
    REPO_ROOT,
    DistributedRunError,
    DistributedTimeoutError,
    run_distributed,
)


def _rank_and_all_reduce(rank: int, world_size: int) -> tuple:
    x = torch.tensor([float(rank + 1)])
    dist.all_reduce(x)
    return rank, world_size, dist.get_rank(), dist.get_world_size(), x.item()


def _expected_rank_and_all_reduce(world_size: int) -> list[tuple]:
    total = world_size * (world_size + 1) / 2
    return [(rank, world_size, rank, world_size, total) for rank in range(world_size)]


def _pid(rank: int, world_size: int) -> int:
    return os.getpid()


def _scale(rank: int, world_size: int, tensor: torch.Tensor, factor: float) -> torch.Tensor:
    tensor.mul_(factor * rank)  # in place: must not affect the caller's tensor
    return tensor


def _raise_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("deliberate failure on rank 1")
    return rank


def _assert_wrong_sum(rank: int, world_size: int) -> None:
    total = rank + 41
    assert total == 42


def _return_a_generator(rank: int, world_size: int) -> object:
    return (x for x in range(rank))


def _exit_hard_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        os._exit(3)
    return rank


def _rank_0_waits_alone(rank: int, world_size: int) -> None:
    if rank == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins: deadlock


def _leave_a_collective_pending_on_rank_0(rank: int, world_size: int) -> None:
    if rank == 0:
        dist.all_reduce(torch.ones(1), async_op=True)  # never matched by rank 1, never waited


def _change_global_state(rank: int, world_size: int) -> None:
    torch.set_grad_enabled(False)
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(2)


def _global_state(rank: int, world_size: int) -> tuple:
    return torch.is_grad_enabled(), torch.get_default_dtype(), torch.get_num_threads()


def _environment(rank: int, world_size: int) -> dict:
    return {
        "backend": dist.get_backend(),
        "threads": torch.get_num_threads(),
        "master_addr": os.environ["MASTER_ADDR"],
        "repo_root_on_path": REPO_ROOT in sys.path,
        "importable": [
            importlib.util.find_spec(name) is not None
            for name in ("tiny_fsdp", "example", "tests.harness")
        ],
    }


def _cuda_all_reduce(rank: int, world_size: int) -> tuple:
    x = torch.full((2,), float(rank + 1), device="cuda")
    dist.all_reduce(x)
    return torch.cuda.current_device(), x.cpu()


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_results_come_back_in_rank_order_from_a_working_process_group(world_size: int) -> None:
    assert run_distributed(_rank_and_all_reduce, world_size) == _expected_rank_and_all_reduce(
        world_size
    )


def test_extra_args_reach_every_rank_by_value() -> None:
    tensor = torch.arange(4.0)
    results = run_distributed(_scale, 2, tensor, 3.0)
    torch.testing.assert_close(results[0], torch.zeros(4))
    torch.testing.assert_close(results[1], torch.arange(4.0) * 3)
    torch.testing.assert_close(tensor, torch.arange(4.0))


def test_workers_run_single_threaded_gloo_with_the_repo_importable() -> None:
    expected = {
        "backend": "gloo",
        "threads": 1,
        "master_addr": "127.0.0.1",
        "repo_root_on_path": True,
        "importable": [True, True, True],
    }
    assert run_distributed(_environment, 2) == [expected, expected]


def test_successive_calls_reuse_the_same_worker_processes() -> None:
    first = run_distributed(_pid, 2)
    second = run_distributed(_pid, 2)
    assert first == second
    assert len(set(first)) == 2
    assert os.getpid() not in first


def test_global_torch_state_is_restored_after_each_call() -> None:
    run_distributed(_change_global_state, 2)
    assert run_distributed(_global_state, 2) == [(True, torch.float32, 1)] * 2


def test_a_failing_rank_is_reported_and_the_next_call_gets_fresh_workers() -> None:
    before = run_distributed(_pid, 2)
    with pytest.raises(DistributedRunError) as info:
        run_distributed(_raise_on_rank_1, 2)
    message = str(info.value)
    assert info.value.failed_ranks == [1]
    assert "failed on rank 1" in message
    assert "Traceback (most recent call last)" in message
    assert "in _raise_on_rank_1" in message
    assert "ValueError: deliberate failure on rank 1" in message

    after = run_distributed(_pid, 2)
    assert set(after).isdisjoint(before)
    assert run_distributed(_rank_and_all_reduce, 2) == _expected_rank_and_all_reduce(2)


def test_a_plain_assert_in_a_worker_reports_the_compared_values() -> None:
    with pytest.raises(DistributedRunError) as info:
        run_distributed(_assert_wrong_sum, 1)
    assert "assert 41 == 42" in str(info.value)


def test_an_unpicklable_return_value_is_reported_as_a_failure_of_that_rank() -> None:
    with pytest.raises(DistributedRunError, match="return value of fn on rank 0 is not picklable"):
        run_distributed(_return_a_generator, 1)


def test_a_crashed_worker_is_reported_with_its_exit_code() -> None:
    with pytest.raises(DistributedRunError) as info:
        run_distributed(_exit_hard_on_rank_1, 2)
    assert 1 in info.value.failed_ranks
    assert "exit code 3" in info.value.errors[1]
    assert run_distributed(_rank_and_all_reduce, 2) == _expected_rank_and_all_reduce(2)


def test_a_deadlock_times_out_with_stacks_and_the_next_call_works() -> None:
    run_distributed(_pid, 2)  # warm the pool so that only the deadlocked call is timed
    start = time.monotonic()
    with pytest.raises(DistributedTimeoutError) as info:
        run_distributed(_rank_0_waits_alone, 2, timeout=3.0)
    elapsed = time.monotonic() - start
    assert 3.0 <= elapsed < 30.0  # the upper bound leaves room for a heavily loaded machine
    assert info.value.still_running == [0]
    message = str(info.value)
    assert "timed out after 3.0 s; ranks still running: [0]" in message
    assert "in _rank_0_waits_alone" in message  # rank 0's stack when it was killed

    assert run_distributed(_rank_and_all_reduce, 2) == _expected_rank_and_all_reduce(2)


def test_ranks_left_out_of_step_fail_the_call_that_caused_it() -> None:
    with pytest.raises(DistributedRunError, match="out of step") as info:
        run_distributed(_leave_a_collective_pending_on_rank_0, 2, timeout=60.0)
    assert not isinstance(info.value, DistributedTimeoutError)  # detected, not timed out
    assert all("(per rank: [1, 0])" in report for report in info.value.errors.values())
    assert run_distributed(_rank_and_all_reduce, 2) == _expected_rank_and_all_reduce(2)


def test_a_function_that_cannot_be_pickled_is_rejected_before_reaching_the_workers() -> None:
    before = run_distributed(_pid, 2)
    with pytest.raises(TypeError, match="module-level function"):
        run_distributed(lambda rank, world_size: rank, 2)
    assert run_distributed(_pid, 2) == before


@pytest.mark.parametrize("bad", [{"world_size": 0}, {"backend": "mpi"}, {"timeout": 0.0}])
def test_invalid_arguments_are_rejected(bad: dict) -> None:
    kwargs = {"world_size": 2, **bad}
    world_size = kwargs.pop("world_size")
    with pytest.raises(ValueError, match=next(iter(bad))):
        run_distributed(_pid, world_size, **kwargs)


def test_nccl_skips_the_test_when_there_are_not_enough_gpus() -> None:
    too_many = torch.cuda.device_count() + 1
    with pytest.raises(pytest.skip.Exception, match="nccl"):
        run_distributed(_pid, too_many, backend="nccl")


@pytest.mark.parametrize("world_size", [1, 2])
def test_nccl_all_reduce_uses_one_gpu_per_rank(world_size: int) -> None:
    results = run_distributed(_cuda_all_reduce, world_size, backend="nccl")  # skips on CPU
    total = world_size * (world_size + 1) / 2
    assert [device for device, _ in results] == list(range(world_size))
    for _, x in results:
        torch.testing.assert_close(x, torch.full((2,), total))
