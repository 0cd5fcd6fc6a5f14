"""GPT-2 for the examples: re-exported from ``tiny_fsdp.models.gpt2``, where it lives.

Kept so that ``from example.model import GPT2Model, GPTConfigs`` keeps working from the
repository root, as the earlier Tiny-FSDP documented.
"""

from tiny_fsdp.models.gpt2 import (  # noqa: F401
    MLP,
    Block,
    CausalSelfAttention,
    GPT2Model,
    GPTConfig,
    GPTConfigs,
    parameter_counts,
)

if __name__ == "__main__":
    for name, n in parameter_counts().items():
        print(f"{name:12s} {n / 1e6:9.2f} M parameters")
