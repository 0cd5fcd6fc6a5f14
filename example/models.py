"""Which model an example trains: a GPT-2 preset, GPT-2 weights saved by HuggingFace, or a small
``transformers`` model built from a config (``hf:gpt2``, ``hf:llama``; ``pip install
transformers``, nothing is downloaded).

Every strategy trains every one of them with the same flags: GPT-2 presets go through tiny_fsdp's
layer wrappers, ``transformers`` models are used as they are (DDP, ZeRO-1/2) or through the
generic path (ZeRO-3, FSDP; [Note: generic layer]).
"""

from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
from torch import nn

from example.tokenizer import ByteTokenizer
from tiny_fsdp.models.gpt2 import GPT2Model, GPTConfigs
from tiny_fsdp.models.hf_gpt2 import hf_gpt2_config
from tiny_fsdp.models.hf_presets import HF_PRESETS, hf_preset


@dataclass
class ModelSpec:
    """``make()`` builds the model (also under ``torch.device("meta")``); ``vocab_size`` and
    ``block_size`` bound the token ids and the sequence length."""

    name: str
    make: Callable[[], nn.Module]
    vocab_size: int
    block_size: int

    def num_parameters(self) -> int:
        with torch.device("meta"):
            return sum(p.numel() for p in self.make().parameters())


def model_names() -> List[str]:
    """``--model`` choices: GPT-2 presets whose vocabulary covers the default data's byte
    tokenizer (``gpt2_tiny``, 67 entries, is for unit tests only), and the ``hf:`` models."""
    gpt2 = [
        n for n in GPTConfigs.names() if GPTConfigs.get(n).vocab_size >= ByteTokenizer.vocab_size
    ]
    return gpt2 + list(HF_PRESETS)


def model_spec(name: str, init_from: Optional[str] = None) -> ModelSpec:
    """The model of ``--model name`` (``--init_from DIR``: GPT-2 with that directory's config)."""
    if init_from is not None:
        config = hf_gpt2_config(init_from)
        return ModelSpec(init_from, lambda: GPT2Model(config), config.vocab_size, config.block_size)
    if name in HF_PRESETS:
        try:
            return ModelSpec(name, *hf_preset(name))
        except ImportError as e:
            raise SystemExit(str(e)) from e
    config = GPTConfigs.get(name)
    return ModelSpec(name, lambda: GPT2Model(config), config.vocab_size, config.block_size)


def logits_of(output) -> torch.Tensor:
    """The logits of a model's output: a tensor, or a ``transformers`` output's ``.logits``."""
    return output if isinstance(output, torch.Tensor) else output.logits
