"""tiny_fsdp under torch's distributed checkpoint: when it is asking, and what is refused.

[Note: torch's distributed checkpoint]
torchtitan-style checkpointing is ``get_state_dict(model, optimizer)``, ``dcp.save`` /
``dcp.load`` and ``set_state_dict`` (``torch.distributed.checkpoint``, "DCP"). DCP takes a plain
tensor to be the same on every rank and writes one rank's copy of each key. A sharded
optimizer's state is each rank's own part, so written so, one rank's part would stand for all:
measured with ``torch.optim.AdamW`` over an FSDP model on 2 ranks, the resumed run trained on
one rank's moments everywhere, silently (second step after resuming: loss 0.1235, 0.1179 without
the checkpoint; tiny_fsdp's FSDP optimizer refused the load). FSDP2 escapes this because its
parameters, and so their state, are DTensors. Ours are plain tensors, and their state dicts stay
plain (per-rank files and ``torch.save`` keep working), except when DCP is on the call stack
(``for_torch_checkpoint``): then an FSDP shard's state comes as DTensors
(``fsdp/dtensor_state.py``), which DCP saves rank by rank and reshards to any world size, for
tiny_fsdp's FSDP optimizers and element-wise ``torch.optim`` ones alike (a state-dict hook,
``foreign_optimizers.py``). ZeRO-1/2's flat ranges and ZeRO-3's whole tensors on one rank have
no DTensor form: their optimizers raise on every rank (``refuse_torch_checkpoint``), before
anything is written, naming ``tiny_fsdp.checkpoint`` (any world size). The model's state dict is
full under DDP, ZeRO-1/2 and ZeRO-3 (which gathers it), the same on every rank, which DCP saves
right; under FSDP each parameter also comes as its rows in a DTensor (``FSDP.checkpoint_part``),
so saving gathers nothing and no rank holds the full model, as with FSDP2. Names: DCP names a
parameter by the path it walks from the model it is given, which under a wrapper starts with
``module.`` (it strips only torch DDP's), while our state dicts use the plain model's keys. So
the wrapper gives DCP the contract it has for such modules (``_fqn_modifiers``: each top-level
key lives under ``module``) and, when DCP asks, ``named_modules`` (so ``named_parameters``, also
of a ``torch.compile`` module around the wrapper) without the prefix: model and optimizer keys
are the plain model's, as under torch DDP and FSDP2, and checkpoints move between those and ours
(FSDP2's DTensor layout is ours too), and ``set_model_state_dict(...,
broadcast_from_rank0=True)`` finds its keys on every rank.
"""

import sys
from typing import NoReturn


def for_torch_checkpoint() -> bool:
    """Whether ``torch.distributed.checkpoint`` is on the call stack (its ``get_state_dict``,
    or ``dcp.save`` / ``dcp.load`` calling a ``Stateful``'s ``state_dict``)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith("torch.distributed.checkpoint"):
            return True
        frame = frame.f_back
    return False


def refuse_torch_checkpoint(what: str) -> NoReturn:
    """Raise: torch's distributed checkpoint cannot save optimizer ``what``'s state."""
    raise RuntimeError(
        f"{what}: torch.distributed.checkpoint (get_state_dict / get_optimizer_state_dict) "
        "would save one rank's part of this optimizer's state for all ranks: under ZeRO-1/2/3 "
        "it has no DTensor form (FSDP's has). Use tiny_fsdp.checkpoint.save_checkpoint / "
        "load_checkpoint (any number of ranks), or get_model_state_dict for the model alone"
    )
