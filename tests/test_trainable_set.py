"""Specification: parameters frozen or unfrozen after wrapping (``requires_grad_`` between steps:
a fine-tuning run that unfreezes its first layers later, a GAN loop that freezes a model for one
step) train as on one device with torch.optim, under every strategy that can follow the change;
ZeRO-1/2 refuse to unfreeze a parameter frozen at wrap time, with a message ([Note: trainable
set after wrapping] in ``tiny_fsdp/core/replicated.py``).

The oracle is one process with the global batch and ``torch.optim.SGD``: torch's DDP cannot be
one here, since it keeps the gradient of a parameter unfrozen after wrapping local (its replicas
drift apart) and raises when one is frozen.
"""

import copy
from typing import Callable, Dict, List, Optional

import torch
from torch import nn

from tests.harness import run_distributed
from tests.parity import assert_trains_alike

STEPS, CHANGE_AT = 5, 2
SGD = dict(lr=0.1, momentum=0.9)
# SGD steps are lr * grad: only the summation order of the gradient average differs (measured:
# tensors within 6e-8), and this MLP has no analytically zero gradient that AdamW would amplify.
ATOL = (1e-6, 1e-6)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(6, 12)
        self.middle = nn.Linear(12, 12)
        self.last = nn.Linear(12, 3)
        self.scale = nn.Parameter(torch.ones(12))  # a raw parameter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x)) * self.scale
        return self.last(torch.tanh(self.middle(h)))


def _unfreeze_first(model: nn.Module, step: int) -> None:
    if step == CHANGE_AT:
        model.first.requires_grad_(True)


def _freeze_middle(model: nn.Module, step: int) -> None:
    if step == CHANGE_AT:
        model.middle.requires_grad_(False)


def _toggle_middle(model: nn.Module, step: int) -> None:
    """Frozen for one step, as a GAN loop freezes its discriminator for the generator's."""
    model.middle.requires_grad_(step != CHANGE_AT)


CHANGES: Dict[str, Callable[[nn.Module, int], None]] = {
    "unfreeze": _unfreeze_first,
    "freeze": _freeze_middle,
    "toggle": _toggle_middle,
}


def _net(change: str) -> nn.Module:
    torch.manual_seed(0)
    net = Net()
    if change == "unfreeze":
        net.first.requires_grad_(False)  # frozen at wrap time
    return net


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * step + rank))


def _train(model: nn.Module, plain: nn.Module, optimizer, change: str, batch) -> List[float]:
    losses = []
    for step in range(STEPS):
        CHANGES[change](plain, step)
        loss = model(batch(step)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _mean_over_ranks(values: List[float]) -> List[float]:
    import torch.distributed as dist

    total = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(total)
    return (total / dist.get_world_size()).tolist()


def _bucket_numel(model: nn.Module) -> Optional[int]:
    buckets = getattr(model, "buckets", None)
    return None if buckets is None else sum(b.buffer.numel() for b in buckets)


def _assert_refused(what: str, call: Callable[[], object], names: str = "") -> None:
    names = names or "['first.weight', 'first.bias']"
    try:
        call()
    except RuntimeError as error:
        assert f"{names} became trainable after wrapping" in str(error), str(error)
        assert "Set requires_grad before wrapping" in str(error), str(error)
        return
    raise AssertionError(f"{what}: went on without a word")


def _assert_keeps_momentum(what: str, ours: dict, reference: dict) -> None:
    """The consolidated state holds every parameter's momentum, as torch.optim's state_dict
    does, the frozen ``middle`` layer's included."""
    for index, ref_state in reference["state"].items():
        assert index in ours["state"], f"{what}: no state for parameter {index}"
        gap = (ours["state"][index]["momentum_buffer"] - ref_state["momentum_buffer"]).abs().max()
        assert gap <= ATOL[1], f"{what}: momentum of parameter {index} differs by {gap:.2e}"


def _worker(rank: int, world_size: int) -> List[str]:
    from tiny_fsdp import core

    seen = []
    for change in CHANGES:
        reference = _net(change)
        everyone = lambda step: torch.cat([_batch(step, r) for r in range(world_size)])  # noqa
        ref_optim = torch.optim.SGD(reference.parameters(), **SGD)
        ref_losses = _train(reference, reference, ref_optim, change, everyone)
        for wrapper in ("DDP", "Zero1", "Zero2", "FSDP", "Zero3"):
            what = f"{wrapper}, {change} after wrapping"
            model = getattr(core, wrapper)(copy.deepcopy(_net(change)))
            optimizer = getattr(core, wrapper + "SGD")(model.named_parameters(), **SGD)
            numel_before = _bucket_numel(model)
            first_buffer = model.buckets[0].buffer if wrapper == "DDP" else None
            batch = lambda step: _batch(step, rank)  # noqa: E731
            if change == "unfreeze" and wrapper in ("Zero1", "Zero2"):
                _assert_refused(what, lambda: _train(model, model.module, optimizer, change, batch))
                # Adding the unfrozen parameter to an optimizer is refused alike, naming it as
                # the model does even in a group of bare tensors (torch's habit).
                head = getattr(core, wrapper + "SGD")(model.module.last.named_parameters(), **SGD)
                group = {"params": [model.module.first.weight], "lr": 0.01}
                _assert_refused(what, lambda: head.add_param_group(group), "['first.weight']")
                seen.append(what + ": refused")
                continue
            losses = _train(model, model.module, optimizer, change, batch)
            state = model.state_dict()
            assert_trains_alike(
                what, _mean_over_ranks(losses), state, ref_losses, reference.state_dict(), *ATOL
            )
            if wrapper in ("Zero1", "Zero2"):  # the state of a parameter frozen later stays
                optimizer.consolidate_state_dict(to=0)
                if rank == 0:
                    _assert_keeps_momentum(what, optimizer.state_dict(), ref_optim.state_dict())
            if wrapper == "DDP":  # only an unfrozen parameter needs new buckets
                grew = _bucket_numel(model) > numel_before
                assert grew == (change == "unfreeze"), f"{what}: buckets did not follow"
                assert change == "unfreeze" or model.buckets[0].buffer is first_buffer, what
            seen.append(what)
    return seen


def test_requires_grad_changed_after_wrapping_trains_as_on_one_device() -> None:
    seen = run_distributed(_worker, 2)[0]
    assert len(seen) == len(CHANGES) * 5
    assert sorted(s for s in seen if s.endswith("refused")) == [
        "Zero1, unfreeze after wrapping: refused",
        "Zero2, unfreeze after wrapping: refused",
    ]
