"""FSDP shards' optimizer state as DTensors, the form torch's distributed checkpoint saves.

Each state tensor shaped like a shard's rows becomes a ``Shard(0)`` DTensor viewing this rank's
real rows: global shape the parameter's full shape (a 0-d parameter: one row), over the shard
group's ranks (HSDP: the replicas' identical chunks are written once). Our rows split exactly as
a DTensor's (``ceil(rows / world_size)`` per rank, the last ranks short or empty: [Note: dim-0
shards]), so DCP writes every row once and loads at any world size. 0-d state (``step``) is
the same on every rank and stays plain. ``padded``: the state covers the whole padded shard
(``torch.optim``'s optimizers), not only the real rows (tiny_fsdp's). [Note: torch's
distributed checkpoint].
"""

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from tiny_fsdp.core.fsdp.sharded_param import ShardedParam, shard_info

# torch.distributed.tensor is imported when used (0.6 s): DCP has imported it by then.
_MESHES: Dict[Tuple[int, str], Tuple[Any, Any]] = {}  # (group, mesh), group kept alive


def _mesh(group: Optional[Any], device_type: str) -> Any:
    """The 1-D device mesh of ``group``'s ranks (None: every rank), made once per group."""
    from torch.distributed.device_mesh import DeviceMesh

    group = group if group is not None else dist.group.WORLD
    key = (id(group), device_type)
    if key not in _MESHES or _MESHES[key][0] is not group:
        _MESHES[key] = (group, DeviceMesh.from_group(group, device_type))
    return _MESHES[key][1]


def _global_shape(info: ShardedParam) -> Tuple[int, ...]:
    return (info.rows, *info.row_shape)


def _is_rows(key: str, value: Any, info: ShardedParam, padded: bool) -> bool:
    """Whether ``value`` is elementwise state of this rank's shard (else a scalar)."""
    rows = info.shard_rows if padded else info.valid_rows
    return (
        isinstance(value, Tensor)
        and key != "step"
        and tuple(value.shape) == (rows, *info.row_shape)
    )


def _params_in_order(param_groups: List[Dict[str, Any]]) -> List[Tensor]:
    """Parameters in the order ``torch.optim.Optimizer.state_dict`` numbers them."""
    return [p for group in param_groups for p in group["params"]]


def to_dtensors(
    state_dict: Dict[str, Any], param_groups: List[Dict[str, Any]], padded: bool
) -> Dict[str, Any]:
    """``state_dict`` (torch.optim's, of FSDP shards) with every rows tensor a ``Shard(0)``
    DTensor viewing its real rows; the optimizer's own state dicts are not modified."""
    params = _params_in_order(param_groups)
    state = {}
    for index, entry in state_dict["state"].items():
        info = shard_info(params[index])
        state[index] = {k: _as_dtensor(k, v, info, padded) for k, v in entry.items()}
    return {**state_dict, "state": state}


def _as_dtensor(key: str, value: Any, info: Optional[ShardedParam], padded: bool) -> Any:
    from torch.distributed.tensor import DTensor, Shard

    if info is None or not _is_rows(key, value, info, padded):  # a scalar, or not a shard's
        return value
    shape = _global_shape(info)
    return DTensor.from_local(
        value[: info.valid_rows],
        _mesh(info.group, value.device.type),
        [Shard(0)],
        run_check=False,
        shape=torch.Size(shape),
        stride=torch.empty(shape, device="meta").stride(),
    )


def from_dtensors(
    state_dict: Dict[str, Any], param_groups: List[Dict[str, Any]], padded: bool, what: str
) -> Dict[str, Any]:
    """``to_dtensors``' inverse: every DTensor replaced by this rank's rows (zero-padded to the
    shard when ``padded``), after checking that it is this rank's part of the parameter's
    state; a plain tensor of more than 0 dims is refused (another rank's part, or another form).

    ``state_dict["state"]`` may be keyed by index or, from ``set_state_dict``, by the saved
    parameter names, in the order of ``state_dict["param_groups"]``.
    """
    saved = [key for group in state_dict["param_groups"] for key in group["params"]]
    position = {key: i for i, key in enumerate(saved)}
    params = _params_in_order(param_groups)
    state = {}
    for key, entry in state_dict["state"].items():
        index = position.get(key, key)
        info = shard_info(params[index]) if isinstance(index, int) and index < len(params) else None
        state[key] = {k: _as_local(k, v, info, padded, what, key) for k, v in entry.items()}
    return {**state_dict, "state": state}


def _as_local(
    key: str, value: Any, info: Optional[ShardedParam], padded: bool, what: str, name: Any
) -> Any:
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(value, DTensor):
        if isinstance(value, Tensor) and value.dim() > 0:
            raise ValueError(
                f"{what}.load_state_dict: state '{key}' of parameter {name!r} is a plain tensor; "
                "through torch's distributed checkpoint an FSDP shard's state is a DTensor (the "
                "form get_state_dict(model, optimizer) gives for this model and optimizer)"
            )
        return value
    expected = None if info is None else _global_shape(info)
    mesh = value.device_mesh
    if (
        info is None
        or tuple(value.placements) != (Shard(0),)
        or mesh.ndim != 1
        or mesh.size() != info.world_size
        or mesh.get_local_rank() != info.rank
        or tuple(value.shape) != expected
    ):
        raise ValueError(
            f"{what}.load_state_dict: state '{key}' of parameter {name!r} is a DTensor of shape "
            f"{tuple(value.shape)} placed {tuple(value.placements)} on {mesh.size()} ranks; "
            f"expected Shard(0) of shape {expected} over this model's shard group (the form "
            "get_state_dict(model, optimizer) gives for this model and optimizer)"
        )
    rows = value.to_local()
    if not padded:
        return rows
    shard = rows.new_zeros(info.shard_shape)
    shard[: info.valid_rows].copy_(rows)
    return shard
