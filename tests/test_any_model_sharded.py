"""FSDP and ZeRO-3 train models as people write them, with no wrapper registered for their layers.

The oracle is ``torch.nn.parallel.DistributedDataParallel`` + ``torch.optim.AdamW`` on the same
per-rank batches: losses every step, every parameter and buffer at the end. Models: ``ZooLM``
(own transposed linear and RMSNorm, rotary buffers, raw and 0-d parameters, BatchNorm, a module
called twice, a tied head read by the parent, a dataclass output), a model whose parent reads a
child's 0-d parameter (and torch's ``nn.MultiheadAttention``, which reads two of its child's
parameters in one op), blocks sharing a norm module and a weight, a student with a frozen
teacher run under no_grad (after every backward no unit may stay full), weights computed by
``weight_norm`` / ``parametrizations``, recurrent layers (``nn.LSTM``, ``nn.GRU``), a mixture
of experts whose ranks run different experts, and tiny GPT-2 / Llama / BERT from
``transformers`` (if installed). Evaluation of torch's ``nn.TransformerEncoder`` without
gradients computes torch's training path, not its fast path.
Cases are combined into few distributed calls to keep CI time small.
"""

import copy
from collections import OrderedDict, namedtuple
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.harness import run_distributed
from tests.parity import assert_trains_alike, global_batch, local_slice
from tests.zoo import VOCAB, WIDTH, OwnRMSNorm, PrefixToken, RecurrentLM, Rotary, TransposedLinear
from tests.zoo import SharedBlocksLM, ZooLM
from tests.zoo import hf_models, zoo_loss

STEPS, SEQ_LEN = 3, 6
LR = 1e-3  # AdamW; float32 noise amplified by 1/sqrt(v) stays within PARAM_ATOL over STEPS

Build = Callable[[], nn.Module]
Loss = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def _zoo() -> nn.Module:
    model = ZooLM()
    # BatchNorm right after ``h + proj(...)`` cancels proj's bias: its true gradient is 0 and
    # what autograd computes is rounding noise, which AdamW turns into +-lr steps of any sign.
    # Frozen, it also covers a frozen parameter on the generic path.
    model.proj.bias.requires_grad_(False)
    return model


class Holder(nn.Module):
    """Holds a 0-d parameter that its parent reads (a CLIP-style ``logit_scale``)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(0.7))
        self.gain = nn.Parameter(torch.ones(WIDTH))

    def forward(self, h: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return h * self.gain, h  # a tuple output


@dataclass
class ReaderOutput:
    logits: torch.Tensor


class ReaderLM(nn.Module):
    """The parent reads a child's 0-d parameter and the embedding's weight (tied head); torch's
    ``nn.MultiheadAttention`` reads its child ``out_proj``'s weight and bias in one op; the
    parent hands two embeddings' weights to other modules as arguments (DeBERTa's relative
    position table through its LayerNorm): to a registered layer, and by keyword to a module
    of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.holder = Holder()
        self.attn = nn.MultiheadAttention(WIDTH, 2, batch_first=True)
        # The key third of in_proj_bias shifts every score of a row alike, which softmax
        # cancels: its gradient is float32 noise that AdamW turns into +-lr steps (see _zoo).
        self.attn.in_proj_bias.requires_grad_(False)
        self.norm = OwnRMSNorm(WIDTH)
        self.rel, self.rel_norm = nn.Embedding(5, WIDTH), nn.LayerNorm(WIDTH)
        self.pos, self.pos_norm = nn.Embedding(SEQ_LEN, WIDTH), OwnRMSNorm(WIDTH)

    def forward(self, idx: torch.Tensor) -> ReaderOutput:
        h, skip = self.holder(self.wte(idx))
        rel = self.rel_norm(self.rel.weight)  # (5, WIDTH)
        h = h + rel.mean(0) + self.pos_norm(x=self.pos.weight)  # (B, SEQ_LEN, WIDTH)
        h = h + self.attn(h, h, h, need_weights=False)[0]
        h = self.norm(h + skip) * self.holder.scale.exp()  # read outside the holder's forward
        return ReaderOutput(logits=F.linear(h, self.wte.weight))


