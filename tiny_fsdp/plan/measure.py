"""``--calibrate``: measure this machine's compute rates and collective costs ([Note: calibration]).

``calibrate_in_group`` runs on every rank of a live process group (all ranks compute at once,
which is how the strategies use the machine); ``calibrate`` spawns the groups itself (gloo on
CPU, NCCL on CUDA) for each world size and merges the results into one ``Calibration``.
Timings are medians of several repetitions, each started together after a barrier.
"""

import os
import socket
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from tiny_fsdp.plan.calibration import KINDS, Calibration

DEFAULT_SIZES = (2**12, 2**16, 2**20)  # payload bytes of the collectives timed
DEFAULT_SHAPE = (2048, 1024, 4096)  # (rows, in, out) of the timed matrix product


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_s(fn: Callable[[], None], device: torch.device, reps: int, group_sync: bool) -> float:
    """Median seconds of ``fn`` over ``reps`` runs (after one warm-up), the slowest rank's."""
    fn()
    times = []
    for _ in range(reps):
        _sync(device)
        if group_sync:
            dist.barrier()
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    t = torch.tensor([statistics.median(times)], dtype=torch.float64)
    if group_sync:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def measure_compute(
    device: torch.device, shape: Sequence[int] = DEFAULT_SHAPE, reps: int = 5
) -> Dict[str, float]:
    """Matrix-product FLOP/s (forward and both backward products, as training runs them),
    elementwise seconds per activation byte, AdamW seconds per element and the fixed seconds
    per layer, every rank at once ([Note: calibration])."""
    from tiny_fsdp.core.optim import AdamW

    rows, d_in, d_out = shape
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.randn(rows, d_in, device=device, dtype=dtype)
    w = torch.randn(d_in, d_out, device=device, dtype=dtype)
    g = torch.randn(rows, d_out, device=device, dtype=dtype)

    def products() -> None:
        x @ w, g @ w.T, x.T @ g  # forward, input gradient, weight gradient

    grouped = dist.is_initialized()
    matmul_s = _median_s(products, device, reps, grouped)
    param = nn.Parameter(torch.zeros(2**20, device=device))
    param.grad = torch.ones_like(param)
    optimizer = AdamW([param], lr=1e-3)
    optimizer_s = _median_s(optimizer.step, device, reps, grouped)
    act = torch.randn(rows, d_out, device=device, dtype=dtype, requires_grad=True)
    norm = nn.LayerNorm(d_out).to(device=device, dtype=dtype)

    def elementwise() -> None:  # keeps act and the norm's output (GELU's input): 2 tensors
        torch.nn.functional.gelu(norm(act)).sum().backward()

    elementwise_s = _median_s(elementwise, device, reps, grouped)
    width = 8  # a layer so small that its time is the fixed cost of running a layer
    layers = nn.Sequential(*(nn.Linear(width, width) for _ in range(16))).to(device)
    small = torch.randn(4, width, device=device)
    layer_s = _median_s(lambda: layers(small).sum().backward(), device, reps, grouped)
    return {
        "flops_per_s": 3 * 2 * rows * d_in * d_out / matmul_s,
        "optimizer_s_per_param": optimizer_s / param.numel(),
        "layer_overhead_s": layer_s / len(layers),
        "activation_s_per_byte": elementwise_s / (2 * act.numel() * act.element_size()),
    }


