"""The probe model of the calibration: tiny layers whose step time is the fixed cost of running
a layer, plain and under each strategy's wrapper with its default arguments ([Note: calibration]).
"""

import torch
import torch.distributed as dist
from torch import nn

WRAPPED = ("ddp", "zero1", "zero2", "zero3", "fsdp")


UNITS = ("zero3", "fsdp")  # strategies whose cost is also per unit: probed twice


class Probe(nn.Module):
    """``layers`` tiny layers, linear and layer norm in turn (a transformer's two kinds of
    layer, whose wrapped forms cost differently), in ``layers / per_block`` blocks of a
    ``ModuleList``: the auto units of FSDP and ZeRO-3 are its blocks."""

    def __init__(self, layers: int = 8, width: int = 8, per_block: int = 1) -> None:
        super().__init__()
        self.layers = layers
        kinds = [
            nn.Linear(width, width) if i % 2 == 0 else nn.LayerNorm(width) for i in range(layers)
        ]

        self.blocks = nn.ModuleList(  # one type of block: the repeated blocks of unit_layout
            nn.Sequential(*kinds[i : i + per_block]) for i in range(0, layers, per_block)
        )

    @torch.no_grad()
    def init_parameter(self, name: str, tensor: torch.Tensor) -> None:
        tensor.fill_(0.01)  # [Note: per-parameter init]: any pure function of the name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def wrap_probe(strategy: str, device: torch.device, per_block: int = 1):
    """``(model, optimizer)`` of ``Probe(per_block=...)`` under ``strategy``, default arguments."""
    from tiny_fsdp.core.ddp import DDP, DDPAdamW
    from tiny_fsdp.core.fsdp import FSDP, FSDPAdamW
    from tiny_fsdp.core.optim import AdamW
    from tiny_fsdp.core.zero import Zero1, Zero1AdamW, Zero2, Zero2AdamW
    from tiny_fsdp.core.zero3 import Zero3, Zero3AdamW, zero3_partition_tensors

    torch.manual_seed(0)
    if strategy in ("zero3", "fsdp"):
        with torch.device("meta"):
            meta = Probe(per_block=per_block)
        if strategy == "fsdp":
            model = FSDP(meta, device=device)
            return model, FSDPAdamW(model.parameters())
        ranks = [device.type] * dist.get_world_size()
        table, _ = zero3_partition_tensors(dict(meta.named_parameters()), ranks)
        model = Zero3(meta, table)
        return model, Zero3AdamW(model.module.named_parameters(), param_part_table=table)
    plain = Probe().to(device)
    if strategy == "plain":
        return plain, AdamW(plain.parameters())
    wrapper, optim = {"ddp": (DDP, DDPAdamW), "zero1": (Zero1, Zero1AdamW),
                      "zero2": (Zero2, Zero2AdamW)}[strategy]  # fmt: skip
    model = wrapper(plain)
    return model, optim(model.parameters())
