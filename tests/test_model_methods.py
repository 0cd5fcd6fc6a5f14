"""A wrapper lends the model's own attributes and methods: ``model.config``, ``model.generate``.

What the wrapper lacks is looked up on the model it holds (as with torch's FSDP), so code written
for the plain model (HF ``generate``, a ``loss`` method) runs on the wrapper. Such a method calls
the inner model, not the wrapper; it still trains like ``torch.nn.parallel.DistributedDataParallel``
+ ``torch.optim.SGD`` (the oracle), because the hooks are on the model's layers and parameters.
"""

import copy
import os
from typing import Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.build import build, sgd
from tests.harness import run_distributed
from tests.parity import PARAM_ATOL

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")
VOCAB, WIDTH, STEPS = 16, 12, 3
# SGD steps are lr x gradient: strategies differ from the oracle by float32 summation order
# (parity.py), ~1e-7 on the loss.
LOSS_ATOL = 1e-6


class Decoder(nn.Module):
    """A tiny language model with the methods user code calls on it."""

    def __init__(self) -> None:
        super().__init__()
        self.config = {"vocab_size": VOCAB}
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH))
                                    for _ in range(2))  # fmt: skip
        self.gain = nn.Parameter(torch.ones(WIDTH))  # a raw parameter: the generic path
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, VOCAB)
        h = self.embed(idx)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.head(h * self.gain)

    def loss(self, idx: torch.Tensor) -> torch.Tensor:
        logits = self(idx[:, :-1])
        return F.cross_entropy(logits.reshape(-1, VOCAB), idx[:, 1:].reshape(-1))

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, new_tokens: int) -> torch.Tensor:
        for _ in range(new_tokens):
            idx = torch.cat([idx, self(idx)[:, -1:].argmax(-1)], dim=1)
        return idx

    def init_weights(self, seen: Dict[str, tuple]) -> None:
        """The model initialising itself, called after wrapping (torchtitan's habit)."""
        self.apply(_init(seen))

    # The other names a model's own init goes by (transformers' post_init, ...).
    initialize_weights = post_init = reset_parameters = init_parameters = init_weights


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randint(VOCAB, (3, 7), generator=torch.Generator().manual_seed(10 * step + rank))


def _train_oracle(plain: nn.Module, rank: int) -> Tuple[nn.Module, List[float]]:
    """torch DDP + torch.optim.SGD on a copy of ``plain``: (the DDP model, losses by step)."""
    oracle = nn.parallel.DistributedDataParallel(copy.deepcopy(plain))
    oracle_opt = torch.optim.SGD(oracle.parameters(), lr=0.5)
    oracle_losses = []
    for step in range(STEPS):
        idx = _batch(step, rank)
        logits = oracle(idx[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), idx[:, 1:].reshape(-1))
        loss.backward()
        oracle_opt.step()
        oracle_opt.zero_grad()
        oracle_losses.append(loss.item())
    return oracle, oracle_losses


def _train_by_the_loss_method(model: nn.Module, opt, rank: int) -> List[float]:
    """STEPS steps through ``model.loss``, the model's method (it calls the inner model)."""
    losses = []
    for step in range(STEPS):
        loss = model.loss(_batch(step, rank))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _methods_worker(rank: int, world_size: int) -> Dict[str, float]:
    torch.manual_seed(0)
    plain = Decoder()
    prompt = _batch(-1, 0)
    oracle, oracle_losses = _train_oracle(plain, rank)
    gaps = {}
    for strategy in STRATEGIES:
        model, opt = build(strategy, copy.deepcopy(plain), sgd(lr=0.5))
        assert model.config is model.module.config  # an attribute of the model
        with torch.inference_mode():  # evaluation first: what a fetch keeps must still train
            assert torch.equal(model(prompt), plain(prompt))
            assert torch.equal(model.generate(prompt, 4), plain.generate(prompt, 4))
        assert torch.equal(model.generate(prompt, 4), plain.generate(prompt, 4))
        with pytest.raises(AttributeError, match="no_such_thing"):
            model.no_such_thing
        losses = _train_by_the_loss_method(model, opt, rank)
        gap = max(abs(a - b) for a, b in zip(losses, oracle_losses))
        assert gap <= LOSS_ATOL, (strategy, losses, oracle_losses)
        state, want = model.state_dict(), oracle.module.state_dict()
        gaps[strategy] = max((state[k] - v).abs().max().item() for k, v in want.items())
        assert gaps[strategy] <= PARAM_ATOL, (strategy, gaps[strategy])
    return gaps