class DistillLM(nn.Module):
    """A student and a frozen teacher (two lists of blocks), the teacher run under no_grad, and
    a frozen embedding: layers that never run backward, in the root unit and in block units."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wte.weight.requires_grad_(False)
        block = lambda: nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU())  # noqa: E731
        self.student = nn.ModuleList([block(), block()])
        self.teacher = nn.ModuleList([block(), block()]).requires_grad_(False)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor) -> ReaderOutput:
        h = self.wte(idx)
        with torch.no_grad():
            t = h
            for block in self.teacher:
                t = t + block(t)
        s = h
        for block in self.student:
            s = s + block(s)
        return ReaderOutput(logits=self.head(s + t))


class ParametrizedLM(nn.Module):
    """Weights computed from other parameters: ``nn.utils.weight_norm`` (a forward pre-hook
    derives ``conv.weight`` from ``weight_g`` / ``weight_v``; the layer is no longer the
    ``nn.Conv1d`` a wrapper implements), the ``parametrizations`` API's weight norm and an
    orthogonal weight (which keeps a transposed, non-contiguous buffer); and a convolution with
    reflect padding, which the Conv1d wrapper does not implement (the generic path runs it)."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.conv = nn.utils.weight_norm(nn.Conv1d(WIDTH, WIDTH, 3, padding=1))
        self.mix = nn.utils.parametrizations.orthogonal(nn.Linear(WIDTH, WIDTH))
        self.head = nn.utils.parametrizations.weight_norm(nn.Linear(WIDTH, VOCAB))
        self.reflect = nn.Conv1d(WIDTH, WIDTH, 3, padding=1, padding_mode="reflect")

    def forward(self, idx: torch.Tensor) -> ReaderOutput:
        h = self.wte(idx)  # (B, T, WIDTH)
        h = h + F.gelu(self.conv(h.transpose(1, 2))).transpose(1, 2)
        h = h + self.reflect(h.transpose(1, 2)).transpose(1, 2)
        return ReaderOutput(logits=self.head(torch.tanh(self.mix(h))))


def _zoo_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return zoo_loss(model(x), y)


def _models(names: List[str]) -> Dict[str, Tuple[Build, Loss, Callable[[nn.Module], list]]]:
    """name -> (build, loss, blocks of the model for per-block FSDP units)."""
    out = {
        "zoo": (_zoo, _zoo_loss, lambda m: [m.shared, m.bn]),
        "reader": (ReaderLM, _zoo_loss, lambda m: [m.holder]),
        "distill": (DistillLM, _zoo_loss, lambda m: [*m.student, *m.teacher]),
        "parametrized": (ParametrizedLM, _zoo_loss, lambda m: [m.conv, m.mix]),
        "rnn": (RecurrentLM, _zoo_loss, lambda m: [m.lstm, m.gru]),
        "shared": (SharedBlocksLM, _zoo_loss, lambda m: "auto"),  # listing blocks would refuse
    }
    if any(n in ("gpt2", "llama", "bert") for n in names):
        blocks = {
            "gpt2": lambda m: list(m.transformer.h),
            "llama": lambda m: list(m.model.layers),
            "bert": lambda m: list(m.bert.encoder.layer),
        }
        for name, (build, loss, _) in hf_models().items():
            out[name] = (build, loss, blocks[name])
    return {name: out[name] for name in names}


def _wrap(
    strategy: str,
    model: nn.Module,
    world_size: int,
    async_comm: bool,
    fused: Optional[bool] = None,
    **kwargs: Any,
):
    """(wrapped model, optimizer) for ``strategy``: "fsdp..." or "zero3";
    ``fused``: the optimizer's."""
    if strategy.startswith("fsdp"):
        from tiny_fsdp.core.fsdp import FSDP, FSDPAdamW

        wrapped = FSDP(model, enable_async_communication=async_comm, **kwargs)
        return wrapped, FSDPAdamW(wrapped.named_parameters(), lr=LR, fused=fused)
    from tiny_fsdp.core.zero3 import Zero3, Zero3AdamW, zero3_partition_tensors

    parts = zero3_partition_tensors(OrderedDict(model.named_parameters()), ["cpu"] * world_size)
    wrapped = Zero3(model, parts[0], enable_async_communication=async_comm, **kwargs)
    optimizer = Zero3AdamW(
        wrapped.module.named_parameters(), param_part_table=parts[0], lr=LR, fused=fused
    )
    return wrapped, optimizer


