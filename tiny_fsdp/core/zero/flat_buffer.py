"""Flat, padded, bucketed storage for ZeRO-1/2: per-parameter views and per-rank shard views.

[Note: ZeRO flat layout]
The trainable parameters (a tied parameter once) are laid out back to back in ONE flat buffer,
in backward order (reversed model order: the last layer's gradient is ready first). The buffer is
cut into *buckets* at parameter boundaries (a bucket holds whole parameters, at most
``bucket_cap`` elements unless one parameter alone is larger), and each bucket is padded with
zeros to a multiple of the world size ``N``::

    flat buffer  = [ bucket 0 | bucket 1 | ... ]
    bucket b     = [ p_i | p_j | ... | pad ]          numel(b) = N * chunk(b)
                   [ chunk 0 | chunk 1 | ... | chunk N-1 ]    rank r owns chunk r

Rank r's *shard* is the concatenation of its chunk of every bucket, ``shard_numel = sum_b
chunk(b) = numel / N`` elements; a shard-sized tensor (ZeRO-2's gradient shard, the fp32
master) keeps bucket b's chunk at ``[shard_start(b), shard_start(b) + chunk(b))``. Why per-bucket
chunks rather than one contiguous 1/N of the whole buffer: a bucket is then exactly the input of
one reduce-scatter (and its chunk the output), so ZeRO-2 can reduce-scatter bucket by bucket
while backward still runs, and the all-gather of the updated parameters is one collective per
bucket with the rank's chunk as input, in place.

A parameter lies in one bucket and a chunk is contiguous, so a parameter meets a rank's chunk in
at most one contiguous *piece*; a piece is what the optimizer updates (elementwise rule, so the
per-piece update equals the whole-tensor update restricted to the piece).

[Note: ZeRO buckets by dtype]
A model may hold parameters of several dtypes (a bf16 model that keeps its norms in fp32, as
``transformers`` does for ``_keep_in_fp32_modules``); torch's DDP and ZeroRedundancyOptimizer
take it. A collective and a view need one dtype, so each parameter has a *group* (its stored
dtype; under a mixed-precision policy, which stores every parameter in one dtype, also its own,
which its master keeps) and a bucket holds one group: every group fills its own open bucket
in backward order, and the buckets are ordered by the parameter that completes them, so that
reducing them strictly in order still launches each as soon as its last gradient arrives. The
storage is one tensor per bucket (``FlatBuffer``) and one chunk tensor per bucket
(``ShardBuffer``), each of its group's dtype; the flat offsets above stay one index space, so
the layout, the pieces and the consolidated state do not depend on the dtypes. With one dtype
the buckets are those of a single pass, filled and closed one after another.

[Note: ZeRO collectives on gloo]
ZeRO's collectives are a reduce-scatter of each gradient bucket and an all-gather of each
parameter bucket; NCCL runs exactly those. gloo (CPU) implements both far below its all-reduce
and broadcast: on 2 ranks and 2 cores, for 65 MB of fp32 we measured all_reduce 128 ms,
reduce_scatter 339 ms, all_gather 300 ms, and one broadcast per owner 60 ms in all. So on gloo
``gather_bucket`` broadcasts each chunk from its owner (same traffic and ledger payload as the
all-gather), and ``reduce_bucket`` on 2 CPU ranks runs ``comm.reduce_scatter``, which there is one
send and one receive ([Note: collectives on gloo]; ZeRO-1 reduces in place, into its chunk of
the full gradient buffer, so it receives the other rank's part into a buffer of that chunk's
size, counted by its store). Measured alone (2 ranks, load 0.4-0.7, median of 10): a 51.5 MB
bucket in 17.5-19.2 ms against 31-58 ms for gloo's all-reduce, 25.6 MB in 8.1-9.8 against
17.4-18.0; ZeRO-1's and ZeRO-2's steps on gpt2_mini, alternating with the all-reduce in one
run (16 rounds, load 1.8-2.0), went from 1,781 to 1,733 ms and from 1,756 to 1,743 ms. On
more ranks (gloo's reduce-scatter is N reduces there) ``reduce_bucket`` all-reduces the bucket
in place and keeps this rank's chunk: the same result, twice the traffic, and the ledger shows
``all_reduce``. What each rank holds is the same; a 2-rank sum is one addition, c_0 + c_1,
whichever collective makes it.
"""

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from tiny_fsdp.core import comm, gloo_collectives


