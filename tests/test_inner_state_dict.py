"""Specification: ``model.module.state_dict()``, the torch DDP idiom for keys without
``module.``, is the full state dict under every wrapper: equal to ``model.state_dict()`` and
loadable into the plain model, where under FSDP / ZeRO-3 it used to hold this rank's shards
([Note: the inner model's state dict] in ``tiny_fsdp/core/wrapper.py``); likewise
``model.module.load_state_dict`` takes full tensors. A copy of the inner model keeps its own
tensors and gathers nothing. The wrapper's ``load_state_dict`` also takes a state dict saved
from torch's ``DistributedDataParallel``, whose keys carry ``module.``.
"""

import copy
from typing import Any, List

import pytest
import torch
from torch import nn

from tests.harness import run_distributed

STRATEGIES = ("DDP", "Zero1", "Zero2", "FSDP", "Zero3")


def _plain(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Linear(7, 3))


def _worker(rank: int, world_size: int) -> List[str]:
    from tiny_fsdp import core
    from tiny_fsdp.core import comm

    seen = []
    for wrapper in STRATEGIES:
        model = getattr(core, wrapper)(_plain())
        optimizer = getattr(core, wrapper + "SGD")(model.named_parameters(), lr=0.1)
        model(torch.randn(4, 5, generator=torch.Generator().manual_seed(rank))).sum().backward()
        optimizer.step()

        inner, full = model.module.state_dict(), model.state_dict()
        assert list(inner) == list(full), wrapper
        assert all(torch.equal(inner[key], full[key]) for key in full), wrapper
        plain = _plain()
        plain.load_state_dict(inner)  # full shapes: strict loading succeeds
        assert all(torch.equal(v, full[k]) for k, v in plain.state_dict().items()), wrapper

        # Loading full tensors through the inner model keeps this rank's part of each.
        other = {k: v + 1 for k, v in full.items()}
        model.module.load_state_dict(other)
        assert all(torch.equal(v, other[k]) for k, v in model.state_dict().items()), wrapper
        wrong = {**other, "0.weight": torch.zeros(7, 4)}
        mismatch = r"0.weight: copying a param with shape torch.Size\(\[7, 4\]\) from checkpoint"
        with pytest.raises(RuntimeError, match=mismatch + r".*model is torch.Size\(\[7, 5\]\)"):
            model.module.load_state_dict(wrong)

        # A checkpoint torch's DDP saved (keys "module."-prefixed) loads into the wrapper.
        torch_ddp = nn.parallel.DistributedDataParallel(_plain())
        saved = {k: v + 2 for k, v in torch_ddp.state_dict().items()}
        assert all(key.startswith("module.") for key in saved)
        assert model.load_state_dict(saved) == ([], []), wrapper
        assert all(torch.equal(v, saved["module." + k]) for k, v in model.state_dict().items())

        calls = sum(comm.LEDGER.calls.values())
        copy.deepcopy(model.module).state_dict()
        assert sum(comm.LEDGER.calls.values()) == calls, f"{wrapper}: a copy gathered"
        seen.append(wrapper)
    return seen


def test_the_inner_models_state_dict_is_the_full_one_under_every_wrapper() -> None:
    assert run_distributed(_worker, 2)[0] == list(STRATEGIES)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm(torch.tanh(self.fc(x)))


