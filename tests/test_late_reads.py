"""Parameters read outside their layer (FSDP / ZeRO-3), from any forward on ([Note: outside reads]).

- A parent that starts reading a child's parameter in a later forward (a tied head switched on
  at some step, a child's 0-d scale) trains like torch's DDP, and its eval-mode output is the
  plain model's; before, FSDP computed with the rank's shard silently and a ZeRO-3 rank that
  does not own the tensor failed while the other waited.
- A parameter handed to a layer as an input first in a later forward is refused on every rank
  with a message saying what to do (no rank hangs).
- Reading a parameter's dtype or shape (transformers' T5 checks ``self.wo.weight.dtype``) gives
  the full tensor's answer, the dtype the layer computes in, in every forward, and fetches
  nothing: the step's collectives are those of the model that does not read them.
"""

from typing import Any, List, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.harness import run_distributed
from tests.parity import assert_trains_alike, global_batch, local_slice
from tiny_fsdp.core import DDP, FSDP, FSDPAdamW, MixedPrecisionPolicy, Zero3, Zero3AdamW
from tiny_fsdp.core.comm import LEDGER

VOCAB, WIDTH, SEQ_LEN, STEPS, LATE = 23, 8, 5, 4, 2
LR = 1e-3  # AdamW; float32 noise amplified by 1/sqrt(v) stays within the parity tolerances
STRATEGIES = ["fsdp", "fsdp-layer", "zero3"]  # FSDP's default unit, one unit per layer, ZeRO-3


class Scale(nn.Module):
    """A 0-d parameter used in its own forward, and read by its parent from step ``LATE`` on."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(0.7))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.scale


class LateReaderLM(nn.Module):
    """With ``tied`` set, the parent also reads ``emb.weight`` (a tied head) and
    ``gate.scale``: reads its first forward did not make."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.gate = Scale()
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.tied = False

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.gate(torch.tanh(self.mix(self.emb(idx))))
        logits = self.head(h)
        if self.tied:
            logits = logits + F.linear(h, self.emb.weight) * self.gate.scale
        return logits


def _wrap(strategy: str, model: nn.Module, **kwargs: Any) -> Tuple[nn.Module, Any]:
    if strategy == "zero3":
        wrapped = Zero3(model, **kwargs)
        return wrapped, Zero3AdamW(wrapped.named_parameters(), lr=LR)
    unit = {"unit": "layer"} if strategy == "fsdp-layer" else {}
    wrapped = FSDP(model, **unit, **kwargs)
    return wrapped, FSDPAdamW(wrapped.named_parameters(), lr=LR)


