"""What one forward of a model keeps for backward and computes, measured on ``meta``.

[Note: attention on meta]
On ``meta``, ``F.scaled_dot_product_attention`` runs its math fallback, which keeps the
(B, H, L, L) scores for backward; the fused kernels every real device picks (flash and
memory-efficient attention on CUDA, flash on CPU) keep their inputs, the output and an fp32
log-sum-exp of (B, H, L). So the meta forward counts those instead: an error quadratic in the
sequence length otherwise (a LLaMA of width 256 at 512 tokens: +27 %).

The flash kernels lay their output out in the order of the query's strides: (B, L, H, D) for
heads split by ``view(B, L, H, D).transpose(1, 2)``, so that the usual ``y.transpose(1, 2)
.reshape(B, L, H * D)`` is a view; (B, H, L, D) for contiguous heads (DeepSeek-V3's), where
that reshape is a copy the next layer keeps. CUDA's memory-efficient kernel, taken for a mask,
writes (B, L, H, D) always. The meta forward returns its output so laid out.

Where the device runs the math kernel, it is counted as it runs, as is attention written out
by hand: on the CPU where torch's own choice, asked of stand-ins, takes it (dropout, BERT's in
training; a mask that takes a gradient, T5's position bias); on either device for key and
value heads broadcast to the query's without ``enable_gqa`` (Falcon's one head).

[Note: grouped matmul on meta]
Mixture-of-experts layers (``transformers``' MoE models, torchtitan's) multiply each token by
its expert's weight in one ``torch._grouped_mm`` (``F.grouped_mm``), which the CPU runs in any
dtype but whose meta kernel takes bf16 only, as CUDA's does; their other path (a loop over the
experts hit) depends on the routing's values, which meta has not. So on meta a grouped matmul
of another dtype runs in bf16 for the shape of its output, and the forward goes on from a
tensor of that shape in the input's dtype; what it keeps for backward (its input and the group
offsets; the weight is a parameter) and its FLOPs (2 x tokens x in x out: each token through
one expert) are counted as the kernel's.
"""

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torch.nn.attention import SDPBackend
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode


@dataclass(frozen=True)
class ForwardCosts:
    """What one forward saves for backward, as ``(elements in the compute dtype, other bytes)``:
    ``total``; with every block checkpointed, ``kept`` (what is saved outside the blocks and
    the blocks' inputs; None without blocks) and ``block`` (the largest block's, recomputed);
    and the forward's FLOPs; ``grouped``: per parameter that grouped matmuls multiply (MoE
    experts: each token meets its experts' part), by name, those products' FLOPs, part of
    ``forward_flops`` ([Note: grouped matmul on meta])."""

    total: Tuple[int, int]
    kept: Optional[Tuple[int, int]]
    block: Tuple[int, int]
    forward_flops: int
    grouped: Dict[str, int] = field(default_factory=dict)


