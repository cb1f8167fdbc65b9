"""Dedup across the dataset: exact and near duplicates, the first by (source, row) wins."""

import random

import pyarrow as pa

from tasks.formats.recipe_download import DedupConfig
from tasks.stages.validate import DEDUP_COLUMNS, find_duplicates


def table(rows):
    cols = {c: [r.get(c) for r in rows] for c in DEDUP_COLUMNS}
    cols["status"] = [r.get("status", "ok") for r in rows]
    return pa.table(
        cols,
        schema=pa.schema(
            [
                ("key", pa.string()),
                ("source", pa.string()),
                ("row", pa.int64()),
                ("status", pa.string()),
                ("pixel_sha256", pa.string()),
                ("phash", pa.uint64()),
            ]
        ),
    )


def row(source, n, sha, phash, status="ok"):
    return {
        "key": f"{source}-{n:09d}",
        "source": source,
        "row": n,
        "pixel_sha256": sha,
        "phash": phash,
        "status": status,
    }


def test_exact_duplicates_point_at_the_first_by_source_order_then_row():
    a = table([row("b", 5, "x", 1), row("b", 2, "x", 2)])
    b = table([row("a", 9, "x", 3)])
    dups = find_duplicates([a, b], DedupConfig(near=False), {"a": 0, "b": 1})
    assert dups == {"b-000000005": "a-000000009", "b-000000002": "a-000000009"}


def test_near_duplicates_within_the_threshold():
    base = 0xF0F0F0F0F0F0F0F0
    near = base ^ 0b1011  # 3 bits differ
    far = base ^ 0xFFFF  # 16 bits differ
    t = table([row("s", 0, "h0", base), row("s", 1, "h1", near), row("s", 2, "h2", far)])
    assert find_duplicates([t], DedupConfig(hamming_threshold=4), {"s": 0}) == {"s-000000001": "s-000000000"}
    assert find_duplicates([t], DedupConfig(hamming_threshold=2), {"s": 0}) == {}
    assert find_duplicates([t], DedupConfig(near=False), {"s": 0}) == {}


def test_rejected_rows_are_not_candidates():
    t = table([row("s", 0, "x", 1, status="rejected"), row("s", 1, "x", 1)])
    assert find_duplicates([t], DedupConfig(), {"s": 0}) == {}


def test_band_index_finds_what_brute_force_finds():
    rng = random.Random(7)
    hashes = []
    for _ in range(60):
        h = rng.getrandbits(64)
        hashes.append(h)
        for _ in range(3):  # a few near copies of each, up to 6 bits away
            flips = rng.sample(range(64), rng.randint(0, 6))
            hashes.append(h ^ sum(1 << b for b in flips))
    rows = [row("s", i, f"sha{i}", h) for i, h in enumerate(hashes)]
    for t in (0, 3, 5):
        got = find_duplicates([table(rows)], DedupConfig(hamming_threshold=t, exact=False), {"s": 0})
        kept: list[tuple[int, str]] = []
        expected = {}
        for r in rows:
            first = next((k for h, k in kept if (h ^ r["phash"]).bit_count() <= t), None)
            if first is None:
                kept.append((r["phash"], r["key"]))
            else:
                expected[r["key"]] = first
        assert got == expected
