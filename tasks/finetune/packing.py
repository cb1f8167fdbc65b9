"""Constrained padding and multimodal packing under a token budget with image and tile caps."""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tasks.formats.recipe_finetune import PackingConfig, PaddingConfig

_NO_CAP = 1 << 62
_PROBES = 32  # packs the balanced packer tries (least loaded first) before opening a new one


class PackingError(ValueError):
    """An item no pack can hold (over the budget or a cap); padding must cut it off first."""


@dataclass(frozen=True)
class PackStats:
    """How well packs use their budget.

    Args:
        packs: number of packs.
        samples: samples packed.
        tokens: useful tokens over all packs.
        fill_ratio: ``tokens / (packs * budget)``.
        max_tokens, max_images, max_tiles: the fullest pack in each dimension.
    """

    packs: int
    samples: int
    tokens: int
    fill_ratio: float
    max_tokens: int
    max_images: int
    max_tiles: int


def _caps(n: int, images: Sequence[int] | None, tiles: Sequence[int] | None) -> tuple[list[int], list[int]]:
    img = [0] * n if images is None else [int(x) for x in images]
    til = [0] * n if tiles is None else [int(x) for x in tiles]
    if len(img) != n or len(til) != n:
        raise ValueError("tokens, images and tiles must have the same length")
    return img, til


def _check_items(tok: list[int], img: list[int], til: list[int], budget: int, max_images: int, max_tiles: int) -> None:
    for i, (t, m, k) in enumerate(zip(tok, img, til)):
        if t < 0 or m < 0 or k < 0:
            raise PackingError(f"item {i}: negative size ({t} tokens, {m} images, {k} tiles)")
        if t > budget or m > max_images or k > max_tiles:
            raise PackingError(
                f"item {i} cannot fit any pack: {t} tokens (budget {budget}), {m} images (cap {max_images}), {k} tiles (cap {max_tiles})"
            )


def _items(
    tokens: Sequence[int],
    budget: int,
    images: Sequence[int] | None,
    max_images: int | None,
    tiles: Sequence[int] | None,
    max_tiles: int | None,
) -> tuple[list[int], list[int], list[int], int, int]:
    """(tokens, images, tiles) per item and the (image, tile) caps, once every item is known to fit a pack."""
    tok = [int(x) for x in tokens]
    img, til = _caps(len(tok), images, tiles)
    cap_img = _NO_CAP if max_images is None else max_images
    cap_til = _NO_CAP if max_tiles is None else max_tiles
    _check_items(tok, img, til, budget, cap_img, cap_til)
    return tok, img, til, cap_img, cap_til


def _order(tok: list[int]) -> list[int]:
    # Longest first; ties by index so the plan is deterministic.
    return sorted(range(len(tok)), key=lambda i: (-tok[i], i))


def pack_balanced_greedy(
    tokens: Sequence[int],
    budget: int,
    images: Sequence[int] | None = None,
    max_images: int | None = None,
    tiles: Sequence[int] | None = None,
    max_tiles: int | None = None,
) -> list[list[int]]:
    """Balanced greedy knapsack: longest first, each into the least-loaded pack that fits.

    Starts with ``ceil(total / budget)`` empty packs, the lower bound, so loads stay even;
    an item that fits none of the least-loaded packs it tries opens a new one. Returns packs
    as lists of item indices, each pack in insertion (longest first) order.
    """
    tok, img, til, cap_img, cap_til = _items(tokens, budget, images, max_images, tiles, max_tiles)
    if not tok:
        return []
    n_start = max(1, math.ceil(sum(tok) / budget))
    packs: list[list[int]] = [[] for _ in range(n_start)]
    load_img = [0] * n_start
    load_til = [0] * n_start
    heap = [(0, j) for j in range(n_start)]  # (token load, pack); ties to the older pack
    for i in _order(tok):
        t, m, k = tok[i], img[i], til[i]
        tried: list[tuple[int, int]] = []
        chosen = None
        while heap and len(tried) < _PROBES:
            load, j = heapq.heappop(heap)
            if load + t > budget:
                # The least-loaded pack cannot take it, so no other pack can either.
                tried.append((load, j))
                break
            if load_img[j] + m <= cap_img and load_til[j] + k <= cap_til:
                chosen = (load, j)
                break
            tried.append((load, j))
        for entry in tried:
            heapq.heappush(heap, entry)
        if chosen is None:
            j = len(packs)
            packs.append([])
            load_img.append(0)
            load_til.append(0)
            load = 0
        else:
            load, j = chosen
        packs[j].append(i)
        load_img[j] += m
        load_til[j] += k
        heapq.heappush(heap, (load + t, j))
    return [p for p in packs if p]


