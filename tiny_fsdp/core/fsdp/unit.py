"""A gather unit: the parameters of one or more layers, all-gathered together and freed together.

[Note: gather units]
The unit of communication decides how many collectives a step issues and how much is gathered
at once. ``FSDP(unit=...)`` takes the layouts of ``unit_layout.py``: ``"auto"`` (default: the
model's repeated blocks, found without the user naming them, plus a root unit; else per layer),
``"layer"`` (a layer's flat shards concatenated into one all-gather), ``"tensor"`` (one
all-gather per tensor, no concatenation / copy-out), or a list of modules (FSDP2's layout).

A unit is unsharded (all-gathered) when the first of its layers fetches and stays full until
every one of its layers has released it in that pass, then resharded ([Note: glossary]); a
parameter that appears in several of its layers (a tied weight) is gathered once. Its
gradients are summed and reduce-scattered once per unit, when its last layer's backward has
added them, and delivered at the end of the backward ([Note: unit reduction]).

A single-tensor collective yields the full tensor as a view of the gathered buffer; a
multi-tensor one is laid out rank-major (rank r's shards of every tensor, then rank r+1's), so
it is copied out, in one op (``torch.split_with_sizes_copy``, as FSDP2), into a buffer of the
same size holding each tensor's shards rank after rank: its padded full tensor, of which the
full tensor is a view. The gathered buffer is freed at once. (Per tensor, as before, the copies
cost a Python-side op each: at world size 1 on the CPU, where only such overhead counts,
gpt2_tiny's step took 1.48-1.55 x FSDP2's instead of 1.63-1.68, three alternating runs each.)
On one rank (world size 1, or HSDP with shard groups of one) the output's single row is already
every tensor whole, unpadded, back to back: the full tensors are views of it and nothing is
copied out. On the CPU proxy of a GPU host's work (one process, a 12-layer GPT-2 of width 96,
bf16, forward and backward against FSDP2's in the same process, 150 rounds, five runs each way
alternating, load 0.6-1.6), FSDP's host time went from 1.080-1.161 (median 1.126) to
1.029-1.096 (median 1.059) x FSDP2's.

Which unit, by measurement (the first round's FSDP benchmark, now part of ``example/benchmark.py``:
gpt2_mini, 2 CPU ranks on gloo, all variants and FSDP2 alternating in one run; step-time ratio to
FSDP2, median / paired median): per tensor 1.10-1.14 / 1.10 (158 collectives a step), per layer 1.15
/ 1.08 (83), per block + root 0.98 / 0.96 (36). Gloo collectives are slow here (milliseconds each, a
few hundred MB/s), so what counts is the number of collectives and the bytes moved: per block issues
the fewest and, with the tied weight in one unit, gathers and reduces GPT-2's 51 MB embedding once a
step instead of three and two times. Its price is memory: the root unit (the embedding) stays
gathered for the whole step, as in FSDP2, and a block is gathered at once instead of a layer.
Hence ``"auto"`` is the default: it finds the blocks itself, so the fast layout needs no
knowledge of the model from the user; ``"layer"`` gathers the least at a time (less memory).
With the defaults (``"auto"``, one reduce-scatter per unit, asynchronous reductions, gloo
collectives as broadcasts / reduces, in-place all-gathers, buffers in huge pages: [Note: huge
pages for transient buffers]), ``torchrun --nproc_per_node=2 example/benchmark.py --model
gpt2_mini --batch_size 4 --seq_len 256 --one_phase --steps 14`` measured FSDP at 0.91 x FSDP2's
step time and 1.03 x our DDP's, ZeRO-3 at 0.90 x FSDP2 and 1.01 x DDP (median of per-round
ratios, load average 1.6-2.0 on 2 cores; 4 ranks: 0.92, 1.02, 0.91, 1.03). With 2-rank
reduce-scatters as a send and a receive on gloo since ([Note: collectives on gloo]), one run
with ``--steps 8`` (load 1.9): FSDP 0.87 x FSDP2 and 1.02 x DDP, ZeRO-3 0.92 and 1.09; the same
machine's runs spread by about 0.05.
"""

import functools
from typing import Any, Dict, List, Sequence, Tuple

import torch
from torch import nn

from tiny_fsdp.core import comm
from tiny_fsdp.core.fsdp.gather_buffers import GatherBuffers
from tiny_fsdp.core.fsdp.sharded_param import shard_info
from tiny_fsdp.core.fsdp.state import FSDPState
from tiny_fsdp.core.full_unit import FullUnit, copied_model_error
from tiny_fsdp.core.unit_layout import grouped, unit_params
from tiny_fsdp.core.streams import GATHER, CommHandle, Launch
from tiny_fsdp.core.utils.storage import MadeOnce

# One collective per group: (handle, the group's buffers, whose output is allocated).
PendingGather = List[Tuple[CommHandle, GatherBuffers]]


