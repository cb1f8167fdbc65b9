"""Tests for tasks/reshard.py: plans from counts, byte-range builds, shuffle, reruns, completeness."""

from __future__ import annotations

import hashlib
import os
import pickle
from collections import Counter

import numpy as np
import pytest

from tasks.ledger import LedgerRow, read_ledger, write_ledger
from tasks.reshard import (
    INCOMPLETE,
    InputShard,
    OutputPlan,
    build_output,
    census_input,
    plan_reshard,
)
from tasks.shards import ShardError, ShardWriter, iter_samples
from tasks.storage import Storage

COUNTS = (7, 0, 13, 5)


def sample_members(source: str, row: int) -> dict[str, bytes]:
    rng = np.random.default_rng([int(source[3:]), row])
    jpg = rng.integers(0, 256, int(rng.integers(1, 3000)), dtype=np.uint8).tobytes()
    return {"jpg": jpg, "txt": f"caption {source} {row}".encode(), "json": f'{{"row": {row}}}'.encode()}


def make_input(storage: Storage, index: int, ok: int, *, drop: dict[int, str] | None = None) -> tuple[str, str, dict]:
    """An input shard with ``ok`` ok samples and a rejected row after every third one.

    ``drop`` maps an ok sample's number to an extension left out of it (an incomplete sample).
    Returns (tar, ledger, {key: members}).
    """
    source = f"src{index}"
    tar, ledger = f"in/{index:03d}.tar", f"in/{index:03d}.ledger.parquet"
    rows, written = [], {}
    with storage.atomic_writer(tar) as fh, ShardWriter(fh) as writer:
        row = 0
        for n in range(ok):
            key = f"{source}-{row:06d}"
            members = sample_members(source, row)
            if drop and n in drop:
                del members[drop[n]]
            rec = writer.write_sample(key, members)
            written[key] = members
            digest = hashlib.sha256(members["jpg"]).hexdigest()
            rows.append(
                LedgerRow(key=key, source=source, row=row, shard=tar, bytes=len(members["jpg"]), sha256=digest,
                          offset=rec.offset, length=rec.length, members=rec.members_as_dicts())
            )
            row += 1
            if n % 3 == 2:  # a rejected row: in the ledger, not in the tar
                rows.append(LedgerRow(key=f"{source}-{row:06d}", source=source, row=row, reason="too_large"))
                row += 1
    write_ledger(storage, ledger, rows)
    return tar, ledger, written


@pytest.fixture
def dataset(tmp_path):
    storage = Storage(str(tmp_path / "root"))
    inputs, members = [], {}
    for i, n in enumerate(COUNTS):
        tar, ledger, written = make_input(storage, i, n)
        inputs.append(InputShard(tar, ledger, n))
        members.update(written)
    return storage, inputs, members


def build_all(storage, plan, **kw):
    return [build_output(storage, out, **kw) for out in plan.outputs]


def read_keys(storage, tar):
    with storage.open(tar, "rb") as fh:
        return [s.key for s in iter_samples(fh, required=("jpg", "txt", "json"))]


def test_uneven_inputs_make_equal_outputs_with_the_tail_recorded(dataset):
    storage, inputs, members = dataset
    plan = plan_reshard(inputs, 10, prefix="ds/reshard")
    assert (plan.total, plan.tail) == (25, 5)
    assert [o.samples for o in plan.outputs] == [10, 10, 5]
    results = build_all(storage, plan)
    assert [r.samples for r in results] == [10, 10, 5]
    assert [r.tar for r in results] == [f"ds/reshard/{plan.digest[:12]}/shard-{j:06d}.tar" for j in range(3)]

    # every input sample exactly once, in dataset order without a seed
    keys = [k for r in results for k in read_keys(storage, r.tar)]
    assert keys == list(members)
    for r in results:
        data = storage.read_bytes(r.tar)
        assert hashlib.sha256(data).hexdigest() == r.sha256
        assert len(data) == r.bytes
        with storage.open(r.tar, "rb") as fh:
            for sample in iter_samples(fh):
                assert sample.members == members[sample.key]
        # the records and the ledger locate every member in the new tar
        ledger = read_ledger(storage, r.ledger).to_pylist()
        assert [row["key"] for row in ledger] == [rec.key for rec in r.records]
        for row, rec in zip(ledger, r.records):
            assert (row["status"], row["reason"], row["shard"]) == ("ok", None, r.tar)
            assert (row["offset"], row["length"]) == (rec.offset, rec.length)
            assert row["input_shard"] == inputs[int(row["source"][3:])].tar
            assert row["sha256"] == hashlib.sha256(members[row["key"]]["jpg"]).hexdigest()
            for m in row["members"]:
                ext = m["name"].split(".", 1)[1]
                assert data[m["offset"] : m["offset"] + m["size"]] == members[row["key"]][ext]


