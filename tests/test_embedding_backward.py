"""Specification: a layer whose backward reads only the description of its parameters (the
``Embedding`` layer: its gradient scatters rows of ``grad_output``; any layer that says
``backward_reads_params = False``) neither unshards nor holds its unit in backward ([Note: full
units] in ``tiny_fsdp/core/full_unit.py``). GPT-2's root unit,
which holds the tied embedding / lm_head weight, is resharded right after lm_head's backward
under FSDP and ZeRO-3, not held through every block's backward; the gathers of a step stay those
of the forward and of the blocks' backward (``test_fsdp.py`` counts them), and training matches
one device (the parity tests)."""

from typing import Any, Dict, List, Tuple

import torch
from torch import nn

from tests.build import adamw, build
from tests.harness import run_distributed
from tests.parity import global_batch, lm_loss, local_slice, make_model
from tiny_fsdp.core.comm import LEDGER
from tiny_fsdp.core.fsdp import FSDP, FSDPSGD
from tiny_fsdp.core.module import CallbackModule, Embedding

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


class Shift(nn.Module):
    """``x + bias`` over the last dimension."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.bias


class ShiftWrapper(CallbackModule, Shift):
    """A layer of a user's own (docs/extending.md) whose backward needs ``bias``'s shape only."""

    param_names = ("bias",)
    backward_reads_params = False

    def forward_callback(self, ctx: Any, x: torch.Tensor) -> torch.Tensor:
        (bias,) = ctx.params
        return x + bias

    def backward_callback(self, ctx: Any, grad_output: torch.Tensor) -> Any:
        (bias,) = ctx.params
        grad_x = grad_output if ctx.needs_input_grad[2] else None
        wanted = ctx.param_needs_grad[0]
        grad_bias = grad_output.reshape(-1, bias.shape[0]).sum(0) if wanted else None
        return (grad_x,), (grad_bias,)


def _own_layer(rank: int, world_size: int) -> Dict[bool, Tuple[List[float], Dict, int]]:
    """The same model with the flag said and not: losses, weights, a step's all-gathers."""
    runs = {}
    for reads in (True, False):
        layer = type("Shift", (ShiftWrapper,), {"backward_reads_params": reads})
        torch.manual_seed(0)
        # One unit per layer (no block list); Linear, last in forward, is kept for backward.
        model = FSDP(nn.Sequential(layer(8), nn.Linear(8, 8)))
        opt = FSDPSGD(model.parameters(), lr=0.1, momentum=0.9)
        losses, gathers = [], 0
        for step in range(3):
            x = torch.randn(4, 3, 8, generator=torch.Generator().manual_seed(10 * step + rank))
            LEDGER.reset()
            loss = model(x).square().mean()
            loss.backward()
            gathers = LEDGER.calls["all_gather"]
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        runs[reads] = losses, model.state_dict(), gathers
    return runs


def test_a_layer_of_ones_own_that_says_so_is_not_gathered_for_its_backward() -> None:
    for runs in run_distributed(_own_layer, 2):
        (losses, state, gathers), (d_losses, d_state, d_gathers) = runs[True], runs[False]
        assert d_losses == losses  # bitwise: the backward read no value it did not get
        assert all(torch.equal(state[k], d_state[k]) for k in state)
        assert (gathers, d_gathers) == (3, 2)  # Shift's unit is not gathered for its backward
