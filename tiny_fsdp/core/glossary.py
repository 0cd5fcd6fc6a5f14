"""The words the strategies use for tensors and their life cycle, defined once.

[Note: glossary]
Tensors of one parameter, as a rank sees them:

- *full*: the whole tensor, of the shape the plain model gives it; what a layer computes with
  (``ctx.params``, [Note: param handler]) and what ``state_dict()`` returns.
- *local*: the tensor this rank's module really holds under the parameter's name
  (``getattr(module, name)``): what the optimizer updates and autograd accumulates ``.grad``
  into. It is the full tensor (single device, DDP, ZeRO-1/2), a shard (FSDP), or, under ZeRO-3,
  the full tensor on its owner and an empty ``(0,)`` placeholder elsewhere.
- *shard*: this rank's 1/N of something cut evenly over the N ranks: FSDP's zero-padded rows of
  dim 0 of each parameter ([Note: dim-0 shards]); ZeRO-1/2's contiguous range of the flat
  buffer ([Note: ZeRO flat layout]).
- *owned*: held by this rank alone, and updated by it: under ZeRO-3 a whole tensor whose owner
  (partition table) is this rank; under ZeRO-1/2 the pieces that fall in this rank's shard.
- *piece*: a flat range ``[start, stop)`` of a full tensor in row-major order: how ZeRO-1/2's
  shard cuts parameters, and how checkpoints store any slice ([Note: checkpoint pieces]).

The life cycle of full parameters under FSDP and ZeRO-3 ([Note: prefetch]):

- *unit*: parameters that are made full together and freed together: an FSDP gather unit (one
  layer by default, [Note: gather units]), a ZeRO-3 layer.
- *unshard*: issue the collectives that make a unit's parameters full (FSDP: all-gather the
  shards; ZeRO-3: broadcast from the owners); *wait_for_unshard*: wait for them, after which the
  unit holds its full parameters; *reshard*: free them; *discard*: wait for an unshard nobody
  will use and free what it brought.
- *fetch* / *release*: a layer needs its full parameters now / is done with them (the seam of
  [Note: param handler]); a fetch unshards the unit unless it is already full.
- *prefetch*: an unshard issued asynchronously, ahead of the fetch that will use it.
- *phase*: ``TrainingPhase.FORWARD`` or ``TrainingPhase.BACKWARD``, the pass a fetch belongs to.
"""
