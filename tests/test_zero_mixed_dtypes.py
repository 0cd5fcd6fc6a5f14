"""Specification: ZeRO-1/2 train a model whose parameters differ in dtype, as torch's DDP and
``ZeroRedundancyOptimizer`` do ([Note: ZeRO buckets by dtype]).

The case users have: a bf16 model that keeps its norms in fp32 (``transformers``'
``_keep_in_fp32_modules``), here with an fp64 head too. A bucket holds one dtype; bf16
parameters step fp32 masters, 32- and 64-bit ones are their own masters. The oracle: torch's
``DistributedDataParallel`` on the same mixed model, and ``torch.optim.AdamW`` stepping fp32 copies
of the bf16 parameters (the usual master-weights recipe) and the others as they are. Under a
bf16 policy every parameter is stored in bf16 and keeps a master of its own dtype: the stored
values are the project's DDP's under the same policy (whose masters are the parameters), rounded.
"""

from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tests.harness import run_distributed
from tiny_fsdp.checkpoint import load_checkpoint, save_checkpoint
from tiny_fsdp.core import (
    DDP,
    MixedPrecisionPolicy,
    DDPAdamW,
    Zero1,
    Zero1AdamW,
    Zero2,
    Zero2AdamW,
    Zero2Optimizer,
)
from tiny_fsdp.core.zero import FlatLayout

STEPS = 3
LR = 1e-2
# Tiny buckets: each dtype spans several, and the dtypes interleave in backward order.
BUCKET_MB = 200 * 4 / 2**20


class KeepsNormsInFp32(nn.Module):
    """bf16 linears, fp32 LayerNorms (computing in fp32, as transformers' kept modules), an fp64
    head: three dtypes, interleaved."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(6, 24).to(torch.bfloat16)
        self.norm1 = nn.LayerNorm(24)
        self.mid = nn.Linear(24, 24).to(torch.bfloat16)
        self.norm2 = nn.LayerNorm(24)
        self.head = nn.Linear(24, 3).to(torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(self.up(x.to(torch.bfloat16)).float()).to(torch.bfloat16)
        h = self.norm2(self.mid(torch.relu(h)).float())
        return self.head(h.double())


def _model() -> nn.Module:
    torch.manual_seed(0)
    return KeepsNormsInFp32()


def _batches(rank: int) -> List[torch.Tensor]:
    generator = torch.Generator().manual_seed(10 + rank)
    return [torch.randn(5, 6, generator=generator) for _ in range(STEPS)]


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


def _oracle(rank: int) -> Dict[str, torch.Tensor]:
    """torch DDP + torch.optim.AdamW over fp32 masters of the bf16 parameters."""
    model = DistributedDataParallel(_model())
    params = list(model.parameters())
    masters = [p.detach().float() if p.dtype == torch.bfloat16 else p for p in params]
    masters = [m.requires_grad_() if m is not p else m for m, p in zip(masters, params)]
    optimizer = torch.optim.AdamW(masters, lr=LR)
    for x in _batches(rank):
        _loss(model, x).backward()
        for m, p in zip(masters, params):
            if m is not p:
                m.grad = p.grad.float()
        optimizer.step()
        optimizer.zero_grad()
        model.zero_grad()
        with torch.no_grad():
            for m, p in zip(masters, params):
                if m is not p:
                    p.copy_(m)  # rounds to bf16
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}


def _train(model: nn.Module, optimizer: Any, batches: List[torch.Tensor]) -> None:
    for x in batches:
        _loss(model, x).backward()
        optimizer.step()
        optimizer.zero_grad()


def _mixed_worker(rank: int, world_size: int, path: str) -> None:
    want = _oracle(rank)
    built: List[Tuple[nn.Module, Any]] = []
    for wrapper, make_optimizer in [
        (Zero1, lambda m: Zero1AdamW(m.named_parameters(), lr=LR, fused=False)),
        (Zero2, lambda m: Zero2Optimizer(m.named_parameters(), torch.optim.AdamW, lr=LR)),
    ]:
        model = wrapper(_model(), bucket_cap_mb=BUCKET_MB)
        optimizer = make_optimizer(model)
        _train(model, optimizer, _batches(rank))
        got = model.state_dict()
        for key, value in want.items():
            # The same operations on the same values in the same dtypes: equal.
            assert got[key].dtype == value.dtype, key
            assert torch.equal(got[key], value), f"{wrapper.__name__} {key}"
        built.append((model, optimizer))

    # Buckets hold one dtype each; every dtype spans several; the parameters keep theirs.
    zero1, zero1_optimizer = built[0]
    layout = zero1.layout
    assert len(layout.buckets) > 3
    for bucket in layout.buckets:
        assert len({zero1.params[i].dtype for i in bucket.slots}) == 1
    assert {p.dtype for p in zero1.module.parameters()} == {
        torch.bfloat16,
        torch.float32,
        torch.float64,
    }

    # The state of mixed dtypes resumes: consolidated into ZeRO-2 (other buckets) bitwise at
    # the step ZeRO-1 is at; through tiny_fsdp.checkpoint into DDP, which steps the bf16
    # parameters themselves, as torch.optim does after loading the same state (its
    # load_state_dict casts the state to each parameter's dtype).
    zero1_optimizer.consolidate_state_dict(to=0)
    saved = [zero1_optimizer.state_dict() if rank == 0 else None]
    dist.broadcast_object_list(saved, src=0)
    save_checkpoint(path, zero1, zero1_optimizer, step=STEPS)
    zero2 = Zero2(_model(), bucket_cap_mb=BUCKET_MB / 2)
    zero2.load_state_dict(zero1.state_dict())
    zero2_optimizer = Zero2AdamW(zero2.named_parameters(), lr=LR, fused=False)
    zero2_optimizer.load_state_dict(saved[0])
    ddp = DDP(_model())
    ddp_optimizer = DDPAdamW(ddp.named_parameters(), lr=LR, fused=False)
    assert load_checkpoint(path, ddp, ddp_optimizer)["step"] == STEPS
    torch_ddp = DistributedDataParallel(_model())
    torch_ddp.module.load_state_dict(zero1.state_dict())
    torch_optimizer = torch.optim.AdamW(torch_ddp.parameters(), lr=LR)
    state = {i: {k: v for k, v in e.items() if k != "master"} for i, e in saved[0]["state"].items()}
    torch_optimizer.load_state_dict({"state": state, "param_groups": saved[0]["param_groups"]})
    more = [torch.randn(5, 6, generator=torch.Generator().manual_seed(99 + rank))]
    for model, optimizer in [
        (zero1, zero1_optimizer),
        (zero2, zero2_optimizer),
        (ddp, ddp_optimizer),
        (torch_ddp, torch_optimizer),
    ]:
        _train(model, optimizer, more)
    for key, value in zero1.state_dict().items():
        assert torch.equal(zero2.state_dict()[key], value), key
    for key, value in torch_ddp.module.state_dict().items():
        assert torch.equal(ddp.state_dict()[key], value), key


def _wide_model() -> nn.Module:
    """fp32 and fp64 parameters, which a bf16 policy computes with alike."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3).to(torch.float64))


