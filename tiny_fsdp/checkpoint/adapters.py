"""What each strategy holds, as slices of full tensors: export to pieces, import from pieces.

[Note: checkpoint pieces]
A checkpoint never depends on the strategy or world size that wrote it. Each tensor has an id,
``model/<name>`` (a parameter or buffer) or ``optim/<param name>/<state key>``, where a
parameter's name is its first one in ``model.named_parameters()`` (a tied weight has one id), and
is stored as *pieces*: flat ranges ``[start, stop)`` of the full tensor in row-major order.
Each strategy says which flat range of which full tensor its local storage is:

- one device / DDP: whole tensors (when saving: rank 0 only, the others hold copies);
- ZeRO-1/2: parameters whole (when saving: the rank's owned flat range of each, so writes are
  balanced); optimizer state: the owned flat range ([Note: ZeRO flat layout]);
- ZeRO-3: the whole tensors the rank owns, parameters and state;
- FSDP: rows ``[r k, r k + valid)`` of dim 0, i.e. flat ``[r k w, (r k + valid) w)`` with ``k``
  rows per shard and ``w`` elements per row ([Note: dim-0 shards]).

Saving, the ranges of all ranks cover every tensor exactly once. Loading, each rank fills every
range it holds from the pieces overlapping it, whoever wrote them. Optimizer state values shaped
like their slice are elementwise pieces; the rest (AdamW's 0-d ``step``) are per-parameter
*scalars*, equal wherever the parameter has a slice. A strategy keeping a separate
higher-precision master copy saves it as state key ``master``.
"""

from dataclasses import dataclass
from typing import Any, Dict, List, MutableMapping, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from tiny_fsdp.checkpoint.format import CheckpointError, CheckpointReader

SCALAR_KEYS = ("step",)  # 0-d state that is per parameter even when the parameter is 0-d


def model_tid(name: str) -> str:
    return f"model/{name}"


def optim_tid(name: str, key: str) -> str:
    return f"optim/{name}/{key}"


@dataclass
class Slice:
    """Flat elements ``[start, stop)`` of full tensor ``name`` (shape ``shape``), here ``local``.

    ``local``: contiguous, ``stop - start`` elements; the live storage (model) or the tensor
    the update rule updates, whose shape the elementwise state has (optimizer).
    """

    name: str
    shape: Tuple[int, ...]
    start: int
    stop: int
    local: Tensor


@dataclass
class StateSlice(Slice):
    """A ``Slice`` with its optimizer state: ``store[key]`` (absent when no state yet)."""

    store: Optional[MutableMapping] = None
    key: Optional[Tensor] = None
    master: Optional[Tensor] = None  # separate high-precision copy of the slice, if any

    def get(self) -> Dict[str, Any]:
        return self.store.get(self.key) or {}

    def set(self, state: Dict[str, Any]) -> None:
        if state:
            self.store[self.key] = state
        else:
            self.store.pop(self.key, None)


@dataclass
class Piece:
    """One saved range: flat elements ``[start, stop)`` of tensor ``tid``; ``data`` (n,)."""

    tid: str
    shape: Tuple[int, ...]
    start: int
    stop: int
    data: Tensor


def _whole(name: str, tensor: Tensor, shape: Optional[tuple] = None) -> Slice:
    return Slice(name, tuple(tensor.shape if shape is None else shape), 0, tensor.numel(), tensor)


