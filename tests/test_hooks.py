"""Specification: hooks a user puts on the model see what they see under torch's DDP.

Module hooks (a forward hook capturing activations, a full backward hook capturing gradients)
under every wrapper; a gradient hook on a parameter (``p.register_hook``: here doubling one
weight's gradient) under DDP and ZeRO-1/2, where it sees this rank's gradient before the
average, as under torch's DDP. FSDP and ZeRO-3 refuse parameter hooks (``tests/test_errors.py``).
"""

import copy
from typing import List, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from tests.harness import run_distributed
from tests.zoo import TinyBlocksLM

VOCAB, STEPS = 20, 2
# SGD and the same kernels: only the summation order of the gradient average may differ
# (measured: 0 on 2 ranks).
ATOL = 1e-6


def _train(model: nn.Module, inner: nn.Module, optimizer, rank: int, param_hook: bool):
    """Train with hooks on ``inner``; returns (activations, grad outputs, grad inputs)."""
    seen: Tuple[List[torch.Tensor], ...] = ([], [], [])

    def on_backward(module: nn.Module, grad_in, grad_out) -> None:
        seen[1].append(grad_out[0].clone())
        seen[2].append(grad_in[0].clone())

    handles = [
        inner.blocks[1][1].register_forward_hook(lambda m, i, out: seen[0].append(out.clone())),
        inner.blocks[1][3].register_full_backward_hook(on_backward),
    ]
    if param_hook:
        handles.append(inner.blocks[0][1].weight.register_hook(lambda grad: grad * 2))
    for step in range(STEPS):
        g = torch.Generator().manual_seed(10 * step + rank)
        x, y = (torch.randint(0, VOCAB, (4, 7), generator=g) for _ in range(2))
        F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad()
    for handle in handles:
        handle.remove()
    return seen


def _worker(rank: int, world_size: int) -> List[str]:
    from torch.nn.parallel import DistributedDataParallel

    from tiny_fsdp import core

    torch.manual_seed(0)
    net = TinyBlocksLM(VOCAB)
    checked = []
    for param_hook in (True, False):
        reference = DistributedDataParallel(copy.deepcopy(net))
        optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
        expected = _train(reference, reference.module, optimizer, rank, param_hook)
        expected_state = reference.module.state_dict()
        names = ("DDP", "Zero1", "Zero2") if param_hook else ("FSDP", "Zero3")
        for name in names:
            what = f"{name}, {'parameter and ' if param_hook else ''}module hooks"
            model = getattr(core, name)(copy.deepcopy(net))
            optimizer = getattr(core, name + "SGD")(model.named_parameters(), lr=0.1)
            seen = _train(model, model.module, optimizer, rank, param_hook)
            for kind, ours, ref in zip(("activations", "grad out", "grad in"), seen, expected):
                assert len(ours) == len(ref) == STEPS, f"{what}: {kind} seen {len(ours)} times"
                gap = max((a - b).abs().max().item() for a, b in zip(ours, ref))
                assert gap <= ATOL, f"{what}: {kind} differ by {gap:.2e}"
            state = model.state_dict()
            gap = max((state[k] - v).abs().max().item() for k, v in expected_state.items())
            assert gap <= ATOL, f"{what}: parameters differ by {gap:.2e}"
            checked.append(what)
    return checked


def test_hooks_see_what_they_see_under_torch_ddp() -> None:
    assert len(run_distributed(_worker, 2)[0]) == 5