def test_the_models_methods_run_on_the_wrapper_and_train_as_torch_ddp() -> None:
    run_distributed(_methods_worker, 2)


def _init(seen: Dict[str, tuple]):
    """An init after wrapping: random draws, orthogonal_, which needs the whole matrix, and a
    parent drawing its child's weight again (as HuggingFace GPT-2 does for ``c_proj``)."""

    def init(module: nn.Module) -> None:
        if isinstance(module, nn.Sequential):  # a block: LayerNorm, Linear
            nn.init.normal_(module[1].weight, std=0.02)
        elif isinstance(module, nn.Linear):
            seen[type(module).__name__] = tuple(module.weight.shape)
            nn.init.orthogonal_(module.weight)
            nn.init.normal_(module.bias, std=0.1)
        elif isinstance(module, (nn.Embedding, nn.LayerNorm)):
            seen[type(module).__name__] = tuple(module.weight.shape)
            nn.init.normal_(module.weight)

    return init


def _apply_worker(rank: int, world_size: int, how: str) -> List[str]:
    """``model.apply(init)`` after wrapping, or the model's own init method (``init_weights``
    and the other names of ``INIT_METHODS``), gives
    on every rank the parameters ``plain.apply`` gives on one device, draw for draw, and the
    model trains on from them as torch DDP does."""
    torch.manual_seed(0)
    plain, want_seen = Decoder(), {}
    torch.manual_seed(7)
    plain.apply(_init(want_seen))
    _, oracle_losses = _train_oracle(plain, rank)
    checked = []
    for strategy in STRATEGIES:
        torch.manual_seed(0)
        model, opt = build(strategy, Decoder(), sgd(lr=0.5))
        seen = {}
        torch.manual_seed(7)
        if how == "apply":
            assert model.apply(_init(seen)) is model
        else:
            getattr(model, how)(seen)
        assert seen == want_seen, (strategy, "init saw shards", seen)  # whole tensors
        state = model.state_dict()
        for key, value in plain.state_dict().items():
            assert torch.equal(state[key], value), (strategy, key)
        losses = _train_by_the_loss_method(model, opt, rank)
        gap = max(abs(a - b) for a, b in zip(losses, oracle_losses))
        assert gap <= LOSS_ATOL, (strategy, losses, oracle_losses)
        with pytest.raises(RuntimeError, match="in place only"):
            model.apply(lambda m: setattr(m, "bias", nn.Parameter(torch.zeros(VOCAB)))
                        if m is model.module.head else None)  # fmt: skip
        checked.append(strategy)
    return checked


# README's list of a model's own init methods that run with whole parameters.
INIT_METHODS = [
    "init_weights",
    "initialize_weights",
    "post_init",
    "reset_parameters",
    "init_parameters",
]


@pytest.mark.parametrize("how", ["apply", *INIT_METHODS])
def test_init_after_wrapping_gives_one_devices_draws_under_every_wrapper(how: str) -> None:
    assert run_distributed(_apply_worker, 2, how)[0] == list(STRATEGIES)


