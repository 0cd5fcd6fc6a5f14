"""Specification: code that decides per rank which forwards run keeps the ranks in step under
FSDP and ZeRO-3, whose forwards are collectives, as it does under torch's FSDP2 ([Note:
forwards in lockstep] in ``tiny_fsdp/core/utils/lockstep.py``).

- HuggingFace ``generate`` with prompts whose sequences end at different lengths on different
  ranks, with its default ``synced_gpus``: each rank gets what the plain model generates, and
  training goes on after it. (Before the mark, the rank that finished first went on to train
  while the other still generated: a hang.)
- HuggingFace LayerDrop (a speech model's ``layerdrop``) with a different random stream per rank
  (``torch.manual_seed(seed + rank)``, nanoGPT's habit): trains as FSDP2 ``fully_shard`` does,
  bit for bit (HF's synchronised mode runs every layer on every rank).
- A model's own choice per rank (a block skipped on some ranks only) cannot be kept in step; with
  identical blocks the gathers would pair across blocks and train wrong without a sign (as under
  FSDP2). FSDP raises at the end of that backward instead ([Note: ranks out of step] in
  ``tiny_fsdp/core/prefetch.py``), with prefetch on and off.
- A block skipped on one rank only, where the ranks then issue different numbers of collectives:
  their next collectives differ in kind or size and the ranks wait for each other (a 90 s run
  of FSDP and of ZeRO-3 was killed waiting, as FSDP2 waits). ``TORCH_DISTRIBUTED_DEBUG=DETAIL``
  makes torch compare every collective across ranks before running it: then every rank raises
  torch's "Detected mismatch between collectives", naming both, under FSDP and ZeRO-3.
"""

import os
import sys
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tests.build import build, sgd
from tests.harness import run_distributed, run_script_ranks

GATHERING = ("fsdp", "zero3")
NEW_TOKENS, STEPS = 24, 3


def _gpt2() -> nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=12, n_positions=64, vocab_size=37,
        bos_token_id=0, eos_token_id=5, pad_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # the training step is compared
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config).eval()


def _sample(model: nn.Module, prompt: torch.Tensor, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    with torch.no_grad():
        return model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=True, top_k=0)


def _generate_then_train(rank: int, world_size: int, strategy: str) -> float:
    plain = _gpt2()
    prompt = torch.randint(6, 37, (1, 4), generator=torch.Generator().manual_seed(rank))
    # Rank 0 samples a sequence that ends early (eos), the others one that runs to the limit.
    full = prompt.shape[1] + NEW_TOKENS
    seed = next(s for s in range(200) if (_sample(plain, prompt, s).shape[1] < full) == (rank == 0))
    expected = _sample(plain, prompt, seed)
    lengths = [None] * world_size
    dist.all_gather_object(lengths, expected.shape[1])
    assert len(set(lengths)) > 1, f"the ranks' sequences must end apart: {lengths}"

    model, optimizer = build(strategy, _gpt2(), sgd(lr=0.1))
    assert torch.equal(_sample(model, prompt, seed), expected)
    oracle = DistributedDataParallel(_gpt2())  # then one training step, as torch's DDP takes it
    oracle_optimizer = torch.optim.SGD(oracle.parameters(), lr=0.1)
    for trained, opt in ((model, optimizer), (oracle, oracle_optimizer)):
        trained.train()
        trained(input_ids=prompt, labels=prompt).loss.backward()
        opt.step()
    ours, theirs = model.state_dict(), oracle.module.state_dict()
    return max((ours[k] - v).abs().max().item() for k, v in theirs.items())


@pytest.mark.parametrize("strategy", GATHERING)
def test_hf_generate_ends_each_ranks_sequences_where_they_end(strategy: str) -> None:
    pytest.importorskip("transformers")
    # One SGD step, the same kernels, and a sum of two ranks' gradients is the same in any
    # order: bit for bit (measured 0.0).
    assert run_distributed(_generate_then_train, 2, strategy, timeout=60.0) == [0.0, 0.0]


