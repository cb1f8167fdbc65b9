"""Fine-tuning releases in training: the online packer keeps budget and image cap and loses nothing."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from release_fixtures import TILE, finetuning_release


def _synthetic(lengths):
    return [
        {"key": f"k{i}", "record": {"key": f"k{i}", "images": []}, "members": {}, "tokens": t, "images": n}
        for i, (t, n) in enumerate(lengths)
    ]


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(1, 100), st.integers(0, 3)), max_size=80),
    buffer_size=st.integers(1, 16),
    queue_size=st.integers(1, 8),
)
def test_online_packer_never_exceeds_budget_or_cap_and_loses_nothing(lengths, buffer_size, queue_size):
    from loaders.packing import OnlinePacker

    samples = _synthetic(lengths)
    packs = list(OnlinePacker(samples, 100, 3, buffer_size=buffer_size, queue_size=queue_size))
    keys = [r["key"] for p in packs for r in p["samples"]]
    assert sorted(keys) == sorted(s["key"] for s in samples)  # each exactly once
    for p in packs:
        assert 0 < p["tokens"] <= 100 and p["images"] <= 3
        assert p["cu_seqlens"][0] == 0 and p["cu_seqlens"][-1] == p["tokens"]
        assert len(p["cu_seqlens"]) == len(p["samples"]) + 1


def test_online_packer_oversize_samples_raise_or_are_skipped_by_name():
    from loaders.packing import OnlinePacker

    samples = _synthetic([(10, 0), (120, 0), (5, 5), (20, 1)])
    with pytest.raises(ValueError, match="'k1' has 120 tokens"):
        list(OnlinePacker(samples, 100, 3))
    packer = OnlinePacker(samples, 100, 3, oversize="skip")
    assert [r["key"] for p in packer for r in p["samples"]] == ["k0", "k3"]
    assert packer.skipped == ["k1", "k2"]


def test_online_packer_passes_source_errors_on_and_stops_its_thread():
    from loaders.packing import OnlinePacker

    def broken():
        yield from _synthetic([(10, 0)] * 3)
        raise OSError("disk gone")

    before = threading.active_count()
    with pytest.raises(OSError, match="disk gone"):
        list(OnlinePacker(broken(), 100, 3, buffer_size=8))
    endless = (
        {"key": f"k{i}", "record": {"key": f"k{i}"}, "members": {}, "tokens": 30, "images": 0} for i in range(10**9)
    )
    it = iter(OnlinePacker(endless, 100, 3, queue_size=4, num_packs=5))
    assert len(list(it)) == 5
    assert threading.active_count() == before


def test_online_packer_over_a_release_with_equal_packs_per_rank(tmp_path):
    from loaders.packing import OnlinePacker, collate_packs, finetuning_samples
    from loaders.release import open_release

    url, records = finetuning_release(str(tmp_path), [20, 17])
    rel = open_release(url)
    assert rel.kind == "finetuning" and not rel.packed and rel.samples == 37
    every = []
    for rank in range(2):
        src = finetuning_samples(rel, rank=rank, world_size=2, seed=1, even="pad")
        packs = list(OnlinePacker(src, 300, 4, buffer_size=8))
        every += [r["key"] for p in packs for r in p["samples"]]
        for p in packs:
            assert p["tokens"] <= 300 and p["images"] <= 4
        batch = collate_packs(packs[:3], tile_size=TILE)
        n_tiles = sum(len(img["tile_members"]) for p in packs[:3] for r in p["samples"] for img in r["images"])
        assert batch["pixel_values"].shape == (n_tiles, 3, TILE, TILE)
        assert batch["position_ids"].shape == batch["segment_ids"].shape == (3, 300)
        cu = batch["cu_seqlens"].tolist()
        assert cu[0] == 0 and cu[-1] == 3 * 300 and cu == sorted(cu)
        first = packs[0]
        for s, (lo, hi) in enumerate(zip(first["cu_seqlens"], first["cu_seqlens"][1:])):
            assert batch["segment_ids"][0, lo:hi].eq(s).all() and batch["position_ids"][0, lo] == 0
        assert batch["segment_ids"][0, first["tokens"] :].eq(-1).all()
    assert set(every) == {r["key"] for r in records}  # pad mode: all read, 37 % 2 read twice
    assert len(every) == 38


def test_offline_packed_release_reads_as_packs(tmp_path):
    from loaders.packing import collate_packs, packed_dataset
    from loaders.release import open_release

    url, records = finetuning_release(str(tmp_path), [9, 9], packed_budget=300)
    rel = open_release(url)
    assert rel.packed and rel.schema["budget"] == 300
    packs = list(packed_dataset(rel, rank=0, world_size=1, shuffle=False))
    assert len(packs) == rel.samples
    assert [r["key"] for p in packs for r in p["samples"]] == [r["key"] for r in records]
    for p in packs:
        assert p["tokens"] <= 300 and p["cu_seqlens"][-1] == p["tokens"]
        for r in p["samples"]:
            for img in r["images"]:
                assert img["member"] in p["members"] and all(m in p["members"] for m in img["tile_members"])
    batch = collate_packs(packs, tile_size=TILE)
    assert batch["tokens"].tolist() == [p["tokens"] for p in packs]
    assert batch["keys"] == [[r["key"] for r in p["samples"]] for p in packs]
