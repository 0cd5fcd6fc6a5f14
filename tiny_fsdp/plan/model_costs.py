"""What a model costs per step, independent of any strategy: FLOPs, activations, parameter groups.

[Note: model costs]
``ModelCosts`` describes a model by what the strategies see of it:

- ``tensors``: elements of every distinct parameter tensor (a tied weight once), and ``rows``
  its dim-0 size (FSDP shards along it, padding the rows to a multiple of the shard group);
- ``layers``: per layer (a module holding parameters directly: a linear, a norm, an
  embedding) the tensors it uses, in forward order; a tied weight appears in each layer using it
  (ZeRO-3 fetches and reduces it once per use, FSDP reduces per layer);
- ``units``: FSDP's gather units with ``unit="auto"`` (the root's layers, then one unit per
  repeated block), as tensor index lists.

FLOPs per token (Kaplan et al. 2020, "Scaling laws", section 2.1): 6 per weight element of the
matrix products (2 forward, 4 backward), embeddings excluded except a tied output head, plus
attention scores and their product with the values, 2 * 2 * T * C forward per layer (12 T C
with backward). Elementwise operations (norms, GELU, softmax, the optimizer) are not FLOPs here:
their time is in the calibrated rate ([Note: calibration]). Other models: the layers' weights
give the first term, and the matrix products of the meta forward below that use no layer's own
weight (attention, a head tied to an embedding) the second (for GPT-2: the formula exactly).

Activations: the bytes autograd keeps for backward, per token, measured from the saved tensors
of ``GPT2Model`` with CPU's fused attention (``tests/test_plan.py`` checks it per strategy):

    per block      16 C  activation elements  (ln_1 in, c_attn in, q k v, attention out,
                                                c_proj in, ln_2 in, c_fc in, GELU in 4C,
                                                c_proj in 4C) + 4 fp32 norm statistics
                                                + n_head fp32 log-sum-exp
    head            2 C + V elements           (ln_f in, lm_head in, log-softmax out)
                                                + 2 fp32 statistics + 2 int64 ids + 2 bytes

With gradient checkpointing a block keeps only its input (C elements), and backward recomputes
one block at a time, so one block's full activations come back on top. Other models: the saved
tensors of one forward on the ``meta`` device (no memory, no compute; ``meta_forward.py``) in the
planned precision's dtype, the ones in that dtype as elements (of its width) and the rest as
bytes (ids, masks, what a bf16 model keeps in fp32: upcast norms, the loss), each charged to the
block that saved it (the blocks FSDP's ``unit="auto"`` finds) or to the rest of the model; with
checkpointing, the rest and the blocks' inputs are kept and the largest block comes back (for
GPT-2 the two ways agree within 1 %, ``tests/test_plan.py``).
"""

from dataclasses import dataclass, field
from typing import Dict, FrozenSet, List, Mapping, Optional, Tuple, Union

import torch
from torch import nn

from tiny_fsdp.models.gpt2 import GPT2Model, GPTConfig
from tiny_fsdp.plan.meta_forward import measure_forward

MAX_CALIBRATION_ROWS = 8192


