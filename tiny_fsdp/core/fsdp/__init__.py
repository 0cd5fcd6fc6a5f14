"""Fully sharded data parallelism: ``FSDP`` wrapper and the optimizers over its shards."""

from tiny_fsdp.core.fsdp.fsdp import FSDP
from tiny_fsdp.core.state_dicts import IncompatibleKeys
from tiny_fsdp.core.fsdp.mesh import MeshGroups, hsdp_mesh
from tiny_fsdp.core.fsdp.optim import FSDPSGD, FSDPAdamW
from tiny_fsdp.core.fsdp.sharded_param import ShardedParam, shard_info
from tiny_fsdp.core.fsdp.state import FSDPState
from tiny_fsdp.core.fsdp.unit import GatherUnit

__all__ = [
    "FSDP",
    "FSDPAdamW",
    "FSDPSGD",
    "FSDPState",
    "GatherUnit",
    "IncompatibleKeys",
    "MeshGroups",
    "ShardedParam",
    "hsdp_mesh",
    "shard_info",
]
