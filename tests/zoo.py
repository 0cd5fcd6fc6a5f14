"""Models as people write them, for "any model" parity tests: no tiny_fsdp layer in sight.

``ZooLM`` packs, in one small language model, every pattern that a strategy built around its own
layer wrappers gets wrong: a linear class of its own with a transposed weight (HF's ``Conv1D``),
an RMSNorm class of its own, rotary embeddings with non-persistent buffers, a raw
``nn.Parameter`` held by a module, BatchNorm with running statistics, a module called twice per
forward, a parent reading a child's weight for a tied head and a 0-d logit scale, and a
structured (dataclass) output. Widths are odd so that no dim divides 2, 3 or 4 ranks.

``hf_models()`` builds tiny, randomly initialised ``transformers`` models (no download) with a
function that turns a batch into their loss.
"""

from dataclasses import dataclass
from typing import Any, Callable, Dict, Tuple

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 37
WIDTH = 10


class TransposedLinear(nn.Module):
    """y = x @ W + b with W of shape (in, out): HuggingFace's ``Conv1D`` layout. W is stored as
    the transpose of an (out, in) tensor, so it is not contiguous (strides (1, in)), as a weight
    converted from ``nn.Linear`` with ``.t()`` is: a collective handed it as it lies would send
    scrambled values."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter((torch.randn(d_out, d_in) * 0.2).t())
        self.bias = nn.Parameter(torch.zeros(d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(
            *x.shape[:-1], -1
        )


class OwnRMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Rotary(nn.Module):
    """Rotates pairs of channels by position; ``inv_freq`` and ``position_ids`` are
    non-persistent buffers (not in the state dict), as in Llama and BERT."""

    def __init__(self, d: int, max_len: int = 64) -> None:
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("position_ids", torch.arange(max_len), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[1]
        angles = self.position_ids[:T, None].float() * self.inv_freq[None, :]  # (T, d/2)
        cos, sin = angles.cos(), angles.sin()
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class PrefixToken(nn.Module):
    """Holds a raw parameter (a learned token added to every position, like ViT's cls token)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.token = nn.Parameter(torch.randn(1, 1, d) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.token


@dataclass
class ZooOutput:
    logits: torch.Tensor  # (B, T, VOCAB)
    hidden: torch.Tensor  # (B, T, WIDTH)


class ZooLM(nn.Module):
    def __init__(self, vocab: int = VOCAB, d: int = WIDTH) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.prefix = PrefixToken(d)
        self.rotary = Rotary(d)
        self.norm = OwnRMSNorm(d)
        self.proj = TransposedLinear(d, d)
        self.bn = nn.BatchNorm1d(d)
        self.shared = nn.Sequential(nn.Linear(d, d), nn.Tanh())  # called twice
        self.logit_scale = nn.Parameter(torch.tensor(1.5))  # 0-d, read by this module

    def forward(self, idx: torch.Tensor) -> ZooOutput:
        h = self.rotary(self.prefix(self.wte(idx)))  # (B, T, d)
        h = h + self.proj(self.norm(h))
        h = self.bn(h.transpose(1, 2)).transpose(1, 2)  # BatchNorm over channels
        h = self.shared(self.shared(h))
        logits = F.linear(h, self.wte.weight) * self.logit_scale  # the parent reads wte.weight
        return ZooOutput(logits=logits, hidden=h)


class RecurrentLM(nn.Module):
    """Recurrent layers: a 2-layer ``nn.LSTM`` and a bidirectional ``nn.GRU``, whose kernels take
    a whole layer's weights at once from the module's list of them (``_flat_weights``), not from
    attribute reads as other modules do."""

    def __init__(self, vocab: int = VOCAB, d: int = WIDTH) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.lstm = nn.LSTM(d, d + 1, num_layers=2, batch_first=True)
        self.gru = nn.GRU(d + 1, d, batch_first=True, bidirectional=True)
        self.head = nn.Linear(2 * d, vocab)

    def forward(self, idx: torch.Tensor) -> ZooOutput:
        h, _ = self.lstm(self.wte(idx))  # (B, T, d + 1)
        h, _ = self.gru(h)  # (B, T, 2 d)
        return ZooOutput(logits=self.head(h), hidden=h)


class SharedNormBlock(nn.Module):
    def __init__(self, norm: nn.Module, d: int = WIDTH) -> None:
        super().__init__()
        self.norm = norm  # the same module in every block
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(F.gelu(self.up(self.norm(h))))


class SharedBlocksLM(nn.Module):
    """Blocks that share layers, as ALBERT-style models do: one ``nn.LayerNorm`` module held
    by every block, and the first and last blocks' up-projections tied. With blocks as units
    (``unit="auto"``) the shared norm belongs to none of them (the root unit) and the tied
    weight to two, each of which gathers it."""

    def __init__(self, vocab: int = VOCAB, d: int = WIDTH) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        norm = nn.LayerNorm(d)
        self.blocks = nn.ModuleList(SharedNormBlock(norm, d) for _ in range(3))
        self.blocks[2].up.weight = self.blocks[0].up.weight
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> ZooOutput:
        h = self.wte(idx)  # (B, T, d)
        for block in self.blocks:
            h = block(h)
        return ZooOutput(logits=self.head(h), hidden=h)


def zoo_loss(output: ZooOutput, y: torch.Tensor) -> torch.Tensor:
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


# --------------------------------------------------------------------------- transformers

LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def _causal_lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


def hf_models() -> Dict[str, Tuple[Callable[[], nn.Module], LossFn, int]]:
    """name -> (build, loss(model, x, y), vocab) for tiny random ``transformers`` models."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return {
        "gpt2": (
            lambda: tf.GPT2LMHeadModel(
                tf.GPT2Config(n_layer=2, n_head=2, n_embd=10, n_positions=32, resid_pdrop=0.0,
                              embd_pdrop=0.0, attn_pdrop=0.0, **common)  # fmt: skip
            ),
            _causal_lm_loss,
            VOCAB,
        ),
        "llama": (
            lambda: tf.LlamaForCausalLM(
                tf.LlamaConfig(hidden_size=12, intermediate_size=20, num_hidden_layers=2,
                               num_attention_heads=2, num_key_value_heads=1,
                               max_position_embeddings=32, **common)  # fmt: skip
            ),
            _causal_lm_loss,
            VOCAB,
        ),
        "bert": (
            lambda: tf.BertForMaskedLM(
                tf.BertConfig(hidden_size=12, num_hidden_layers=2, num_attention_heads=2,
                              intermediate_size=20, max_position_embeddings=32,
                              hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                              **common)  # fmt: skip
            ),
            _causal_lm_loss,
            VOCAB,
        ),
    }


class BranchyNet(nn.Module):
    """``branch`` runs only when asked; ``never`` is never used."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.branch = nn.Linear(8, 8)
        self.never = nn.Linear(8, 8)
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        h = torch.tanh(self.inp(x))  # (B, 8)
        if use_branch:
            h = h + self.branch(h)
        return self.out(h)  # (B, 3)


class TinyBlocksLM(nn.Module):
    """Embedding, two residual LayerNorm-MLP blocks, head: (B, T) tokens -> (B, T, vocab)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, 8)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
            for _ in range(2)
        )
        self.out = nn.Linear(8, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)  # (B, T, 8)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)  # (B, T, vocab)


class SignSGD(torch.optim.Optimizer):
    """An optimizer of "another library": element-wise (right on shards and slices), but not
    one tiny_fsdp knows."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-group["lr"])
