"""A GAN trains under every strategy as under ``torch.nn.parallel.DistributedDataParallel``.

The loop is PyTorch's DCGAN example: the discriminator takes two backwards (real, then detached
fakes) before its step, and the generator's backward runs through the discriminator after that
step, without ``zero_grad`` in between, adding onto gradients that the next iteration clears.
Both models are wrapped; the oracle is torch's DDP with ``torch.optim.SGD`` (momentum: the
gradient's scale matters, unlike Adam's).
"""

import copy
from typing import Dict, List, Tuple

import torch
from torch import nn

from tests.build import build, sgd
from tests.harness import run_distributed

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")
HYPER = dict(lr=0.05, momentum=0.5)
STEPS = 4
# float32 summation order only (parity.py): SGD moves parameters by lr x gradient.
ATOL = 1e-6


def _models() -> Tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    generator = nn.Sequential(nn.Linear(4, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 8))
    discriminator = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    return generator, discriminator


def _train(rank: int, g: nn.Module, d: nn.Module, opt_g, opt_d) -> List[float]:
    criterion = nn.BCEWithLogitsLoss()
    gen = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(STEPS):
        real, noise = torch.randn(6, 8, generator=gen), torch.randn(6, 4, generator=gen)
        d.zero_grad()
        loss_real = criterion(d(real), torch.ones(6, 1))
        loss_real.backward()
        fake = g(noise)
        loss_fake = criterion(d(fake.detach()), torch.zeros(6, 1))
        loss_fake.backward()
        opt_d.step()
        g.zero_grad()
        loss_g = criterion(d(fake), torch.ones(6, 1))  # backward through the stepped d
        loss_g.backward()
        opt_g.step()
        losses += [loss_real.item(), loss_fake.item(), loss_g.item()]
    return losses


def _gan_worker(rank: int, world_size: int) -> Dict[str, float]:
    generator, discriminator = _models()
    torch_g = nn.parallel.DistributedDataParallel(copy.deepcopy(generator))
    torch_d = nn.parallel.DistributedDataParallel(copy.deepcopy(discriminator))
    want = _train(
        rank,
        torch_g,
        torch_d,
        torch.optim.SGD(torch_g.parameters(), **HYPER),
        torch.optim.SGD(torch_d.parameters(), **HYPER),
    )
    gaps = {}
    for strategy in STRATEGIES:
        g, opt_g = build(strategy, copy.deepcopy(generator), sgd(**HYPER))
        d, opt_d = build(strategy, copy.deepcopy(discriminator), sgd(**HYPER))
        got = _train(rank, g, d, opt_g, opt_d)
        loss_gap = max(abs(a - b) for a, b in zip(got, want))
        assert loss_gap <= ATOL, (strategy, got, want)
        for ours, oracle in ((g, torch_g.module), (d, torch_d.module)):
            state = ours.state_dict()
            for key, value in oracle.state_dict().items():
                gap = (state[key] - value).abs().max().item()
                assert gap <= ATOL, f"{strategy}: {key} differs by {gap:.2e}"
        gaps[strategy] = loss_gap
    return gaps


def test_the_dcgan_loop_trains_as_torch_ddp() -> None:
    assert all(len(gaps) == len(STRATEGIES) for gaps in run_distributed(_gan_worker, 2))
