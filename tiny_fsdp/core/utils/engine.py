"""What the running backward will do: asked of autograd's engine from inside a backward.

[Note: backward for inputs only]
``torch.autograd.grad(loss, x)`` (an adversarial example, a saliency map, the input gradient of
a gradient penalty) and ``loss.backward(inputs=[...])`` run layers' backwards for their input
gradients but accumulate into no (or only some) parameters. torch's DDP then leaves ``.grad``
alone: its hooks on the parameters never run. A strategy that works inside the layers' backward
must do the same: compute and reduce only the gradients the engine will accumulate (a
registered layer, ``module/base.py``) and set aside nothing when no parameter accumulates
(ZeRO-1/2, [Note: backward again before the step]). The engine says whether it will run a
parameter's accumulator; inside ``autograd.grad`` it refuses to answer for accumulators, which
``autograd.grad`` never runs.
"""

from typing import Any, Iterable

import torch


def will_run(node: Any) -> bool:
    """Whether the running backward executes autograd ``node`` (None: no node, False)."""
    try:
        return node is not None and torch._C._will_engine_execute_node(node)
    except RuntimeError as error:  # inside torch.autograd.grad, which accumulates nothing
        if "autograd.grad" not in str(error):
            raise
        return False


def accumulates_any(params: Iterable[torch.Tensor]) -> bool:
    """Whether the running backward accumulates a gradient into any of ``params``."""
    return any(
        will_run(torch.autograd.graph.get_gradient_edge(p).node) for p in params if p.requires_grad
    )
