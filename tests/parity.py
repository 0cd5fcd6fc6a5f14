"""Parity recipe shared by every strategy's tests (runs inside each rank of ``run_distributed``).

seed -> build model -> deepcopy as the reference -> wrap the copy with the strategy -> same
optimizer settings -> per-rank slices of one global batch -> N steps, comparing the loss
(averaged over ranks) with the reference's loss on the whole global batch at every step, and all
parameters at the end. The reference is plain PyTorch: ``torch.nn`` layers and ``torch.optim``.
"""

import copy
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from example.model import GPT2Model, GPTConfig, GPTConfigs

# fp32 tolerances for "same numbers as one device". The strategies compute the same layer math,
# but the gradient of the global mean is summed in another order (per-rank partial sums, then a
# collective), so results differ by float32 rounding: ~1e-7 relative per step. Adam divides by
# sqrt(v) ~ |g|, which turns a relative gradient difference into the same relative difference of
# an update of size lr; worse, some gradients are analytically zero (the attention key bias:
# softmax ignores a constant shift) and Adam turns their pure rounding noise into updates of size
# ~lr. With lr=1e-3 (what the tests use) that bounds parameter differences by ~1e-5 after 10 steps
# (measured: <= 1.1e-5); SGD steps are lr * grad and agree to ~1e-7.
LOSS_ATOL = 1e-5
PARAM_ATOL = 2e-5


@dataclass
class ParityResult:
    losses: List[float] = field(default_factory=list)
    reference_losses: List[float] = field(default_factory=list)
    max_param_diff: float = 0.0


def make_model(seed: int = 0, config: GPTConfig = GPTConfigs.gpt2_tiny) -> GPT2Model:
    torch.manual_seed(seed)
    return GPT2Model(config)


def global_batch(
    step: int, global_batch_size: int, seq_len: int, vocab: int, seed: int = 1234
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(x, y) of shape (global_batch_size, seq_len), a function of (seed, step) only."""
    gen = torch.Generator().manual_seed(seed * 100_003 + step)
    tokens = torch.randint(vocab, (global_batch_size, seq_len + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def local_slice(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    b = t.shape[0] // world_size
    return t[rank * b : (rank + 1) * b]


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def mean_over_ranks(value: torch.Tensor) -> float:
    value = value.detach().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def check_parity(
    rank: int,
    world_size: int,
    wrap: Callable[[nn.Module], Tuple[nn.Module, torch.optim.Optimizer]],
    make_reference_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
    full_state_dict: Callable[[nn.Module], Dict[str, torch.Tensor]],
    *,
    steps: int = 10,
    batch_per_rank: int = 2,
    seq_len: int = 8,
    config: GPTConfig = GPTConfigs.gpt2_tiny,
    seed: int = 0,
    loss_atol: float = LOSS_ATOL,
    param_atol: float = PARAM_ATOL,
) -> ParityResult:
    """Train reference and strategy side by side; assert they agree; return what was seen.

    ``wrap(model) -> (wrapped_model, optimizer)`` applies the strategy to a copy of the
    reference model. ``full_state_dict(wrapped)`` must return full tensors under the plain
    model's keys (called on every rank).
    """
    reference = make_model(seed, config)
    strategy_model, optimizer = wrap(copy.deepcopy(reference))
    reference_optimizer = make_reference_optimizer(reference)
    result = ParityResult()
    for step in range(steps):
        x, y = global_batch(step, batch_per_rank * world_size, seq_len, config.vocab_size)
        ref_loss = lm_loss(reference(x), y)
        ref_loss.backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad(set_to_none=True)

        loss = lm_loss(
            strategy_model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)
        )
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        result.reference_losses.append(ref_loss.item())
        result.losses.append(mean_over_ranks(loss))
        assert abs(result.losses[-1] - result.reference_losses[-1]) <= loss_atol, (
            f"rank {rank} step {step}: loss {result.losses[-1]:.8f} vs single-device "
            f"{result.reference_losses[-1]:.8f}"
        )
    full = full_state_dict(strategy_model)
    expected = reference.state_dict()
    assert set(full) == set(expected), f"keys differ: {set(full) ^ set(expected)}"
    for name, value in expected.items():
        diff = (full[name].float() - value.float()).abs().max().item() if value.numel() else 0.0
        result.max_param_diff = max(result.max_param_diff, diff)
        assert diff <= param_atol, f"rank {rank}: parameter {name} differs by {diff:.3e}"
    return result


def assert_trains_alike(
    what: str,
    losses: List[float],
    state: Dict[str, torch.Tensor],
    ref_losses: List[float],
    ref_state: Dict[str, torch.Tensor],
    loss_atol: float = LOSS_ATOL,
    param_atol: float = PARAM_ATOL,
) -> float:
    """Assert the same losses step by step and the same final tensors (same keys) as the
    oracle's, within the tolerances (default: AdamW's, above); return the worst tensor gap."""
    for step, (ours, ref) in enumerate(zip(losses, ref_losses)):
        assert abs(ours - ref) <= loss_atol, f"{what} step {step}: loss {ours} vs {ref}"
    assert set(state) == set(ref_state), f"{what}: keys differ"
    worst = 0.0
    for key, ref in ref_state.items():
        gap = (state[key].double() - ref.double()).abs().max().item() if ref.numel() else 0.0
        assert gap <= param_atol, f"{what}: {key} differs by {gap:.2e}"
        worst = max(worst, gap)
    return worst
