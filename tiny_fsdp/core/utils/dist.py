"""Process-group set-up shared by every strategy and example."""

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterable, Optional, Tuple

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits. ``rank`` is global (``RANK``); ``local_rank`` picks the device."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_master(self) -> bool:
        return self.rank == 0


def require_process_group(what: str) -> None:
    """Raise a RuntimeError that says how to fix a missing process group."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{what} needs an initialised process group: call "
            "torch.distributed.init_process_group('gloo' or 'nccl') first, or launch with "
            "torchrun and call tiny_fsdp.core.utils.dist.init_distributed()."
        )


def init_distributed(device: Optional[str] = None, timeout_s: Optional[float] = None) -> DistEnv:
    """Initialise the default process group from torchrun's environment (or a 1-rank group).

    ``RANK`` and ``WORLD_SIZE`` are global; ``LOCAL_RANK`` (the rank on this node) picks the
    CUDA device, so the same script runs on several nodes. The backend is NCCL on CUDA, gloo on
    CPU. Without torchrun's variables a single-process group is made on a free local port.
    ``timeout_s``: how long a collective may wait for the other ranks before it raises (None:
    torch's default, 30 min for gloo); also applied to an already initialised group.
    """
    if timeout_s is not None and not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive or None, got {timeout_s}")
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} CUDA devices: "
                "launch at most that many processes per node, or pass --device cpu."
            )
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ:
            os.environ["MASTER_ADDR"] = "127.0.0.1"
            os.environ["MASTER_PORT"] = str(_free_port())
        timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
        dist.init_process_group(
            "nccl" if dev.type == "cuda" else "gloo",
            rank=rank,
            world_size=world_size,
            timeout=timeout,
        )
    elif timeout_s is not None:
        set_collective_timeout(timeout_s)
    return DistEnv(rank, local_rank, world_size, dev)


def get_collective_timeout(group: Optional[dist.ProcessGroup] = None) -> Optional[float]:
    """Seconds a collective of ``group`` (default group) waits before raising; None if unknown."""
    if group is None:
        group = dist.distributed_c10d._get_default_group()
    for device in group._device_types:
        try:
            return group._get_backend(device).options._timeout.total_seconds()
        except (AttributeError, RuntimeError):
            continue
    return None


def set_collective_timeout(timeout_s: float, group: Optional[dist.ProcessGroup] = None) -> None:
    """Make every later collective of ``group`` (default group) raise after ``timeout_s``.

    gloo raises in the waiting collective; NCCL's watchdog aborts the communicator. Uses torch's
    private ``_set_pg_timeout`` (no public API changes the timeout of an existing group).
    """
    setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if setter is None:
        raise RuntimeError(
            "this torch version cannot change the timeout of an existing process group; pass "
            "timeout=datetime.timedelta(seconds=...) to init_process_group (or timeout_s to "
            "tiny_fsdp.core.utils.dist.init_distributed) instead"
        )
    setter(timedelta(seconds=timeout_s), group)


def default_device_type() -> str:
    """The device type the default process group communicates: ``"cuda"`` on NCCL (which moves
    CUDA tensors only), else ``"cpu"``."""
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def default_device() -> torch.device:
    """The default group's device (``default_device_type``): the current CUDA device on NCCL."""
    if default_device_type() == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_backend_device(
    named_tensors: Iterable[Tuple[str, torch.Tensor]],
    what: str,
    allow_meta: bool = False,
    backend: Optional[str] = None,
) -> None:
    """Raise ValueError (saying how to fix it) if a tensor's device cannot be communicated.

    ``backend``: default the default group's. NCCL moves CUDA tensors only; gloo moves CPU and
    CUDA tensors (CUDA reductions through an all-reduce, [Note: collectives on gloo]). ``meta``
    tensors hold no data: only a strategy that materialises them (``allow_meta``) accepts them.
    """
    backend = str(backend or dist.get_backend()).lower()
    for name, tensor in named_tensors:
        kind = tensor.device.type
        if kind == "meta":
            if allow_meta:
                continue
            raise ValueError(
                f"{what}: parameter '{name}' is on the meta device (no data), and {what} does "
                "not materialise parameters. Build the model on a real device, or materialise "
                "it first (model.to_empty(device=...) then initialise it), or use FSDP / Zero3, "
                "which initialise a meta model one tensor at a time (model.init_parameter(name, "
                "tensor), else the model's own init of each module)."
            )
        if backend == "nccl" and kind != "cuda":
            raise ValueError(
                f"{what}: parameter '{name}' is on {tensor.device} but the process group uses "
                "NCCL, which only communicates CUDA tensors. Move the model to its GPU first "
                "(model.to(f'cuda:{LOCAL_RANK}')), or train on CPU with a gloo group "
                "(init_distributed(device='cpu'))."
            )
        if backend == "gloo" and kind not in ("cpu", "cuda"):
            raise ValueError(
                f"{what}: parameter '{name}' is on {tensor.device}, which gloo cannot "
                "communicate. Move the model to CPU (or CUDA with an NCCL group)."
            )


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
