"""What FSDP's gather units and ZeRO-3's broadcast units share: holding full parameters.

[Note: full units]
A unit's layers compute with its full parameters between an unshard (the strategy's
collectives, [Note: prefetch]) and a reshard. ``FullUnit`` keeps the bookkeeping of that
window, written once: a layer ``hold``s the full parameters while it computes and
``release``s them after; the unit reshards once every one of its layers has released in the
current phase and none is computing. Per phase, so that the forward fetches of a recomputation
inside the backward (gradient checkpointing) do not count as the backward's; a recomputation
nested in a layer's backward finds the unit full and holds it too (``_holders`` counts both).
A unit the state keeps after forward (the first one of the backward, [Note: prefetch]) is not
resharded by forward releases. A unit some of whose layers never run backward (frozen layers fed
no gradient, a part run under no_grad) is resharded at the end of the backward
(``UnitState.backward_finished``); a unit that is a module is also resharded when the module's
forward or backward is over, whichever of its layers ran ([Note: unit module events]).

A layer whose backward reads only the description of its parameters (``backward_reads_params``
False: an embedding scatters rows) neither unshards nor holds the unit in backward: it gets
``described`` tensors, of the full parameters' shape, dtype and device but no values, and the
unit reshards once the layers that do read have released. GPT-2's tied embedding and lm_head
share the root unit: it reshards after lm_head's backward instead of being held through every
block's backward until the embedding's, which FSDP2 does (2 ranks, gpt2_mini: 49 MiB less
while the blocks' backward runs; on the CPU the block cache then needs one block fewer, and
FSDP's peak in the benchmark, run alone, went from 1,097 to 1,048 MiB).

Subclasses make the parameters full (``unshard`` / ``wait_for_unshard``, then ``set_full``) and
say what a reshard frees (``on_reshard``).
"""

from typing import Dict, Optional, Sequence, Tuple

import torch
from torch import nn

from tiny_fsdp.core.module.handler import Params, TrainingPhase
from tiny_fsdp.core.module.layer import local_param
from tiny_fsdp.core.prefetch import Prefetcher
from tiny_fsdp.core.utils.tensor_queries import stand_in


class FullUnit:
    """Full parameters of ``layers``, held and released by them ([Note: full units])."""

    def __init__(self, name: str, layers: Sequence[nn.Module], state: Prefetcher) -> None:
        self.name = name
        self.layers = list(layers)
        self.state = state  # the strategy's per-model state: fetch, keeps_after_forward
        self._full: Optional[Dict[int, torch.Tensor]] = None  # id(local param) -> full tensor
        self._released: Dict[TrainingPhase, set] = {phase: set() for phase in TrainingPhase}
        # Each layer's local parameters in ``param_names`` order, found once. local_param: a
        # registration a reader has swapped to its own full tensor ([Note: outside reads]; an
        # op reading two of the layer's parameters) still names the local parameter. Keyed by
        # the layer itself, so that a copy of the wrapper maps its own layers to its own params.
        self._locals: Dict[nn.Module, Tuple[Optional[torch.Tensor], ...]] = {
            layer: tuple(local_param(layer, n) for n in layer.param_names) for layer in self.layers
        }
        self._holders = 0
        # Per phase, the layers whose release a reshard waits for ([Note: full units]).
        self._readers: Dict[TrainingPhase, set] = {
            TrainingPhase.FORWARD: {id(layer) for layer in self.layers},
            TrainingPhase.BACKWARD: {
                id(layer) for layer in self.layers if reads_params_in_backward(layer)
            },
        }
        self._described: Dict[int, torch.Tensor] = {}  # id(local param) -> its description

    @property
    def is_unsharded(self) -> bool:
        return self._full is not None

    @property
    def fetched_in_backward(self) -> bool:
        return bool(self._readers[TrainingPhase.BACKWARD])

    def hold(self, layer: nn.Module) -> Params:
        """The full parameters of ``layer``, in use until its ``release`` (the unit is full)."""
        assert self._full is not None, f"{self.name}: hold() before the unit was unsharded"
        self._holders += 1
        full = self._full
        return tuple(None if p is None else full[id(p)] for p in self._locals[layer])

    def described(self, layer: nn.Module) -> Params:
        """Tensors with the shape, dtype and device of ``layer``'s full parameters, one element
        each expanded (``stand_in``), made once, for a backward that reads nothing else; neither
        held nor released. The unit was full at least once (in the layer's forward)."""
        described = self._described
        return tuple(None if p is None else described[id(p)] for p in self._locals[layer])

    def release(self, layer: nn.Module, phase: TrainingPhase) -> None:
        """``layer`` is done; reshard once all layers that read the unit in this phase are done
        and none computes."""
        self._holders -= 1
        if phase is TrainingPhase.FORWARD and self.state.keeps_after_forward(self):
            return
        released = self._released[phase]
        released.add(id(layer))
        if self._holders == 0 and self._readers[phase] <= released:
            self.reshard()

    def module_done(self, phase: TrainingPhase) -> None:
        """The unit's module finished ``phase``: layers that did not run count as released
        ([Note: unit module events])."""
        if self._full is None or self._holders:
            return
        if phase is TrainingPhase.FORWARD and self.state.keeps_after_forward(self):
            return
        self.reshard()

    def set_full(self, full: Dict[int, torch.Tensor]) -> None:
        """The unshard is complete: ``full`` maps id(local parameter) -> its full tensor."""
        self._full = full
        if self._described.keys() != full.keys():
            self._described = {key: stand_in(t.shape, t.dtype, t.device) for key, t in full.items()}
        self._clear_released()

    def reshard(self) -> None:
        """Free the full parameters (back to local parts only)."""
        if self._full is not None:
            self._full = None
            self.on_reshard()
        self._clear_released()

    def on_reshard(self) -> None:
        """Account for the freed full parameters (subclasses)."""

    def _clear_released(self) -> None:
        for released in self._released.values():
            released.clear()


def reads_params_in_backward(layer: nn.Module) -> bool:
    """Whether ``layer``'s backward reads its full parameters' values ([Note: full units])."""
    return getattr(layer, "backward_reads_params", True)


def copied_model_error(what: str) -> RuntimeError:
    """The error of a unit whose parameters lost the strategy's tag: a copy of the inner model."""
    return RuntimeError(
        f"a parameter of this {what} model has no {what} tag: the inner model was copied "
        "(copy.deepcopy(model.module)), which copies this rank's part of each tensor without "
        "the strategy. Copy the wrapper instead: copy.deepcopy(model), or "
        "torch.optim.swa_utils.AveragedModel(model) ([Note: copying a wrapped model])."
    )
