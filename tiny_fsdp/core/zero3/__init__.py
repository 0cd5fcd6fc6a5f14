"""ZeRO-3 inter-tensor: every whole parameter, its gradient and its optimizer state on one rank.

Usage::

    model = Zero3(GPT2Model(config))  # or Zero3(meta_model): owners build their tensors
    optimizer = Zero3AdamW(model.named_parameters(), lr=1e-4)

    # Choosing the owners: a table made for this model and world size.
    parts, rank_bytes = zero3_partition_tensors(
        OrderedDict(meta_model.named_parameters()), ranks_map=["cpu"] * world_size
    )
    model = Zero3(meta_model, parts)
    optimizer = Zero3AdamW(model.named_parameters(), lr=1e-4, param_part_table=parts)
"""

from tiny_fsdp.core.zero3.optim import Zero3AdamW, Zero3SGD
from tiny_fsdp.core.zero3.partition import PartitionTable, zero3_partition_tensors
from tiny_fsdp.core.zero3.zero3 import Zero3

__all__ = ["PartitionTable", "Zero3", "Zero3AdamW", "Zero3SGD", "zero3_partition_tensors"]
