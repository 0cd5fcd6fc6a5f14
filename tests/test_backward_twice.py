"""Specification: a second backward through a kept graph is reduced like the first.

``loss.backward(retain_graph=True)`` then ``(0.5 * loss).backward()``, no forward in between,
then ``step()``: every wrapper's gradients are the average over ranks of both backwards, so it
trains as one device on the global batch (1.5 x the gradient of the mean loss). The oracle is
that device, not torch's DDP: torch's DDP reduces only the first backward after a forward and
leaves the second one's gradients local (checked here too, so that the oracle's choice stays
justified), after which its ranks hold different gradients and drift apart.
"""

from typing import Dict, List

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tests.build import adamw, build
from tests.harness import run_distributed

STRATEGIES = ["ddp", "zero1", "zero2", "zero3", "fsdp"]
STEPS = 3
ROWS = 3  # per rank
OPTIM = adamw(lr=1e-2)


def _model() -> nn.Module:
    torch.manual_seed(0)  # rows 5 and 7: uneven FSDP shards at 2 ranks
    return nn.Sequential(nn.Linear(4, 7), nn.Tanh(), nn.Linear(7, 5))


def _batch(step: int, world_size: int) -> torch.Tensor:
    return torch.randn(ROWS * world_size, 4, generator=torch.Generator().manual_seed(step))


def _twice(loss: torch.Tensor) -> None:
    loss.backward(retain_graph=True)
    (0.5 * loss).backward()  # through the same graph: no forward in between


def _one_device(world_size: int) -> List[torch.Tensor]:
    model = _model()
    optimizer = OPTIM.reference(model.parameters())
    for step in range(STEPS):
        x = _batch(step, world_size)
        # DDP's loss: each rank's mean over its rows, averaged over ranks
        _twice(torch.stack([model(part).square().mean() for part in x.split(ROWS)]).mean())
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _worker(rank: int, world_size: int) -> Dict[str, float]:
    expected = _one_device(world_size)
    gaps = {}
    for strategy in STRATEGIES:
        model, optimizer = build(strategy, _model(), OPTIM)
        for step in range(STEPS):
            x = _batch(step, world_size).split(ROWS)[rank]
            _twice(model(x).square().mean())
            optimizer.step()
            optimizer.zero_grad()
        state = model.state_dict()  # full tensors, plain model's keys, on every rank
        full = [state[name] for name, _ in _model().named_parameters()]
        gaps[strategy] = max((a - b).abs().max().item() for a, b in zip(full, expected))

    torch_ddp = DistributedDataParallel(_model())
    x = _batch(0, world_size).split(ROWS)[rank]
    loss = torch_ddp(x).square().mean()
    loss.backward(retain_graph=True)
    first = torch_ddp.module[0].weight.grad.clone()
    loss.backward()
    second = torch_ddp.module[0].weight.grad - first
    on_rank_0 = second.clone()
    dist.broadcast(on_rank_0, src=0)
    spread = (second - on_rank_0).abs().max().reshape(1)  # 0 on rank 0 itself
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    gaps["torch_ddp_second_backward_across_ranks"] = spread.item()
    return gaps


def test_a_second_backward_through_a_kept_graph_trains_as_one_device() -> None:
    # One rank too: there ZeRO-2 stages gradients straight into its shard, which the second
    # backward overwrites after setting the first one's aside.
    for world_size in (1, 2):
        gaps = run_distributed(_worker, world_size)[0]
        for strategy in STRATEGIES:
            # One device vs 2 ranks: the sums of the reduction differ in order only (float32,
            # 3 AdamW steps at lr 1e-2 on weights of size ~0.5): measured 1.5e-8 for each.
            assert gaps[strategy] < 1e-7, (world_size, strategy, gaps[strategy])
    # torch's DDP: the second backward's gradient differs between ranks (not reduced)
    assert gaps["torch_ddp_second_backward_across_ranks"] > 1e-3
