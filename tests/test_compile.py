"""Specification: ``torch.compile`` works with every wrapper, whichever way it is applied: around
the wrapper (``torch.compile(FSDP(model))``), around the model before wrapping, or per block
(``block.compile()``, FSDP2's habit). Each trains like torch's DDP without compile. DDP and
ZeRO-1/2 compile the model's forward; FSDP and ZeRO-3 run it eagerly, compiling nothing (their
fetching is Python with side effects: [Note: torch.compile] in ``tiny_fsdp/core/utils/eager.py``),
instead of re-tracing every layer until dynamo's recompile limit or failing.

The ``aot_eager`` backend runs dynamo and AOTAutograd without generating code, so the test needs
no C++ compiler and takes seconds.
"""

import copy
from typing import List

import torch
import torch.nn.functional as F
from torch import nn

from tests.harness import run_distributed
from tests.parity import assert_trains_alike

STEPS, VOCAB = 3, 20
# SGD steps are lr * grad and aot_eager runs the same kernels: only the summation order of the
# gradient average may differ between the strategies (measured: 0 here, 3e-8 elsewhere).
ATOL = (1e-6, 1e-6)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(F.gelu(self.up(self.norm(h))))  # (B, T, 8)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.out = nn.Linear(8, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)  # (B, T, 8)
        for block in self.blocks:
            h = block(h)
        return self.out(h)  # (B, T, VOCAB)


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(10 * step + rank)
    seq = 5 + step  # a new sequence length every step: dynamic shapes
    return torch.randint(0, VOCAB, (4, seq), generator=g), torch.randint(
        0, VOCAB, (4, seq), generator=g
    )


def _train(model: nn.Module, optimizer, rank: int) -> List[float]:
    losses = []
    for step in range(STEPS):
        x, y = _batch(step, rank)
        loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _compiled(net: nn.Module, wrapper, how: str) -> tuple:
    """(what to call, the wrapper) with compile applied ``how``."""
    if how == "model":
        net = torch.compile(net, backend="aot_eager")
    if how == "blocks":
        for block in net.blocks:
            block.compile(backend="aot_eager")
    model = wrapper(net)
    if how == "wrapper":
        return torch.compile(model, backend="aot_eager"), model
    return model, model


def _worker(rank: int, world_size: int) -> List[str]:
    import torch._dynamo
    from torch._dynamo.utils import counters
    from torch.nn.parallel import DistributedDataParallel

    from tiny_fsdp import core

    torch.manual_seed(0)
    net = Net()
    reference = DistributedDataParallel(copy.deepcopy(net))
    ref_losses = _train(reference, torch.optim.SGD(reference.parameters(), lr=0.1), rank)
    ref_state = reference.module.state_dict()
    seen = []
    try:
        for name in ("DDP", "Zero1", "Zero2", "FSDP", "Zero3"):
            for how in ("wrapper", "model", "blocks"):
                what = f"{name}, torch.compile around the {how}"
                torch._dynamo.reset()
                counters.clear()
                call, model = _compiled(copy.deepcopy(net), getattr(core, name), how)
                optimizer = getattr(core, name + "SGD")(model.named_parameters(), lr=0.1)
                losses = _train(call, optimizer, rank)
                state = {k.replace("_orig_mod.", ""): v for k, v in model.state_dict().items()}
                assert_trains_alike(what, losses, state, ref_losses, ref_state, *ATOL)
                graphs = counters["stats"]["unique_graphs"]
                if name in ("FSDP", "Zero3"):
                    assert graphs == 0, f"{what}: dynamo compiled {graphs} graphs"
                else:
                    assert graphs > 0, f"{what}: nothing was compiled"
                seen.append(what)
    finally:
        torch._dynamo.reset()  # the worker process runs other tests next
    return seen


def test_torch_compile_trains_like_torch_ddp_with_every_wrapper() -> None:
    seen = run_distributed(_worker, 2)[0]
    assert len(seen) == 5 * 3