def _checkpointed() -> nn.Module:
    """Blocks wrapped by torch's ``apply_activation_checkpointing`` (torchtitan's and
    accelerate's way with FSDP): the parameters are named ``..._checkpoint_wrapped_module...``,
    the state-dict keys are not (hooks of the wrapper rename them)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )

    model = _blocks()
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, _Block))
    return model


def _blocks() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), _Block(), _Block(), nn.Linear(6, 2))


def _renamed_keys_worker(rank: int, world_size: int, path: str) -> List[str]:
    from tiny_fsdp import core
    from tiny_fsdp.checkpoint import load_checkpoint, save_checkpoint

    def train(model: nn.Module, optimizer: torch.optim.Optimizer, first: int = 0) -> None:
        for step in range(first, first + 2):
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * step + rank))
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()

    reference = nn.parallel.DistributedDataParallel(_checkpointed())
    train(reference, torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9))
    want = reference.module.state_dict()
    assert not any("_checkpoint_wrapped_module" in key for key in want)
    seen = []
    for wrapper in ("FSDP", "Zero3"):
        model = getattr(core, wrapper)(_checkpointed())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        train(model, optimizer)
        for full in (model.state_dict(), model.module.state_dict()):
            assert list(full) == list(want), wrapper
            for key, value in want.items():  # the same SGD steps on the same gradients
                assert torch.allclose(full[key], value, atol=1e-6), f"{wrapper} {key}"
        # tiny_fsdp.checkpoint names tensors by state-dict key: the checkpoint resumes in
        # the same model without checkpoint_wrapper, under another strategy.
        save_checkpoint(f"{path}-{wrapper}", model, optimizer)
        plain = core.DDP(_blocks())
        plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
        load_checkpoint(f"{path}-{wrapper}", plain, plain_optimizer)
        train(model, optimizer, first=2)
        train(plain, plain_optimizer, first=2)
        resumed, continued = plain.state_dict(), model.state_dict()
        for key, value in continued.items():
            assert torch.allclose(resumed[key], value, atol=1e-6), f"{wrapper} resumed {key}"
        # And back, through the wrapper and through the inner model.
        for load in (model.load_state_dict, model.module.load_state_dict):
            load({k: v + 1 for k, v in want.items()})
            loaded = model.state_dict()
            assert all(torch.equal(loaded[k], v + 1) for k, v in want.items()), wrapper
        seen.append(wrapper)
    return seen


def test_state_dict_keys_renamed_by_module_hooks_hold_full_tensors(tmp_path: Any) -> None:
    """A module whose state-dict hooks rename its keys (torch's checkpoint_wrapper): the
    state dicts under FSDP and ZeRO-3 gathered only the keys equal to parameter names and
    held this rank's shards under the others, silently; a tiny_fsdp checkpoint of it loads
    into the model without the wrapper."""
    ranks = run_distributed(_renamed_keys_worker, 2, str(tmp_path / "ckpt"))
    assert ranks[0] == ["FSDP", "Zero3"]


def _nested_worker(rank: int, world_size: int) -> List[str]:
    """Every wrapper inside ``torch.compile``'s module and inside a container: the outer
    module's ``load_state_dict`` of its own ``state_dict()`` form (taken from a twin with other
    weights) gives exactly those weights."""
    from tiny_fsdp import core

    seen = []
    for wrapper in STRATEGIES:
        for outer in ("compiled", "container"):
            models = []
            for seed in (1, 2):
                model = getattr(core, wrapper)(_plain(seed))
                models.append(
                    torch.compile(model) if outer == "compiled" else nn.ModuleDict({"net": model})
                )
            target, source = models
            wanted = {key: value.clone() for key, value in source.state_dict().items()}
            target.load_state_dict(wanted)
            got = target.state_dict()
            assert list(got) == list(wanted), (wrapper, outer, list(got))
            assert all(torch.equal(got[key], wanted[key]) for key in wanted), (wrapper, outer)
            seen.append(f"{wrapper}/{outer}")
    return seen


def test_a_wrapper_inside_another_module_loads_the_state_dict_it_gives() -> None:
    """torch.compile(model) and containers save the wrapper's keys (the plain model's) and
    load through torch's recursion, which looked for them under ``module.``: every wrapper
    refused its own state dict ("Missing key(s) ... module.0.weight")."""
    expected = [f"{w}/{o}" for w in STRATEGIES for o in ("compiled", "container")]
    assert run_distributed(_nested_worker, 2) == [expected] * 2
