"""Small ``transformers`` models built from a config, nothing downloaded: ``hf:gpt2`` and
``hf:llama``, on the byte vocabulary of the examples' default data (block size 256).

The examples train them (``--model hf:llama``) and the planner plans them; both read them here,
so that the installed library, which has no ``example`` package, plans them too.
"""

from typing import Any, Callable, Dict, Tuple

from torch import nn

_CONFIGS: Dict[str, Callable[[Any], Any]] = {
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
_CLASSES = {"hf:gpt2": "GPT2LMHeadModel", "hf:llama": "LlamaForCausalLM"}
HF_PRESETS = tuple(_CONFIGS)


def hf_preset(name: str) -> Tuple[Callable[[], nn.Module], int, int]:
    """``(make, vocab_size, block_size)`` of preset ``name``; ``make()`` builds the model (also
    under ``torch.device("meta")``). Raises ImportError naming the package if ``transformers``
    is not installed."""
    try:
        import transformers as tf
    except ImportError as e:
        raise ImportError(
            f"{name} is a transformers model: pip install transformers (nothing is downloaded)"
        ) from e
    config = _CONFIGS[name](tf)
    cls = getattr(tf, _CLASSES[name])
    block = getattr(config, "n_positions", None) or config.max_position_embeddings
    return (lambda: cls(config)), config.vocab_size, block
