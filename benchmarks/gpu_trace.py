"""Timeline of FSDP steps with 2 ranks sharing one GPU: its collectives on their own streams.

    torchrun --standalone --nproc_per_node=2 benchmarks/gpu_trace.py   # or benchmarks/gpu.sh

At world size 1 every collective is the identity and runs on the compute stream ([Note:
collectives on one rank]), so a one-GPU timeline of a single rank shows no communication
stream. Here two processes share ``cuda:0`` through gloo ([Note: collectives on gloo]): FSDP
issues its all-gathers and reductions on side streams ([Note: communication streams]) and the
trace's communication lanes are named by the stream each collective was issued on. Writes
``--out/fsdp_2ranks.trace.json`` (and ``.png`` with matplotlib). ``--device cpu``: a smoke test
of this script (no streams there).
"""

import argparse
import contextlib
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.gpu_throughput import step  # noqa: E402
from example.model import GPT2Model, GPTConfigs  # noqa: E402
from tiny_fsdp.core.fsdp import FSDP, FSDPAdamW  # noqa: E402
from tiny_fsdp.core.precision import MixedPrecisionPolicy  # noqa: E402
from tiny_fsdp.trace.session import StepTracer  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt2_mini", choices=GPTConfigs.names())
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--steps", type=int, default=4, help="the last one is traced")
    p.add_argument("--out", default="out/gpu/trace")
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    dist.init_process_group("gloo")  # every rank on the same device: NCCL refuses that
    rank = dist.get_rank()
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    config = getattr(GPTConfigs, args.model)
    torch.manual_seed(0)
    model = FSDP(GPT2Model(config).to(device), mixed_precision=MixedPrecisionPolicy())
    optimizer = FSDPAdamW(model.named_parameters(), lr=3e-4)
    tracer = StepTracer(args.out, "fsdp_2ranks", [args.steps - 1], model, optimizer, rank)
    g = torch.Generator().manual_seed(rank)
    for i in range(args.steps):
        x = torch.randint(0, config.vocab_size, (args.batch_size, args.seq_len), generator=g)
        x, y = x.to(device), torch.roll(x, -1, 1).to(device)
        tracer.start(i)
        step(model, optimizer, contextlib.nullcontext(), x, y)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        tracer.stop()
    for path in tracer.finish():
        print(f"trace written: {path}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
