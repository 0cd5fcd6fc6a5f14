"""GPT-2 in plain ``torch.nn`` (module names as in OpenAI's checkpoints), built for strategies.

Every strategy converts this model's ``nn.Linear`` / ``nn.LayerNorm`` / ``nn.Embedding`` into
tiny_fsdp wrappers in place, so the model itself knows nothing about distribution. It lives in
the library (not in ``example/``) so that the estimator and users' code can build it from an
installed package; ``example.model`` re-exports it for scripts run from the repository.

[Note: per-parameter init]
Weights are a pure function of (``init_seed``, parameter name): ``init_parameter`` seeds a private
generator from both. A strategy can therefore build the model on the ``meta`` device and
initialise only the tensors (or the pieces) it keeps, one tensor at a time, and get exactly the
values that a normal construction with the same ``torch.manual_seed`` gives. ``init_seed`` itself
is drawn from the global CPU generator at construction, so two models built in a row differ as
usual.
"""

import math
import zlib
from dataclasses import dataclass, fields
from typing import Dict

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class GPTConfig:
    """nanoGPT's field names. ``vocab_size`` 50304 is GPT-2's 50257 padded to a multiple of 64."""

    block_size: int = 1024
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    bias: bool = True
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in ("int", int) and value <= 0:
                raise ValueError(f"GPTConfig.{f.name} must be positive, got {value}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}): each head "
                f"gets n_embd / n_head channels; pick e.g. n_head={_divisor_near(self)}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")


def _divisor_near(cfg: GPTConfig) -> int:
    return min(
        (d for d in range(1, cfg.n_embd + 1) if cfg.n_embd % d == 0),
        key=lambda d: abs(d - cfg.n_head),
    )


class GPTConfigs:
    """Presets. The four GPT-2 sizes, and small ones for tests, benchmarks and CPU runs."""

    gpt2 = GPTConfig(n_layer=12, n_head=12, n_embd=768)  # 124M
    gpt2_medium = GPTConfig(n_layer=24, n_head=16, n_embd=1024)  # 350M
    gpt2_large = GPTConfig(n_layer=36, n_head=20, n_embd=1280)  # 774M
    gpt2_xl = GPTConfig(n_layer=48, n_head=25, n_embd=1600)  # 1558M
    # Benchmarks: 4 layers of width 256 on the real vocabulary.
    gpt2_mini = GPTConfig(block_size=256, n_layer=4, n_head=4, n_embd=256)
    # CPU training on byte-level text: vocabulary of the byte tokenizer.
    gpt2_bytes = GPTConfig(block_size=256, vocab_size=256, n_layer=4, n_head=4, n_embd=128)
    # Unit tests: odd widths so that no dimension divides the world size evenly.
    gpt2_tiny = GPTConfig(block_size=32, vocab_size=67, n_layer=2, n_head=2, n_embd=18)

    @classmethod
    def names(cls) -> list:
        return [k for k, v in vars(cls).items() if isinstance(v, GPTConfig)]

    @classmethod
    def get(cls, name: str) -> GPTConfig:
        if name not in cls.names():
            raise ValueError(f"unknown model '{name}'; choose one of {cls.names()}")
        return getattr(cls, name)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        # (B, T, C) -> (B, n_head, T, C / n_head)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    """GPT-2: ``forward(idx (B, T) int64) -> logits (B, T, vocab_size)``.

    ``lm_head.weight`` is ``transformer.wte.weight`` (one tied parameter). Set
    ``gradient_checkpointing = True`` to recompute each block in backward instead of keeping its
    activations. Weights follow GPT-2's initialisation ([Note: per-parameter init]).
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.gradient_checkpointing = False
        # Drawn first, on the CPU generator, even under `with torch.device("meta")`: the layers'
        # own default init below consumes random numbers only on a real device, so the seed must
        # not depend on it ([Note: per-parameter init]).
        self.init_seed = int(torch.randint(2**62, (1,), device="cpu").item())
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # weight tying
        if self.lm_head.weight.device.type != "meta":
            self.init_weights()

    @torch.no_grad()
    def init_parameter(self, name: str, tensor: torch.Tensor) -> None:
        """Fill ``tensor`` (the full shape of parameter ``name``) with its initial value."""
        if name.endswith(".bias"):
            tensor.zero_()
        elif ".ln_" in name or name.startswith("transformer.ln_f"):
            tensor.fill_(1.0)
        else:
            std = 0.02
            if name.endswith("c_proj.weight"):  # GPT-2 scales residual projections by depth
                std = 0.02 / math.sqrt(2 * self.config.n_layer)
            gen = torch.Generator(device="cpu")
            gen.manual_seed((self.init_seed + zlib.crc32(name.encode())) % 2**63)
            values = torch.empty(tensor.shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
            tensor.copy_(values)

    def init_weights(self) -> None:
        for name, param in self.named_parameters():
            self.init_parameter(name, param.data)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(
                f"sequence length {T} exceeds block_size {self.config.block_size}: "
                "pass --seq_len <= block_size or pick a model with a larger block_size"
            )
        pos = torch.arange(T, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B,T,C)
        recompute = self.gradient_checkpointing and torch.is_grad_enabled()
        for block in self.transformer.h:
            x = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
        return self.lm_head(self.transformer.ln_f(x))  # (B, T, vocab)


def parameter_counts() -> Dict[str, int]:
    """Parameter counts of the presets, computed on the meta device (no memory used)."""
    counts = {}
    for name in GPTConfigs.names():
        with torch.device("meta"):
            counts[name] = GPT2Model(GPTConfigs.get(name)).num_parameters()
    return counts


if __name__ == "__main__":
    for name, n in parameter_counts().items():
        print(f"{name:12s} {n / 1e6:9.2f} M parameters")