def _batch(step: int, rank: int, world_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    x, y = global_batch(step, 2 * world_size, SEQ_LEN, VOCAB)
    return local_slice(x, rank, world_size), local_slice(y, rank, world_size)


def _train(
    model: nn.Module, optimizer, loss_fn: Loss, rank: int, world_size: int, batch=None
) -> List[float]:
    """STEPS steps on ``batch(step, rank, world_size)`` (default ``_batch``); local losses."""
    losses = []
    for step in range(STEPS):
        x, y = (batch or _batch)(step, rank, world_size)
        loss = loss_fn(model, x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _oracle(build: Build, loss_fn: Loss, rank: int, world_size: int):
    """(losses, state_dict) of torch DDP + AdamW; buffers are not broadcast, as in FSDP /
    ZeRO-3 (and FSDP2): each rank's BatchNorm statistics follow its own batches."""
    torch.manual_seed(0)
    model = build()
    ddp = nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)
    optimizer = torch.optim.AdamW([p for p in ddp.parameters() if p.requires_grad], lr=LR)
    return _train(ddp, optimizer, loss_fn, rank, world_size), model.state_dict()


def _parity_worker(rank: int, world_size: int, names: List[str]) -> List[Tuple[str, float]]:
    seen = []
    for name, (build, loss_fn, blocks) in _models(names).items():
        ref_losses, ref_state = _oracle(build, loss_fn, rank, world_size)
        for strategy in ("fsdp-layer", "fsdp-block", "zero3"):  # FSDP's default: per block
            for async_comm in (False, True):
                what = f"{name} {strategy} async={async_comm} world={world_size}"
                torch.manual_seed(0)
                model = build()
                units = {"fsdp-layer": "layer", "fsdp-block": blocks(model)}
                kwargs = {"unit": units[strategy]} if strategy in units else {}
                wrapped, optimizer = _wrap(strategy, model, world_size, async_comm, **kwargs)
                losses = _train(wrapped, optimizer, loss_fn, rank, world_size)
                # Every unit was resharded by the end of each backward, also those holding
                # layers that never ran backward (frozen, or run under no_grad).
                held = (
                    wrapped.fetch_stats.live_bytes
                    if strategy == "zero3"
                    else wrapped.memory_stats()["gathered_bytes"]
                )
                assert held == 0, f"{what}: {held} bytes of full parameters still held"
                gap = assert_trains_alike(what, losses, wrapped.state_dict(), ref_losses, ref_state)
                seen.append((what, gap))
    return seen


@pytest.mark.parametrize("world_size", [2, 3])
def test_models_as_written_train_like_torch_ddp(world_size):
    names = ["zoo", "reader", "distill", "parametrized", "rnn", "shared"]
    results = run_distributed(_parity_worker, world_size, names)
    assert len(results[0]) == 6 * 3 * 2  # models x strategies x async, checked on every rank


@pytest.mark.parametrize("world_size", [2, 3])
def test_transformers_models_train_like_torch_ddp(world_size):
    pytest.importorskip("transformers")
    results = run_distributed(_parity_worker, world_size, ["gpt2", "llama", "bert"])
    assert len(results[0]) == 3 * 3 * 2


# ---------------------------------------------------------------------- layers some ranks skip


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(h)))


MoEInput = namedtuple("MoEInput", "hidden idx")


class MoEBlock(nn.Module):
    """Top-1 mixture of experts as it is often written: only the experts some token picked run.
    A token's expert is its id mod 3 (a hash router); the router's softmax weighs the output.
    With 4 experts, expert 3 is never picked."""

    def __init__(self, n_experts: int) -> None:
        super().__init__()
        self.router = nn.Linear(WIDTH, n_experts)
        self.experts = nn.ModuleList(Expert() for _ in range(n_experts))

    def forward(self, h: Any, idx: Optional[torch.Tensor] = None) -> torch.Tensor:
        if isinstance(h, MoEInput):
            h, idx = h  # one namedtuple argument
        elif idx is None:
            h, idx = h["hidden"], h["idx"]  # one dict argument
        weight = self.router(h).softmax(-1)  # (B, T, 4)
        pick = idx % 3  # (B, T)
        out = torch.zeros_like(h)
        for e in pick.unique().tolist():
            mask = pick == e
            out[mask] = self.experts[e](h[mask]) * weight[mask][:, e : e + 1]
        return h + out


