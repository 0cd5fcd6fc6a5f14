"""Tell libraries that a model's forwards are collectives, so they keep the ranks in step.

[Note: forwards in lockstep]
Under FSDP and ZeRO-3 every forward gathers parameters from every rank, so every rank must run
the same modules in the same order. Some models and libraries choose per rank what runs: HF's
``generate`` stops a rank once its sequences end (ranks with other prompts end at other
lengths), and LayerDrop (HF's speech models: ``layerdrop=0.1`` by default) skips a layer on
the ranks whose random draw says so. With one rank inside a gather the others never start, the
job hangs (NCCL) or stops with a size mismatch (gloo).

Those libraries have a synchronised mode for sharded models (``generate(synced_gpus=True)``:
finished ranks keep running forwards; LayerDrop: the layer runs and its output is dropped),
which they turn on for a module that has ``_is_fsdp_managed_module`` set: torch's
``fully_shard`` sets it on the modules it manages, and HF checks it. ``mark_lockstep`` sets it
on every module of a gathering wrapper's model, so the defaults of those libraries are right
under tiny_fsdp as under FSDP2. A layer that runs without its output reaching the loss gets no
gradient on that rank, as with any unused parameter ([Note: unit reduction]).

A model's own per-rank branch (``if x[0, 0] % 2: h = self.extra(h)``) is not kept in step.
Where the collectives that pair differ in size it stops gloo ("Received data size doesn't
match") or, where they differ in kind (a rank left behind meets a reduce with a broadcast),
leaves the ranks waiting; NCCL hangs; all as under FSDP2. ``TORCH_DISTRIBUTED_DEBUG=DETAIL``
has torch compare each collective across ranks first: every rank then raises, naming both
(``tests/test_lockstep.py``). Where they match (identical blocks), FSDP2 trains wrong without a
sign and we raise at the end of the backward ([Note: ranks out of step] in ``prefetch.py``).

Dynamo reads the same attribute (it then treats the module's parameters as inputs, and requires
``_fsdp_use_orig_params``, set too, which is true here: the parameters are the model's own); it
never traces these forwards anyway ([Note: torch.compile] in ``eager.py``).
"""

from torch import nn


def mark_lockstep(module: nn.Module) -> None:
    """Mark ``module`` and all its submodules as run in step by every rank ([Note: forwards in
    lockstep])."""
    for sub in module.modules():
        sub._is_fsdp_managed_module = True
        sub._fsdp_use_orig_params = True