@dataclass(frozen=True)
class ModelCosts:
    """A model as the planner sees it ([Note: model costs]).

    Attributes:
        name: for printing.
        tensors: elements per distinct parameter tensor.
        layers: per layer, in forward order, the indices (into ``tensors``) it uses.
        units: FSDP gather units (``unit="auto"``), root first, as tensor index lists.
        layer_matmul: per layer, the weight elements of its matrix products per token.
        matmul_params: weight elements of the matrix products per token (tied head included).
        attention_flops_per_token: forward attention FLOPs per token at ``seq_len`` = 1
            (multiply by ``seq_len``): ``4 * n_layer * C`` for GPT-2; another model's are
            counted in its meta forward (every matrix product not of a layer's own weight).
        act_per_token: ``(elements, fixed bytes)`` saved for backward per token; ``fixed``
            holds the fp32 / int64 parts that do not follow the compute dtype.
        ckpt_per_token: the same with gradient checkpointing; None if the model cannot.
        block_per_token: one block's ``(elements, fixed bytes)`` (recomputed under checkpointing).
        rows: dim-0 size per tensor (1 for a scalar); empty: a tensor's rows are its elements.
        matmul_shape: ``(in, out)`` of the widest matrix product in a block (GPT-2: the MLP's
            ``(C, 4 C)``), where ``--calibrate`` measures this model's rates.
        frozen: indices of the tensors that take no gradient (``requires_grad=False``: a LoRA
            model's base weights): no gradient, optimizer state or reduction.
    """

    name: str
    tensors: List[int]
    layers: List[List[int]]
    units: List[List[int]]
    layer_matmul: List[int]
    matmul_params: int
    attention_flops_per_token: float = 0
    act_per_token: tuple = (0, 0)
    ckpt_per_token: Optional[tuple] = None
    block_per_token: tuple = (0, 0)
    rows: List[int] = field(default_factory=list)
    matmul_shape: Tuple[int, int] = (1024, 4096)
    frozen: FrozenSet[int] = frozenset()

    @property
    def num_params(self) -> int:
        return sum(self.tensors)

    @property
    def trainable(self) -> List[int]:
        """Indices of the tensors that take a gradient."""
        return [t for t in range(len(self.tensors)) if t not in self.frozen]

    @property
    def num_trainable(self) -> int:
        return sum(self.tensors[t] for t in self.trainable)

    def rows_of(self, tensor: int) -> int:
        """Tensor ``tensor``'s dim-0 size, which FSDP shards."""
        return self.rows[tensor] if self.rows else self.tensors[tensor]

    def padded_numel(self, tensor: int, shards: int) -> int:
        """Elements of tensor ``tensor`` as FSDP lays it out over ``shards`` ranks: its rows
        padded to a multiple of ``shards``."""
        rows = self.rows_of(tensor)
        return -(-rows // shards) * shards * (self.tensors[tensor] // rows if rows else 0)

    def fsdp_rank_elements(self, shards: int) -> List[Tuple[int, int, int]]:
        """Per rank of an FSDP shard group of ``shards``, ``(held, with gradients, updated)``
        elements: each rank holds every tensor's padded shard (parameters; gradients of the
        trainable ones) and updates the real rows in it (optimizer state): rows
        ``[r c, (r + 1) c)`` of R, c = ceil(R / shards), so the first ranks update the most, and
        a tensor of fewer rows than ranks (a mixture's experts) leaves the last ones nothing."""
        held = sum(self.padded_numel(t, shards) for t in range(len(self.tensors))) // shards
        graded = sum(self.padded_numel(t, shards) for t in self.trainable) // shards
        updated = [0] * shards
        for t in self.trainable:
            rows = self.rows_of(t)
            chunk = -(-rows // shards)
            for rank in range(min(shards, -(-rows // chunk) if chunk else 0)):
                updated[rank] += min(chunk, rows - rank * chunk) * (self.tensors[t] // rows)
        return [(held, graded, n) for n in updated]

    def zero3_owners(self, ranks: int) -> List[int]:
        """The owner rank of each tensor under ``Zero3``'s default partition (it reads sizes
        only, so ``meta`` tensors of the same sizes give the same table)."""
        from tiny_fsdp.core.zero3 import zero3_partition_tensors

        named = [
            (str(i), torch.empty(numel, device="meta")) for i, numel in enumerate(self.tensors)
        ]
        table, _ = zero3_partition_tensors(named, ["cpu"] * ranks)
        return [table[str(i)] for i in range(len(self.tensors))]

    def zero3_owned(
        self, ranks: int, trainable_only: bool = False, owner: Optional[List[int]] = None
    ) -> List[List[int]]:
        """Per rank, the indices of the tensors it owns under ``Zero3``; with ``trainable_only``,
        of those it steps. ``owner``: ``zero3_owners(ranks)`` if the caller has it already (the
        partition is not made twice)."""
        owner = self.zero3_owners(ranks) if owner is None else owner
        tensors = self.trainable if trainable_only else range(len(self.tensors))
        return [[t for t in tensors if owner[t] == rank] for rank in range(ranks)]

    def calibration_shape(self, tokens: int) -> Tuple[int, int, int]:
        """``(rows, in, out)`` of the matrix product (and, ``(rows, out)``, the elementwise work)
        that calibrates this model's rates ([Note: calibration]): a rank's tokens as rows, at
        most ``MAX_CALIBRATION_ROWS`` (the rates change little beyond)."""
        return (min(tokens, MAX_CALIBRATION_ROWS), *self.matmul_shape)

    def flops(self, tokens: int, seq_len: int) -> float:
        """Forward + backward FLOPs of ``tokens`` tokens in sequences of ``seq_len``."""
        return (
            6.0 * self.matmul_params * tokens
            + 3.0 * self.attention_flops_per_token * seq_len * tokens
        )

    def activation_bytes(self, tokens: int, elem_bytes: int, grad_ckpt: bool = False) -> int:
        """Peak bytes kept for backward by ``tokens`` tokens ([Note: model costs])."""
        if grad_ckpt:
            if self.ckpt_per_token is None:
                raise ValueError(f"{self.name} cannot checkpoint (no repeated blocks known)")
            (e, f), (be, bf) = self.ckpt_per_token, self.block_per_token
            return int(tokens * (e * elem_bytes + f + be * elem_bytes + bf))
        e, f = self.act_per_token
        return int(tokens * (e * elem_bytes + f))


def _layers_and_tensors(model: nn.Module):
    """Distinct tensors, each layer's tensor indices, the auto gather units, and the widest
    matrix product's ``(in, out)`` (of the first block if there are blocks; in, out: the smaller
    and larger dimension of its weight)."""
    from tiny_fsdp.core.unit_layout import holders, repeated_blocks, unit_of

    index: Dict[int, int] = {}
    tensors: List[int] = []
    rows: List[int] = []
    frozen = set()
    for p in model.parameters():  # a tied parameter once
        index[id(p)] = len(tensors)
        if not p.requires_grad:
            frozen.add(len(tensors))
        tensors.append(p.numel())
        rows.append(p.shape[0] if p.dim() else 1)
    # Every module holding parameters is a layer; a tied weight is in each layer that uses it.
    layer_modules = [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]
    layers = [[index[id(p)] for p in m.parameters(recurse=False)] for m in layer_modules]
    layer_matmul = [
        (
            0
            if isinstance(m, nn.Embedding)
            else sum(p.numel() for p in m.parameters(recurse=False) if p.dim() >= 2)
        )
        for m in layer_modules
    ]
    blocks = repeated_blocks(model) or []
    held = holders(blocks)
    # As ``unit_layers``: a layer of one block is in its unit, any other in the root (first).
    units: List[List[int]] = [[] for _ in range(len(blocks) + 1)]
    for m, layer in zip(layer_modules, layers):
        unit = units[unit_of(held, m, root=-1) + 1]
        unit.extend(i for i in layer if i not in unit)  # a tied weight once per unit
    units = [u for u in units if u] if blocks else [[i] for layer in layers for i in layer]
    weights = [
        p.shape
        for m in (blocks[0] if blocks else model).modules()
        if not isinstance(m, nn.Embedding)
        for p in m.parameters(recurse=False)
        if p.dim() == 2
    ]
    widest = max(weights, key=lambda shape: shape.numel(), default=None)
    matmul_shape = (min(widest), max(widest)) if widest else ModelCosts.matmul_shape
    return tensors, rows, layers, units, layer_matmul, matmul_shape, frozenset(frozen)


def _grouped_matmul(
    model: nn.Module,
    layers: List[List[int]],
    tensors: List[int],
    layer_matmul: List[int],
    grouped: Dict[str, int],
    tokens: int,
) -> List[int]:
    """``layer_matmul`` with each parameter that grouped matmuls multiply counted by their
    FLOPs per token instead of its elements ([Note: grouped matmul on meta])."""
    if not grouped:
        return layer_matmul
    by_name = dict(model.named_parameters(remove_duplicate=False))
    index = {id(p): i for i, p in enumerate(model.parameters())}
    per_token = {index[id(by_name[n])]: round(f / (2 * tokens)) for n, f in grouped.items()}
    return [
        m + sum(per_token[i] - tensors[i] for i in layer if i in per_token)
        for m, layer in zip(layer_matmul, layers)
    ]


def gpt2_costs(config: GPTConfig, name: str = "gpt2") -> ModelCosts:
    """``ModelCosts`` of ``GPT2Model(config)``, built on ``meta`` ([Note: model costs])."""
    with torch.device("meta"):
        model = GPT2Model(config)
    tensors, rows, layers, units, layer_matmul, matmul_shape, _ = _layers_and_tensors(model)
    c, v, h = config.n_embd, config.vocab_size, config.n_head
    per_layer = 12 * c * c  # c_attn 3 C^2, c_proj C^2, c_fc 4 C^2, c_proj 4 C^2
    block = (16 * c, 4 * 4 + 4 * h)
    head = (2 * c + v, 2 * 4 + 2 * 8 + 2)
    n = config.n_layer
    return ModelCosts(
        name=name,
        tensors=tensors,
        layers=layers,
        units=units,
        layer_matmul=layer_matmul,
        matmul_params=n * per_layer + c * v,
        attention_flops_per_token=4 * n * c,
        act_per_token=(n * block[0] + head[0], n * block[1] + head[1]),
        ckpt_per_token=(n * c + head[0], head[1]),
        block_per_token=block,
        rows=rows,
        matmul_shape=matmul_shape,
    )


def module_costs(
    model: nn.Module,
    example_input: Union[torch.Tensor, Mapping[str, torch.Tensor], None] = None,
    name: Optional[str] = None,
    device_type: str = "cuda",
    seq_len: Optional[int] = None,
    dtype: torch.dtype = torch.float32,
) -> ModelCosts:
    """``ModelCosts`` of any module. A ``GPT2Model`` uses its config; another model's
    activations come from one forward on ``meta`` of ``example_input``: a tensor or the
    forward's keyword arguments (``{"input_ids": ..., "decoder_input_ids": ...}``), whose first
    is ``(B, T)`` token ids or else B samples of ``seq_len`` tokens each (images, audio; without
    ``seq_len``, ``(B, T, C)`` features); divided by those B T tokens, as ``device_type``'s
    attention kernels keep them, computing in ``dtype`` (what the model keeps in another, a
    bf16 model's fp32 norms and loss, is fixed bytes) ([Note: model costs], [Note: attention on
    meta]). Without an input they are unknown (0)."""
    name = name or type(model).__name__
    config = getattr(model, "config", None)
    if isinstance(model, GPT2Model) and isinstance(config, GPTConfig):
        return gpt2_costs(config, name)
    tensors, rows, layers, units, layer_matmul, matmul_shape, frozen = _layers_and_tensors(model)
    matmul = sum(layer_matmul)
    act, kept, block, other_flops = (0.0, 0.0), None, (0.0, 0.0), 0.0
    if example_input is not None:
        saved = measure_forward(model, example_input, device_type, dtype)
        inputs = example_input.values() if isinstance(example_input, Mapping) else [example_input]
        first = next(iter(inputs))
        if seq_len is None or (first.dim() == 2 and not first.is_floating_point()):
            batch, seq_len = (tuple(first.shape[:2]) + (1, 1))[:2]  # (B, T) ids, (B, T, C)
        else:  # a ViT's (B, 3, H, W) images: B samples of seq_len tokens (patches)
            batch = first.shape[0] if first.dim() else 1
        tokens = batch * seq_len
        act, block = (tuple(x / tokens for x in pair) for pair in (saved.total, saved.block))
        kept = None if saved.kept is None else tuple(x / tokens for x in saved.kept)
        # Experts multiplied by grouped matmuls: a token meets its experts' part of the weight.
        layer_matmul = _grouped_matmul(model, layers, tensors, layer_matmul, saved.grouped, tokens)
        matmul = sum(layer_matmul)
        # Matrix products of no layer's own weight (attention, a tied head), as attention's
        # term of ``flops``: per token and sequence position.
        other_flops = max(0.0, saved.forward_flops - 2.0 * matmul * tokens) / (tokens * seq_len)
    return ModelCosts(
        name, tensors, layers, units, layer_matmul, matmul, other_flops, act, kept, block, rows,
        matmul_shape, frozen,
    )  # fmt: skip