@dataclass(frozen=True)
class Slot:
    """Where parameter ``index`` lives: flat elements ``[start, start + numel)``."""

    index: int
    bucket: int
    start: int
    numel: int
    shape: torch.Size


@dataclass(frozen=True)
class Bucket:
    """Flat elements ``[start, start + numel)``; ``numel = N * chunk``; holds ``slots``."""

    start: int
    numel: int
    chunk: int
    shard_start: int
    slots: Tuple[int, ...]
    group: int


@dataclass(frozen=True)
class Piece:
    """The part of parameter ``index`` that one rank owns, as three aligned ranges of ``numel``
    elements: ``[start, ...)`` of the flat buffer, ``[param_start, ...)`` of the flattened
    parameter and ``[shard_start, ...)`` of that rank's shard."""

    index: int
    bucket: int
    start: int
    param_start: int
    shard_start: int
    numel: int


class FlatLayout:
    """The layout of [Note: ZeRO flat layout] for parameters of the given ``shapes`` (in order).

    ``groups[i]``: parameter i's group (its stored dtype; None: one group 0); a bucket holds
    one group ([Note: ZeRO buckets by dtype]).

    Attributes:
        slots: one ``Slot`` per parameter, in the given order.
        buckets: the buckets in flat order (which is also the reduce-scatter launch order).
        numel: padded size of the flat buffer, a multiple of ``world_size``.
        shard_numel: ``numel // world_size``, the size of every rank's shard.
    """

    def __init__(
        self,
        shapes: Sequence[torch.Size],
        world_size: int,
        bucket_cap_numel: int,
        groups: Optional[Sequence[int]] = None,
    ) -> None:
        if world_size < 1 or bucket_cap_numel < 1:
            raise ValueError(f"bad world_size {world_size} or bucket cap {bucket_cap_numel}")
        self.world_size = world_size
        group_of = [0] * len(shapes) if groups is None else list(groups)
        closed: List[List[int]] = []
        open_: Dict[int, List[int]] = {}  # group -> its bucket being filled
        filled: Dict[int, int] = {}
        for i, shape in enumerate(shapes):
            g, n = group_of[i], torch.Size(shape).numel()
            if g in open_ and filled[g] > 0 and filled[g] + n > bucket_cap_numel:
                closed.append(open_.pop(g))
            if g not in open_:
                open_[g], filled[g] = [], 0
            open_[g].append(i)
            filled[g] += n
        # Complete when its last parameter's gradient is ready: reduced in that order.
        closed = sorted([*closed, *open_.values()], key=lambda members: members[-1])
        self.slots: List[Slot] = [None] * len(shapes)  # type: ignore[list-item]
        self.buckets: List[Bucket] = []
        start = shard_start = 0
        for b, members in enumerate(closed):
            offset = start
            for i in members:
                shape = torch.Size(shapes[i])
                self.slots[i] = Slot(i, b, offset, shape.numel(), shape)
                offset += shape.numel()
            chunk = -(-(offset - start) // world_size)  # ceil: pad the bucket to N * chunk
            self.buckets.append(
                Bucket(start, chunk * world_size, chunk, shard_start, tuple(members), group_of[i])
            )
            start += chunk * world_size
            shard_start += chunk
        self.numel = start
        self.shard_numel = shard_start
        # Per parameter, (shape, strides, offset) of its slot in a tensor laid out as its bucket:
        # a slot is then one op (as_strided) on a bucket made anew (a slice and a reshape are two).
        self._in_bucket = [
            (
                s.shape,
                torch.empty(s.shape, device="meta").stride(),
                s.start - self.buckets[s.bucket].start,
            )
            for s in self.slots
        ]

    def in_bucket(self, index: int) -> Tuple[torch.Size, Tuple[int, ...], int]:
        """``as_strided`` arguments of parameter ``index``'s slot in a (bucket numel,) tensor."""
        return self._in_bucket[index]

    def slot_views(self, buckets: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """Every parameter's slot, shaped like it, in ``buckets`` (one (bucket numel,) tensor
        per bucket); made once by their owner, as a view per slot is host work per call."""
        return [buckets[s.bucket].as_strided(*self.in_bucket(s.index)) for s in self.slots]

    def chunk_range(self, bucket: int, rank: int) -> Tuple[int, int]:
        """Flat ``[start, stop)`` of ``rank``'s chunk of ``bucket``."""
        b = self.buckets[bucket]
        return b.start + rank * b.chunk, b.start + (rank + 1) * b.chunk

    def pieces(self, rank: int) -> List[Piece]:
        """``rank``'s pieces, one per parameter that meets its chunks, in flat order."""
        out = []
        for slot in self.slots:
            bucket = self.buckets[slot.bucket]
            lo, hi = self.chunk_range(slot.bucket, rank)
            start, stop = max(lo, slot.start), min(hi, slot.start + slot.numel)
            if start < stop:
                shard_start = bucket.shard_start + (start - lo)
                out.append(
                    Piece(
                        slot.index,
                        slot.bucket,
                        start,
                        start - slot.start,
                        shard_start,
                        stop - start,
                    )
                )
        return out

    def padding(self) -> int:
        """Number of padding elements (``numel`` minus the parameters' elements)."""
        return self.numel - sum(s.numel for s in self.slots)


def spans(pieces: Iterable[Piece]) -> List[Piece]:
    """``pieces`` joined where they are adjacent in one bucket (flat and shard ranges both
    contiguous): one span per run, for elementwise work done in one op per run instead of one
    per piece. A span that joins several pieces keeps its first piece's ``index`` and
    ``param_start`` (it covers several parameters: only its bucket and ranges mean anything)."""
    runs: List[List[Piece]] = []
    for piece in sorted(pieces, key=lambda p: p.start):
        last = runs[-1][-1] if runs else None
        if (
            last is not None
            and last.bucket == piece.bucket
            and last.start + last.numel == piece.start
            and last.shard_start + last.numel == piece.shard_start
        ):
            runs[-1].append(piece)
        else:
            runs.append([piece])
    return [
        run[0] if len(run) == 1 else dataclasses.replace(run[0], numel=sum(p.numel for p in run))
        for run in runs
    ]


class FlatBuffer:
    """The full flat buffer of a ``FlatLayout``: one tensor (bucket numel,) per bucket, of
    ``dtypes[bucket.group]`` ([Note: ZeRO buckets by dtype]), with the layout's views.

    Created zero-filled, so the padding is zero and stays zero under sums and copies.
    """

    def __init__(
        self, layout: FlatLayout, dtypes: Sequence[torch.dtype], device: torch.device
    ) -> None:
        self.layout = layout
        self.tensors = [
            torch.zeros(b.numel, dtype=dtypes[b.group], device=device) for b in layout.buckets
        ]
        self._views = layout.slot_views(self.tensors)  # made once, not at each call

    def view(self, index: int) -> torch.Tensor:
        """Parameter ``index``'s slot, shaped like the parameter (the same tensor each call)."""
        return self._views[index]

    def bucket(self, bucket: int) -> torch.Tensor:
        """Bucket ``bucket``, flat: (N * chunk,)."""
        return self.tensors[bucket]

    def chunk(self, bucket: int, rank: int) -> torch.Tensor:
        """``rank``'s chunk of ``bucket``: (chunk,)."""
        chunk = self.layout.buckets[bucket].chunk
        return self.tensors[bucket][rank * chunk : (rank + 1) * chunk]

    def piece(self, piece: Piece) -> torch.Tensor:
        """The flat elements of ``piece``: (piece.numel,)."""
        start = piece.start - self.layout.buckets[piece.bucket].start
        return self.tensors[piece.bucket][start : start + piece.numel]


class ShardBuffer:
    """A rank's shard of a ``FlatLayout``: one tensor (chunk,) per bucket, of
    ``dtypes[bucket.group]``; a group whose dtype is None gets none (``chunk`` raises)."""

    def __init__(
        self,
        layout: FlatLayout,
        dtypes: Sequence[Optional[torch.dtype]],
        device: torch.device,
    ) -> None:
        self.layout = layout
        self.tensors: List[Optional[torch.Tensor]] = [
            (
                None
                if dtypes[b.group] is None
                else torch.zeros(b.chunk, dtype=dtypes[b.group], device=device)
            )
            for b in layout.buckets
        ]

    def has(self, bucket: int) -> bool:
        return self.tensors[bucket] is not None

    def chunk(self, bucket: int) -> torch.Tensor:
        """Bucket ``bucket``'s chunk: (chunk,)."""
        tensor = self.tensors[bucket]
        assert tensor is not None, f"no shard tensor for bucket {bucket}'s group"
        return tensor

    def piece(self, piece: Piece) -> torch.Tensor:
        """``piece``'s elements: (piece.numel,)."""
        start = piece.shard_start - self.layout.buckets[piece.bucket].shard_start
        return self.chunk(piece.bucket)[start : start + piece.numel]

    def held(self) -> List[torch.Tensor]:
        return [t for t in self.tensors if t is not None]


class PendingReduce:
    """A bucket reduction in flight; ``wait()`` completes it (and copies the chunk on gloo)."""

    def __init__(self, work: Any, copy_from: Optional[torch.Tensor], out: torch.Tensor) -> None:
        self.work, self.copy_from, self.out = work, copy_from, out

    def is_completed(self) -> bool:
        return self.work is None or self.work.is_completed()

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
        if self.copy_from is not None:
            self.out.copy_(self.copy_from)


def reduce_bucket(bucket: torch.Tensor, out: torch.Tensor, rank: int, async_op: bool) -> Any:
    """Sum ``bucket`` (N * chunk,) over ranks; ``out`` (chunk,) gets this rank's chunk of the sum
    (``out`` may be that chunk of ``bucket`` itself); ``bucket`` is scratch afterwards. [Note:
    ZeRO collectives on gloo]"""
    chunk = out.numel()
    own = bucket[rank * chunk : (rank + 1) * chunk]
    if gloo_collectives.is_gloo(None) and not gloo_collectives.pairs(bucket, None):
        work = comm.all_reduce(bucket, async_op=async_op)
        return PendingReduce(work, own if own.data_ptr() != out.data_ptr() else None, out)
    return PendingReduce(comm.reduce_scatter(out, bucket, async_op=async_op), None, out)


def gather_bucket(bucket: torch.Tensor, rank: int, world_size: int, async_op: bool) -> List[Any]:
    """Fill ``bucket`` (N * chunk,), whose chunk ``rank`` holds this rank's values, with every
    rank's chunk. Returns the works to wait for (None entries when synchronous)."""
    chunk = bucket.numel() // world_size
    if gloo_collectives.is_gloo(None):  # one broadcast per owner ([Note: ZeRO collectives on gloo])
        return [
            comm.broadcast(bucket[r * chunk : (r + 1) * chunk], src=r, async_op=async_op)
            for r in range(world_size)
        ]
    own = bucket[rank * chunk : (rank + 1) * chunk]
    return [comm.all_gather(bucket, own, async_op=async_op)]