class GatherUnit(FullUnit):
    """Unshards and reshards the full parameters of ``layers`` ([Note: gather units]).

    Implements the prefetcher's ``Unit`` verbs ([Note: prefetch]) with all-gathers of shards;
    holding and releasing are ``FullUnit``'s ([Note: full units]). Each group's buffers and
    their views are made once ([Note: buffers made once]).
    """

    def __init__(
        self, name: str, layers: Sequence[nn.Module], state: FSDPState, per_tensor: bool = False
    ) -> None:
        super().__init__(name, layers, state)
        for layer in self.layers:
            for param_name in layer.param_names:
                param = getattr(layer, param_name)
                if param is not None and shard_info(param) is None:
                    raise ValueError(f"{name}: {param_name} of {layer} is not an FSDP shard")
        shards = unit_params(self.layers)  # each once
        # A collective has one dtype: tensors of one dtype travel together (or each alone).
        self.groups = grouped(shards, lambda param: param.dtype, per_tensor)
        self._buffers: MadeOnce[GatherBuffers] = MadeOnce(len(self.groups))
        self._full_bytes = 0

    def gathered_numel(self) -> int:
        """Elements of the padded all-gather outputs of one gather of this unit."""
        world = self.state.world_size
        return sum(world * shard_info(p).shard_numel for group in self.groups for p in group)

    # ---------------------------------------------------------------- unit verbs
    def unshard(self, async_op: bool) -> PendingGather:
        """Start (or run) one all-gather per group; counted in the state's gathered bytes."""
        pending: PendingGather = []
        allocated: List[GatherBuffers] = []
        try:
            for index, group in enumerate(self.groups):
                if any(shard_info(param) is None for param in group):
                    raise copied_model_error("FSDP")
                buffers = self._group_buffers(index, group)
                views = buffers.out.allocate()  # of the output (world * numel,)
                allocated.append(buffers)
                self.state.track_gathered(buffers.out.nbytes)
                # In place: this rank's shards go straight into their chunk of the output in
                # one multi-tensor copy (and cast: mixed precision casts the shard, not the
                # gathered tensor, so half the bytes travel), no concatenation and second copy
                # ([Note: collectives on gloo]). Not torch.cat(out=): into another dtype it
                # first makes a cast copy of each input.
                torch._foreach_copy_(views.own_parts, buffers.local.of(group))
                groups = self.state.groups  # [Note: hybrid sharding]
                launch = _all_gather(buffers.out.buffer, views.own, groups)
                pending.append((self.state.streams.issue(GATHER, launch, async_op), buffers))
        except BaseException:
            self._forget(allocated)
            raise
        return pending

    def wait_for_unshard(self, pending: PendingGather) -> None:
        """Wait for the all-gathers; keep each parameter's full tensor (view or copy-out)."""
        full: Dict[int, torch.Tensor] = {}
        full_bytes = 0
        try:
            for handle, buffers in pending:
                self.state.streams.wait(handle)
                if buffers.padded is None:
                    full.update(buffers.out.views.full)
                else:
                    # Copy-out in one op: tensor i's columns of the grid, rank after rank, are
                    # its padded full tensor; back to back in one buffer, each a view of it.
                    padded = buffers.padded.allocate()
                    self.state.track_gathered(buffers.padded.nbytes)
                    grid = buffers.out.views.grid
                    torch.split_with_sizes_copy(grid, buffers.sizes, dim=1, out=padded.blocks)
                    buffers.out.free()  # the rank-major buffer dies here
                    self.state.track_gathered(-buffers.out.nbytes)
                    full.update(padded.full)
                full_bytes += buffers.full_memory.nbytes
        except BaseException:
            self._forget([buffers for _, buffers in pending])
            raise
        self._full_bytes = full_bytes
        self.set_full(full)

    def discard(self, pending: PendingGather) -> None:
        """Forget a prefetch that will not be used, once its collective has finished."""
        try:
            for handle, buffers in pending:
                self.state.streams.wait(handle)
                buffers.out.free()
                self.state.track_gathered(-buffers.out.nbytes)
        except BaseException:
            self._forget([buffers for _, buffers in pending])
            raise

    def on_reshard(self) -> None:
        for buffers in self._buffers:
            if buffers is not None:
                buffers.full_memory.free()
        self.state.track_gathered(-self._full_bytes)
        self._full_bytes = 0

    def _forget(self, failed: List[GatherBuffers]) -> None:
        """After an error in an unshard (a collective or a copy that raised): uncount these
        buffers and make new ones next time ([Note: buffers made once])."""
        for buffers in failed:
            for memory in (buffers.out, buffers.padded):
                if memory is not None and memory.holds_memory:
                    self.state.track_gathered(-memory.nbytes)
        self._buffers.forget(failed)

    def _group_buffers(self, index: int, group: List[nn.Parameter]) -> GatherBuffers:
        """Group ``index``'s buffers ([Note: buffers made once])."""
        state, device = self.state, group[0].device
        dtype = state.gather_dtype(group[0].dtype)
        make = functools.partial(GatherBuffers, group, state.world_size, state.rank, dtype, device)
        return self._buffers.get(index, (dtype, device), make)


def _all_gather(out: torch.Tensor, flat: torch.Tensor, groups: Any) -> Launch:
    def launch(async_op: bool) -> Any:
        group, label = groups.shard_group, groups.shard_label
        return comm.all_gather(out, flat, group=group, async_op=async_op, label=label)

    return launch