def _apply_changing_nothing_worker(rank: int, world_size: int) -> List[str]:
    """A ``model.apply`` that writes no parameter, between steps (setting an attribute, as
    code that switches dropout does), changes no bit of training under a bf16 policy: ZeRO-1/2
    keep the fp32 masters of their bf16 parameters, which a re-read would round."""
    from tiny_fsdp.core import MixedPrecisionPolicy

    checked = []
    for strategy in STRATEGIES:
        states = []
        for touch in (False, True):
            torch.manual_seed(0)
            policy = MixedPrecisionPolicy(torch.bfloat16)
            model, opt = build(strategy, Decoder(), sgd(lr=0.5), mixed_precision=policy)
            for step in range(2 * STEPS):
                if touch and step == STEPS:
                    model.apply(lambda m: setattr(m, "seen", True))
                model.loss(_batch(step, rank)).backward()
                opt.step()
                opt.zero_grad()
            states.append(model.state_dict())
        for key, value in states[0].items():
            assert torch.equal(value, states[1][key]), (strategy, key)
        checked.append(strategy)
    return checked


def test_apply_that_changes_no_parameter_changes_no_bit_of_training() -> None:
    assert run_distributed(_apply_changing_nothing_worker, 2)[0] == list(STRATEGIES)


class Regressor(nn.Module):
    """Floating inputs, and a loss method that calls the model."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden, self.out = nn.Linear(4, WIDTH), nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 4) -> (B, 3)
        return self.out(torch.tanh(self.hidden(x)))

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self(x).float(), y)


def _policy_paths_worker(rank: int, world_size: int) -> Dict[str, List[str]]:
    """Under a bf16 policy, the model called through the wrapper, through its own method and
    as ``model.module``: per strategy, what each path computed in and trained to."""
    from tiny_fsdp.core import MixedPrecisionPolicy

    paths = {
        "wrapper": lambda model, x, y: F.mse_loss(model(x).float(), y),
        "method": lambda model, x, y: model.loss(x, y),
        "module": lambda model, x, y: F.mse_loss(model.module(x).float(), y),
    }
    found: Dict[str, List[str]] = {}
    for strategy in STRATEGIES:
        runs = {}
        for path, loss_of in paths.items():
            torch.manual_seed(0)
            policy = MixedPrecisionPolicy(torch.bfloat16)
            model, opt = build(strategy, Regressor(), sgd(lr=0.5), mixed_precision=policy)
            g = torch.Generator().manual_seed(rank)
            losses = []
            for _ in range(STEPS):
                x, y = torch.randn(5, 4, generator=g), torch.randn(5, 3, generator=g)
                loss = loss_of(model, x, y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            with torch.no_grad():
                dtype = str(model.module(x).dtype)
            runs[path] = (losses, model.state_dict(), dtype)
        losses, state, dtype = runs["wrapper"]
        found[strategy] = [
            path
            for path, (other_losses, other_state, other_dtype) in runs.items()
            if other_losses == losses
            and other_dtype == dtype == "torch.bfloat16"
            and all(torch.equal(other_state[k], v) for k, v in state.items())
        ]
    return found


def test_under_a_policy_a_method_and_the_inner_model_compute_as_the_wrapper() -> None:
    """The policy hooks the inner model, so every path to it computes in bf16 and trains bit
    for bit as the wrapper's own call (under DDP too, whose parameters stay fp32 between
    forwards: [Note: DDP mixed precision])."""
    for found in run_distributed(_policy_paths_worker, 2):
        assert found == {strategy: ["wrapper", "method", "module"] for strategy in STRATEGIES}


class Stashing(Regressor):
    """Returns its loss, or keeps it in ``self.last_loss`` and returns None (``stash``), or
    raises (``fail``): the odd forwards DDP's compute copies must see through. ``gain`` is
    multiplied in, so autograd saves that parameter itself for the backward."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.full((3,), 1.5))

    def forward(self, x: torch.Tensor, y: torch.Tensor, stash: bool = False, fail: bool = False):
        if fail:
            raise ValueError("a forward that fails")
        # y came in cast to bf16 by the policy, as any floating input (torch 2.9's mse_loss
        # backward refuses a target of another dtype).
        loss = F.mse_loss((super().forward(x) * self.gain).float(), y.float())
        if stash:
            self.last_loss = loss
            return None
        return loss