def test_outputs_read_back_with_webdataset(dataset):
    import webdataset as wds

    storage, inputs, members = dataset
    results = build_all(storage, plan_reshard(inputs, 10, prefix="ds/reshard"))
    got = []
    for r in results:
        for s in wds.WebDataset(storage.url(r.tar), shardshuffle=False):
            got.append(s["__key__"])
            assert {ext: s[ext] for ext in ("jpg", "txt", "json")} == members[s["__key__"]]
    assert got == list(members)


def test_rerun_converges_same_names_and_skipped(dataset):
    storage, inputs, _ = dataset
    first = build_all(storage, plan_reshard(inputs, 10, prefix="ds/reshard"))
    mtimes = [os.stat(storage.path(r.tar)).st_mtime_ns for r in first]
    plan = plan_reshard(list(inputs), 10, prefix="ds/reshard")
    again = build_all(storage, plan)
    assert [r.tar for r in again] == [r.tar for r in first]
    assert all(r.skipped for r in again) and not any(r.skipped for r in first)
    assert [(r.samples, r.bytes, r.sha256, r.records) for r in again] == [(r.samples, r.bytes, r.sha256, r.records) for r in first]
    assert [os.stat(storage.path(r.tar)).st_mtime_ns for r in again] == mtimes
    # a different N, seed or set of inputs is a different plan under different names
    assert plan_reshard(inputs, 9, prefix="ds/reshard").digest != plan.digest
    assert plan_reshard(inputs, 10, prefix="ds/reshard", seed=0).digest != plan.digest
    assert plan_reshard(inputs[:3], 10, prefix="ds/reshard").digest != plan.digest


def test_crash_before_the_ledger_rebuilds_the_output(dataset):
    storage, inputs, _ = dataset
    plan = plan_reshard(inputs, 10, prefix="ds/reshard")
    first = build_output(storage, plan.outputs[1])
    storage.rm(first.ledger)  # as if the task died between the tar and the ledger
    again = build_output(storage, plan.outputs[1])
    assert not again.skipped
    assert (again.sha256, again.records) == (first.sha256, first.records)


def test_seeded_shuffle_is_deterministic_and_a_permutation(dataset):
    storage, inputs, members = dataset

    def order(seed, prefix):
        plan = plan_reshard(inputs, 10, prefix=prefix, seed=seed)
        assert [o.samples for o in plan.outputs] == [10, 10, 5]
        results = build_all(storage, plan)
        return [[k for k in read_keys(storage, r.tar)] for r in results], results

    a, ra = order(1, "a")
    b, rb = order(1, "b")
    c, _ = order(2, "c")
    assert a == b
    assert [r.sha256 for r in ra] == [r.sha256 for r in rb]
    assert a != c
    for shards in (a, c):
        flat = [k for shard in shards for k in shard]
        assert sorted(flat) == sorted(members) and len(flat) == len(members)
        assert flat != list(members)
    # the order within an output follows the permutation, not the inputs' order
    assert any(shard != sorted(shard) for shard in a)
    # bytes are still exact after the shuffle
    for r in ra:
        with storage.open(r.tar, "rb") as fh:
            for sample in iter_samples(fh):
                assert sample.members == members[sample.key]


class RecordingStorage(Storage):
    def __init__(self, root):
        super().__init__(root)
        self.opened: list[str] = []

    def open(self, rel, mode="rb"):
        if "r" in mode:
            self.opened.append(rel)
        return super().open(rel, mode)


def test_an_output_opens_only_the_inputs_it_needs(dataset):
    storage, inputs, _ = dataset
    plan = plan_reshard(inputs, 10, prefix="ds/reshard")
    recording = RecordingStorage(storage.root)
    build_output(recording, plan.outputs[0])  # positions 0..9: inputs 0 (7) and 2 (3)
    assert set(recording.opened) == {inputs[0].tar, inputs[0].ledger, inputs[2].tar, inputs[2].ledger}
    recording.opened.clear()
    build_output(recording, plan.outputs[2])  # positions 20..24: input 3 only
    assert set(recording.opened) == {inputs[3].tar, inputs[3].ledger}
    assert plan.outputs[2].inputs == (inputs[3],)
    # each input tar is opened once, not once per sample
    recording.opened.clear()
    storage.rm(plan.outputs[1].ledger)
    build_output(recording, plan.outputs[1])
    assert Counter(recording.opened)[inputs[2].tar] == 1