def _run(wrapped: nn.Module, model: LateReaderLM, optimizer: Any, rank: int, world: int):
    """STEPS training steps, reading late from step LATE on; then two eval forwards, the
    first without the reads. Returns (losses, eval outputs)."""
    losses = []
    for step in range(STEPS):
        model.tied = step >= LATE
        x, y = global_batch(step, 2 * world, SEQ_LEN, VOCAB)
        x, y = local_slice(x, rank, world), local_slice(y, rank, world)
        loss = F.cross_entropy(wrapped(x).flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    wrapped.eval()
    outputs = []
    with torch.no_grad():
        for tied in (False, True):
            model.tied = tied
            outputs.append(wrapped(x))
    wrapped.train()
    return losses, outputs


def _late_read_worker(rank: int, world: int) -> List[str]:
    torch.manual_seed(0)
    reference = LateReaderLM()
    ddp = nn.parallel.DistributedDataParallel(reference)
    ref_losses, ref_outputs = _run(
        ddp, reference, torch.optim.AdamW(ddp.parameters(), lr=LR), rank, world
    )
    seen = []
    for strategy in STRATEGIES:
        torch.manual_seed(0)
        model = LateReaderLM()
        wrapped, optimizer = _wrap(strategy, model)
        losses, outputs = _run(wrapped, model, optimizer, rank, world)
        what = f"{strategy} world={world}"
        assert_trains_alike(what, losses, wrapped.state_dict(), ref_losses, reference.state_dict())
        for tied, (ours, ref) in enumerate(zip(outputs, ref_outputs)):
            assert ours.shape == ref.shape, f"{what} eval tied={tied}: {ours.shape}"
            gap = (ours - ref).abs().max().item()
            assert gap <= 1e-5, f"{what} eval tied={tied}: output differs by {gap:.2e}"
        seen.append(what)
    return seen


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_read_that_starts_in_a_later_forward_trains_like_torch_ddp(world_size):
    results = run_distributed(_late_read_worker, world_size)
    assert all(len(seen) == len(STRATEGIES) for seen in results)


class LateInputLM(nn.Module):
    """With ``tied`` set, the embedding's weight is handed to a LayerNorm (DeBERTa hands its
    relative embeddings to one), which the first forward did not do."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.tied = False

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        if self.tied:
            return h @ self.norm(self.emb.weight).t()
        return self.norm(h)


def _late_input_worker(rank: int, world: int) -> List[str]:
    messages = []
    for strategy in STRATEGIES:
        torch.manual_seed(0)
        model = LateInputLM()
        wrapped, _ = _wrap(strategy, model)
        x = torch.randint(0, VOCAB, (2, SEQ_LEN))
        wrapped(x).sum().backward()
        model.tied = True
        with pytest.raises(RuntimeError, match="handed to a layer as an input") as error:
            wrapped(x)
        messages.append(str(error.value))
    return messages


def test_a_parameter_handed_to_a_layer_first_in_a_later_forward_is_refused_on_every_rank():
    for messages in run_distributed(_late_input_worker, 2):
        assert all("emb.weight" in m and "first forward" in m for m in messages), messages


class ReadsDtype(nn.Module):
    """transformers' T5 feed-forward: casts its input to ``wo.weight``'s dtype if they differ."""

    def __init__(self, read: bool) -> None:
        super().__init__()
        self.wi = nn.Linear(WIDTH, 2 * WIDTH)
        self.wo = nn.Linear(2 * WIDTH, WIDTH)
        self.read = read
        self.seen: List[Tuple[torch.dtype, Tuple[int, ...]]] = []

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.wi(h))
        if self.read:
            self.seen.append((self.wo.weight.dtype, tuple(self.wo.weight.shape)))
            if h.dtype != self.wo.weight.dtype:
                h = h.to(self.wo.weight.dtype)
        return self.wo(h)


class DtypeLM(nn.Module):
    def __init__(self, read: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.ff = ReadsDtype(read)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.ff(self.emb(idx)))


def _property_worker(rank: int, world: int) -> List[str]:
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    seen = []
    for strategy in [*STRATEGIES, "ddp"]:
        for policy in (None, bf16):
            calls = {}
            for read in (False, True):
                torch.manual_seed(0)
                model = DtypeLM(read)
                if strategy == "ddp":
                    wrapped = DDP(model, mixed_precision=policy)
                else:
                    wrapped, _ = _wrap(strategy, model, mixed_precision=policy)
                x = torch.randint(0, VOCAB, (2, SEQ_LEN))
                for step in range(3):
                    LEDGER.reset()
                    wrapped(x).float().sum().backward()
                calls[read] = (dict(LEDGER.calls), dict(LEDGER.payload_bytes))  # the last step
            what = f"{strategy} {policy and policy.param_dtype}"
            dtype = torch.float32 if policy is None else torch.bfloat16
            full = (WIDTH, 2 * WIDTH)
            assert model.ff.seen == [(dtype, full)] * 3, f"{what}: {model.ff.seen}"
            assert calls[True] == calls[False], f"{what}: {calls}"
            seen.append(what)
    return seen


def test_a_dtype_or_shape_read_outside_the_layer_is_the_full_tensors_and_fetches_nothing():
    for seen in run_distributed(_property_worker, 2):
        assert len(seen) == 2 * (len(STRATEGIES) + 1)
