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
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tiny_fsdp.plan.calibration import KINDS, Calibration
from tiny_fsdp.plan.model_costs import ModelCosts
from tiny_fsdp.plan.probe import (
    PROBE_ROWS,
    UNITS,
    WRAPPED,
    Probe,
    fit_wrapper_costs,
    wide_dims,
    wrap_probe,
)

DEFAULT_SIZES = (2**12, 2**16, 2**20, 2**24)  # payload bytes of the collectives timed
DEFAULT_SHAPE = (2048, *ModelCosts.matmul_shape)  # (rows, in, out) when no model is given
# AdamW over this many small tensors: the cost per tensor. Of SMALL_NUMEL elements: one vector
# row of the CPU's fused AdamW, which a tensor whose size is a multiple of 64 (most of a
# model's) adds; one with a tail adds about five times more ([Note: fused AdamW on the CPU]).
SMALL_TENSORS, SMALL_NUMEL = 32, 64
SAMPLE_S = 0.02  # a compute sample runs its benchmark back to back for about this long


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_s(fn: Callable[[], None], device: torch.device) -> float:
    """Seconds of one ``fn`` started on every rank together (after a barrier)."""
    _sync(device)
    dist.barrier()
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


class Calibrator:
    """Micro-benchmarks of this machine on the default group ([Note: calibration]).

    ``sample()`` runs each once on every rank at the same time; ``result()`` is the medians of
    the slowest rank's samples and the alpha-beta fits. Calling ``sample()`` between the steps
    of a workload calibrates the machine under the same load as the workload.

    Benchmarks: matrix products of ``shape = (rows, in, out)`` (forward and both backward
    products); a LayerNorm + GELU forward and backward (elementwise work per activation byte);
    one AdamW step of 2^18 elements, and one of 32 tensors of 16 (its cost per tensor); a
    forward and backward of 8 tiny layers, linear and layer norm (the fixed cost of a layer);
    the same probe with layers of about the model's scale (``wide_dims``), plain and under each
    strategy with its default arguments, and for ZeRO-3 and FSDP also with the same layers in
    half as many units (``calibration_from`` turns what each wrapper adds into its cost per
    layer and per unit, [Note: wrapper costs]); every collective kind at each of
    ``sizes`` payload bytes, back to back (in a step the ranks do not arrive together, as they
    do right after a barrier: on a shared CPU a rank that waits must be woken); an asynchronous
    all-reduce issued before the matrix products and waited for after them (``overlap``).
    """

    def __init__(self, device: torch.device, shape=DEFAULT_SHAPE, sizes=DEFAULT_SIZES) -> None:
        from tiny_fsdp.core.optim import AdamW

        self.device, self.shape, self.sizes = device, tuple(shape), tuple(sizes)
        rows, d_in, d_out = shape
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self._x = torch.randn(rows, d_in, device=device, dtype=dtype)
        self._w = torch.randn(d_in, d_out, device=device, dtype=dtype)
        self._g = torch.randn(rows, d_out, device=device, dtype=dtype)
        self._act = torch.randn(rows, d_out, device=device, dtype=dtype, requires_grad=True)
        self._norm = nn.LayerNorm(d_out).to(device=device, dtype=dtype)
        self._param = nn.Parameter(torch.zeros(2**18, device=device))
        self._param.grad = torch.ones_like(self._param)
        self._adamw = AdamW([self._param], lr=1e-3)
        self._small = [
            nn.Parameter(torch.zeros(SMALL_NUMEL, device=device)) for _ in range(SMALL_TENSORS)
        ]
        for p in self._small:
            p.grad = torch.ones_like(p)
        self._adamw_small = AdamW(self._small, lr=1e-3)  # its fixed cost per tensor
        # [Note: wrapper costs]: tiny layers for the fixed cost of a layer ("plain"), layers
        # of about the model's scale for what each wrapper adds (paired with "plain wide").
        self.wide = wide_dims(shape)
        rows_wide, width = self.wide
        self._probes = {"plain": wrap_probe("plain", device)}
        self._probes["plain wide"] = wrap_probe("plain", device, width=width)
        for name in WRAPPED:
            self._probes[name] = wrap_probe(name, device, width=width)
        for name in UNITS:  # the same layers in half as many units: per-unit cost apart
            self._probes[f"{name} x2"] = wrap_probe(name, device, per_block=2, width=width)
        self._probe_in = torch.randn(PROBE_ROWS, 8, device=device)  # Probe's default width
        self._wide_in = torch.randn(rows_wide, width, device=device)
        self._samples: Dict[str, List[float]] = {}
        self._repeats: Dict[str, int] = {}  # runs per sustained sample (same on every rank)
        for name in self._probes:  # warm-up: the first steps build the optimizer state
            self._probe_step(name)
            self._probe_step(name)

    def _probe_step(self, name: str) -> None:
        model, optimizer = self._probes[name]
        model(self._probe_in if name == "plain" else self._wide_in).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def _record(self, key: str, fn: Callable[[], None], sustained: bool = False) -> None:
        """One sample of ``fn``, seconds per run. ``sustained``: run it back to back for about
        ``SAMPLE_S`` (about a small training step: on a shared CPU a short burst escapes
        the preemptions that a longer run suffers); the count is fixed at the first sample."""
        repeat = 1
        if sustained:
            if key not in self._repeats:  # every rank the same count: probes communicate
                once = _timed_s(fn, self.device)
                count = torch.tensor([max(1, round(SAMPLE_S / max(1e-6, once)))])
                dist.all_reduce(count, op=dist.ReduceOp.MAX)
                self._repeats[key] = int(count.item())
            repeat = self._repeats[key]

        def runs() -> None:
            for _ in range(repeat):
                fn()

        self._samples.setdefault(key, []).append(_timed_s(runs, self.device) / repeat)

    def reset(self) -> None:
        """Forget the samples taken so far (e.g. a warm-up)."""
        self._samples.clear()

    def sample(self) -> None:
        """Run every benchmark once, on every rank at once."""
        from tiny_fsdp.core import comm

        x, w, g = self._x, self._w, self._g
        self._record("matmul", lambda: (x @ w, g @ w.T, x.T @ g), True)
        elementwise = lambda: F.gelu(self._norm(self._act)).sum().backward()  # noqa: E731
        self._record("elementwise", elementwise, True)
        self._record("adamw", self._adamw.step, True)
        self._record("adamw small", self._adamw_small.step, True)
        for name in self._probes:
            self._record(f"probe {name}", lambda: self._probe_step(name), True)
        # Overlap: an asynchronous all-reduce issued before the matrix products, waited after.
        busy = torch.zeros(max(1, self.sizes[-1] // 4), device=self.device)
        repeat = self._repeats["matmul"]
        products = lambda: [(x @ w, g @ w.T, x.T @ g) for _ in range(repeat)]  # noqa: E731
        self._record(
            "overlap", lambda: (comm.all_reduce(busy, async_op=True), products())[0].wait()
        )
        self._record("overlap comm", lambda: comm.all_reduce(busy))
        n = dist.get_world_size()
        for size in self.sizes:
            numel = max(n, size // 4 // n * n)
            full = torch.zeros(numel, device=self.device)
            part = torch.zeros(numel // n, device=self.device)
            calls = {
                "all_reduce": lambda: comm.all_reduce(full),
                "all_gather": lambda: comm.all_gather(full, part),
                "reduce_scatter": lambda: comm.reduce_scatter(part, full),
                "broadcast": lambda: comm.broadcast(full, src=0),
                "reduce": lambda: comm.reduce(full, dst=0),
            }
            for kind in KINDS:
                self._record(f"{kind} {numel * 4}", calls[kind], True)

    def result(self) -> Tuple[Dict[str, Any], Dict[str, Dict[str, float]]]:
        """``(compute, collectives)``: per benchmark the median over samples of the slowest
        rank's time (a synchronous step waits for its slowest rank, and so does its median step),
        the same on every rank."""
        keys = sorted(self._samples)
        slowest = torch.tensor([self._samples[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # samples were taken together
        samples = dict(zip(keys, slowest.tolist()))
        med = {k: statistics.median(row) for k, row in samples.items()}
        extra_s = {}  # what each wrapper adds to the plain wide probe, paired by sample
        for name in WRAPPED + tuple(f"{u} x2" for u in UNITS):
            pairs = zip(samples[f"probe {name}"], samples["probe plain wide"])  # same sample
            extra_s[name] = statistics.median(a - b for a, b in pairs)
        rows, d_in, d_out = self.shape
        fits = {}
        for kind in KINDS:
            points = [(float(k.split()[1]), v) for k, v in med.items() if k.split()[0] == kind]
            fits[kind] = _fit(points)
        layers = Probe().layers
        act_bytes = 2 * self._act.numel() * self._act.element_size()  # act and GELU's input
        compute = {
            "flops_per_s": 3 * 2 * rows * d_in * d_out / med["matmul"],
            "optimizer_s_per_param": med["adamw"] / self._param.numel(),
            "optimizer_s_per_tensor": max(
                0.0,
                med["adamw small"] / SMALL_TENSORS
                - SMALL_NUMEL * med["adamw"] / self._param.numel(),
            ),
            "layer_overhead_s": med["probe plain"] / layers,
            "activation_s_per_byte": med["elementwise"] / act_bytes,
            "probe_extra_s": extra_s,  # turned into wrapper costs by calibration_from
            "probe_dims": list(self.wide),
            "shape": list(self.shape),
            "overlap": _overlap(
                self._repeats["matmul"] * med["matmul"], med["overlap comm"], med["overlap"]
            ),
        }
        return compute, fits


def _overlap(compute_s: float, comm_s: float, both_s: float) -> float:
    """The share of the shorter of two tasks hidden when they run together: 1 if together they
    take the longer one's time, 0 if the sum."""
    hidden = compute_s + comm_s - both_s
    return min(1.0, max(0.0, hidden / max(1e-12, min(compute_s, comm_s))))


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
    """``(compute, collectives)`` of ``reps`` samples on the default group ([Note:
    calibration]), identical on every rank."""
    calibrator = Calibrator(device, shape, sizes)
    calibrator.sample()  # warm-up
    calibrator.reset()
    for _ in range(reps):
        calibrator.sample()
    return calibrator.result()


def _worker(rank: int, world: int, port: int, use_cuda: bool, shape, sizes, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if world > 1 and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)  # as torchrun sets it for several processes on one machine
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
    calibration = Calibration(
        name=name or f"measured-{backend}",
        backend=backend,
        flops_per_s=compute["flops_per_s"],
        optimizer_s_per_param=compute["optimizer_s_per_param"],
        optimizer_s_per_tensor=compute.get("optimizer_s_per_tensor", 0.0),
        layer_overhead_s=compute["layer_overhead_s"],
        activation_s_per_byte=compute["activation_s_per_byte"],
        comm_channels=2 if backend == "gloo" else 1,  # gloo's default worker threads
        overlap=compute.get("overlap", 1.0),
        latency_s=latency,
        bandwidth_bytes_per_s=bandwidth,
        collectives=collectives,
        shape=tuple(compute["shape"]),
        sources={
            "compute": f"{where}; {largest} ranks computing at once, shape {compute['shape']}",
            "collectives": f"{where}; world sizes {sorted(per_world)}",
            "link": f"fitted to the all_gather of {largest} ranks (ring model)",
        },
    )
    dims = tuple(compute["probe_dims"])
    fit_wrapper_costs(calibration, compute["probe_extra_s"], dims, largest)  # [Note: wrapper costs]
    return calibration