class UnmappableStorage(Storage):
    """Files without a file descriptor, as on an object store: inputs are read, not mapped."""

    def __init__(self, root):
        super().__init__(root)
        self.reads: list[int] = []

    def open(self, rel, mode="rb"):
        fh = super().open(rel, mode)
        if "r" not in mode or not rel.endswith(".tar"):
            return fh
        reads = self.reads

        class NoFileno:
            def read(self, n=-1):
                data = fh.read(n)
                reads.append(len(data))
                return data

            def __getattr__(self, name):
                if name == "fileno":
                    raise AttributeError(name)
                return getattr(fh, name)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                fh.close()

        return NoFileno()


def test_read_path_matches_the_mapped_path(dataset):
    storage, inputs, _ = dataset
    unmapped = UnmappableStorage(storage.root)
    for seed in (None, 4):
        mapped = build_all(storage, plan_reshard(inputs, 10, prefix="m", seed=seed))
        for window in (1, 2_000, 1 << 26):
            read = build_all(unmapped, plan_reshard(inputs, 10, prefix=f"r{window}", seed=seed), window_bytes=window)
            assert [r.sha256 for r in read] == [r.sha256 for r in mapped]
            assert [r.records for r in read] == [r.records for r in mapped]
        # memory: with a window smaller than any sample, one sample is read at a time
        unmapped.reads.clear()
        build_all(unmapped, plan_reshard(inputs, 10, prefix="small", seed=seed), window_bytes=1)
        largest = max(rec.length for r in mapped for rec in r.records)
        assert len(unmapped.reads) == 25 and max(unmapped.reads) <= largest
        # unshuffled, a big window reads each input's run of samples at once
        if seed is None:
            unmapped.reads.clear()
            build_all(unmapped, plan_reshard(inputs, 10, prefix="big", seed=seed))
            assert len(unmapped.reads) == 4  # input 0; input 2 twice (two outputs); input 3


@pytest.mark.slow
def test_s3_storage(dataset, s3_bucket):
    storage, inputs, members = dataset
    bucket, options = s3_bucket
    s3 = Storage(f"s3://{bucket}/root", options)
    for s in inputs:
        s3.write_bytes(s.tar, storage.read_bytes(s.tar))
        s3.write_bytes(s.ledger, storage.read_bytes(s.ledger))
    local = build_all(storage, plan_reshard(inputs, 10, prefix="ds/reshard", seed=9))
    remote = build_all(s3, plan_reshard(inputs, 10, prefix="ds/reshard", seed=9))
    assert [r.sha256 for r in remote] == [r.sha256 for r in local]
    assert [hashlib.sha256(s3.read_bytes(r.tar)).hexdigest() for r in remote] == [r.sha256 for r in local]
    assert all(r.skipped for r in build_all(s3, plan_reshard(inputs, 10, prefix="ds/reshard", seed=9)))


def test_small_windows_give_the_same_bytes(dataset):
    storage, inputs, _ = dataset
    for seed in (None, 3):
        whole = build_all(storage, plan_reshard(inputs, 10, prefix="w1", seed=seed))
        tiny = build_all(storage, plan_reshard(inputs, 10, prefix="w2", seed=seed), window_bytes=1)
        assert [r.sha256 for r in tiny] == [r.sha256 for r in whole]
        assert [r.records for r in tiny] == [r.records for r in whole]


def test_incomplete_samples_get_a_reason_and_outputs_stay_full(tmp_path):
    storage = Storage(str(tmp_path / "root"))
    censuses, kept, all_ok = [], [], []
    for i, (n, drop) in enumerate([(8, {2: "txt"}), (6, {}), (9, {0: "json", 5: "txt"})]):
        tar, ledger, written = make_input(storage, i, n, drop=drop)
        census = census_input(storage, tar, ledger)
        assert census.ok == n and census.shard.count == n - len(drop)
        censuses.append(census)
        all_ok += list(written)
        kept += [k for k, m in written.items() if {"jpg", "txt", "json"} <= set(m)]
    incomplete = [r for c in censuses for r in c.incomplete.to_pylist()]
    assert [(r["key"], r["status"], r["reason"]) for r in incomplete] == [
        ("src0-000002", "rejected", INCOMPLETE),
        ("src2-000000", "rejected", INCOMPLETE),
        ("src2-000006", "rejected", INCOMPLETE),
    ]
    assert incomplete[1]["detail"] == "missing member(s) ['json']"
    assert incomplete[0]["input_shard"] == censuses[0].shard.tar

    plan = plan_reshard([c.shard for c in censuses], 4, prefix="ds/reshard")
    results = build_all(storage, plan)
    assert [r.samples for r in results] == [4, 4, 4, 4, 4]
    carried = [k for r in results for k in read_keys(storage, r.tar)]
    assert carried == kept
    # nothing lost: every ok input row is carried or has a reason, once
    assert sorted(carried + [r["key"] for r in incomplete]) == sorted(all_ok)

    # a plan made from the raw ok counts is stale: the build refuses to make a short shard
    stale = plan_reshard([InputShard(c.shard.tar, c.shard.ledger, c.ok) for c in censuses], 4, prefix="stale")
    with pytest.raises(ValueError, match="stale reshard plan"):
        build_output(storage, stale.outputs[0])
    assert not storage.exists(stale.outputs[0].name)