def _wav2vec2() -> nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.Wav2Vec2Config(
        vocab_size=12, hidden_size=12, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=20, conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3),
        num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2, hidden_dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0,
        layerdrop=0.5, mask_time_prob=0.0, pad_token_id=0, ctc_loss_reduction="mean",
    )  # fmt: skip
    return transformers.Wav2Vec2ForCTC(config)


def _train_with_layerdrop(model: nn.Module, optimizer: Any, rank: int) -> List[float]:
    torch.manual_seed(100 + rank)  # each rank its own draws: LayerDrop picks layers per rank
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(10 * step + rank)
        audio, labels = torch.randn(2, 400, generator=g), torch.randint(1, 12, (2, 3), generator=g)
        loss = model(input_values=audio, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _layerdrop_against_fsdp2(rank: int, world_size: int) -> Dict[str, float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    theirs = _wav2vec2()
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in theirs.wav2vec2.encoder.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(theirs, mesh=mesh)
    their_losses = _train_with_layerdrop(theirs, torch.optim.SGD(theirs.parameters(), lr=0.1), rank)
    expected = {k: v.full_tensor() for k, v in theirs.state_dict().items()}
    gaps = {}
    for strategy in GATHERING:
        model, optimizer = build(strategy, _wav2vec2(), sgd(lr=0.1))
        assert _train_with_layerdrop(model, optimizer, rank) == their_losses, strategy
        full = model.state_dict()
        gaps[strategy] = max((full[k] - v).abs().max().item() for k, v in expected.items())
    return gaps


def test_layerdrop_with_per_rank_random_streams_trains_as_fsdp2() -> None:
    pytest.importorskip("transformers")
    for gaps in run_distributed(_layerdrop_against_fsdp2, 2, timeout=90.0):
        # Same layers, same kernels, same reduction order as FSDP2 on gloo: bit for bit
        # (measured 0.0).
        assert gaps == {strategy: 0.0 for strategy in GATHERING}


class _SkippingModel(nn.Module):
    """Identical layers, so that gathers paired across them match in size (a layer of another
    size would stop gloo instead); rank r skips block 1 + r (a LayerDrop whose draws differ)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, skip: int) -> torch.Tensor:  # (B, 8) -> (B, 8)
        for index, block in enumerate(self.blocks):
            if index != skip:
                x = torch.tanh(block(x))
        return self.head(x)


def _skip_per_rank(rank: int, world_size: int, prefetch: bool) -> str:
    torch.manual_seed(0)
    model, optimizer = build(
        "fsdp", _SkippingModel(), sgd(lr=0.1), enable_async_communication=prefetch
    )
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    model(x, skip=0).sum().backward()  # every rank skips the same block: in step, no error
    optimizer.step()
    optimizer.zero_grad()
    with pytest.raises(RuntimeError, match="did not unshard the same units") as caught:
        model(x, skip=1 + rank).sum().backward()
    optimizer.zero_grad()  # its gradients were made NaN; a run that catches the error goes on
    model(x, skip=0).sum().backward()
    optimizer.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    return str(caught.value)


@pytest.mark.parametrize("prefetch", [True, False])
def test_a_block_skipped_on_one_rank_only_raises_instead_of_training_wrong(prefetch: bool):
    messages = run_distributed(_skip_per_rank, 2, prefetch)
    assert messages[0] == messages[1]


@pytest.mark.parametrize("strategy", GATHERING)
def test_with_torchs_debug_mode_a_rank_left_behind_raises_on_every_rank(strategy: str) -> None:
    script = os.path.join("tests", "test_lockstep.py")
    env = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL", "LOCKSTEP_STRATEGY": strategy}
    for rank, (code, out) in enumerate(run_script_ranks(script, 2, timeout=60.0, env=env)):
        assert code != 0 and "Detected mismatch between collectives" in out, (rank, out[-3000:])


def _left_behind_main() -> None:
    """A launched rank: rank 1 skips block 1 in the second step, rank 0 runs every block."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model, optimizer = build(os.environ["LOCKSTEP_STRATEGY"], _SkippingModel(), sgd(lr=0.1))
    for step in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
        model(x, skip=1 if rank == 1 and step == 1 else -1).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    sys.exit("every rank ran every collective: the test's premise is gone")


if __name__ == "__main__":
    _left_behind_main()