def _policy_worker(rank: int, world_size: int) -> None:
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    batches = [x.to(torch.bfloat16) for x in _batches(rank)]
    ddp = DDP(_wide_model(), mixed_precision=policy)
    ddp_optimizer = DDPAdamW(ddp.named_parameters(), lr=LR, fused=False)
    _train(ddp, ddp_optimizer, batches)
    zero = Zero1(_wide_model(), bucket_cap_mb=BUCKET_MB, mixed_precision=policy)
    optimizer = Zero1AdamW(zero.named_parameters(), lr=LR, fused=False)
    _train(zero, optimizer, batches)
    # Stored in bf16, stepped on masters of each parameter's own dtype (fp32 at least), as
    # DDP under the policy steps its parameters: the stored values are the masters rounded.
    assert {master.dtype for master in optimizer.state} == {torch.float32, torch.float64}
    want = ddp.state_dict()
    for key, value in zero.state_dict().items():
        assert value.dtype == torch.bfloat16, key
        assert torch.equal(value, want[key].to(torch.bfloat16)), key


def test_under_a_policy_each_parameter_keeps_a_master_of_its_own_dtype() -> None:
    run_distributed(_policy_worker, 2)


def test_zero12_train_a_model_of_three_dtypes_as_torch_ddp_with_fp32_masters(
    tmp_path: Any,
) -> None:
    run_distributed(_mixed_worker, 2, str(tmp_path / "ckpt"))


def test_layout_keeps_each_dtype_in_its_own_buckets_ordered_by_completion() -> None:
    """Groups interleaved in backward order: no bucket mixes them, every element has one
    owner, and a bucket comes before another when its last parameter comes first (reducing in
    order then launches each as soon as it is complete)."""
    # Group 0's first bucket closes (at parameter 3) before group 1's (at 6), but group 1's
    # is complete first (its last parameter is 1): it comes first.
    shapes = [torch.Size((n,)) for n in (4, 1, 4, 4, 2, 3, 8, 1)]
    groups = [0, 1, 0, 0, 2, 0, 1, 2]
    for world_size in (1, 2, 3):
        layout = FlatLayout(shapes, world_size, bucket_cap_numel=8, groups=groups)
        lasts = []
        for bucket in layout.buckets:
            assert {groups[i] for i in bucket.slots} == {bucket.group}
            assert sum(shapes[i].numel() for i in bucket.slots) <= 8
            lasts.append(bucket.slots[-1])
        assert lasts == sorted(lasts)
        assert sorted(i for b in layout.buckets for i in b.slots) == list(range(len(shapes)))
        owners = [[0] * s.numel() for s in shapes]
        for rank in range(world_size):
            for piece in layout.pieces(rank):
                for k in range(piece.param_start, piece.param_start + piece.numel):
                    owners[piece.index][k] += 1
        assert all(count == 1 for row in owners for count in row)
