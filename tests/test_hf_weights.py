"""GPT-2 weights in HuggingFace's format load into ``GPT2Model`` (``--init_from DIR``): the same
logits as ``transformers``' own model, from safetensors and from ``pytorch_model.bin``, and the
examples start training from them."""

import os
from typing import List

import pytest
import torch
import torch.nn.functional as F

from example.data import TokenBatches, load_tokens
from example.tokenizer import ByteTokenizer
from tests.harness import printed_by_a_launched_job, run_distributed
from tiny_fsdp.models.hf_gpt2 import load_hf_gpt2

transformers = pytest.importorskip("transformers")

# Same math in the same order up to the Conv1D transpose (x @ W vs x @ W^T.T): float32 rounding.
LOGITS_ATOL = 1e-5
# The examples print the loss with 4 decimals.
PRINTED_LOSS_ATOL = 1.5e-4


def _hf_gpt2(seed: int = 0):
    # vocab 300 >= 256: the default data's byte tokens fit; random init, nothing downloaded.
    config = transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, vocab_size=300, n_positions=64, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config).eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(directory, model): a tiny HF GPT-2 as ``save_pretrained`` writes it (safetensors)."""
    directory = str(tmp_path_factory.mktemp("hf_gpt2"))
    model = _hf_gpt2()
    model.save_pretrained(directory)
    return directory, model


def test_safetensors_give_the_same_logits(saved):
    directory, hf = saved
    ours = load_hf_gpt2(directory).eval()
    idx = torch.randint(300, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), hf(idx).logits, atol=LOGITS_ATOL, rtol=0)


def test_pytorch_model_bin_gives_the_same_logits(saved, tmp_path):
    directory, hf = saved
    # The older layout: config.json and a torch.save'd state dict (tied lm_head included).
    os.symlink(os.path.join(directory, "config.json"), tmp_path / "config.json")
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    ours = load_hf_gpt2(str(tmp_path)).eval()
    idx = torch.randint(300, (3, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), hf(idx).logits, atol=LOGITS_ATOL, rtol=0)


def test_a_directory_without_weights_says_what_is_expected(tmp_path):
    with pytest.raises(FileNotFoundError, match="save_pretrained"):
        load_hf_gpt2(str(tmp_path))


def _fsdp_trainer_output(rank: int, world_size: int, argv: List[str]) -> str:
    from example import trainer

    return printed_by_a_launched_job(lambda: trainer.main("fsdp", argv))


def test_examples_start_from_the_saved_weights(saved, corpus_bin):
    """Step 0's loss (before any update) is the saved model's loss on the same global batch.

    The trainer hands the full tensors to the wrapper's ``load_state_dict``, which every
    strategy's own tests load full state dicts through; here FSDP, which splits each of them
    across the ranks."""
    directory, hf = saved
    args = ["--init_from", directory, "--steps", "1", "--seq_len", "16", "--batch_size", "2",
            "--device", "cpu", "--log_every", "1", "--tokenizer", "byte",
            "--data", corpus_bin]  # fmt: skip
    printed = run_distributed(_fsdp_trainer_output, 2, args)[0]  # rank 0 prints
    logged = float(printed.split("step     0 | loss ")[1].split()[0])

    # 2 ranks x 2 sequences read exactly the tokens of one process with 4 (example/data.py).
    tokens = load_tokens(corpus_bin, ByteTokenizer())
    x, y = TokenBatches(tokens, 16, 0, source=corpus_bin).get_batch(0, "train", 4, 0, 1)
    with torch.no_grad():
        logits = hf(x).logits
    expected = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).item()
    assert abs(logged - expected) <= PRINTED_LOSS_ATOL, (logged, expected)