def measure_forward(
    model: nn.Module,
    example_input: Union[torch.Tensor, Mapping[str, torch.Tensor]],
    device_type: str,
    dtype: torch.dtype = torch.float32,
) -> ForwardCosts:
    """The distinct tensors (not parameters) autograd saves in one forward on meta computing in
    ``dtype`` (parameters and floating-point inputs in it, buffers as they are, as a mixed
    precision policy has them): elements of the ones in ``dtype`` (their width is the planned
    precision's) and bytes of the rest (token ids, masks, a bf16 model's fp32 norms and loss),
    per block of the model (``repeated_blocks``) and outside them; and the forward's FLOPs
    (``torch.utils.flop_counter``)."""
    from tiny_fsdp.core.unit_layout import repeated_blocks

    def stand_in(t: torch.Tensor, cast: bool) -> torch.Tensor:
        """``t`` on meta, in ``dtype`` if ``cast`` and floating-point."""
        cast = cast and t.is_floating_point()
        return torch.empty_like(t, device="meta", dtype=dtype if cast else t.dtype)

    # The caller's module runs on meta stand-ins of its tensors (no copy of a loaded model).
    named_params = dict(model.named_parameters())
    state = {
        **{n: stand_in(t, True).requires_grad_(t.requires_grad) for n, t in named_params.items()},
        **{n: stand_in(t, False) for n, t in model.named_buffers()},
    }
    params = {id(t) for name, t in state.items() if name in named_params}
    seen: Dict[object, Tuple[int, int, int]] = {}  # tensor -> (region, elements, bytes)
    block_inputs: Dict[object, Tuple[int, int, int]] = {}
    alive: List[torch.Tensor] = []  # every tensor counted, to the end: no id is reused
    counting, region = [True], [-1]  # region: the block running, -1 outside

    def record(t: torch.Tensor, into: Dict[object, Tuple[int, int, int]]) -> None:
        base = _base(t)
        if id(base) not in params and id(base) not in into:
            alive.append(base)
            floating = base.dtype == dtype
            into[id(base)] = (region[0], *((base.numel(), 0) if floating else (0, base.nbytes)))

    def pack(t: torch.Tensor) -> torch.Tensor:
        if counting[0]:
            record(t, seen)
        return t

    def fused_attention(attention, args, kwargs) -> torch.Tensor:
        """[Note: attention on meta]: what a fused kernel keeps, not the math fallback's."""
        given = {**dict(zip(_SDPA_ARGS, args)), **kwargs}
        if not _runs_fused(device_type, given):
            return attention(*args, **kwargs)
        inputs = [given[n] for n in _SDPA_ARGS[:4] if n in given]
        query, masked = inputs[0], given.get("attn_mask") is not None
        counting[0] = False
        try:
            out = attention(*args, **kwargs)
            if out.dim() == 4:  # laid out as the kernel writes it
                as_query = device_type == "cpu" or not masked
                if not as_query or query.stride(1) < query.stride(2):  # (B, L, H, D)
                    out = out.transpose(1, 2).contiguous().transpose(1, 2)
                else:
                    out = out.contiguous()
        finally:
            counting[0] = True
        for t in [*inputs, out]:
            if isinstance(t, torch.Tensor):
                record(t, seen)
        seen[("logsumexp", id(out))] = (region[0], 0, 4 * out.shape[:-1].numel())  # fp32
        return out

    def enter(index: int) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            region[0] = index  # a checkpointed block keeps its floating-point inputs
            for t in [*args, *kwargs.values()]:
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    record(t, block_inputs)

        return hook

    def leave(module: nn.Module, args: tuple, output: object) -> None:
        region[0] = -1

    blocks = repeated_blocks(model) or []
    handles = [
        h
        for index, block in enumerate(blocks)
        for h in (
            block.register_forward_pre_hook(enter(index), with_kwargs=True),
            block.register_forward_hook(leave),
        )
    ]
    extra_flops = [0]  # of the ops the flop counter does not see
    names = {id(t): name for name, t in state.items()}
    grouped: Dict[str, int] = {}  # parameter name -> FLOPs of the grouped matmuls with it

    def grouped_mm(matmul, args, kwargs) -> torch.Tensor:
        """[Note: grouped matmul on meta]."""
        a, b = args[0], args[1]
        if not a.is_meta:
            return matmul(*args, **kwargs)
        counting[0] = False
        try:
            low = [t.to(torch.bfloat16) for t in (a, b)]
            shape = matmul(*low, *args[2:], **kwargs).shape
        finally:
            counting[0] = True
        offs = args[2] if len(args) > 2 else kwargs.get("offs")
        for t in (a, b, offs):  # what the kernel saves; record skips the parameters
            if isinstance(t, torch.Tensor):
                record(t, seen)
        k_split = a.dim() == 2 and b.dim() == 2  # groups along K: one product in all
        product = (
            2 * a.shape[0] * a.shape[1] * b.shape[1]
            if k_split
            else (2 * shape.numel() * a.shape[-1])
        )
        extra_flops[0] += product
        weight = _base(b)
        if id(weight) in params:
            name = names[id(weight)]
            grouped[name] = grouped.get(name, 0) + product
        dtype = kwargs.get("out_dtype") or a.dtype
        out = torch.empty(shape, dtype=dtype, device="meta")
        if a.requires_grad or b.requires_grad:  # not a leaf: GPT-OSS adds its biases in place
            out = out.requires_grad_().clone()
        return out

    intercepts = {F.scaled_dot_product_attention: fused_attention}
    for matmul in (getattr(F, "grouped_mm", None), getattr(torch, "_grouped_mm", None)):
        if matmul is not None:
            intercepts[matmul] = grouped_mm
    flops = FlopCounterMode(display=False)
    try:
        with _Intercept(intercepts), flops, \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):  # fmt: skip
            if isinstance(example_input, Mapping):
                kwargs = {k: stand_in(v, True) for k, v in example_input.items()}
                out = functional_call(model, state, (), kwargs)
            else:
                out = functional_call(model, state, (stand_in(example_input, True),))
            if not isinstance(out, torch.Tensor):  # transformers' outputs, a tuple: the first
                out = out.logits if hasattr(out, "logits") else out[0]
            if out.dim():  # not a loss the model computed itself
                F.log_softmax(out.float(), dim=-1).sum()
    finally:
        for h in handles:
            h.remove()

    forward_flops = flops.get_total_flops() + extra_flops[0]

    def total(entries, where=lambda r: True) -> Tuple[int, int]:
        chosen = [(e, b) for r, e, b in entries if where(r)]
        return sum(e for e, _ in chosen), sum(b for _, b in chosen)

    if not blocks:
        return ForwardCosts(total(seen.values()), None, (0, 0), forward_flops, grouped)
    outside = {k: v for k, v in seen.items() if v[0] == -1}
    kept_entries = {**block_inputs, **outside}.values()  # a tensor once
    per_block = [total(seen.values(), lambda r, b=b: r == b) for b in range(len(blocks))]
    return ForwardCosts(
        total(seen.values()), total(kept_entries), max(per_block), forward_flops, grouped
    )


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _runs_fused(device_type: str, given: Dict[str, object]) -> bool:
    """Whether ``device_type`` runs ``F.scaled_dot_product_attention(**given)`` in a fused kernel
    ([Note: attention on meta]). The CPU: torch's own choice, asked of stand-ins one position
    long (it reads dtypes, heads, head sizes, dropout, whether the mask takes a gradient). CUDA:
    flash or memory-efficient attention, unless key and value have other heads than the query
    without ``enable_gqa`` (Falcon's one head, broadcast), which only the math kernel runs."""
    query, key, value = given["query"], given["key"], given["value"]
    if device_type != "cpu":
        heads = {t.shape[1] if t.dim() == 4 else None for t in (query, key, value)}
        return len(heads) == 1 or bool(given.get("enable_gqa", False))

    def stand_in(t: object, sequence_dims: Tuple[int, ...]) -> object:
        if not isinstance(t, torch.Tensor):
            return t
        shape = [1 if d - t.dim() in sequence_dims else n for d, n in enumerate(t.shape)]
        return torch.empty(shape, dtype=t.dtype).requires_grad_(t.requires_grad)

    # (..., L, D) inputs, a (..., L, S) mask: one position each
    stand_ins = {n: stand_in(t, (-2, -1) if n == "attn_mask" else (-2,)) for n, t in given.items()}
    return torch._fused_sdp_choice(**stand_ins) != int(SDPBackend.MATH)


def _base(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage ``t`` views (``t`` itself if it is no view)."""
    while t._base is not None:
        t = t._base
    return t


class _Intercept(TorchFunctionMode):
    """Calls ``handlers[func](func, args, kwargs)`` instead of such a ``func`` while active."""

    def __init__(self, handlers: Dict[Callable, Callable]) -> None:
        super().__init__()
        self.handlers = handlers

    def __torch_function__(self, func, types, args=(), kwargs=None):
        handler = self.handlers.get(func)
        if handler is not None:
            return handler(func, args, kwargs or {})
        return func(*args, **(kwargs or {}))
