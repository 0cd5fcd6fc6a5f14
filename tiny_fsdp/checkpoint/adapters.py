"""What each strategy holds, as slices of full tensors: export to pieces, import from pieces.

[Note: checkpoint pieces]
A checkpoint never depends on the strategy or world size that wrote it. Each tensor has an id,
``model/<name>`` (a parameter or buffer) or ``optim/<param name>/<state key>``, where a
parameter's name is its first key in the plain model's state dict, as torch's distributed
checkpoint names it (a tied weight has one id; the same as its first name in
``named_parameters()`` unless a module's hooks rename keys, as torch's ``checkpoint_wrapper``
does, so a checkpoint loads with or without such wrappers), and is stored as *pieces*: flat
ranges ``[start, stop)`` of the full tensor in row-major order. Each strategy says which flat
range of which full tensor its local storage is, and which range it writes when saving ([Note:
strategy state]): whole tensors (one device, DDP; saved by rank 0), ZeRO-1/2's owned flat
ranges ([Note: ZeRO flat layout]), the whole tensors a ZeRO-3 rank owns, FSDP's real rows of
each dim-0 shard ([Note: dim-0 shards]).

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
from tiny_fsdp.core.local_state import LocalPiece, StatePiece, replicated_piece

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
    # What the state values are shaped like when not ``local``: the rank's parameter, whose
    # leading ``stop - start`` elements are the slice (FSDP's padding rows come last).
    holder: Optional[Tensor] = None

    @property
    def state_shape(self) -> torch.Size:
        return (self.local if self.holder is None else self.holder).shape

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


class Adapter:
    """The checkpoint's view of a model (a strategy wrapper or a plain module) and optimizer:
    slices of full tensors, from what the strategy says it holds ([Note: strategy state])."""

    def __init__(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> None:
        from tiny_fsdp.core.wrapper import DataParallelWrapper

        self.wrapper = model if isinstance(model, DataParallelWrapper) else None
        self.inner: nn.Module = model.module if self.wrapper is not None else model
        self.optimizer = optimizer
        initialised = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if initialised else 0
        self.world_size = dist.get_world_size() if initialised else 1
        first = next(iter(self.inner.parameters()), None)
        self.device = first.device if first is not None else torch.device("cpu")
        # A parameter's name: its first state-dict key ([Note: checkpoint pieces]).
        self.names: Dict[int, str] = {}
        for key, value in self._own_state_dict().items():
            if isinstance(value, nn.Parameter):
                self.names.setdefault(id(value), key)
        for name, p in self.inner.named_parameters():  # one a hook left out of the state dict
            self.names.setdefault(id(p), name)

    def _own_state_dict(self) -> Dict[str, Any]:
        """What this rank holds, under the plain model's keys (parameters as objects)."""
        if self.wrapper is None:
            return self.inner.state_dict(keep_vars=True)
        return self.wrapper.local_state_dict(keep_vars=True)

    def _piece(self, param: nn.Parameter, saving: bool) -> Optional[LocalPiece]:
        if self.wrapper is None:  # one device
            return replicated_piece(param, self.rank, saving)
        return self.wrapper.saved_piece(param) if saving else self.wrapper.local_piece(param)

    def _slice(self, name: str, param: nn.Parameter, piece: LocalPiece) -> Slice:
        shape = tuple(param.shape if self.wrapper is None else self.wrapper.full_shape(param))
        return Slice(name, shape, piece.start, piece.start + piece.local.numel(), piece.local)

    def param_slices(self, name: str, param: nn.Parameter, saving: bool) -> List[Slice]:
        piece = self._piece(param, saving)
        return [] if piece is None else [self._slice(name, param, piece)]

    def state_slices(self, saving: bool) -> List[StateSlice]:
        """The optimizer state this rank holds (or writes): its own pieces where the optimizer
        describes them, else each parameter's state keyed by it, shaped like its piece."""
        state_pieces = getattr(self.optimizer, "state_pieces", None)
        if state_pieces is not None:
            pieces = state_pieces(saving)
        else:
            pieces = []
            for _, param in self.optimizer_params():
                piece = self._piece(param, saving)
                if piece is not None:
                    pieces.append(StatePiece(param, piece.start, piece.local))
        # Another library's optimizer shapes its state like the parameter (FSDP: the padded
        # shard); tiny_fsdp's like the slice it updates.
        foreign = not getattr(self.optimizer, "takes_strategy_params", False)
        out = []
        for sp in pieces:
            s = self._slice(self.name_of(sp.param), sp.param, LocalPiece(sp.start, sp.local))
            key = sp.param if state_pieces is None else sp.local
            holder = sp.param if state_pieces is None and foreign else None
            out.append(
                StateSlice(
                    s.name,
                    s.shape,
                    s.start,
                    s.stop,
                    s.local,
                    self.optimizer.state,
                    key,
                    sp.master,
                    holder,
                )
            )
        return out

    def before_load(self) -> None:
        if self.wrapper is not None:
            self.wrapper.before_load()

    def after_model_load(self) -> None:
        if self.wrapper is not None:
            self.wrapper.after_load()

    # ---------------------------------------------------------------- shared
    def name_of(self, param: torch.Tensor) -> str:
        if id(param) not in self.names:
            raise CheckpointError(
                "the optimizer holds a parameter that is not the model's: build it "
                "from the parameters of the same (wrapped) model"
            )
        return self.names[id(param)]

    def optimizer_params(self) -> List[Tuple[str, nn.Parameter]]:
        """(canonical name, parameter) for every parameter of the optimizer, in group order."""
        return [
            (self.name_of(p), p) for group in self.optimizer.param_groups for p in group["params"]
        ]

    def model_keys(self) -> Dict[str, str]:
        """state-dict key -> tensor name (a tied key maps to its parameter's first name)."""
        return {
            key: self.names.get(id(value), key)
            for key, value in self._own_state_dict().items()
            if isinstance(value, Tensor)
        }

    def model_slices(self, saving: bool) -> List[Slice]:
        out = []
        for p in self.inner.parameters():
            out += self.param_slices(self.names[id(p)], p, saving)
        params = set(self.names)
        for key, value in self._own_state_dict().items():
            # Buffers stay whole and equal on every rank in every strategy.
            if isinstance(value, Tensor) and id(value) not in params:
                piece = replicated_piece(value, self.rank, saving)
                if piece is not None:
                    out.append(Slice(key, tuple(value.shape), 0, value.numel(), piece.local))
        return out


