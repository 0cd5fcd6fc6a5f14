"""Specification: a layer whose backward reads only the description of its parameters (the
``Embedding`` layer: its gradient scatters rows of ``grad_output``) neither unshards nor holds its
unit in backward ([Note: full units] in ``tiny_fsdp/core/full_unit.py``). GPT-2's root unit,
which holds the tied embedding / lm_head weight, is resharded right after lm_head's backward
under FSDP and ZeRO-3, not held through every block's backward; the gathers of a step stay those
of the forward and of the blocks' backward (``test_fsdp.py`` counts them), and training matches
one device (the parity tests)."""

from typing import Dict, List

from tests.build import adamw, build
from tests.harness import run_distributed
from tests.parity import global_batch, lm_loss, local_slice, make_model
from tiny_fsdp.core.module import Embedding

VOCAB = 67  # gpt2_tiny


def _root_held_during_the_blocks_backward(rank: int, world_size: int) -> Dict[str, List[bool]]:
    held: Dict[str, List[bool]] = {}
    for name in ("fsdp", "zero3"):
        model, opt = build(name, make_model(3), adamw(lr=1e-3))
        (root,) = [unit for unit in model.units if unit.name == "<root>"]
        seen: List[bool] = []

        def on_last_block(module, inputs, output):  # its output's gradient: lm_head is done
            output.register_hook(lambda grad: seen.append(root.is_unsharded))

        hook = model.module.transformer.h[-1].register_forward_hook(on_last_block)
        for step in range(3):  # the first backward runs on a guessed order, the next recorded
            x, y = global_batch(step, 2 * world_size, 8, VOCAB)
            x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
            lm_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        hook.remove()
        held[name] = seen
    return held


def test_the_root_unit_is_resharded_once_lm_head_has_run_backward() -> None:
    assert not Embedding.backward_reads_params
    for held in run_distributed(_root_held_during_the_blocks_backward, 2):
        assert held == {"fsdp": [False] * 3, "zero3": [False] * 3}, held