def pack_first_fit_decreasing(
    tokens: Sequence[int],
    budget: int,
    images: Sequence[int] | None = None,
    max_images: int | None = None,
    tiles: Sequence[int] | None = None,
    max_tiles: int | None = None,
) -> list[list[int]]:
    """First-fit decreasing: longest first, each into the first pack (oldest) that fits all limits.

    A segment tree over the packs' remaining room (tokens, images, tiles; max per subtree)
    finds the first fit in O(log packs) per item instead of scanning every pack.
    """
    tok, img, til, cap_img, cap_til = _items(tokens, budget, images, max_images, tiles, max_tiles)
    n = len(tok)
    if not n:
        return []
    size = 1
    while size < n:
        size *= 2
    # Unused leaves have full room, so the leftmost fit is an open pack or the next new one.
    rt = [budget] * (2 * size)
    ri = [cap_img] * (2 * size)
    rk = [cap_til] * (2 * size)
    packs: list[list[int]] = []
    for i in _order(tok):
        t, m, k = tok[i], img[i], til[i]
        stack = [1]
        leaf = -1
        while stack:
            v = stack.pop()
            if rt[v] < t or ri[v] < m or rk[v] < k:
                continue
            if v >= size:
                leaf = v
                break
            stack.append(2 * v + 1)
            stack.append(2 * v)
        j = leaf - size
        if j == len(packs):
            packs.append([])
        packs[j].append(i)
        rt[leaf] -= t
        ri[leaf] -= m
        rk[leaf] -= k
        v = leaf // 2
        while v:
            a, b = 2 * v, 2 * v + 1
            rt[v] = rt[a] if rt[a] > rt[b] else rt[b]
            ri[v] = ri[a] if ri[a] > ri[b] else ri[b]
            rk[v] = rk[a] if rk[a] > rk[b] else rk[b]
            v //= 2
    return packs


def pack(tokens: Sequence[int], images: Sequence[int], tiles: Sequence[int], cfg: PackingConfig) -> list[list[int]]:
    """Packs by the recipe's algorithm, budget and caps."""
    fn = pack_balanced_greedy if cfg.algorithm == "balanced_greedy" else pack_first_fit_decreasing
    return fn(tokens, cfg.budget, images, cfg.max_images, tiles, cfg.max_tiles)


def pack_stats(
    packs: list[list[int]],
    tokens: Sequence[int],
    budget: int,
    images: Sequence[int] | None = None,
    tiles: Sequence[int] | None = None,
) -> PackStats:
    img, til = _caps(len(tokens), images, tiles)
    per_tok = [sum(int(tokens[i]) for i in p) for p in packs]
    per_img = [sum(img[i] for i in p) for p in packs]
    per_til = [sum(til[i] for i in p) for p in packs]
    total = sum(per_tok)
    return PackStats(
        packs=len(packs),
        samples=sum(len(p) for p in packs),
        tokens=total,
        fill_ratio=round(total / (len(packs) * budget), 6) if packs else 0.0,
        max_tokens=max(per_tok, default=0),
        max_images=max(per_img, default=0),
        max_tiles=max(per_til, default=0),
    )


def cu_seqlens(lengths: Sequence[int]) -> list[int]:
    """Cumulative sample boundaries in a pack, ``[0, l1, l1+l2, ...]``, for per-sample attention masks."""
    out = [0]
    for n in lengths:
        out.append(out[-1] + int(n))
    return out


# --- padding ---------------------------------------------------------------------------------


def padding_cutoff(lengths: Sequence[int], cfg: PaddingConfig, budget: int | None = None) -> int:
    """The longest sample allowed: fixed, or a percentile of ``lengths`` capped by ``max_tokens``.

    Never above the packing budget. The percentile is an observed length (``higher``), so the
    sample at the percentile itself is kept.
    """
    cap = cfg.max_tokens if budget is None else min(cfg.max_tokens, budget)
    if cfg.cutoff == "fixed" or len(lengths) == 0:
        return cap
    value = int(np.percentile(np.asarray(lengths, dtype=np.int64), cfg.percentile, method="higher"))
    return max(1, min(cap, value))


def truncate_at_turns(turn_tokens: Sequence[int], cutoff: int) -> int:
    """How many turns to keep: the longest prefix of whole (human, gpt) exchanges within ``cutoff``.

    Returns 0 when not even the first exchange fits (the sample is dropped).
    """
    kept, total = 0, 0
    for j in range(0, len(turn_tokens) - 1, 2):
        pair = int(turn_tokens[j]) + int(turn_tokens[j + 1])
        if total + pair > cutoff:
            break
        total += pair
        kept = j + 2
    return kept


# --- baselines the report and the benchmark compare with --------------------------------------


def pad_to_longest_ratio(lengths: Sequence[int], batch_size: int) -> float:
    """Useful / computed tokens when consecutive batches are each padded to their longest sample
    (the last, partial batch only to its own size)."""
    arr = np.asarray(lengths, dtype=np.int64)
    if arr.size == 0:
        return 0.0
    computed = sum(
        int(arr[s : s + batch_size].max()) * arr[s : s + batch_size].size for s in range(0, arr.size, batch_size)
    )
    return round(int(arr.sum()) / computed, 6) if computed else 0.0


def fixed_drop_ratio(lengths: Sequence[int], limit: int) -> tuple[float, float]:
    """(fill ratio, dropped share) when samples over ``limit`` are dropped and the rest padded to it."""
    arr = np.asarray(lengths, dtype=np.int64)
    if arr.size == 0:
        return 0.0, 0.0
    kept = arr[arr <= limit]
    fill = float(kept.sum()) / (kept.size * limit) if kept.size else 0.0
    return round(fill, 6), round(1 - kept.size / arr.size, 6)