# -------------------------------------------------------------------- export / import


def _elementwise(key: str, value: Any, s: StateSlice) -> bool:
    return (
        isinstance(value, Tensor)
        and value.shape == s.state_shape
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
            if _elementwise(key, value, s):
                tid = optim_tid(s.name, key)
                data = value.reshape(-1)[: s.stop - s.start]
                pieces.append(Piece(tid, s.shape, s.start, s.stop, data))
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
            value = torch.zeros(
                s.state_shape, dtype=_state_dtype(reader.dtype(tid), s), device=s.local.device
            )
            reader.read_into(tid, s.start, s.stop, value.view(-1)[: s.stop - s.start])
            state[key] = value
        s.set(state)
    saved = reader.optional("param_groups")
    if saved is not None:
        import_param_groups(adapter, saved)


def _state_dtype(saved: torch.dtype, s: StateSlice) -> torch.dtype:
    """A floating state tensor takes the dtype of what the optimizer steps (``s.key``: the
    parameter, or its master), as ``torch.optim.Optimizer.load_state_dict`` casts it: a state
    saved beside fp32 masters (ZeRO-1/2 with bf16 parameters) loads into an optimizer stepping
    the bf16 parameters themselves, and back."""
    if saved.is_floating_point and s.key is not None and s.key.is_floating_point():
        return s.key.dtype
    return saved


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