class MoELM(nn.Module):
    """``packed``: how a block gets (hidden, idx): None (two arguments), "dict", "namedtuple"."""

    def __init__(self, n_experts: int, n_blocks: int = 3, packed: Optional[str] = None) -> None:
        super().__init__()
        self.packed = packed
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(MoEBlock(n_experts) for _ in range(n_blocks))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor) -> ReaderOutput:
        h = self.wte(idx)
        for block in self.blocks:
            if self.packed == "dict":
                h = block({"hidden": h, "idx": idx})
            else:
                h = block(MoEInput(h, idx)) if self.packed == "namedtuple" else block(h, idx)
        return ReaderOutput(logits=self.head(h))


def _moe_batch(step: int, rank: int, world_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rank 0's tokens pick experts 0, 1 and 2; rank 1's only 0 and 1."""
    g = torch.Generator().manual_seed(100 * step + rank)
    x = (
        torch.randint(0, VOCAB // 3, (2, SEQ_LEN), generator=g) * 3
        + torch.tensor([0, 1, 2])[torch.randint(0, 3 - rank, (2, SEQ_LEN), generator=g)]
    )
    return x, torch.randint(0, VOCAB, (2, SEQ_LEN), generator=g)


def _moe_worker(rank: int, world_size: int) -> List[str]:
    seen = []
    # (experts, blocks, packed input): with one block, the experts are the only list of like
    # modules, so the unit is named: the MoE block (unit="auto" would make each expert a unit).
    for n_experts, n_blocks, packed in (
        (3, 3, None),
        (4, 3, None),
        (3, 1, None),
        (3, 3, "dict"),
        (3, 3, "namedtuple"),
    ):
        torch.manual_seed(0)
        model = MoELM(n_experts, n_blocks, packed)
        ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=LR, weight_decay=0.1)
        ref_losses = _train(ddp, optimizer, _zoo_loss, rank, world_size, _moe_batch)
        ref_state = model.state_dict()
        for strategy in ("fsdp", "zero3"):
            for async_comm in (True, False):
                torch.manual_seed(0)
                ours = MoELM(n_experts, n_blocks, packed)
                kw = {"unit": [ours.blocks[0]]} if n_blocks == 1 else {}
                wrapped, optimizer = _wrap(strategy, ours, world_size, async_comm, **kw)
                for group in optimizer.param_groups:
                    group["weight_decay"] = 0.1  # steps a parameter whose gradient is zero
                losses = _train(wrapped, optimizer, _zoo_loss, rank, world_size, _moe_batch)
                what = f"moe {n_experts} x {n_blocks} packed={packed} {strategy} {async_comm}"
                assert_trains_alike(what, losses, wrapped.state_dict(), ref_losses, ref_state)
                seen.append(what)
    return seen


def test_a_block_whose_layers_run_on_some_ranks_only_trains_like_torch_ddp():
    """Expert 2 of every block runs on rank 0 only, so rank 0 runs every layer of a block and
    rank 1 does not; with a fourth expert, no rank runs expert 3. FSDP and ZeRO-3 give torch
    DDP's (find_unused_parameters=True) numbers: expert 2's gradient is the average over both
    ranks (rank 1 adds zeros), expert 3 gets none and is not stepped (no weight decay), and the
    ranks' collectives pair up ([Note: unit module events]), also when a block takes its
    input inside a dict or a namedtuple. A single MoE block, named as the unit, as the README
    says."""
    assert len(run_distributed(_moe_worker, 2)[0]) == 5 * 2 * 2


# ------------------------------------------------------------------------------ forward once


def _count_worker(rank: int, world_size: int) -> Dict[str, Dict[str, int]]:
    """Calls of each generic module's forward per training step, under each strategy."""
    counted = [TransposedLinear, OwnRMSNorm, PrefixToken, Rotary, ZooLM]
    originals = {cls: cls.forward for cls in counted}
    calls: Dict[str, int] = {}

    def counting(cls):
        def forward(self, *args, **kwargs):
            calls[cls.__name__] = calls.get(cls.__name__, 0) + 1
            return originals[cls](self, *args, **kwargs)

        return forward

    out = {}
    try:
        for cls in counted:
            cls.forward = counting(cls)
        for strategy in ("fsdp", "zero3"):
            torch.manual_seed(0)
            model = _zoo()
            wrapped, optimizer = _wrap(strategy, model, world_size, async_comm=True)
            calls.clear()
            _train(wrapped, optimizer, _zoo_loss, rank, world_size)
            out[strategy] = {k: v / STEPS for k, v in calls.items()}
            out[strategy]["bn"] = model.bn.num_batches_tracked.item() / STEPS
    finally:
        for cls, forward in originals.items():
            cls.forward = forward
    return out


def test_generic_path_runs_each_forward_once_per_step():
    for per_rank in run_distributed(_count_worker, 2):
        for strategy, counts in per_rank.items():
            expected = {name: 1 for name in ("TransposedLinear", "OwnRMSNorm", "PrefixToken")}
            expected.update(Rotary=1, ZooLM=1, bn=1)  # bn: running statistics updated once
            assert counts == expected, strategy


# ------------------------------------------------------------------------------ features


def _accumulate_worker(rank: int, world_size: int) -> List[str]:
    """no_sync micro-batches, and frozen + tied + outside-read parameters, vs torch DDP."""
    seen = []
    for strategy in ("fsdp", "zero3"):
        torch.manual_seed(0)
        reference = _zoo()
        ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(reference), broadcast_buffers=False)
        model, optimizer = _wrap(strategy, reference, world_size, async_comm=True)
        ref_optimizer = torch.optim.AdamW([p for p in ddp.parameters() if p.requires_grad], lr=LR)
        ref_losses, losses = [], []
        for step in range(STEPS):
            for wrapped, opt, out in ((ddp, ref_optimizer, ref_losses), (model, optimizer, losses)):
                x, y = _batch(step, rank, world_size)
                with wrapped.no_sync():
                    _zoo_loss(wrapped, x[:1], y[:1]).backward()
                loss = _zoo_loss(wrapped, x[1:], y[1:])
                loss.backward()
                opt.step()
                opt.zero_grad()
                out.append(loss.item())
        assert_trains_alike(
            f"no_sync {strategy}", losses, model.state_dict(), ref_losses, ddp.module.state_dict()
        )
        seen.append(strategy)
    return seen