def _odd_forwards_worker(rank: int, world_size: int) -> List[Tuple[str, bool]]:
    """Under DDP's bf16 policy: steps returning the loss; the same with a forward that raised
    before each step; the same with the loss kept in an attribute and None returned."""
    from tiny_fsdp.core import DDP, DDPSGD, MixedPrecisionPolicy

    runs = {}
    for how in ("returned", "after a raise", "stashed"):
        torch.manual_seed(0)
        model = DDP(Stashing(), mixed_precision=MixedPrecisionPolicy(torch.bfloat16))
        opt = DDPSGD(model.named_parameters(), lr=0.5)
        g = torch.Generator().manual_seed(rank)
        for _ in range(STEPS):
            x, y = torch.randn(5, 4, generator=g), torch.randn(5, 3, generator=g)
            if how == "after a raise":
                with pytest.raises(ValueError, match="a forward that fails"):
                    model(x, y, fail=True)
                assert all(p.dtype == torch.float32 for p in model.parameters())  # masters back
            if how == "stashed":
                assert model(x, y, stash=True) is None
                loss = model.module.last_loss
            else:
                loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        runs[how] = model.state_dict()
    return [
        (how, all(torch.equal(state[k], v) for k, v in runs["returned"].items()))
        for how, state in runs.items()
    ]


def test_ddp_s_compute_copies_see_through_a_forward_that_raises_or_returns_none() -> None:
    """A forward that raised gives the fp32 masters back (no backward follows it); one that
    returned None keeps the copies for the backward of the loss it kept: both train bit for
    bit as plain steps ([Note: DDP mixed precision])."""
    for got in run_distributed(_odd_forwards_worker, 2):
        assert got == [("returned", True), ("after a raise", True), ("stashed", True)]


def _save_pretrained_worker(rank: int, world_size: int, directory: str) -> List[str]:
    """Every rank calls ``model.save_pretrained``; what rank 0 wrote is the trained model."""
    import transformers

    from tests.zoo import hf_models

    build_hf, loss_fn, _ = hf_models()["gpt2"]
    saved = []
    for strategy in STRATEGIES:
        torch.manual_seed(0)
        model, opt = build(strategy, build_hf(), sgd(lr=0.5))
        loss_fn(model, _batch(0, rank), _batch(1, rank)).backward()
        opt.step()
        path = os.path.join(directory, strategy)
        model.save_pretrained(path)
        state = model.state_dict()  # gathers under FSDP / ZeRO-3: every rank
        dist.barrier()  # rank 0 has written
        back = transformers.GPT2LMHeadModel.from_pretrained(path).state_dict()
        for key, value in back.items():
            assert torch.equal(value, state[key]), (strategy, key)
        saved.append(strategy)
    return saved


def test_save_pretrained_writes_the_full_model_under_every_wrapper(tmp_path) -> None:
    pytest.importorskip("transformers")
    assert run_distributed(_save_pretrained_worker, 2, str(tmp_path))[0] == list(STRATEGIES)


def _counted(forward, calls: List[int]):
    def run(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)

    return run


