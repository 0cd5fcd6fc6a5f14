"""Models that ship with tiny_fsdp: GPT-2 and its presets (``tiny_fsdp.models.gpt2``), and small
``transformers`` presets built from a config (``tiny_fsdp.models.hf_presets``)."""

from tiny_fsdp.models.gpt2 import GPT2Model, GPTConfig, GPTConfigs, parameter_counts

__all__ = ["GPT2Model", "GPTConfig", "GPTConfigs", "parameter_counts"]
