"""``model.apply(fn)`` on a wrapped model: ``fn`` sees every parameter whole.

[Note: apply with whole parameters]
Between steps FSDP holds a dim-0 shard of each parameter and ZeRO-3 the tensors it owns, so
``fn`` run on the modules as they are (torch's ``Module.apply``) would initialise a shard as if
it were the tensor: every rank draws the same numbers for its shard (FSDP's full tensor then
repeats one block world-size times), and ``orthogonal_`` or a fan-based init sees the shard's
shape. So the wrapper's ``apply`` first gathers every parameter (``param.data`` swapped for the
full tensor), runs torch's ``Module.apply`` (children first, then the module itself), then keeps
this rank's part of what ``fn`` left. Every parameter, not only those of the module ``fn`` is
given: an init often reaches into children (HuggingFace GPT-2 draws its blocks'
``c_proj.weight`` again from the attention and MLP modules). Every rank runs ``fn`` on the same
full tensors: with the same random state on every rank (a seed set before the call, as before
building the model) the result is what one device gets, draw for draw.

It is a collective under FSDP / ZeRO-3, after every rank has arrived ([Note: arrival check]),
and the whole model is on every rank while ``fn`` runs (as FSDP1's ``summon_full_params``); a
model too large for one rank is built on ``meta`` and initialised at wrap time instead ([Note:
meta parameters]). Replicated strategies hold the tensors whole already: the same code only
re-derives what depends on the parameters (``after_load``: ZeRO-1/2's fp32 masters of
low-precision parameters, for the elements ``fn`` wrote; an ``fn`` that writes nothing changes no
bit of training). ``fn`` may change a parameter in place (``nn.init``, ``copy_``); replacing it
would detach it from the strategy's buffers, so it raises. The model's own init methods called
through the wrapper (``INIT_METHODS``: ``model.init_weights()`` after wrapping, as torchtitan
calls it after ``fully_shard``; HuggingFace's ``post_init()``) run the same way, inside
``whole_parameters``: without it FSDP's would draw the same rows on every rank. Other code that
writes to the parameters (a method of ``model.module``, another method) still acts on what this
rank holds (the shard).
"""

import contextlib
import functools
from typing import Any, Callable, Iterator, List, Tuple

import torch
from torch import nn

from tiny_fsdp.core.utils.arrival import every_rank_arrives

_FIX = "it gathers every parameter: call it on every rank, with the same seed."

#: Methods of a model that initialise its parameters: called through the wrapper
#: (``model.init_weights()``), they run with every parameter whole, as ``apply`` does.
INIT_METHODS = frozenset(
    {"init_weights", "initialize_weights", "post_init", "reset_parameters", "init_parameters"}
)


def apply_whole(wrapper: Any, fn: Callable[[nn.Module], None]) -> None:
    """Run ``fn`` on every module of ``wrapper`` (a ``DataParallelWrapper``) as
    ``nn.Module.apply`` does, every parameter whole ([Note: apply with whole parameters])."""
    with whole_parameters(wrapper, "apply(fn)"):
        nn.Module.apply(wrapper, fn)


def whole_method(wrapper: Any, method: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``method`` (one of the model's ``INIT_METHODS``) run with every parameter whole."""

    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        with whole_parameters(wrapper, f"{name}()"):
            return method(*args, **kwargs)

    return run


@contextlib.contextmanager
def whole_parameters(wrapper: Any, what: str) -> Iterator[None]:
    """Inside, every parameter of ``wrapper``'s model is the full tensor; on exit each rank
    keeps its part of what was written. ``what`` names the call in messages."""
    kind = type(wrapper).__name__
    if wrapper.gathers_full_tensors:
        every_rank_arrives(f"{kind}.{what}", f"{kind}.{what}: {_FIX}")
    managed = [(n, p) for n, p in wrapper.module.named_parameters() if wrapper.manages(p)]
    held: List[Tuple[nn.Parameter, torch.Tensor]] = []
    wrapper.before_load()
    try:
        for _, param in managed:  # the same order on every rank
            full = wrapper.full_tensor(param)  # a collective where the tensor is split
            held.append((param, param.data))
            param.data = full
        yield
    finally:
        for param, local in held:
            whole, param.data = param.data, local
            with torch.no_grad():
                wrapper.load_full_(param, whole)
        wrapper.after_load()
    for name, param in managed:
        owner, _, leaf = name.rpartition(".")
        if getattr(wrapper.module.get_submodule(owner), leaf, None) is not param:
            raise RuntimeError(
                f"{kind}.{what} replaced the parameter '{name}'; the strategy holds the "
                "parameters in its own buffers, so it may change them in place only "
                "(nn.init.*_, param.copy_(...)). Replace parameters before wrapping the model."
            )
