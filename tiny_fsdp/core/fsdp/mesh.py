"""Hybrid sharding (HSDP): which ranks share one copy of the shards, and which hold copies.

[Note: hybrid sharding]
``FSDP(model, mesh=mesh)`` with a 2-D ``DeviceMesh`` of shape ``(replicas, shard_size)`` and dim
names ``("replicate", "shard")`` shards every parameter over the ranks of one *shard group* (a row
of the mesh: ranks ``[g * shard_size, (g + 1) * shard_size)``, typically one node) and keeps one
copy of those shards in each of the ``replicas`` rows. The shard group plays the part the whole
world plays in plain FSDP: dim-0 shards of ``1 / shard_size`` ([Note: dim-0 shards]), all-gathers
and reduce-scatters inside it. Gradients are averaged over the whole world in two steps:

    g_shard = reduce_scatter_shard_group(g_full / world_size)   # (numel / shard_size,)
    g_shard = all_reduce_replicate_group(g_shard)                 # sum over the replicas

both launched from the backward, once per unit ([Note: unit reduction]), and delivered at its
end ([Note: asynchronous reduction]); the all-reduce may only start once the reduce-scatter it
reads has finished (CUDA: same-stream order; gloo: a collective on another group runs on
another thread, so it is issued when the first one is done, see ``PendingReductions``). So
per step a rank moves what FSDP on ``shard_size`` ranks moves inside its node, plus one
all-reduce of its ``1 / shard_size`` of the gradients across nodes, instead of every
all-gather and reduce-scatter crossing the nodes.

On gloo the all-reduce is thus issued up to one unit's backward late (by the next launch that
finds the reduce-scatter done); issuing it at once and waiting on the host would stall the
backward instead. Per rank, memory is FSDP's on ``shard_size`` ranks (1 / shard_size of the
parameters, gradients and optimizer state), and the ledger counts the shard group's collectives
under ``"shard"`` and the all-reduces under ``"replicate"`` ([Note: communication ledger]): per
step, for P padded parameter bytes, all-gathers of P (once or twice, as in FSDP) and
reduce-scatters of P inside the group, and all-reduces of P / shard_size across it. The edge
layouts: 1 x N issues exactly plain FSDP's collectives (bitwise the same results, only labelled);
N x 1 keeps whole tensors (gathers and reduce-scatters over one rank are copies) and all-reduces
every gradient, as DDP does, per unit.

Each shard group holds the whole model once, so what "every element once" means is per shard
group: a gradient norm sums the squares over the shard group only (the replicas hold the same
numbers), and a checkpoint is written by replica 0 alone (``FSDP.saved_piece``); loading fills
every replica. ``mesh=None`` or a 1-D mesh over every rank is plain FSDP (one shard group, no
replicas), with exactly its collectives. ZeRO-3 takes no mesh: its units are whole tensors owned
by single ranks, and replicating owners across nodes is a different partition, left undone.

Bad meshes raise on every rank before any collective of the wrapper: a mesh that is not 1-D or
2-D, dim names other than ``("replicate", "shard")``, or a mesh that does not cover the world;
``hsdp_mesh`` also refuses sizes that do not multiply to the world size and, when asked for
node-local shard groups, a shard group spanning two nodes.
"""

import os
import socket
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch.distributed as dist

from tiny_fsdp.core import comm
from tiny_fsdp.core.utils.dist import default_device_type

DIM_NAMES = ("replicate", "shard")


@dataclass(frozen=True)
class MeshGroups:
    """This rank's place in the (replicas, shard_size) mesh ([Note: hybrid sharding]).

    ``shard_group`` / ``replicate_group``: process groups of this rank's row / column; None for
    the default group (plain FSDP) / no replicas. ``hybrid``: built from a 2-D mesh; its
    collectives are then counted per group in the ledger ([Note: communication ledger]).
    """

    shard_group: Optional[Any]
    shard_size: int
    shard_rank: int
    replicate_group: Optional[Any]
    replicas: int
    replicate_rank: int
    hybrid: bool = False

    def __deepcopy__(self, memo: Dict[int, Any]) -> "MeshGroups":
        """The same groups: a copied model runs on the same ranks ([Note: copying a wrapped
        model]); a process group cannot be copied."""
        return self

    @property
    def shard_label(self) -> Optional[str]:
        """Ledger label of the shard group's collectives (None: plain FSDP, unlabelled)."""
        return "shard" if self.hybrid else None

    @property
    def world_size(self) -> int:
        """Ranks a gradient is averaged over: every rank of the mesh."""
        return self.shard_size * self.replicas