def test_no_sync_accumulation_matches_torch_ddp():
    assert run_distributed(_accumulate_worker, 2)[0] == ["fsdp", "zero3"]


def _hf_features_worker(rank: int, world_size: int) -> List[str]:
    """Gradient checkpointing (non-reentrant) and mixed precision on transformers models."""
    from tiny_fsdp.core.precision import MixedPrecisionPolicy

    seen = []
    models = _models(["gpt2", "llama"])
    for name, (build, loss_fn, blocks) in models.items():
        ref_losses, ref_state = _oracle(build, loss_fn, rank, world_size)
        for strategy in ("fsdp-block", "zero3"):
            torch.manual_seed(0)
            model = build()
            model.gradient_checkpointing_enable({"use_reentrant": False})
            kwargs = {"unit": blocks(model)} if strategy == "fsdp-block" else {}
            wrapped, optimizer = _wrap(strategy, model, world_size, True, **kwargs)
            losses = _train(wrapped, optimizer, loss_fn, rank, world_size)
            what = f"{name} {strategy} checkpointing"
            assert_trains_alike(what, losses, wrapped.state_dict(), ref_losses, ref_state)
            seen.append(what)
        for strategy in ("fsdp", "zero3"):
            torch.manual_seed(0)
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
            wrapped, optimizer = _wrap(strategy, build(), world_size, True, mixed_precision=policy)
            losses = _train(wrapped, optimizer, loss_fn, rank, world_size)
            # bf16 keeps 8 mantissa bits: each op rounds at 2^-9 relative; through a few
            # layers the loss (~3.6) stays within 0.05 of float32's.
            gaps = [abs(a - b) for a, b in zip(losses, ref_losses)]
            assert max(gaps) <= 0.05, f"{name} {strategy} bf16: {gaps}"
            assert all(p.dtype == torch.float32 for p in wrapped.parameters())
            seen.append(f"{name} {strategy} bf16")
    return seen


def test_checkpointing_and_mixed_precision_on_transformers_models():
    pytest.importorskip("transformers")
    assert len(run_distributed(_hf_features_worker, 2)[0]) == 8


# ------------------------------------------------------------------------------ meta


class MetaZoo(ZooLM):
    """ZooLM that says how to initialise its buffers (``init_buffers``, [Note: meta buffers])."""

    def init_buffers(self, module: nn.Module) -> None:
        if isinstance(module, Rotary):
            d = module.inv_freq.shape[0] * 2
            module.inv_freq.copy_(1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)))
            module.position_ids.copy_(torch.arange(module.position_ids.shape[0]))
        elif isinstance(module, nn.BatchNorm1d):
            module.reset_running_stats()


