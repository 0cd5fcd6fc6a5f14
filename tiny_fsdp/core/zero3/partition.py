"""The ZeRO-3 inter-tensor partition table: which rank owns which whole tensor.

[Note: evenness priority]
Tensors (in model order, sizes in bytes) are cut into ``k`` contiguous *runs* that minimise the
largest run, and the runs are dealt to the ``N`` ranks largest-first onto the least-loaded rank
(with ``k = N`` run ``i`` simply goes to rank ``i``). ``k`` is the only knob:

- ``k = N``: every rank owns one contiguous run and rank order follows model order (a layer's
  tensors, and consecutive layers, mostly share one owner: broadcasts come from one rank at a
  time, which is what prefetching wants). The largest share is the optimum over contiguous
  partitions.
- ``k = M`` (one run per tensor): order is ignored; this is the classic largest-first greedy.

``evenness_priority = p`` in [0, 1] allows at most ``k_max = N + p (M - N)`` runs. The candidates
are the ``k`` of the grid ``{N, 2N, 4N, ...} + {M}`` with ``k <= k_max``; the table is the
candidate with the smallest largest share (ties: the smaller ``k``). Promises, pinned by
``tests/test_zero3_partition.py``:

1. ``p = 0``: each rank owns one contiguous run, ranks in model order, and the largest share is
   the minimum over all contiguous partitions.
2. The table never has more than ``k_max`` contiguous runs (owner changes along model order + 1).
3. The largest share never grows when ``p`` grows (the candidate set only grows).
4. ``p = 1``: largest share <= max(s1, T / N + (1 - 1/N) s_{N+1}) with ``T`` the total and
   ``s_i`` the i-th largest tensor (the greedy's bound: the last tensor put on the fullest rank
   found it at most average, and was at most the (N+1)-th largest). So the share is
   <= max(s1, 1.05 T / N) as soon as s_{N+1} <= 5 % of T / N, as in transformers. No rule can
   promise 1.05 for every input: three equal tensors on two ranks force 4/3 of the average.
5. With ``M >= N`` tensors no rank owns nothing; every tensor has exactly one owner.
"""

import heapq
from typing import Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist


class PartitionTable(Mapping):
    """``name -> owner rank`` in model order (a read-only Mapping), plus what it was made for.

    Attributes:
        world_size: number of ranks the table was made for.
        devices: ``devices[r]`` is rank r's device string from ``ranks_map`` (None if omitted).
        nbytes: ``name -> bytes`` of each tensor; ``rank_bytes[r]`` sums rank r's tensors.
    """

    def __init__(
        self,
        owners: Dict[str, int],
        nbytes: Dict[str, int],
        world_size: int,
        devices: Sequence[Optional[str]],
    ) -> None:
        self._owners = dict(owners)
        self.nbytes = dict(nbytes)
        self.world_size = world_size
        self.devices: Tuple[Optional[str], ...] = tuple(devices)
        self.rank_bytes: List[int] = [0] * world_size
        for name, rank in self._owners.items():
            self.rank_bytes[rank] += self.nbytes[name]

    def __getitem__(self, name: str) -> int:
        return self._owners[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._owners)

    def __len__(self) -> int:
        return len(self._owners)

    def names_of(self, rank: int) -> List[str]:
        """Names owned by ``rank``, in model order."""
        return [name for name, owner in self._owners.items() if owner == rank]

    def __repr__(self) -> str:
        return f"PartitionTable(world_size={self.world_size}, rank_bytes={self.rank_bytes})"


def zero3_partition_tensors(
    tensors: Union[Mapping[str, torch.Tensor], Iterable[Tuple[str, torch.Tensor]]],
    ranks_map: Optional[Sequence[str]] = None,
    evenness_priority: float = 0.0,
) -> Tuple[PartitionTable, List[int]]:
    """Give every tensor one owner rank. ``tensors``: name -> tensor (or pairs), model order.

    Only sizes matter (``numel * element_size``), so meta tensors are fine.

    ``ranks_map[r]`` is rank r's device (``"cuda:0"``, ``"cpu"``...); its length is the world
    size. Omitted: the world size of the initialised default process group, devices unknown.
    ``evenness_priority`` trades contiguity (0) for byte balance (1); see [Note: evenness
    priority]. Returns ``(table, rank_bytes)``: the ``PartitionTable`` (name -> rank) and the
    bytes each rank owns (``rank_bytes[r]``). No process group is needed when ``ranks_map`` is
    given.
    """
    if not 0.0 <= evenness_priority <= 1.0:
        raise ValueError(f"evenness_priority must be in [0, 1], got {evenness_priority}")
    if ranks_map is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                "zero3_partition_tensors needs ranks_map (one device string per rank, e.g. "
                "['cpu'] * world_size) when no process group is initialised"
            )
        devices: List[Optional[str]] = [None] * dist.get_world_size()
    else:
        devices = [str(d) for d in ranks_map]
    n_ranks = len(devices)
    if n_ranks == 0:
        raise ValueError("ranks_map must name at least one rank")
    tensors = dict(tensors)  # also accepts model.named_parameters() directly
    names = list(tensors)
    sizes = [t.numel() * t.element_size() for t in tensors.values()]
    owners = _partition(sizes, n_ranks, evenness_priority)
    table = PartitionTable(dict(zip(names, owners)), dict(zip(names, sizes)), n_ranks, devices)
    return table, list(table.rank_bytes)


