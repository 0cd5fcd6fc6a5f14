"""Specification: a finished job exits cleanly ([Note: leaving after collectives], core/comm.py).

gloo's worker thread keeps a collective's work, and so its tensors, until shortly after the
collective completes. When the script ends before that thread has dropped them, freeing a
tensor made in Python happens during interpreter shutdown and aborts the process ("terminate
called without an active exception", SIGABRT), which ``torchrun`` reports as a failed job.
A user's script ending in ``destroy_process_group()`` right after a step hit it in about 1 of 4
two-rank runs. The test below makes it certain: rank 0 issues an all-reduce it keeps no
reference to, and holds the GIL (a 60 s switch interval, pure Python) while rank 1 joins late;
the collective completes and the gloo thread waits for the GIL until the script has ended.
With ``torch.distributed.all_reduce`` instead of ``comm.all_reduce`` rank 0 aborts every time
(torch 2.13); through the library it exits with 0.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

from tests.harness import run_script_ranks

LATE_S = 0.5  # rank 1 joins the all-reduce this late
HOLD_S = 1.5  # rank 0 holds the GIL this long: the all-reduce completes meanwhile


def test_a_rank_whose_gloo_thread_holds_the_last_reference_exits_cleanly() -> None:
    results = run_script_ranks(os.path.join("tests", "test_exit.py"), 2)
    for rank, (code, out) in enumerate(results):
        assert code == 0, f"rank {rank} exited with {code}:\n{out[-2000:]}"
        assert "terminate called" not in out, out[-2000:]


def _rank_main() -> None:
    from tiny_fsdp.core import comm

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        time.sleep(LATE_S)
        comm.all_reduce(torch.ones(1000))
    else:
        comm.all_reduce(torch.ones(1000), async_op=True)  # neither the tensor nor the work kept
        sys.setswitchinterval(60.0)
        start = time.perf_counter()
        while time.perf_counter() - start < HOLD_S:
            pass
    # No destroy_process_group(): it releases the GIL, which would hide the hazard here.


if __name__ == "__main__":
    _rank_main()
