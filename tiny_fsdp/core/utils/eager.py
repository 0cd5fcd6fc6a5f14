"""Code that ``torch.compile`` must run as written, never trace.

[Note: torch.compile]
FSDP and ZeRO-3 fetch parameters in Python with side effects on the strategy's state: a unit is
all-gathered when its first layer runs and freed after its last, a torch-function mode resolves
parameters read outside their layer ([Note: outside reads]), hooks on every module track where
the forward is, and the layers' hand-written autograd functions fetch again in backward. Dynamo
cannot trace that into a graph: it re-traces every layer for every shape until its recompile
limit, then falls back with warnings, or fails on a call it cannot trace. So the forward of an
FSDP / ZeRO-3 wrapper runs eagerly under ``torch.compile``, including any module inside it that
was compiled on its own (``torch.compile(FSDP(model))``, ``FSDP(torch.compile(model))`` and
per-block ``block.compile()`` all train as without compile). DDP and ZeRO-1/2 compute with the
model's own modules and reduce in backward hooks, so ``torch.compile`` compiles their forward
(``tests/test_compile.py``).

``eager(fn)`` is ``torch.compiler.disable(fn)`` made on the first call, so importing tiny_fsdp
does not import dynamo (about a second); it is imported by then anyway (torch.optim, wrapping).
"""

import functools
from typing import Any, Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])


def eager(fn: F) -> F:
    """``fn``, and everything it calls, run eagerly under ``torch.compile`` ([Note:
    torch.compile])."""
    disabled: list = []

    def forced(*args: Any, **kwargs: Any) -> Any:
        with torch.compiler.set_stance("force_eager"):  # modules compiled on their own too
            return fn(*args, **kwargs)

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not disabled:
            disabled.append(torch.compiler.disable(forced, recursive=True))
        return disabled[0](*args, **kwargs)

    return run  # type: ignore[return-value]
