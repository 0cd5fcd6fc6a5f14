"""The hooks a traced step installs, and removes when it ends ([Note: trace recorder]).

[Note: trace hooks]
- Layers of the library (``CallbackModule``) report their compute from the layer seam
  (``core/module/base.py``): exactly ``forward_callback`` / ``backward_callback``.
- Any other module that holds parameters of its own (the modules DDP / ZeRO-1 / ZeRO-2 train as
  they are, the generic path's layers) gets module hooks, registered after the strategy's own
  (so a generic layer has fetched before its span opens): forward from the pre-hook to the
  post-hook; backward from the first gradient of its outputs (``register_multi_grad_hook``,
  mode "any", registered after the generic layer's, so after its backward fetch) to the moment
  the gradients of its inputs are computed (mode "all"), or, when no input needs one (an
  embedding), of its own parameters. Not registered during a recomputation inside backward
  (gradient checkpointing): that graph is never backpropagated.
- Activations: ``saved_tensors_hooks`` around the step count the distinct storages autograd
  saves (parameters excluded: they are counted as parameters), each until autograd drops it.
- Phases: the ledger's categories change only in backward (gradients), ``optimizer.step`` and
  ``zero_grad``, so ``trace_step`` samples the ledger when it starts and ends, and the optimizer's
  step pre / post hooks before and after the step (a walk costs ~1-5 ms: not at every boundary);
  ``optimizer.step`` is a compute span.
"""

from typing import Any, Callable, List, Optional

import torch
from torch import nn

from tiny_fsdp.core.module import CallbackModule
from tiny_fsdp.core.module.generic import output_tensors
from tiny_fsdp.trace.recorder import Recorder


class _Saved:
    """What autograd keeps for a saved tensor while tracing; frees its bytes when dropped."""

    __slots__ = ("tensor", "key", "recorder")

    def __init__(self, tensor: torch.Tensor, recorder: Recorder) -> None:
        self.tensor = tensor
        self.recorder = recorder
        self.key = recorder.save_activation(tensor)

    def __del__(self) -> None:
        self.recorder.free_activation(self.key)


def saved_tensor_hooks(recorder: Recorder) -> torch.autograd.graph.saved_tensors_hooks:
    def pack(tensor: torch.Tensor) -> Any:
        if isinstance(tensor, nn.Parameter) or tensor.device.type == "meta":
            return tensor
        return _Saved(tensor, recorder)

    def unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Saved) else packed

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


class LayerHooks:
    """Forward / backward spans of one module that is not a library layer ([Note: trace hooks])."""

    def __init__(self, recorder: Recorder, name: str, module: nn.Module) -> None:
        self.recorder, self.name, self.module = recorder, name, module
        self.params = [p for p in module.parameters(recurse=False) if p.requires_grad]
        self.handles: List[Any] = [
            module.register_forward_pre_hook(self._pre_forward),
            module.register_forward_hook(self._post_forward),
        ]
        self._forward: List[Any] = []  # open forward spans (a module may call itself)

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        recompute = torch._C._current_graph_task_id() != -1
        phase = "forward (recompute)" if recompute else "forward"
        self._forward.append(self.recorder.begin(self.name, phase))
        self._inputs = [t for t in output_tensors(args) if t.requires_grad]

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self._forward:
            return
        self.recorder.end(self._forward.pop())
        outputs = [t for t in output_tensors(output) if t.requires_grad]
        ends = self._inputs or self.params
        if not outputs or not ends or torch._C._current_graph_task_id() != -1:
            return
        span: List[Any] = []

        def begin(_: Any) -> None:
            span.append(self.recorder.begin(self.name, "backward"))

        def end(_: Any) -> None:
            if span:
                self.recorder.end(span.pop())

        register = torch.autograd.graph.register_multi_grad_hook
        self.handles.append(register(outputs, begin, mode="any"))
        self.handles.append(register(ends, end, mode="all"))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def attach_layer_hooks(recorder: Recorder, model: nn.Module) -> List[LayerHooks]:
    """``LayerHooks`` on every module with parameters of its own that is not a library layer."""
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, CallbackModule):
            continue
        if any(True for _ in module.parameters(recurse=False)):
            hooks.append(LayerHooks(recorder, name or type(module).__name__, module))
    return hooks


def attach_phase_hooks(
    recorder: Recorder,
    optimizer: Optional[torch.optim.Optimizer],
    states: Callable[[], Optional[dict]],
) -> List[Any]:
    """Ledger samples around ``optimizer.step`` (a compute span)."""

    def sample(*_: Any) -> None:
        values = states()
        if values is not None:
            recorder.sample_states(values)

    handles: List[Any] = []
    if optimizer is not None:
        span: List[Any] = []

        def pre_step(*_: Any) -> None:
            sample()
            span.append(recorder.begin("optimizer.step", "optimizer"))

        def post_step(*_: Any) -> None:
            if span:
                recorder.end(span.pop())
            sample()

        handles.append(optimizer.register_step_pre_hook(pre_step))
        handles.append(optimizer.register_step_post_hook(post_step))
    return handles