def _partition(sizes: List[int], n_ranks: int, evenness_priority: float) -> List[int]:
    """Owner rank of each tensor ([Note: evenness priority])."""
    m = len(sizes)
    if m <= n_ranks:  # one tensor per rank; the ranks after the last tensor own nothing
        return list(range(m))
    k_max = n_ranks + evenness_priority * (m - n_ranks)
    grid = {m}
    k = n_ranks
    while k < m:
        grid.add(k)
        k *= 2
    best: Optional[Tuple[int, int, List[int]]] = None
    for k in sorted(grid):
        if k > k_max + 1e-9:
            break
        owners = _deal_runs(sizes, _contiguous_runs(sizes, k), n_ranks)
        loads = [0] * n_ranks
        for size, rank in zip(sizes, owners):
            loads[rank] += size
        if best is None or max(loads) < best[0]:  # strict: ties keep the smaller k
            best = (max(loads), k, owners)
    assert best is not None  # k = n_ranks is always a candidate
    return best[2]


def _contiguous_runs(sizes: List[int], k: int) -> List[Tuple[int, int]]:
    """``k`` non-empty ``[start, end)`` runs covering ``sizes`` whose largest sum is minimal.

    Binary search on the budget (the answer is an integer between the largest tensor and the
    total); a greedy left-to-right fill tells whether a budget fits in ``k`` runs.
    """
    if k == len(sizes):
        return [(i, i + 1) for i in range(k)]
    lo, hi = max(sizes), sum(sizes)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(_greedy_fill(sizes, mid)) <= k:
            hi = mid
        else:
            lo = mid + 1
    runs = _greedy_fill(sizes, lo)
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)

    def run_sum(start: int, end: int) -> int:
        return prefix[end] - prefix[start]

    # The fill may use fewer runs; splitting a run never raises the maximum, so split the
    # largest splittable run at its most balanced point until there are exactly k.
    while len(runs) < k:
        i = max((j for j, (s, e) in enumerate(runs) if e - s >= 2), key=lambda j: run_sum(*runs[j]))
        start, end = runs[i]
        cut = min(range(start + 1, end), key=lambda c: max(run_sum(start, c), run_sum(c, end)))
        runs[i : i + 1] = [(start, cut), (cut, end)]
    return runs


def _greedy_fill(sizes: List[int], budget: int) -> List[Tuple[int, int]]:
    """Runs made by adding tensors in order until the next one would exceed ``budget``."""
    runs: List[Tuple[int, int]] = []
    start, acc = 0, 0
    for i, size in enumerate(sizes):
        if i > start and acc + size > budget:
            runs.append((start, i))
            start, acc = i, 0
        acc += size
    runs.append((start, len(sizes)))
    return runs


def _deal_runs(sizes: List[int], runs: List[Tuple[int, int]], n_ranks: int) -> List[int]:
    """Owner of each tensor: run i -> rank i if there are N runs, else largest-first greedy."""
    owners = [0] * len(sizes)
    run_bytes = [sum(sizes[s:e]) for s, e in runs]
    if len(runs) == n_ranks:
        order = [(i, i) for i in range(n_ranks)]
    else:
        # Heap of (load, number of runs, rank): ties go to the rank with fewer runs, so the first
        # N runs land on N different ranks (no empty rank, even with zero-byte tensors).
        heap = [(0, 0, r) for r in range(n_ranks)]
        order = []
        for i in sorted(range(len(runs)), key=lambda j: -run_bytes[j]):
            load, count, rank = heapq.heappop(heap)
            order.append((i, rank))
            heapq.heappush(heap, (load + run_bytes[i], count + 1, rank))
    for i, rank in order:
        start, end = runs[i]
        owners[start:end] = [rank] * (end - start)
    return owners