def mesh_groups(mesh: Optional[Any], what: str = "FSDP") -> MeshGroups:
    """The groups of ``mesh`` (None: the default group), checked; raises on every rank alike."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if mesh is None:
        return MeshGroups(None, world, rank, None, 1, 0)
    ndim = getattr(mesh, "ndim", None)
    if ndim not in (1, 2):
        raise ValueError(
            f"{what}(mesh=...) takes a 1-D or 2-D DeviceMesh (replicate, shard), got {mesh!r}"
        )
    if mesh.size() != world:
        raise ValueError(
            f"{what}: the mesh {tuple(mesh.shape)} has {mesh.size()} ranks but the process group "
            f"has {world}; the mesh must cover every rank (replicas * shard_size == world size)"
        )
    if ndim == 1:
        return MeshGroups(None, world, rank, None, 1, 0)  # plain FSDP over every rank
    names = mesh.mesh_dim_names
    if names is not None and tuple(names) != DIM_NAMES:
        raise ValueError(
            f"{what}: a 2-D mesh must have dims named {DIM_NAMES} (replicas first), got {names}: "
            f"init_device_mesh(device_type, (replicas, shard_size), mesh_dim_names={DIM_NAMES})"
        )
    replicas, shard_size = tuple(mesh.shape)
    shard_group, replicate_group = mesh.get_group(1), mesh.get_group(0)
    return MeshGroups(
        shard_group,
        shard_size,
        mesh.get_local_rank(1),
        replicate_group if replicas > 1 else None,
        replicas,
        mesh.get_local_rank(0),
        hybrid=True,
    )


def hsdp_mesh(
    replicas: Optional[int] = None,
    *,
    device_type: Optional[str] = None,
    node_local: bool = True,
) -> Any:
    """A ``(replicas, world / replicas)`` DeviceMesh named ``("replicate", "shard")``.

    ``replicas`` defaults to the number of nodes (``world / LOCAL_WORLD_SIZE``, torchrun's ranks
    per node), so that a shard group is one node. With ``node_local`` every shard group must lie
    on one node (torchrun's ``GROUP_RANK``, else the host name, tells the node); a call on every
    rank, which raises on every rank alike when the sizes or the placement are wrong.
    ``device_type``: the mesh's device, by default the default process group's (``"cuda"`` on
    NCCL, else ``"cpu"``).
    """
    from torch.distributed.device_mesh import init_device_mesh

    if device_type is None:
        device_type = default_device_type()

    world = dist.get_world_size()
    if replicas is None:
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        replicas = max(1, world // per_node)
    if replicas < 1 or world % replicas:
        raise ValueError(
            f"hsdp_mesh: {replicas} replica groups do not divide the world size {world}; "
            "pick a number of replica groups that divides it (one per node for node-local shards)"
        )
    shard_size = world // replicas
    if node_local:
        node = os.environ.get("GROUP_RANK") or socket.gethostname()
        nodes = comm.all_gather_object(node)  # every rank gets the same list: same verdict
        for start in range(0, world, shard_size):
            spanned = sorted({str(n) for n in nodes[start : start + shard_size]})
            if len(spanned) > 1:
                raise ValueError(
                    f"hsdp_mesh: the shard group of ranks {start}..{start + shard_size - 1} "
                    f"spans nodes {spanned}, but node-local shard groups were asked for. Use "
                    f"more replica groups (at least one per node: --hsdp {world // len(set(nodes))}"
                    ") or pass node_local=False to shard across nodes."
                )
    return init_device_mesh(device_type, (replicas, shard_size), mesh_dim_names=DIM_NAMES)
