"""What ``torch.save`` / ``pickle`` of a wrapped model, or of its inner model, gives.

[Note: pickling a wrapped model]
torch's DDP users save a model object with ``torch.save(model.module, path)``. Here:

- Under DDP and ZeRO-1/2 every rank holds the whole model, so ``model.module`` pickles as the
  plain model: a parameter's ownership tag pickles as None (the copy is no wrapper's), and
  DDP's mixed-precision hooks, which act for DDP's own model only ([Note: DDP mixed
  precision]), as ``Inert`` hooks; ZeRO-1/2's bf16-stored model keeps its input casts. Loading
  a model pickled with such hooks needs tiny_fsdp importable, as any pickled class does.
- Under FSDP and ZeRO-3 a rank holds parts of the parameters and the inner model carries the
  strategy's hooks: pickling it raises ``TypeError`` with the fix (FSDP2's modules do not
  pickle either). A parameter's tag and the root's arrival hook raise it. pickle meets one of
  them before the strategy's other objects for the models tried (``tests/test_copy.py``'s, with
  a raw parameter on its root; GPT-2, ours and HuggingFace's); a model whose root pickle reaches
  first through another of the strategy's hooks gets pickle's own error about that object.
- A wrapper itself refuses (``DataParallelWrapper.__reduce_ex__``), naming what to save
  instead: ``model.module`` where it is the plain model, else ``model.state_dict()`` (full
  tensors) or ``tiny_fsdp.checkpoint``.
"""

from typing import Any, NoReturn


def refuse_pickling(kind: str, whole: bool = False, module_is_plain: bool = False) -> NoReturn:
    """Raise the TypeError of [Note: pickling a wrapped model] for a ``kind`` wrapper
    (``whole``: the wrapper itself, else its inner model; ``module_is_plain``: the wrapper's
    inner model holds every parameter whole, so it is what to save)."""
    article = "an" if kind.startswith("FSDP") else "a"
    what = f"{article} {kind} wrapper" if whole else f"the inner model of {article} {kind} wrapper"
    if whole and module_is_plain:
        fix = "torch.save(model.module) (the plain model) or torch.save(model.state_dict())"
    else:
        fix = (
            "torch.save(model.state_dict()) (full tensors: call state_dict() on every rank, "
            "save on rank 0) or tiny_fsdp.checkpoint.save_checkpoint; to pickle a whole model "
            "object, load that state dict into a plain model first"
        )
        if not whole:
            what += ", whose parameters are this rank's parts (shards or empty tensors)"
    raise TypeError(f"{what} cannot be pickled (torch.save, pickle, copy.copy); instead use {fix}")


class HookObject:
    """A hook that is an object rather than a function (so that it can say how it pickles):
    ``copy.deepcopy`` shares it, as it shares a function, and the hook decides itself whether
    it acts on a copy of its model ([Note: copying a wrapped model])."""

    def __deepcopy__(self, memo: Any) -> "HookObject":
        return self


class Inert(HookObject):
    """A forward hook or pre-hook that does nothing: what a hook acting for one wrapper's own
    model becomes in a pickled copy of that model."""

    def __call__(self, *args: Any) -> None:
        return None
