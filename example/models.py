"""Which model an example trains: a GPT-2 preset, GPT-2 weights saved by HuggingFace, or a small
``transformers`` model built from a config (``hf:gpt2``, ``hf:llama``; ``pip install
transformers``, nothing is downloaded).

Every strategy trains every one of them with the same flags: GPT-2 presets go through tiny_fsdp's
layer wrappers, ``transformers`` models are used as they are (DDP, ZeRO-1/2) or through the
generic path (ZeRO-3, FSDP; [Note: generic layer]).
"""

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch
from torch import nn

from example.tokenizer import ByteTokenizer
from tiny_fsdp.models.gpt2 import GPT2Model, GPTConfigs
from tiny_fsdp.models.hf_gpt2 import hf_gpt2_config

# Small transformers configs on the byte vocabulary of the default data (block size 256).
_HF_CONFIGS: Dict[str, Callable[[], object]] = {
    "hf:gpt2": lambda tf: tf.GPT2Config(
        n_layer=4, n_head=4, n_embd=128, n_positions=256, vocab_size=256, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    ),  # fmt: skip
    "hf:llama": lambda tf: tf.LlamaConfig(
        hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, vocab_size=256, bos_token_id=0,
        eos_token_id=0, pad_token_id=0,
    ),  # fmt: skip
}
_HF_CLASSES = {"hf:gpt2": "GPT2LMHeadModel", "hf:llama": "LlamaForCausalLM"}


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
    return gpt2 + list(_HF_CONFIGS)


def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise SystemExit(
            "the hf: models need the transformers package: pip install transformers"
        ) from e
    return transformers


def model_spec(name: str, init_from: Optional[str] = None) -> ModelSpec:
    """The model of ``--model name`` (``--init_from DIR``: GPT-2 with that directory's config)."""
    if init_from is not None:
        config = hf_gpt2_config(init_from)
        return ModelSpec(init_from, lambda: GPT2Model(config), config.vocab_size, config.block_size)
    if name in _HF_CONFIGS:
        tf = _transformers()
        config = _HF_CONFIGS[name](tf)
        cls = getattr(tf, _HF_CLASSES[name])
        block = getattr(config, "n_positions", None) or config.max_position_embeddings
        return ModelSpec(name, lambda: cls(config), config.vocab_size, block)
    config = GPTConfigs.get(name)
    return ModelSpec(name, lambda: GPT2Model(config), config.vocab_size, config.block_size)


def logits_of(output) -> torch.Tensor:
    """The logits of a model's output: a tensor, or a ``transformers`` output's ``.logits``."""
    return output if isinstance(output, torch.Tensor) else output.logits