def _builds_for(first: Dict[str, Tuple[Build, Loss]], names: List[str]) -> Dict:
    """name -> (build, loss): ``first`` (the worker's own model, names[0]), then ``_models``'."""
    rest = {n: (b, lf) for n, (b, lf, _) in _models(names[1:]).items()} if names[1:] else {}
    return {**first, **rest}


def _meta_worker(rank: int, world_size: int, names: List[str]) -> List[str]:
    """Built on meta: parameters from init_parameter, buffers (non-persistent ones included)
    from the model's own initialisation; the same training as a model built normally."""
    seen = []
    builds = _builds_for({"zoo": (MetaZoo, _zoo_loss)}, names)
    for name in names:
        build, loss_fn = builds[name]
        for strategy in ("fsdp", "zero3"):
            torch.manual_seed(0)
            reference = build()
            with torch.device("meta"):
                model = build()
            source = reference.state_dict()
            model.init_parameter = lambda key, tensor: tensor.copy_(source[key])
            reference_wrapped, ref_opt = _wrap(strategy, reference, world_size, True)
            wrapped, optimizer = _wrap(strategy, model, world_size, True)
            ref_losses = _train(reference_wrapped, ref_opt, loss_fn, rank, world_size)
            losses = _train(wrapped, optimizer, loss_fn, rank, world_size)
            what = f"meta {name} {strategy}"
            # The same wrapper on the same weights, buffers and batches: bitwise equal.
            assert_trains_alike(
                what, losses, wrapped.state_dict(), ref_losses, reference_wrapped.state_dict()
            )
            seen.append(what)
    return seen


def test_models_built_on_meta_get_their_buffers():
    names = ["zoo"]
    try:
        import transformers  # noqa: F401

        names += ["llama", "bert"]  # rotary inv_freq; position_ids and token_type_ids
    except ImportError:
        pass
    assert len(run_distributed(_meta_worker, 2, names)[0]) == 2 * len(names)


def _meta_error_worker(rank: int, world_size: int) -> str:
    with torch.device("meta"):
        model = ZooLM()  # no init_buffers: the rotary buffers cannot be recomputed
    model.init_parameter = lambda key, tensor: tensor.zero_()
    try:
        _wrap("zero3", model, world_size, True)
    except ValueError as error:
        return str(error)
    return ""


def test_meta_buffers_nothing_can_initialise_are_refused_with_the_fix():
    for message in run_distributed(_meta_error_worker, 2):
        assert "['rotary.inv_freq', 'rotary.position_ids'] are on the meta device" in message
        assert "Add init_buffers(self, module)" in message


