"""Process-group set-up shared by every strategy and example."""

import os
from dataclasses import dataclass
from typing import Optional

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


def init_distributed(device: Optional[str] = None) -> DistEnv:
    """Initialise the default process group from torchrun's environment (or a 1-rank group).

    ``RANK`` and ``WORLD_SIZE`` are global; ``LOCAL_RANK`` (the rank on this node) picks the
    CUDA device, so the same script runs on several nodes. The backend is NCCL on CUDA, gloo on
    CPU. Without torchrun's variables a single-process group is made on a free local port.
    """
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
        dist.init_process_group(
            "nccl" if dev.type == "cuda" else "gloo", rank=rank, world_size=world_size
        )
    return DistEnv(rank, local_rank, world_size, dev)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
