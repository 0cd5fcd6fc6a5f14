"""Checks every strategy runs on a model at wrap time ([Note: wrap-time checks] in wrapper.py)."""

from typing import Any, Dict, Iterable, List, Tuple

from torch import nn
from torch.nn.parameter import is_lazy

from tiny_fsdp.core.loss_reads import is_loss_read_hook
from tiny_fsdp.core.ownership import changed_by, owner_of


def check_module(module: Any, what: str) -> None:
    """Raise unless ``module`` is a ``torch.nn.Module`` whose parameters all have a shape.

    A lazy module (``nn.LazyLinear``...) learns its shapes in its first forward; until then no
    strategy can bucket, shard or broadcast its parameters (torch's DDP refuses them too).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"{what} wraps a torch.nn.Module, got {type(module).__name__}: put the computation "
            "in the forward of a module and wrap that"
        )
    lazy = [name for name, t in [*module.named_parameters(), *module.named_buffers()] if is_lazy(t)]
    if lazy:
        raise ValueError(
            f"{what}: {lazy[:4]} are not initialised yet (a lazy module, e.g. nn.LazyLinear, "
            "learns its shapes in its first forward). Run one forward on an example batch "
            f"before wrapping, then wrap: {what}(model)."
        )


def check_not_wrapped(module: nn.Module, what: str) -> None:
    """Raise if a parameter of ``module`` already belongs to a live wrapper, or was given
    storage of its own by one since dropped ([Note: ownership tag]): wrap a model once."""
    blocks = (
        "; one wrapper around the whole model is what FSDP2's fully_shard per block and on the "
        "root make: FSDP and Zero3 make each block a unit themselves (unit='auto')"
    )
    for name, param in module.named_parameters():
        owner = owner_of(param)
        if owner is not None:
            nested = owner is not module and any(m is owner.module for m in module.modules())
            raise ValueError(
                f"{what}: parameter '{name}' already belongs to a {type(owner).__name__} "
                "wrapper; wrap a model once (build a new model for another strategy)"
                + (blocks if nested else "")
            )
        gone = changed_by(param)
        if gone is not None:
            raise ValueError(
                f"{what}: parameter '{name}' was given storage of its own by a {gone} wrapper "
                f"that no longer exists: a wrapper returns a new module (FSDP2's fully_shard "
                f"changes one in place), so {gone}(submodule) changed the model even with its "
                "result dropped. Build the model anew and wrap it once" + blocks
            )


def check_same_model_on_all_ranks(module: nn.Module, what: str) -> None:
    """Raise on every rank if the ranks' parameters / buffers differ in name, shape or dtype.

    Mismatched models would otherwise pair unrelated tensors in the collectives.
    """
    from tiny_fsdp.core import comm

    signature = [
        (name, tuple(t.shape), str(t.dtype), bool(t.requires_grad))
        for name, t in [*module.named_parameters(), *module.named_buffers()]
    ]
    signatures = comm.all_gather_object(signature)
    for rank, other in enumerate(signatures):
        if other != signatures[0]:
            diff = sorted(set(other) ^ set(signatures[0]))[:4]
            raise ValueError(
                f"{what}: rank {rank}'s model differs from rank 0's (name, shape, dtype, "
                f"requires_grad); e.g. {diff}. Build the same model on every rank."
            )


def check_no_shared_storage(module: nn.Module, what: str) -> None:
    """Raise if two distinct parameters overlap in memory: sharding each on its own unties
    them. Parameters that are disjoint pieces of one storage (a copy of a ZeRO-1/2 model, whose
    parameters are views of one flat buffer) are independent tensors, and allowed."""
    spans: Dict[Any, List[Tuple[int, int, str]]] = {}  # storage -> (first byte, end, name)
    for name, param in module.named_parameters():  # a tied Parameter (one object) comes once
        if param.device.type == "meta" or param.numel() == 0:
            continue
        last = sum((n - 1) * s for n, s in zip(param.shape, param.stride()))  # in elements
        start = param.storage_offset() * param.element_size()
        end = start + (last + 1) * param.element_size()
        key = (param.device, param.untyped_storage().data_ptr())
        spans.setdefault(key, []).append((start, end, name))
    for pieces in spans.values():
        pieces.sort()
        reach, owner = -1, ""  # the furthest end so far, and whose
        for start, end, name in pieces:
            if start < reach:  # between two elements of one piece may lie the other's
                raise ValueError(
                    f"{what}: parameters '{owner}' and '{name}' share memory but are distinct "
                    f"Parameter objects, which {what} would shard separately (untying them). "
                    "Tie them by assigning one Parameter to both modules (e.g. b.weight = "
                    "a.weight)."
                )
            if end > reach:
                reach, owner = end, name


def check_no_max_norm_embeddings(module: nn.Module, what: str) -> None:
    """Raise if an embedding of ``module`` has ``max_norm``.

    [Note: embeddings with max_norm]
    ``nn.Embedding(max_norm=m)`` (and ``nn.EmbeddingBag``) rescales, in place and inside the
    forward, the rows its batch looks up whose norm exceeds ``m``. Every rank looks up other
    rows, so replicated parameters would drift apart (torch's DDP lets them, silently), and
    under FSDP / ZeRO-3 the forward rescales a gathered copy, so the rescale would be lost.
    Rescaling every row after the step, ``weight.renorm_(p, 0, m)`` under ``no_grad``, is the
    same on every rank and works on what a rank holds under every wrapper (rows are never
    split; ZeRO-3's empty tensor of a weight another rank owns is skipped): the message
    proposes it.
    """
    for name, m in module.named_modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.max_norm is not None:
            where = f"'{name}'" if name else "the model"
            raise ValueError(
                f"{what}: {where} is an {type(m).__name__} with max_norm={m.max_norm}, which "
                "rescales the rows its batch looks up, in place, during the forward; each rank "
                "looks up other rows, so the ranks' parameters would drift apart (torch's DDP "
                "lets them, silently). Build it without max_norm and rescale every row after "
                f"each optimizer step instead, under torch.no_grad(): w = <the {type(m).__name__}>"
                f".weight; if w.numel(): w.renorm_({m.norm_type}, 0, {m.max_norm}). That works "
                "on what a rank holds with every wrapper: rows are never split across ranks "
                "(under Zero3 a rank that does not own w holds an empty tensor)."
            )


def check_no_param_hooks(named_params: Iterable[Tuple[str, nn.Parameter]], what: str) -> None:
    """Raise if one of a sharding strategy's parameters (``named_parameters()`` of its model)
    has a gradient hook.

    Under FSDP and ZeRO-3 a layer computes the gradient of the full tensor it was given, and the
    strategy reduces it into each rank's part at the end of the backward: autograd would call a
    ``register_hook`` hook of the local parameter with None, a post-accumulate-grad hook before
    ``.grad`` is set (FSDP2 skips the former silently). Checked before each forward that
    records a graph (a hook registered after wrapping counts too), on the list of parameters
    the wrapper made once (the walk of the modules took longer than the check).
    """
    hooked = [
        name
        for name, param in named_params
        if param._backward_hooks
        or any(
            not is_loss_read_hook(hook)  # the strategy's own ([Note: parameters in the loss])
            for hook in (getattr(param, "_post_accumulate_grad_hooks", None) or {}).values()
        )
    ]
    if hooked:
        raise RuntimeError(
            f"{what}: parameters {hooked[:4]} have gradient hooks (Tensor.register_hook / "
            f"register_post_accumulate_grad_hook). {what} computes each gradient on a full "
            "tensor gathered for the layer and reduces it into this rank's part after the "
            "backward, so autograd would call these hooks without the gradient. Change p.grad "
            "after backward() instead (this rank's part of the averaged gradient), or use DDP, "
            "Zero1 or Zero2, whose parameter hooks see the local gradient as under torch's DDP."
        )