class Adapter:
    """One device and DDP: every rank holds whole tensors. Subclasses override the hooks."""

    def __init__(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> None:
        self.model = model
        self.inner: nn.Module = getattr(model, "module", model) if _is_wrapper(model) else model
        self.optimizer = optimizer
        initialised = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if initialised else 0
        self.world_size = dist.get_world_size() if initialised else 1
        self.names: Dict[int, str] = {id(p): n for n, p in self.inner.named_parameters()}
        first = next(iter(self.inner.parameters()), None)
        self.device = first.device if first is not None else torch.device("cpu")

    # ---------------------------------------------------------------- hooks per strategy
    def param_slices(self, name: str, param: nn.Parameter, saving: bool) -> List[Slice]:
        return [] if saving and self.rank != 0 else [_whole(name, param.detach())]

    def state_slices(self, saving: bool) -> List[StateSlice]:
        out = []
        for name, param in self.optimizer_params():
            if not (saving and self.rank != 0):
                out.append(self._state_of(_whole(name, param.detach()), param))
        return out

    def before_load(self) -> None:
        """Drop whatever a strategy derived from the parameters (prefetched copies ...)."""

    def after_model_load(self) -> None:
        """Re-derive what depends on the parameters just loaded."""

    # ---------------------------------------------------------------- shared
    def _state_of(self, s: Slice, key: Tensor, master: Optional[Tensor] = None) -> StateSlice:
        store = self.optimizer.state
        return StateSlice(s.name, s.shape, s.start, s.stop, s.local, store, key, master)

    def optimizer_params(self) -> List[Tuple[str, nn.Parameter]]:
        """(canonical name, parameter) for every parameter of the optimizer, in group order."""
        out = []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in self.names:
                    raise CheckpointError(
                        "the optimizer holds a parameter that is not the model's: build it "
                        "from the parameters of the same (wrapped) model"
                    )
                out.append((self.names[id(p)], p))
        return out

    def model_keys(self) -> Dict[str, str]:
        """state-dict key -> tensor name (a tied key maps to its parameter's first name)."""
        return {
            key: self.names.get(id(value), key)
            for key, value in self.inner.state_dict(keep_vars=True).items()
            if isinstance(value, Tensor)
        }

    def model_slices(self, saving: bool) -> List[Slice]:
        out = []
        for name, p in self.inner.named_parameters():
            out += self.param_slices(name, p, saving)
        params = set(self.names)
        for key, value in self.inner.state_dict(keep_vars=True).items():
            # Buffers stay whole and equal on every rank in every strategy.
            if isinstance(value, Tensor) and id(value) not in params:
                if not (saving and self.rank != 0):
                    out.append(_whole(key, value.detach()))
        return out


class Zero12Adapter(Adapter):
    """ZeRO-1/2: parameters replicated in a flat buffer; state on the owned flat pieces."""

    def param_slices(self, name: str, param: nn.Parameter, saving: bool) -> List[Slice]:
        if not (saving and param.requires_grad):
            return super().param_slices(name, param, saving)
        piece = self.model.owned_pieces.get(self.model.index_of(param))
        if piece is None:
            return []
        view = self.model.param_buffer.piece(piece)
        return [
            Slice(name, tuple(param.shape), piece.param_start, piece.param_start + len(view), view)
        ]

    def state_slices(self, saving: bool) -> List[StateSlice]:
        opt = self.optimizer
        params = self.optimizer_params()
        separate = getattr(opt, "_master_shard", None) is not None
        out = []
        for owned in opt._all_pieces():
            name, p = params[owned.opt_index]
            start = owned.piece.param_start
            s = Slice(name, tuple(p.shape), start, start + owned.piece.numel, owned.master)
            out.append(self._state_of(s, owned.master, owned.master if separate else None))
        return out

    def after_model_load(self) -> None:
        for optimizer in list(self.model._optimizers):
            optimizer._masters_from_params()  # fp32 masters of low-precision parameters


class Zero3Adapter(Adapter):
    """ZeRO-3: whole tensors on their owner rank only."""

    def _owned(self, param: nn.Parameter) -> Optional[Tuple[int, ...]]:
        from tiny_fsdp.core.zero3.handler import ATTR

        info = getattr(param, ATTR)
        return tuple(info.shape) if info.owner == self.rank else None

    def param_slices(self, name: str, param: nn.Parameter, saving: bool) -> List[Slice]:
        shape = self._owned(param)
        return [] if shape is None else [_whole(name, param.detach(), shape)]

    def state_slices(self, saving: bool) -> List[StateSlice]:
        return [
            self._state_of(_whole(name, p.detach(), shape), p)
            for name, p in self.optimizer_params()
            if (shape := self._owned(p)) is not None
        ]


class FSDPAdapter(Adapter):
    """FSDP: the real rows of each dim-0 shard (padding rows are not part of the tensor)."""

    def _rows(self, name: str, param: nn.Parameter) -> Slice:
        from tiny_fsdp.core.fsdp.sharded_param import shard_info

        info = shard_info(param)
        first = info.rank * info.shard_rows
        local = param.detach()[: info.valid_rows]  # (valid_rows, *rest), a contiguous prefix
        start = first * info.row_numel
        return Slice(name, tuple(info.full_shape), start, start + local.numel(), local)

    def param_slices(self, name: str, param: nn.Parameter, saving: bool) -> List[Slice]:
        return [self._rows(name, param)]

    def state_slices(self, saving: bool) -> List[StateSlice]:
        return [self._state_of(self._rows(name, p), p) for name, p in self.optimizer_params()]

    def before_load(self) -> None:
        self.model._state.drop_transients()  # gathered / prefetched full params go stale


def make_adapter(model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> Adapter:
    """The adapter of ``model``'s strategy (a plain module: one device)."""
    from tiny_fsdp.core.fsdp import FSDP
    from tiny_fsdp.core.zero import ZeroWrapper
    from tiny_fsdp.core.zero3 import Zero3

    for cls, adapter in ((FSDP, FSDPAdapter), (Zero3, Zero3Adapter), (ZeroWrapper, Zero12Adapter)):
        if isinstance(model, cls):
            return adapter(model, optimizer)
    return Adapter(model, optimizer)  # DDP, or a single-device model


def _is_wrapper(model: nn.Module) -> bool:
    from tiny_fsdp.core.wrapper import DataParallelWrapper

    return isinstance(model, DataParallelWrapper)


# -------------------------------------------------------------------- export / import


def _elementwise(key: str, value: Any, local: Tensor) -> bool:
    return (
        isinstance(value, Tensor)
        and value.shape == local.shape
        and not (value.dim() == 0 and key in SCALAR_KEYS)
    )


def export_pieces(adapter: Adapter) -> Tuple[List[Piece], Dict[str, Dict[str, Any]]]:
    """This rank's pieces (exactly-once over ranks) and scalars ``{param: {key: value}}``."""
    pieces = [
        Piece(model_tid(s.name), s.shape, s.start, s.stop, s.local.reshape(-1))
        for s in adapter.model_slices(saving=True)
    ]
    scalars: Dict[str, Dict[str, Any]] = {}
    if adapter.optimizer is None:
        return pieces, scalars
    for s in adapter.state_slices(saving=True):
        state = dict(s.get())
        if not state:
            continue  # no step taken yet (or nothing to update here)
        if s.master is not None:
            state["master"] = s.master
        for key, value in state.items():
            if _elementwise(key, value, s.local):
                tid = optim_tid(s.name, key)
                pieces.append(Piece(tid, s.shape, s.start, s.stop, value.reshape(-1)))
            else:
                scalars.setdefault(s.name, {})[key] = value
    return pieces, scalars


def export_param_groups(adapter: Adapter) -> List[Dict[str, Any]]:
    """Hyper-parameters of each group, with ``params`` as canonical parameter names."""
    names = iter(name for name, _ in adapter.optimizer_params())
    return [
        {
            **{k: v for k, v in g.items() if k not in ("params", "param_names")},
            "params": [next(names) for _ in g["params"]],
        }
        for g in adapter.optimizer.param_groups
    ]


@torch.no_grad()
def import_pieces(adapter: Adapter, reader: CheckpointReader) -> None:
    """Fill the model (and optimizer) slices this rank holds from ``reader``'s pieces."""
    slices = adapter.model_slices(saving=False)
    _check_model(adapter, reader, slices)
    adapter.before_load()
    for s in slices:
        reader.read_into(model_tid(s.name), s.start, s.stop, s.local)
    adapter.after_model_load()
    if adapter.optimizer is None:
        return
    for s in adapter.state_slices(saving=False):
        state = {
            k: v.clone() if isinstance(v, Tensor) else v for k, v in reader.scalars(s.name).items()
        }
        for key in reader.state_keys(s.name):
            tid = optim_tid(s.name, key)
            if key == "master":
                if s.master is not None:
                    reader.read_into(tid, s.start, s.stop, s.master)
                continue
            value = torch.empty(s.local.shape, dtype=reader.dtype(tid), device=s.local.device)
            reader.read_into(tid, s.start, s.stop, value)
            state[key] = value
        s.set(state)
    saved = reader.optional("param_groups")
    if saved is not None:
        import_param_groups(adapter, saved)


def import_param_groups(adapter: Adapter, saved: List[Dict[str, Any]]) -> None:
    groups = adapter.optimizer.param_groups
    mine = export_param_groups(adapter)
    if len(saved) != len(groups) or any(
        set(s["params"]) != set(m["params"]) for s, m in zip(saved, mine)
    ):
        raise CheckpointError(
            "the optimizer's parameter groups differ from the checkpoint's: saved "
            f"{[len(g['params']) for g in saved]} parameters per group, this optimizer "
            f"{[len(g['params']) for g in mine]}; build the optimizer with the same groups"
        )
    for group, values in zip(groups, saved):
        group.update({k: v for k, v in values.items() if k not in ("params", "param_names")})


def _check_model(adapter: Adapter, reader: CheckpointReader, slices: List[Slice]) -> None:
    expected = set(adapter.model_keys().values())
    saved = {tid[len("model/") :] for tid in reader.tensors if tid.startswith("model/")}
    missing, unexpected = sorted(expected - saved), sorted(saved - expected)
    if missing or unexpected:
        raise CheckpointError(
            f"the checkpoint does not fit this model: missing {missing[:5]}, unexpected "
            f"{unexpected[:5]} (names of the plain model's parameters and buffers)"
        )
    for s in slices:
        if reader.shape(model_tid(s.name)) != tuple(s.shape):
            raise CheckpointError(
                f"'{s.name}' has shape {reader.shape(model_tid(s.name))} in the checkpoint, "
                f"{tuple(s.shape)} in the model"
            )
