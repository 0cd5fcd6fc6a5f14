"""Base of the wrappers whose layers fetch full parameters to compute: FSDP and ZeRO-3.

[Note: fetching strategies]
Between steps a rank of FSDP or ZeRO-3 holds only its local parts ([Note: glossary]); each
layer's handler fetches the full parameters just before the layer computes and releases them
after ([Note: param handler]), in an order the strategy's ``Prefetcher`` records and runs
ahead of ([Note: prefetch]). What the two wrappers share is written here: the forward brackets
the model call with the prefetcher's ``pre_forward`` / ``post_forward`` and watches parameters
read outside their layer ([Note: outside reads]), and warns of those read outside the forward
([Note: parameters in the loss]). On a GPU the forward moves the tensors it is given there
first (also inside dicts, lists and dataclasses), as FSDP2's root does and torch's DDP with
``device_ids``: a batch left on the CPU trains as one moved by hand.
"""

import math
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from tiny_fsdp.core.full_unit import FullUnit
from tiny_fsdp.core.loss_reads import LocalGradWatch
from tiny_fsdp.core.meta_init import check_set
from tiny_fsdp.core.module.outside_reads import OutsideReadWatch
from tiny_fsdp.core.precision import MixedPrecisionPolicy
from tiny_fsdp.core.unit_grads import UnitGradients
from tiny_fsdp.core.unit_handler import UnitHandler
from tiny_fsdp.core.unit_layout import UnitSpec, unit_layers
from tiny_fsdp.core.unit_module import watch_unit_module
from tiny_fsdp.core.unit_state import UnitState
from tiny_fsdp.core.wrapper import DataParallelWrapper
from tiny_fsdp.core.utils.eager import eager
from tiny_fsdp.core.wrap_checks import check_no_param_hooks


class FetchingWrapper(DataParallelWrapper):
    """A wrapper whose layers fetch through a ``Prefetcher`` ([Note: fetching strategies])."""

    def __init__(
        self,
        module: nn.Module,
        enable_async_communication: bool,
        mixed_precision: Optional[MixedPrecisionPolicy],
        registered_layers: bool,
        unit: UnitSpec,
    ) -> None:
        super().__init__(module, enable_async_communication, mixed_precision, registered_layers)
        # ``unit`` is laid out in ``build_units``, after the subclass has changed the model;
        # checked here, before it, so that a mistaken unit leaves the model to be wrapped again.
        unit_layers(self.module, unit)

    def build_units(
        self,
        state: UnitState,
        unit: UnitSpec,
        make_unit: Callable[..., FullUnit],
        make_grads: Callable[..., UnitGradients],
        device: torch.device,
        unset: Sequence[str] = (),
    ) -> None:
        """The last step of a subclass's ``__init__``: lay the layers out in units
        (``unit_layout.py``), give each unit its gradients and each layer a ``UnitHandler``
        ([Note: unit handler]). ``make_unit`` / ``make_grads`` take ``(name, layers, state,
        per_tensor)``; ``device``: where the layers compute (inputs move there unless it is
        the CPU); ``unset``: paths of the tensors the model's init method is to set ([Note:
        tensors the model's init method sets])."""
        self.input_device = None if device.type == "cpu" else device
        per_tensor = isinstance(unit, str) and unit == "tensor"

        def full_numel(param: torch.Tensor) -> int:  # the same on every rank
            return math.prod(self.full_shape(param))

        for name, layers in unit_layers(self.module, unit, full_numel):
            full_unit = make_unit(name, layers, state, per_tensor)
            grads = make_grads(name, layers, state, per_tensor)
            state.units.append(full_unit)
            state.unit_grads.append(grads)
            for layer in layers:
                UnitHandler(layer, full_unit, grads)
            if name != "<root>" and len(layers) > 1:  # [Note: unit module events]
                watch_unit_module(self.module.get_submodule(name), full_unit, grads)
        self._prefetcher = state
        self._named_params: Optional[List[Tuple[str, nn.Parameter]]] = None  # listed at forward
        self._reads = OutsideReadWatch(self.module)
        state.grad_watch = LocalGradWatch(self.module, type(self).__name__)
        self._unset = list(unset)

    @property
    def units(self) -> List[FullUnit]:
        """The units, in module order."""
        return list(self._prefetcher.units)

    @property
    def prefetch_limit(self) -> int:
        """At most this many prefetched units unconsumed at once ([Note: prefetch])."""
        return self._prefetcher.prefetch_limit

    def after_copy(self) -> None:
        for grads in self._prefetcher.unit_grads:
            grads.forget_layout()  # laid out by the original's parameters' ids
        self._named_params = None
        self._reads = OutsideReadWatch(self.module)
        # A copy's parameters come without hooks: watch them anew.
        self._prefetcher.grad_watch = LocalGradWatch(self.module, type(self).__name__)

    def before_load(self) -> None:
        self._prefetcher.drop_transients()  # full / prefetched parameters would go stale
        self._named_params = None  # a load with assign=True replaces parameters

    @eager  # [Note: torch.compile]
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._unset:  # [Note: tensors the model's init method sets]; alike on every rank
            check_set(type(self).__name__, self.module, self._unset)
            self._unset = []
        if torch.is_grad_enabled():
            if self._named_params is None:
                self._named_params = list(self.module.named_parameters())
            check_no_param_hooks(self._named_params, type(self).__name__)
            self._prefetcher.grad_watch.note_grads()  # [Note: parameters in the loss]
        args, kwargs = self.inputs_to_device(args, kwargs)
        self._prefetcher.pre_forward(self.enable_async_communication, torch.is_grad_enabled())
        try:
            return self._reads(lambda: self.module(*args, **kwargs))  # [Note: outside reads]
        finally:
            self._prefetcher.post_forward()
