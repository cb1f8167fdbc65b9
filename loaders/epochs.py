"""Epoch plans: which samples each rank reads, with equal counts per rank and seeded shard shuffles."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

EVEN = ("drop", "pad")


@dataclass(frozen=True)
class EpochPlan:
    """Which samples each (rank, worker) slot reads in one epoch.

    Args:
        per_slot: samples every slot yields (the same for all, so ranks never wait on each other).
        slots: for slot ``rank * num_workers + worker``, its ``(shard index, start, stop)``
            ranges in reading order.
        dropped: samples of the release left out this epoch (``even="drop"``).
        repeated: samples read twice this epoch to fill the last slots (``even="pad"``).
    """

    per_slot: int
    slots: tuple[tuple[tuple[int, int, int], ...], ...]
    dropped: int
    repeated: int


def _shard_order(n: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    if not shuffle:
        return list(range(n))
    import numpy as np

    return [int(i) for i in np.random.default_rng([seed, epoch, 0]).permutation(n)]


def plan_epoch(
    counts: Sequence[int],
    *,
    world_size: int,
    num_workers: int,
    epoch: int = 0,
    seed: int = 0,
    shuffle: bool = True,
    even: str = "drop",
) -> EpochPlan:
    """Split one epoch's samples into ``world_size * num_workers`` slots of equal size.

    The shards, in an order shuffled by ``(seed, epoch)``, are laid end to end as one sequence
    of samples; slot ``s`` reads the ``s``-th run of ``per_slot`` consecutive samples. Most
    slots read whole shards; a shard cut at a slot boundary is read from a seek to the cut
    (its byte offset comes from the DALI index). With ``even="drop"``, ``per_slot = total //
    slots`` and the tail of the sequence (fewer samples than slots) is left out: a different
    tail each epoch, since the shard order changes. With ``even="pad"``, ``per_slot =
    ceil(total / slots)`` and the sequence wraps around to its start to fill the last slots.
    """
    if world_size < 1 or num_workers < 1:
        raise ValueError(f"world_size ({world_size}) and num_workers ({num_workers}) must be >= 1")
    if even not in EVEN:
        raise ValueError(f"even={even!r}: use one of {EVEN}")
    total = sum(counts)
    n_slots = world_size * num_workers
    per_slot = total // n_slots if even == "drop" else -(-total // n_slots)
    if per_slot == 0:
        raise ValueError(f"{total} samples cannot give each of {n_slots} rank x worker slots at least one")
    order = _shard_order(len(counts), seed, epoch, shuffle)
    # The sequence as (shard, start, stop) pieces; "pad" appends it again as often as the wrap
    # needs (more than once where there are more slots than samples).
    pieces = [(i, 0, counts[i]) for i in order if counts[i]]
    if even == "pad":
        pieces = pieces * -(-(n_slots * per_slot) // total)
    slots = []
    piece, pos = 0, 0  # pos: next unread sample within pieces[piece]
    for _ in range(n_slots):
        need = per_slot
        ranges = []
        while need:
            shard, start, stop = pieces[piece]
            take = min(need, stop - start - pos)
            ranges.append((shard, start + pos, start + pos + take))
            need -= take
            pos += take
            if start + pos == stop:
                piece, pos = piece + 1, 0
        slots.append(tuple(ranges))
    used = n_slots * per_slot
    return EpochPlan(
        per_slot=per_slot,
        slots=tuple(slots),
        dropped=max(0, total - used),
        repeated=max(0, used - total),
    )