def test_truncated_input_raises_a_shard_error(dataset):
    storage, inputs, _ = dataset
    plan = plan_reshard(inputs, 10, prefix="ds/reshard")
    data = storage.read_bytes(inputs[3].tar)
    storage.write_bytes(inputs[3].tar, data[: len(data) // 2])
    with pytest.raises(ShardError) as info:
        build_output(storage, plan.outputs[2])
    assert info.value.reason == "tar_truncated"
    assert not storage.exists(plan.outputs[2].name) and not storage.exists(plan.outputs[2].ledger)


def test_output_plans_pickle_small():
    inputs = [InputShard(f"in/{i:06d}.tar", f"in/{i:06d}.ledger.parquet", 100) for i in range(1000)]
    plan = plan_reshard(inputs, 500, prefix="p", seed=5)
    out = plan.outputs[3]
    back = pickle.loads(pickle.dumps(out))
    assert isinstance(back, OutputPlan) and back == out
    assert [a.tolist() for a in back.selection()] == [a.tolist() for a in out.selection()]
    assert len(pickle.dumps(out)) < 200_000  # its own inputs only, not the whole dataset


def test_empty_and_invalid_plans():
    plan = plan_reshard([InputShard("a.tar", "a.parquet", 0)], 10, prefix="p")
    assert (plan.total, plan.tail, plan.outputs) == (0, 0, ())
    with pytest.raises(ValueError):
        plan_reshard([], 0, prefix="p")
    with pytest.raises(ValueError):
        plan_reshard([InputShard("a.tar", "a.parquet", -1)], 10, prefix="p")


def _check_covers(plan, counts):
    """Every (input, position) exactly once across the outputs."""
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    index = {s.tar: i for i, s in enumerate(plan.inputs)}
    flat = []
    for out in plan.outputs:
        slots, positions = out.selection()
        assert len(slots) == out.samples
        glob = np.array([index[s.tar] for s in out.inputs], np.int64)[slots]
        flat.append(starts[glob] + positions)
    seen = np.bincount(np.concatenate(flat), minlength=int(counts.sum()))
    assert len(seen) == counts.sum() and (seen == 1).all()


def test_planning_ten_thousand_inputs():
    counts = np.full(10_000, 1_000, np.int64)
    counts[::7] = 999  # uneven
    inputs = [InputShard(f"in/{i:06d}.tar", f"in/{i:06d}.ledger.parquet", int(c)) for i, c in enumerate(counts)]
    total = int(counts.sum())
    plan = plan_reshard(inputs, 1_000, prefix="big")
    assert plan.total == total and len(plan.outputs) == -(-total // 1_000)
    assert plan.tail == total % 1_000 and plan.outputs[-1].samples == plan.tail
    assert all(o.samples == 1_000 for o in plan.outputs[:-1])
    # the ranges tile the inputs
    ranges = [(o.inputs[slot].tar, a, b) for o in plan.outputs for slot, a, b in o.ranges]
    assert sum(b - a for _, a, b in ranges) == total
    assert ranges[0] == ("in/000000.tar", 0, 999) and ranges[-1][2] == 1_000

    # shuffled: the same 10,000 inputs at a tenth of the samples (the full size is in the bench)
    small = counts // 10
    inputs = [InputShard(s.tar, s.ledger, int(c)) for s, c in zip(inputs, small)]
    shuffled = plan_reshard(inputs, 1_000, prefix="big", seed=11)
    assert shuffled.total == int(small.sum()) and shuffled.tail == int(small.sum()) % 1_000
    _check_covers(shuffled, small)


def test_small_plans_cover_every_position():
    rng = np.random.default_rng(0)
    for trial in range(20):
        counts = rng.integers(0, 30, int(rng.integers(1, 12)))
        inputs = [InputShard(f"t{trial}/{i}.tar", f"t{trial}/{i}.parquet", int(c)) for i, c in enumerate(counts)]
        n = int(rng.integers(1, 40))
        for seed in (None, trial):
            plan = plan_reshard(inputs, n, prefix="p", seed=seed)
            sizes = [o.samples for o in plan.outputs]
            assert sum(sizes) == counts.sum()
            assert all(s == n for s in sizes[:-1]) and (not sizes or 1 <= sizes[-1] == plan.tail <= n)
            if counts.sum():
                _check_covers(plan, counts)