def measure_collectives(
    device: torch.device, sizes: Sequence[int] = DEFAULT_SIZES, reps: int = 5
) -> Dict[str, Dict[str, float]]:
    """``{kind: {"alpha_s", "beta_s_per_byte"}}`` on the default group, least squares over
    ``sizes`` (payload bytes, [Note: collective costs]), through ``tiny_fsdp.core.comm``."""
    from tiny_fsdp.core import comm

    n, rank = dist.get_world_size(), dist.get_rank()
    fits = {}
    for kind in KINDS:
        points: List[Tuple[float, float]] = []
        for size in sizes:
            numel = max(n, size // 4 // n * n)
            full = torch.zeros(numel, device=device)
            part = torch.zeros(numel // n, device=device)
            call = {
                "all_reduce": lambda: comm.all_reduce(full),
                "all_gather": lambda: comm.all_gather(full, part),
                "reduce_scatter": lambda: comm.reduce_scatter(part, full),
                "broadcast": lambda: comm.broadcast(full, src=0),
                "reduce": lambda: comm.reduce(full, dst=0),
            }[kind]
            points.append((numel * 4, _median_s(call, device, reps, True)))
        fits[kind] = _fit(points)
    del rank
    return fits


def _fit(points: Sequence[Tuple[float, float]]) -> Dict[str, float]:
    """Least-squares ``t = alpha + beta * bytes`` with both >= 0."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    beta = max(0.0, sum((x - mx) * (y - my) for x, y in points) / var) if var else 0.0
    alpha = max(0.0, my - beta * mx)
    return {"alpha_s": alpha, "beta_s_per_byte": beta}


def calibrate_in_group(
    device: torch.device,
    shape: Sequence[int] = DEFAULT_SHAPE,
    sizes: Sequence[int] = DEFAULT_SIZES,
    reps: int = 5,
) -> Tuple[Dict[str, float], Dict[str, Dict[str, float]]]:
    """``(compute, collectives)`` measured on the default group, identical on every rank."""
    return measure_compute(device, shape, reps), measure_collectives(device, sizes, reps)


def _worker(rank: int, world: int, port: int, use_cuda: bool, shape, sizes, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world)
    try:
        result = calibrate_in_group(device, shape, sizes)
        if rank == 0:
            queue.put(result)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def calibrate(
    world_sizes: Sequence[int] = (1, 2),
    shape: Sequence[int] = DEFAULT_SHAPE,
    sizes: Sequence[int] = DEFAULT_SIZES,
    name: Optional[str] = None,
) -> Calibration:
    """Measure this machine for each world size (processes of this host) ([Note: calibration])."""
    import torch.multiprocessing as mp

    use_cuda = torch.cuda.is_available()
    if use_cuda:
        world_sizes = [n for n in world_sizes if n <= torch.cuda.device_count()]
    ctx = mp.get_context("spawn")
    per_world = {}
    for world in world_sizes:
        queue = ctx.Queue()
        args = (world, _free_port(), use_cuda, tuple(shape), tuple(sizes), queue)
        mp.start_processes(_worker, args=args, nprocs=world, start_method="spawn")
        per_world[world] = queue.get()
    return calibration_from(per_world, "nccl" if use_cuda else "gloo", name=name)


def calibration_from(
    per_world: Dict[int, Tuple[Dict[str, float], Dict[str, Dict[str, float]]]],
    backend: str,
    name: Optional[str] = None,
) -> Calibration:
    """A ``Calibration`` from ``{world_size: calibrate_in_group(...)}``. Compute rates come from
    the largest world size measured (every rank computing at once); the ring link from the
    largest world size's all-gather fit ([Note: collective costs])."""
    largest = max(per_world)
    compute, _ = per_world[largest]
    collectives: Dict[str, Dict[int, Dict[str, float]]] = {k: {} for k in KINDS}
    for world, (_, fits) in per_world.items():
        for kind, fit in fits.items():
            collectives[kind][world] = fit
    ring = collectives["all_gather"].get(largest) if largest > 1 else None
    latency, bandwidth = 1e-4, 1e9
    if ring is not None:
        latency = ring["alpha_s"] / (largest - 1)
        beta = ring["beta_s_per_byte"]
        bandwidth = (largest - 1) / largest / beta if beta > 0 else 1e12
    where = f"measured by tiny_fsdp.plan --calibrate on {socket.gethostname()}, {time.ctime()}"
    return Calibration(
        name=name or f"measured-{backend}",
        backend=backend,
        flops_per_s=compute["flops_per_s"],
        optimizer_s_per_param=compute["optimizer_s_per_param"],
        layer_overhead_s=compute["layer_overhead_s"],
        activation_s_per_byte=compute["activation_s_per_byte"],
        latency_s=latency,
        bandwidth_bytes_per_s=bandwidth,
        collectives=collectives,
        sources={
            "compute": f"{where}; {largest} ranks computing at once",
            "collectives": f"{where}; world sizes {sorted(per_world)}",
            "link": f"fitted to the all_gather of {largest} ranks (ring model)",
        },
    )