def _recompute_worker(rank: int, world_size: int) -> List[str]:
    """``model.gradient_checkpointing = True`` on the wrapper of a transformers model (which
    has no such attribute: HF switches it with a method) makes backward run each decoder
    layer again, and training still matches torch DDP without recomputation."""
    from tests.zoo import hf_models

    build_hf, loss_fn, _ = hf_models()["llama"]
    torch.manual_seed(0)
    plain = build_hf()
    oracle = nn.parallel.DistributedDataParallel(copy.deepcopy(plain))
    oracle_opt = torch.optim.SGD(oracle.parameters(), lr=0.5)
    oracle_losses = []
    for step in range(STEPS):
        loss = loss_fn(oracle, _batch(step, rank), _batch(step + 100, rank))
        loss.backward()
        oracle_opt.step()
        oracle_opt.zero_grad()
        oracle_losses.append(loss.item())
    checked = []
    for strategy in STRATEGIES:
        model, opt = build(strategy, copy.deepcopy(plain), sgd(lr=0.5))
        calls = []  # runs of a layer's MLP (module hooks do not see a recomputation)
        mlp = model.module.model.layers[0].mlp
        mlp.forward = _counted(mlp.forward, calls)
        model.gradient_checkpointing = True
        assert model.gradient_checkpointing
        losses = []
        for step in range(STEPS):
            calls.clear()
            loss = loss_fn(model, _batch(step, rank), _batch(step + 100, rank))
            loss.backward()
            assert len(calls) == 2, (strategy, "forward and recompute", len(calls))
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        gap = max(abs(a - b) for a, b in zip(losses, oracle_losses))
        assert gap <= LOSS_ATOL, (strategy, losses, oracle_losses)
        model.gradient_checkpointing = False
        calls.clear()
        loss_fn(model, _batch(0, rank), _batch(1, rank)).backward()
        assert not model.gradient_checkpointing and len(calls) == 1, (strategy, len(calls))
        checked.append(strategy)
    return checked


def test_gradient_checkpointing_switches_a_transformers_model_under_every_wrapper() -> None:
    pytest.importorskip("transformers")
    assert run_distributed(_recompute_worker, 2)[0] == list(STRATEGIES)


class NanoGPTCount(Decoder):
    """nanoGPT's count: every parameter, less the position embedding's if ``non_embedding``."""

    def __init__(self) -> None:
        super().__init__()
        self.wpe = nn.Embedding(8, WIDTH)

    def get_num_params(self, non_embedding: bool = True) -> int:
        n_params = sum(p.numel() for p in self.parameters())
        return n_params - self.wpe.weight.numel() if non_embedding else n_params


def _count_worker(rank: int, world_size: int) -> List[str]:
    from tests.zoo import hf_models
    from tiny_fsdp.core.comm import LEDGER

    calls = {
        "nanogpt": lambda m: (m.get_num_params(), m.get_num_params(non_embedding=False)),
        "hf gpt2": lambda m: (
            m.num_parameters(),
            m.num_parameters(only_trainable=True),
            m.num_parameters(exclude_embeddings=True),
        ),
    }
    builds = {"nanogpt": NanoGPTCount, "hf gpt2": hf_models()["gpt2"][0]}
    seen = []
    for name, make in builds.items():
        torch.manual_seed(0)
        plain = make()
        if name == "hf gpt2":  # a frozen parameter, for only_trainable
            plain.transformer.wpe.weight.requires_grad_(False)
        want = calls[name](plain)
        for strategy in STRATEGIES:
            model, _ = build(strategy, copy.deepcopy(plain), None)
            LEDGER.reset()
            got = calls[name](model)
            assert got == want, f"{name} {strategy}: {got}, one device {want}"
            assert not LEDGER.calls, f"{name} {strategy}: the count communicated {LEDGER.calls}"
            kinds = {type(p) for p in model.parameters()}
            assert kinds == {nn.Parameter}, f"{name} {strategy}: parameters left as {kinds}"
            seen.append(f"{name} {strategy}")
    return seen


def test_a_models_own_parameter_count_through_the_wrapper_is_one_devices() -> None:
    """HuggingFace's ``num_parameters`` (all, trainable only, without embeddings) and nanoGPT's
    ``get_num_params`` called on the wrapped model give the plain model's counts under every
    strategy, with no collective ([Note: counting methods]); FSDP / ZeRO-3 gave a rank's part."""
    pytest.importorskip("transformers")
    for seen in run_distributed(_count_worker, 2):
        assert len(seen) == 2 * len(STRATEGIES)