def _rotations(dim: int, length: int) -> torch.Tensor:
    """(length, dim // 2) complex rotations of rotary embeddings, on the default device."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, dim, 2).float() / dim))
    angles = torch.outer(torch.arange(length).float(), inv)
    return torch.polar(torch.ones_like(angles), angles)


class TitanBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(WIDTH)
        self.wq = nn.Linear(WIDTH, WIDTH, bias=False)
        self.experts = nn.Parameter(torch.empty(2, WIDTH, WIDTH))  # drawn by init_weights only

    def forward(self, h: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
        q = self.wq(self.norm(h))  # (B, T, WIDTH)
        pairs = torch.view_as_complex(q.reshape(*q.shape[:-1], -1, 2))
        h = h + torch.view_as_real(pairs * rotations[: q.shape[1]]).flatten(2)
        return h + torch.tanh(h @ self.experts[0]) @ self.experts[1]

    def init_weights(self, std: float) -> None:
        self.norm.reset_parameters()
        nn.init.trunc_normal_(self.wq.weight, std=std)
        nn.init.trunc_normal_(self.experts, std=std)


class TitanLM(nn.Module):
    """torchtitan's way: blocks in an ``nn.ModuleDict``, a non-persistent complex buffer of
    rotations computed in ``__init__`` (on meta when built there) and again by
    ``init_weights(buffer_device)``, which the model is meant to get after wrapping, and raw
    3-D expert weights that only ``init_weights`` draws; no per-module init knows them ([Note:
    tensors the model's init method sets])."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, WIDTH)
        self.register_buffer("freqs_cis", _rotations(WIDTH, 16), persistent=False)
        self.layers = nn.ModuleDict({str(i): TitanBlock() for i in range(2)})
        self.output = nn.Linear(WIDTH, VOCAB, bias=False)

    def init_weights(self, buffer_device: Optional[torch.device] = None) -> None:
        with torch.device(buffer_device or self.freqs_cis.device):
            self.freqs_cis = _rotations(WIDTH, 16)
        nn.init.normal_(self.tok_embeddings.weight)
        for i, layer in enumerate(self.layers.values()):
            layer.init_weights(0.02 / (2 * (i + 1)) ** 0.5)
        nn.init.trunc_normal_(self.output.weight, std=0.3)

    def forward(self, idx: torch.Tensor) -> ReaderOutput:
        h = self.tok_embeddings(idx)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return ReaderOutput(logits=self.output(h))


def _titan_worker(rank: int, world_size: int) -> List[str]:
    def initialised() -> nn.Module:  # the oracle's: a real build, then the same init
        model = TitanLM()
        torch.manual_seed(1)
        model.init_weights()
        return model

    ref_losses, ref_state = _oracle(initialised, _zoo_loss, rank, world_size)
    seen = []
    for strategy in ("fsdp", "zero3"):
        with torch.device("meta"):
            model = TitanLM()
        wrapped, optimizer = _wrap(strategy, model, world_size, True)
        assert [unit.name for unit in wrapped.units] == ["layers.0", "layers.1", "<root>"]
        unset = r"\['freqs_cis', 'layers.0.experts', 'layers.1.experts'\] were on the meta"
        for init in (None, lambda module: None):  # no init yet; one that sets nothing
            if init is not None:
                wrapped.apply(init)
            with pytest.raises(ValueError, match=unset + ".*init_weights"):
                wrapped(_batch(0, rank, world_size)[0])  # before the model's init: refused
        torch.manual_seed(1)
        wrapped.init_weights(buffer_device=torch.device("cpu"))
        losses = _train(wrapped, optimizer, _zoo_loss, rank, world_size)
        what = f"torchtitan-style {strategy}"
        assert_trains_alike(what, losses, wrapped.state_dict(), ref_losses, ref_state)
        seen.append(what)
    return seen


def test_a_model_whose_init_weights_sets_tensors_trains_when_built_on_meta():
    """torchtitan's order (build on meta, wrap, ``init_weights``): the buffer and parameters
    nothing can initialise at wrap time are left to the model's init method, and a forward
    before it is refused with the call to make; after it, training matches torch DDP on the
    same init."""
    assert len(run_distributed(_titan_worker, 2)[0]) == 2


class AttentionStack(nn.Module):
    """torch.nn layers only: each initialises itself (``reset_parameters``), and
    MultiheadAttention (``_reset_parameters``) overrides its child ``out_proj``'s bias with 0."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, 2, batch_first=True)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.wte(idx))
        return self.head(h + self.attn(h, h, h, need_weights=False)[0])


def _logits_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _assert_like_own_init(what: str, state: Dict[str, torch.Tensor], normal: Dict[str, Any]):
    """``state`` drawn by the model's own init, as ``normal`` (built on a real device): a
    constant tensor (LayerNorm's ones, a zeroed bias) is equal; a drawn one has the same spread.
    Std of n >= 100 draws is within ~7 % of the true one per sigma: [0.7, 1.4] is > 4 sigma,
    while a missed parent init (GPT-2 scales its c_proj by 1/sqrt(2 n_layer) = 1/2 here) or a
    wrong fan is not."""
    for key, ref in normal.items():
        ours = state[key]
        if not ref.is_floating_point():
            continue
        assert torch.isfinite(ours).all(), f"{what}: {key} not finite"
        if bool((ref == ref.flatten()[0]).all()):
            assert torch.equal(ours, ref), f"{what}: {key} should be {ref.flatten()[0].item()}"
        elif ref.numel() >= 100:
            ratio = ours.std().item() / ref.std().item()
            assert 0.7 <= ratio <= 1.4, f"{what}: {key} spread {ratio:.2f} x the model's init"


def _meta_own_init_worker(rank: int, world_size: int, names: List[str]) -> List[str]:
    """Built on meta without ``init_parameter``: every tensor drawn by the model's own init
    ([Note: meta parameters]); then a checkpoint loaded into the wrapped model trains like
    torch DDP on a model built with it."""
    seen = []
    builds = _builds_for({"torch.nn": (AttentionStack, _logits_loss)}, names)
    for name in names:
        build, loss_fn = builds[name]
        ref_losses, ref_state = _oracle(build, loss_fn, rank, world_size)
        torch.manual_seed(0)
        normal = build().state_dict()
        for strategy in ("fsdp", "zero3"):
            what = f"meta {name} {strategy}"
            with torch.device("meta"):
                model = build()
            # The oracle's kernel (torch.optim.AdamW's CPU default): the attention's key bias,
            # whose gradient is rounding noise (tests/parity.py, tolerances), then follows the
            # oracle's trajectory instead of drifting by ~lr on the fused kernel's rounding.
            wrapped, optimizer = _wrap(strategy, model, world_size, True, fused=False)
            _assert_like_own_init(what, wrapped.state_dict(), normal)
            wrapped.load_state_dict(normal)
            losses = _train(wrapped, optimizer, loss_fn, rank, world_size)
            assert_trains_alike(what, losses, wrapped.state_dict(), ref_losses, ref_state)
            seen.append(what)
    return seen


def test_models_built_on_meta_without_init_parameter_take_their_own_init():
    names = ["torch.nn"]
    try:
        import transformers  # noqa: F401

        names += ["gpt2", "llama", "bert"]  # _init_weights; GPT-2's also scales c_proj
    except ImportError:
        pass
    assert len(run_distributed(_meta_own_init_worker, 2, names)[0]) == 2 * len(names)


def _meta_uninitialisable_worker(rank: int, world_size: int) -> List[str]:
    messages = []
    for strategy in ("fsdp", "zero3"):
        with torch.device("meta"):  # PrefixToken's raw parameter: no init anywhere
            model = nn.Sequential(nn.Embedding(VOCAB, WIDTH), PrefixToken(WIDTH))
        try:
            _wrap(strategy, model, world_size, True)
        except ValueError as error:
            messages.append(str(error))
    return messages


def test_meta_parameters_nothing_can_initialise_are_refused_with_the_fix_on_every_rank():
    # ZeRO-3 initialises '1.token' on its owner only: the other rank raises too, not hangs.
    for messages in run_distributed(_meta_uninitialisable_worker, 2):
        assert len(messages) == 2
        for message in messages:
            assert "parameters ['1.token'] are on the meta device and nothing" in message
            assert "Add init_parameter(self, name, tensor)" in message


# ------------------------------------------------------------- torch's inference fast paths


def _fast_path_worker(rank: int, world_size: int) -> List[str]:
    """torch's ``nn.TransformerEncoder`` in eval mode without gradients, with a key padding
    mask, takes torch's fast path: one fused op per layer reading the layer's parameters, on
    nested tensors, which leaves the padded positions 0. FSDP / ZeRO-3 watch every forward for
    parameters read outside their layer ([Note: outside reads]), which keeps torch off that
    path: their output is what torch computes with gradients enabled (the path training takes),
    and equals torch's fast-path output everywhere except at the padded positions (whose values
    are the paths' own and which nothing after a masked encoder should read)."""

    def build() -> nn.Module:
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(WIDTH, 2, 2 * WIDTH, dropout=0.0, batch_first=True)
        return nn.TransformerEncoder(layer, 2).eval()

    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, SEQ_LEN, WIDTH, generator=g)
    pad = torch.zeros(3, SEQ_LEN, dtype=torch.bool)
    pad[0, SEQ_LEN - 2 :] = True
    reference = build()
    with torch.no_grad():
        fast = reference(x, src_key_padding_mask=pad)
    slow = reference(x, src_key_padding_mask=pad).detach()
    assert not fast[pad].any() and slow[pad].abs().min() > 0, "torch took no fast path"
    seen = []
    for strategy in ("fsdp", "zero3"):
        wrapped, _ = _wrap(strategy, build(), world_size, True)
        for forward in ("first", "later"):  # the first forward of a mode is watched otherwise
            with torch.no_grad():
                out = wrapped(x, src_key_padding_mask=pad)
            # Our layers' kernels and torch's round differently: up to 4.8e-7 measured on
            # outputs of LayerNorm scale (a few ulps); 2e-6 leaves 4x that.
            torch.testing.assert_close(out, slow, atol=2e-6, rtol=0)
            torch.testing.assert_close(out[~pad], fast[~pad], atol=2e-6, rtol=0)
            seen.append(f"{strategy} {forward}")
    return seen


def test_eval_without_gradients_computes_torch_s_training_path_not_its_fast_path():
    assert (
        run_distributed(_fast_path_worker, 2)
        == [["fsdp first", "fsdp later", "zero3 first", "zero3 later"]] * 2
    )
