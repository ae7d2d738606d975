"""Bin packing for micro-batches: sample lengths into k capped, balanced bins (the algorithms).

nanorl/batching.py `make_micro_batches` decides how many micro-batches a step needs and calls these to
fill them; its docstring states the cost model, the search over k and the bound. Here: `balanced` (start
there) is the best capped, non-empty k-partition among two candidates, LPT (`lpt`: longest item into
the lightest bin, Graham's 4/3 bound) and first-fit-decreasing into k bins (`first_fit_decreasing`), each
first given no empty bin (`fill_empty`) and then polished by `local_search` (moves and swaps that never
raise the heaviest bin); `split_heaviest` reaches an imposed count by halving the heaviest splittable
bin. A partition is judged by `quality`: (heaviest bin, heaviest − lightest), lower is better. Key
choice: pure Python and numpy over index lists (no torch), deterministic (ties broken by index), so
every rank plans the same micro-batches from the same lengths.

Run: `python -m pytest tests/test_batching.py -q`.
"""
from __future__ import annotations

import bisect
import heapq

import numpy as np

# micro-batches as lists of sample indices
Bins = list[list[int]]


def bin_loads(bins: Bins, lengths: list[int]) -> list[int]:
    return [sum(lengths[i] for i in b) for b in bins]


# (heaviest, heaviest − lightest)
def quality(bins: Bins, lengths: list[int]) -> tuple[int, int]:
    loads = bin_loads(bins, lengths)
    return max(loads), max(loads) - min(loads)


def first_fit_decreasing(idx: list[int], lengths: list[int], cap: int, max_bins: int | None) -> Bins | None:
    """FFD over `idx` (all <= cap). With max_bins, return None if an item fits in none of them."""
    # room left per bin
    room = np.full(len(idx) if max_bins is None else max_bins, cap, dtype=np.int64)
    bins: Bins = []
    for i in sorted(idx, key=lambda i: (-lengths[i], i)):
        fits = room >= lengths[i]
        # first bin with room; numpy keeps this O(n·bins) scan in C
        j = int(fits.argmax())
        if not fits[j]:
            return None
        if j == len(bins):
            bins.append([])
        bins[j].append(i)
        room[j] -= lengths[i]
    return bins


def lpt(idx: list[int], lengths: list[int], k: int) -> Bins:
    """Longest processing time first: each sample (longest first) into the lightest bucket."""
    # (load, n_items, bucket): empty buckets are filled first
    heap = [(0, 0, j) for j in range(k)]
    bins: Bins = [[] for _ in range(k)]
    for i in sorted(idx, key=lambda i: (-lengths[i], i)):
        load, n, j = heapq.heappop(heap)
        bins[j].append(i)
        heapq.heappush(heap, (load + lengths[i], n + 1, j))
    return bins


def fill_empty(bins: Bins, lengths: list[int]) -> Bins:
    """Give every empty bucket the lightest sample of a bucket holding several (removal never breaks a
    cap)."""
    for b in bins:
        if not b:
            donor = max((d for d in bins if len(d) > 1), key=len)
            lightest = min(donor, key=lambda i: lengths[i])
            donor.remove(lightest)
            b.append(lightest)
    return bins


def best_transfer(src: tuple[list[int], list[int]], dst: tuple[list[int], list[int]], gap: int):
    """Best move (x from src) or swap (x↔y) shifting d = x − y ∈ (0, gap) tokens from src to dst.

    src/dst: (sorted lengths, aligned sample ids). Returns (score, x, y) as positions in src/dst, with
    score = |gap − 2d| (smaller = more even pair); x is None when no transfer strictly helps.
    """
    # d = 0 or d = gap would only swap the two loads: not an improvement
    best = (gap, None, None)
    src_lens, dst_lens = src[0], dst[0]
    for px, lx in enumerate(src_lens):
        if len(src_lens) > 1 and 0 < lx < gap and abs(gap - 2 * lx) < best[0]:
            best = (abs(gap - 2 * lx), px, None)
        # swap partner nearest the ideal y = x − gap/2
        pos = bisect.bisect_left(dst_lens, lx - gap / 2)
        for p in (pos - 1, pos):
            if 0 <= p < len(dst_lens):
                d = lx - dst_lens[p]
                if 0 < d < gap and abs(gap - 2 * d) < best[0]:
                    best = (abs(gap - 2 * d), px, p)
    return best


def local_search(bins: Bins, lengths: list[int], max_rounds: int = 100_000) -> Bins:
    """Moves/swaps from the heaviest bucket (else into the lightest) until neither helps.

    Every accepted step moves d ∈ (0, gap) tokens from a heavier bucket to a lighter one, so the sum of
    squared loads strictly falls (terminates), no bucket empties, and the heaviest load never rises (a
    feasible partition stays feasible). Partners are tried lightest-first (resp. heaviest-first) and the
    first pair that can improve is taken: cheap rounds, same stopping criterion.
    """
    def take(j, p):
        return bins_[j][0].pop(p), bins_[j][1].pop(p)

    def put(j, item):
        p = bisect.bisect_left(bins_[j][0], item[0])
        bins_[j][0].insert(p, item[0])
        bins_[j][1].insert(p, item[1])

    bins_ = []
    for b in bins:
        b = sorted(b, key=lambda i: lengths[i])
        bins_.append(([lengths[i] for i in b], b))
    loads = [sum(lens) for lens, _ in bins_]
    for _ in range(max_rounds):
        order = sorted(range(len(bins_)), key=lambda j: loads[j])
        h, lo = order[-1], order[0]
        if loads[h] - loads[lo] <= 1:
            # integer loads: already as even as possible
            break
        step = None
        for s, t in [(h, j) for j in order[:-1]] + [(j, lo) for j in reversed(order[1:])]:
            if loads[s] > loads[t]:
                _, px, py = best_transfer(bins_[s], bins_[t], loads[s] - loads[t])
                if px is not None:
                    step = (s, t, px, py)
                    break
        if step is None:
            break
        s, t, px, py = step
        y = take(t, py) if py is not None else None
        x = take(s, px)
        put(t, x)
        if y is not None:
            put(s, y)
        d = x[0] - (y[0] if y is not None else 0)
        loads[s] -= d
        loads[t] += d
    return [ids for _, ids in bins_]


def balanced(idx: list[int], lengths: list[int], k: int, cap: int) -> Bins | None:
    """Best capped, non-empty k-partition of idx among LPT / FFD-into-k (each polished), or None."""
    candidates = [lpt(idx, lengths, k)]
    ffd = first_fit_decreasing(idx, lengths, cap, max_bins=k)
    if ffd is not None:
        candidates.append(ffd + [[] for _ in range(k - len(ffd))])
    best = None
    for bins in candidates:
        bins = local_search(fill_empty(bins, lengths), lengths)
        if max(bin_loads(bins, lengths)) <= cap and (best is None or quality(bins, lengths) <
                                                  quality(best, lengths)):
            best = bins
    return best


def split_heaviest(bins: Bins, lengths: list[int], k: int) -> Bins:
    """Reach k buckets by halving (LPT into two) the heaviest bucket that holds >= 2 samples."""
    bins = [list(b) for b in bins]
    while len(bins) < k:
        j = max((j for j in range(len(bins)) if len(bins[j]) > 1),
                key=lambda j: sum(lengths[i] for i in bins[j]))
        bins[j:j + 1] = lpt(bins[j], lengths, 2)
    return bins
