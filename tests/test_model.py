"""The GPT-2 example model: sizes, names, tying, meta construction, initialisation, errors."""

import pytest
import torch

from example.model import GPT2Model, GPTConfig, GPTConfigs, parameter_counts

# OpenAI's published parameter counts (vocabulary 50257). Our vocabulary is padded to 50304,
# which adds (50304 - 50257) rows of n_embd to the tied embedding / output matrix.
PUBLISHED = {
    "gpt2": 124_439_808,
    "gpt2_medium": 354_823_168,
    "gpt2_large": 774_030_080,
    "gpt2_xl": 1_557_611_200,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts_match_published_gpt2(name):
    cfg = GPTConfigs.get(name)
    assert parameter_counts()[name] == PUBLISHED[name] + (50304 - 50257) * cfg.n_embd


@pytest.mark.parametrize("name", GPTConfigs.names())
def test_every_preset_builds_on_meta(name):
    with torch.device("meta"):
        model = GPT2Model(GPTConfigs.get(name))
    assert all(p.is_meta for p in model.parameters())


def test_module_names_and_tying():
    model = GPT2Model(GPTConfigs.gpt2_tiny)
    names = dict(model.named_modules())
    for expected in ["transformer.wte", "transformer.wpe", "transformer.h.0.attn.c_attn",
                     "transformer.h.0.attn.c_proj", "transformer.h.1.mlp.c_fc",
                     "transformer.h.1.mlp.c_proj", "transformer.ln_f", "lm_head"]:  # fmt: skip
        assert expected in names
    assert model.lm_head.weight is model.transformer.wte.weight
    assert "lm_head.weight" in model.state_dict()  # tied key present, as in torch


def test_forward_shape_and_causality():
    torch.manual_seed(0)
    cfg = GPTConfigs.gpt2_tiny
    model = GPT2Model(cfg)
    idx = torch.randint(cfg.vocab_size, (2, 10))
    logits = model(idx)
    assert logits.shape == (2, 10, cfg.vocab_size)
    changed = idx.clone()
    changed[:, 7] = (changed[:, 7] + 1) % cfg.vocab_size
    # Position t only sees tokens <= t: changing token 7 leaves logits 0..6 unchanged.
    assert torch.equal(model(changed)[:, :7], logits[:, :7])
    assert not torch.equal(model(changed)[:, 7:], logits[:, 7:])


def test_meta_build_then_init_equals_normal_build():
    torch.manual_seed(3)
    normal = GPT2Model(GPTConfigs.gpt2_tiny)
    torch.manual_seed(3)
    with torch.device("meta"):
        meta = GPT2Model(GPTConfigs.gpt2_tiny)
    for name, param in meta.named_parameters():
        full = torch.empty(param.shape)
        meta.init_parameter(name, full)
        assert torch.equal(full, dict(normal.named_parameters())[name]), name


def test_gpt2_initialisation_statistics():
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=64, vocab_size=512, block_size=64)
    model = GPT2Model(cfg)
    h = model.transformer.h[0]
    assert torch.all(h.ln_1.weight == 1) and torch.all(h.attn.c_attn.bias == 0)
    assert abs(model.transformer.wte.weight.std().item() - 0.02) < 0.002
    residual_std = 0.02 / (2 * cfg.n_layer) ** 0.5  # GPT-2 scales residual projections by depth
    assert abs(h.mlp.c_proj.weight.std().item() - residual_std) < 0.1 * residual_std


def test_two_models_in_a_row_differ_and_same_seed_repeats():
    torch.manual_seed(0)
    a, b = GPT2Model(GPTConfigs.gpt2_tiny), GPT2Model(GPTConfigs.gpt2_tiny)
    torch.manual_seed(0)
    c = GPT2Model(GPTConfigs.gpt2_tiny)
    assert not torch.equal(a.lm_head.weight, b.lm_head.weight)
    assert torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_gradient_checkpointing_gives_same_gradients():
    torch.manual_seed(0)
    model = GPT2Model(GPTConfigs.gpt2_tiny)
    idx = torch.randint(GPTConfigs.gpt2_tiny.vocab_size, (2, 8))
    model(idx).square().mean().backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.gradient_checkpointing = True
    model(idx).square().mean().backward()
    for g, p in zip(plain, model.parameters()):
        assert torch.equal(g, p.grad)  # recomputation is deterministic on CPU


def test_bad_config_and_input_errors():
    with pytest.raises(ValueError, match="divisible by n_head"):
        GPTConfig(n_embd=30, n_head=4)
    model = GPT2Model(GPTConfigs.gpt2_tiny)
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, GPTConfigs.gpt2_tiny.block_size + 1, dtype=torch.long))
    with pytest.raises(ValueError, match="unknown model"):
        GPTConfigs.get("gpt5")
