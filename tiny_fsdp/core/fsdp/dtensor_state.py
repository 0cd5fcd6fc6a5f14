"""FSDP shards and their optimizer state as DTensors, the form torch's DCP saves.

A parameter's shard (``FSDP.checkpoint_part``) and each state tensor shaped like it become a
``Shard(0)`` DTensor viewing this rank's real rows: global shape the parameter's full shape (a
0-d parameter's state: one row; the parameter itself is saved whole), over the shard group's
ranks (HSDP: the replicas' identical chunks are written once). Our rows split exactly as a
DTensor's (``ceil(rows / world_size)`` per rank, the last ranks short or empty: [Note: dim-0
shards]), so DCP writes every row once and loads at any world size. 0-d state (``step``) is the
same on every rank and stays plain. ``padded``: the state covers the whole padded shard
(``torch.optim``'s optimizers), not only the real rows (tiny_fsdp's). [Note: torch's distributed
checkpoint].
"""

import sys
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
    if info is None or not _is_rows(key, value, info, padded):  # a scalar, or not a shard's
        return value
    return rows_as_dtensor(value, info)


def rows_as_dtensor(shard: Tensor, info: ShardedParam) -> Any:
    """The real rows of ``shard`` (the rank's rows of a tensor shaped like the parameter,
    padding rows last) as a ``Shard(0)`` DTensor of the parameter's full shape; a view."""
    from torch.distributed.tensor import DTensor, Shard

    shape = _global_shape(info)
    return DTensor.from_local(
        shard[: info.valid_rows],
        _mesh(info.group, shard.device.type),
        [Shard(0)],
        run_check=False,
        shape=torch.Size(shape),
        stride=torch.empty(shape, device="meta").stride(),
    )


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a DTensor (without importing DTensor where none can exist)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def rows_of(value: Any, info: ShardedParam, what: str, name: Any = "") -> Tensor:
    """``rows_as_dtensor``'s inverse: this rank's real rows, after checking that ``value`` is
    this rank's part of a tensor shaped like the parameter (ValueError otherwise)."""
    from torch.distributed.tensor import Shard

    expected = _global_shape(info)
    mesh = value.device_mesh
    if (
        tuple(value.placements) != (Shard(0),)
        or mesh.ndim != 1
        or mesh.size() != info.world_size
        or mesh.get_local_rank() != info.rank
        or tuple(value.shape) != expected
    ):
        raise ValueError(
            f"{what}.load_state_dict: {name!r} is a DTensor of shape {tuple(value.shape)} placed "
            f"{tuple(value.placements)} on {mesh.size()} ranks; expected Shard(0) of shape "
            f"{expected} over this model's shard group (the form get_state_dict(model, "
            "optimizer) gives for this model and optimizer)"
        )
    return value.to_local()


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
    if not is_dtensor(value):
        if info is not None and isinstance(value, Tensor) and value.dim() > 0:
            raise ValueError(
                f"{what}.load_state_dict: state '{key}' of parameter {name!r} is a plain tensor; "
                "through torch's distributed checkpoint an FSDP shard's state is a DTensor (the "
                "form get_state_dict(model, optimizer) gives for this model and optimizer)"
            )
        return value
    if info is None:
        raise ValueError(f"{what}.load_state_dict: state of {name!r}, not an FSDP shard's")
    rows = rows_of(value, info, what, f"{name}/{key}")
    if not padded:
        return rows
    shard = rows.new_zeros(info.shard_shape)
    shard[: info.valid_rows].copy_(rows)
    return shard
