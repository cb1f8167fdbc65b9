"""Tests for the reshard: plans from counts, byte-range builds, shuffle, reruns, completeness, checks, the flow."""

from __future__ import annotations

import hashlib
import os
import pickle
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from tasks.formats.ledger import LedgerRow, read_ledger, write_ledger
from tasks.formats.shards import ShardWriter, iter_samples
from tasks.formats.storage import Storage
from tasks.formats.tar_reader import ShardError
from tasks.stages.reshard import (
    INCOMPLETE,
    InputShard,
    OutputPlan,
    census_input,
    count_inputs,
    group_outputs,
    plan_reshard,
)
from tasks.stages.reshard_build import build_output, build_outputs
from tasks.stages.reshard_check import Layout, check_file

COUNTS = (7, 0, 13, 5)


def sample_members(source: str, row: int) -> dict[str, bytes]:
    rng = np.random.default_rng([int(source[3:]), row])
    jpg = rng.integers(0, 256, int(rng.integers(1, 3000)), dtype=np.uint8).tobytes()
    return {"jpg": jpg, "txt": f"caption {source} {row}".encode(), "json": f'{{"row": {row}}}'.encode()}


def make_input(
    storage: Storage, index: int, ok: int, *, drop: dict[int, str] | None = None, tar_order: list[int] | None = None
) -> tuple[str, str, dict]:
    """An input shard with ``ok`` ok samples and a rejected row after every third one.

    ``drop`` maps an ok sample's number to an extension left out of it (an incomplete sample).
    ``tar_order`` writes the ok samples into the tar in that order of their numbers (as a
    download stores them as they complete); the ledger stays sorted by row.
    Returns (tar, ledger, {key: members}) with keys in ledger order.
    """
    source = f"src{index}"
    tar, ledger = f"in/{index:03d}.tar", f"in/{index:03d}.ledger.parquet"
    rows, written, samples = [], {}, []
    row = 0
    for n in range(ok):
        key = f"{source}-{row:06d}"
        members = sample_members(source, row)
        if drop and n in drop:
            del members[drop[n]]
        written[key] = members
        samples.append((row, key, members))
        row += 1
        if n % 3 == 2:  # a rejected row: in the ledger, not in the tar
            rows.append(LedgerRow(key=f"{source}-{row:06d}", source=source, row=row, reason="too_large"))
            row += 1
    with storage.atomic_writer(tar) as fh, ShardWriter(fh) as writer:
        for n in tar_order if tar_order is not None else range(ok):
            row, key, members = samples[n]
            rec = writer.write_sample(key, members)
            digest = hashlib.sha256(members["jpg"]).hexdigest()
            rows.append(
                LedgerRow(
                    key=key,
                    source=source,
                    row=row,
                    shard=tar,
                    bytes=len(members["jpg"]),
                    sha256=digest,
                    offset=rec.offset,
                    length=rec.length,
                    members=rec.members_as_dicts(),
                )
            )
    rows.sort(key=lambda r: r.row)
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
    assert [(r.samples, r.bytes, r.sha256, r.records) for r in again] == [
        (r.samples, r.bytes, r.sha256, r.records) for r in first
    ]
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


def test_a_task_commits_each_output_while_the_next_is_copied_and_a_failure_spares_the_others(dataset, monkeypatch):
    from tasks.formats.faults import FAULT_ENV

    storage, inputs, _ = dataset
    plan = plan_reshard(inputs, 10, prefix="ds/reshard")
    expected = build_all(storage, plan)
    for out in plan.outputs:
        storage.rm(out.ledger)
        storage.rm(out.name)
    # A full disk while the second output is written: the others are built and committed, the
    # error is raised after them, and nothing of the failed one is left behind.
    second = plan.outputs[1].name
    monkeypatch.setenv(FAULT_ENV, f"enospc:write:{second}")
    with pytest.raises(OSError, match="No space left on device"):
        build_outputs(storage, plan.outputs)
    committed = [out.index for out in plan.outputs if storage.exists(out.ledger)]
    assert committed == [out.index for out in plan.outputs if out.index != 1]
    assert not storage.exists(second) and not storage.exists(plan.outputs[1].ledger)
    assert list(Path(storage.path("ds/reshard")).rglob(".tmp-*")) == []
    monkeypatch.delenv(FAULT_ENV)
    # Each committed tar is the one a lone build makes; the rerun builds only the failed one.
    again = build_outputs(storage, plan.outputs)
    assert [r.skipped for r in again] == [out.index != 1 for out in plan.outputs]
    assert [(r.sha256, r.records) for r in again] == [(r.sha256, r.records) for r in expected]


def test_an_output_is_committed_while_the_next_one_is_written(dataset, monkeypatch):
    import threading

    import tasks.stages.reshard_build as build

    storage, inputs, _ = dataset
    plan = plan_reshard(inputs, 10, prefix="ds/reshard")
    committing = [threading.Event() for _ in plan.outputs]
    write, commit = build.write_output, build._Written.commit
    overlapped = []

    def spy_write(storage_, out, **kw):
        if out.index > 0:
            # Sequential commits would start output k-1's only after this write returns.
            overlapped.append(committing[out.index - 1].wait(timeout=10))
        return write(storage_, out, **kw)

    def spy_commit(self):
        committing[self.output.index].set()
        return commit(self)

    monkeypatch.setattr(build, "write_output", spy_write)
    monkeypatch.setattr(build._Written, "commit", spy_commit)
    results = build_outputs(storage, plan.outputs)
    assert overlapped == [True] * (len(plan.outputs) - 1)
    assert [r.index for r in results] == [o.index for o in plan.outputs]
    assert all(storage.exists(o.ledger) for o in plan.outputs)


def test_a_tar_is_in_place_before_its_ledger_is_written(dataset, monkeypatch):
    import tasks.formats.ledger as ledger_module

    storage, inputs, _ = dataset
    plan = plan_reshard(inputs, 10, prefix="ds/reshard")
    seen = []
    write = ledger_module.write_parquet

    def spy(storage_, rel, table):
        out = next(o for o in plan.outputs if o.ledger == rel)
        seen.append((out.index, storage_.exists(out.name)))
        write(storage_, rel, table)

    monkeypatch.setattr("tasks.stages.reshard_build.write_parquet", spy)
    build_outputs(storage, plan.outputs)
    assert seen == [(o.index, True) for o in plan.outputs]


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
    # In a task of several outputs the failure is raised after the others are committed.
    with pytest.raises(ShardError, match="tar_truncated"):
        build_outputs(storage, plan.outputs[::-1])
    assert [storage.exists(o.ledger) for o in plan.outputs] == [True, True, False]


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


# ---------------------------------------------------------------------------------------------
# Inputs whose tar order is not their ledger order (downloads store samples as they complete)
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def completion_order(tmp_path):
    """Inputs whose tars hold the samples shuffled while their ledgers stay sorted by row."""
    storage = Storage(str(tmp_path / "root"))
    rng = np.random.default_rng(5)
    inputs, members = [], {}
    for i, n in enumerate(COUNTS):
        tar, ledger, written = make_input(storage, i, n, tar_order=rng.permutation(n).tolist())
        inputs.append(InputShard(tar, ledger, n))
        members.update(written)
    # the premise: within an input, consecutive ledger rows do not have increasing offsets
    offsets = [r["offset"] for r in read_ledger(storage, inputs[0].ledger).to_pylist() if r["status"] == "ok"]
    assert offsets != sorted(offsets)
    return storage, inputs, members


def test_outputs_follow_the_ledger_order_when_the_tar_order_differs(completion_order):
    storage, inputs, members = completion_order
    unmapped = UnmappableStorage(storage.root)
    for seed in (None, 6):
        plan = plan_reshard(inputs, 10, prefix=f"co{seed}", seed=seed)
        mapped = build_all(storage, plan)
        keys = [k for r in mapped for k in read_keys(storage, r.tar)]
        if seed is None:
            assert keys == list(members)  # ledger (dataset) order, not tar order
        else:
            assert sorted(keys) == sorted(members) and keys != list(members)
        for r in mapped:
            assert hashlib.sha256(storage.read_bytes(r.tar)).hexdigest() == r.sha256
            assert r.check["readable"] and r.check["complete"] and r.check["checksum_ok"], r.check
            with storage.open(r.tar, "rb") as fh:
                for sample in iter_samples(fh):
                    assert sample.members == members[sample.key]
        # Reads sorted by offset inside each window (object stores) write the same bytes.
        for window in (1, 5_000, 1 << 26):
            read = build_all(
                unmapped, plan_reshard(inputs, 10, prefix=f"co{seed}-w{window}", seed=seed), window_bytes=window
            )
            assert [r.sha256 for r in read] == [r.sha256 for r in mapped]
            assert [r.records for r in read] == [r.records for r in mapped]
        # A rerun after the outputs are gone writes them byte for byte again.
        for r in mapped:
            storage.rm(r.ledger)
        again = build_all(storage, plan)
        assert not any(r.skipped for r in again)
        assert [r.sha256 for r in again] == [r.sha256 for r in mapped]


def test_window_reads_are_sorted_and_merged_when_the_ledger_order_is_scrambled(completion_order):
    storage, inputs, _ = completion_order
    unmapped = UnmappableStorage(storage.root)
    # One window over a whole input: its samples are neighbours in the tar, so one read each
    # input in spite of the scrambled ledger order (input 2 is read by two outputs).
    build_all(unmapped, plan_reshard(inputs, 10, prefix="merged"))
    assert len(unmapped.reads) == 4


# ---------------------------------------------------------------------------------------------
# Checks from the writer's record (the gate's rows)
# ---------------------------------------------------------------------------------------------


def _flip(storage, rel, at, value=None):
    data = bytearray(storage.read_bytes(rel))
    data[at] = value if value is not None else data[at] ^ 0x01
    with open(storage.path(rel), "wb") as fh:  # in place, as a corrupting disk or tool would
        fh.write(data)


def test_a_damaged_output_fails_its_check_on_the_rerun(dataset):
    storage, inputs, _ = dataset
    plan = plan_reshard(inputs, 10, prefix="ds/reshard")
    first = build_all(storage, plan)
    assert all(
        r.check == {**r.check, "readable": True, "complete": True, "checksum_ok": True, "detail": None} for r in first
    )
    assert [r.check["samples"] for r in first] == [10, 10, 5]

    # A member name changed inside a header block: the header checksum no longer matches.
    rec = first[1].records[3]
    _flip(storage, first[1].tar, rec.members[1].offset - 512 + 2)
    # The last output loses its end-of-archive blocks.
    data = storage.read_bytes(first[2].tar)
    with open(storage.path(first[2].tar), "wb") as fh:
        fh.write(data[:-512])
    again = build_all(storage, plan)
    assert all(r.skipped for r in again)
    assert again[0].check["readable"]
    assert not again[1].check["readable"] and rec.key in again[1].check["detail"]
    assert "tar_bad_checksum" in again[1].check["detail"]
    assert not again[2].check["readable"] and "should be" in again[2].check["detail"]

    # The gate judges those rows: both damaged tars are unreadable, and the cut one is no
    # longer the size its recorded sha256 covers.
    import pyarrow as pa

    from tasks.audit.gates import reshard_gate

    rows = [dict(r.check, is_last=(i == len(again) - 1)) for i, r in enumerate(again)]
    gate = reshard_gate(pa.Table.from_pylist(rows), 10, 25)
    assert not gate.success
    assert [o.name for o in gate.outcomes if not o.success] == ["every tar readable", "checksums match the index"]
    assert not again[2].check["checksum_ok"] and again[1].check["checksum_ok"]


def test_headers_written_otherwise_are_read_by_the_tar_reader(dataset):
    """A checksum field written as 7 digits and a NUL (older tars) is valid: the reader says so."""
    storage, inputs, _ = dataset
    result = build_output(storage, plan_reshard(inputs, 10, prefix="ds/reshard").outputs[0])
    rec = result.records[4]
    at = rec.members[0].offset - 512
    data = bytearray(storage.read_bytes(result.tar))
    block = data[at : at + 512]
    block[148:156] = b" " * 8
    block[148:156] = b"%07o\0" % sum(block)
    data[at : at + 512] = block
    with open(storage.path(result.tar), "wb") as fh:
        fh.write(data)
    layout = Layout.of(result.layout)
    with open(storage.path(result.tar), "rb") as fh:
        row = check_file(result.tar, fh.fileno(), layout, len(data), ("jpg", "txt", "json"))
        assert row["readable"] and row["detail"] is None
        # ...while a record that does not match the tar fails, naming the sample.
        wrong = Layout(**{**layout.__dict__, "sizes": layout.sizes + (np.arange(len(layout.sizes)) == 1)})
        row = check_file(result.tar, fh.fileno(), wrong, len(data), ("jpg",))
        assert not row["readable"] and result.records[0].key in row["detail"]
        # A required member no sample has: incomplete, and which sample is named.
        row = check_file(result.tar, fh.fileno(), layout, len(data), ("jpg", "npy"))
        assert row["readable"] and not row["complete"] and "npy" in row["detail"]
        # A digest over fewer bytes than the tar holds.
        assert not check_file(result.tar, fh.fileno(), layout, len(data) - 1, ())["checksum_ok"]


def test_an_output_is_checked_before_it_is_committed(dataset):
    """A ledger whose byte ranges are whole blocks but not samples: the check says so, the gate will fail."""
    storage, inputs, _ = dataset
    # Shift every ok row's range of input 3 by one block: whole blocks, members inside, wrong bytes.
    table = read_ledger(storage, inputs[3].ledger).to_pylist()
    for r in table:
        if r["status"] == "ok":
            r["offset"] += 512
            r["members"] = [{**m, "offset": m["offset"] + 512} for m in r["members"]]
    write_ledger(storage, inputs[3].ledger, [LedgerRow(**{k: v for k, v in r.items() if k != "status"}) for r in table])
    result = build_output(storage, plan_reshard(inputs, 10, prefix="ds/reshard").outputs[2])
    assert not result.check["readable"] and result.check["detail"]
    assert storage.exists(result.ledger)  # committed all the same: the gate fails with a report


# ---------------------------------------------------------------------------------------------
# Counting, grouping
# ---------------------------------------------------------------------------------------------


def test_counting_ok_rows_when_the_ledger_vouches_for_completeness(tmp_path):
    storage = Storage(str(tmp_path / "root"))
    tars, ledgers = [], []
    for i, (n, drop) in enumerate([(8, {}), (6, {4: "txt"})]):
        tar, ledger, _ = make_input(storage, i, n, drop=drop)
        tars.append(tar)
        ledgers.append(ledger)
    counted = count_inputs(storage, tars, ledgers)
    assert [s.count for s in counted] == [8, 6]
    assert counted[0].bytes == sum(
        r["length"] for r in read_ledger(storage, ledgers[0]).to_pylist() if r["status"] == "ok"
    )
    plan = plan_reshard(counted, 5, prefix="p")
    assert build_output(storage, plan.outputs[0]).samples == 5  # input 0 only
    # Input 1 broke the promise: one ok row lacks its txt. The build refuses, saying why.
    with pytest.raises(ValueError, match="as its ledger vouches"):
        build_outputs(storage, plan.outputs[1:])


def test_outputs_are_grouped_into_few_contiguous_tasks():
    inputs = [InputShard(f"in/{i}.tar", f"in/{i}.parquet", 100, bytes=100 * 2**20) for i in range(40)]  # 4000 MiB
    plan = plan_reshard(inputs, 30, prefix="p")  # 134 outputs
    for slots, task_bytes, tasks in ((2, 2**40, 2), (3, 2**40, 3), (2, 2**30, 4), (2, 2**29, 8), (500, 2**40, 134)):
        groups = group_outputs(plan, slots, task_bytes=task_bytes)
        assert len(groups) == tasks
        assert [o.index for g in groups for o in g] == list(range(len(plan.outputs)))
        assert max(map(len, groups)) - min(map(len, groups)) <= 1
    assert group_outputs(plan_reshard([], 5, prefix="p"), 2) == []


# ---------------------------------------------------------------------------------------------
# The phase under Prefect on a Dask LocalCluster
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_reshard_flow_counts_or_takes_a_census_and_gates(prefect_harness, shared_cluster, tmp_path):
    from dataclasses import dataclass

    from prefect_dask import DaskTaskRunner

    from flows.audit import new_run
    from flows.reshard import reshard_flow
    from tasks.formats.recipe import parse_recipe

    @dataclass
    class Validated:
        tars: list
        ledgers: list

    storage = Storage(str(tmp_path / "root"))
    # Tars in reverse ledger order; input 1 has two samples without a caption (txt).
    made = [
        make_input(storage, i, n, drop=drop, tar_order=list(range(n))[::-1])
        for i, (n, drop) in enumerate([(9, {}), (7, {1: "txt", 5: "txt"}), (11, {})])
    ]
    validated = Validated([t for t, _, _ in made], [led for _, led, _ in made])
    written = {k: m for _, _, w in made for k, m in w.items()}
    complete = [k for k, m in written.items() if "txt" in m]

    def run(dataset, **config):
        recipe = parse_recipe(
            {
                "dataset": dataset,
                "storage": storage.root,
                "sources": [{"name": "s", "manifest": "m.csv"}],
                "reshard": {"samples_per_shard": 4},
                **config,
            },
            tmp_path / "recipe.yaml",
        )
        return reshard_flow.with_options(task_runner=DaskTaskRunner(address=address))(
            recipe=recipe, validated=validated, run=new_run(recipe, dataset)
        )

    address = shared_cluster  # the session's cluster (tests/conftest.py)
    # Captions not required: the validated ledgers vouch for jpg and json only, which is
    # what the reshard requires by default. Ok rows are counted; no census.
    summary, record = run("counted", validate={"caption": {"required": False}})
    assert (summary.samples, summary.tail, summary.incomplete) == (27, 3, 0)
    assert [o.samples for o in summary.outputs] == [4] * 6 + [3]
    assert [k for o in summary.outputs for k in read_keys_with(storage, o.tar, ("jpg", "json"))] == list(written)
    phase = record.phases[-1]
    assert phase.gate["success"] and phase.ok == 27 and phase.rows == 27 and phase.shards == 7
    assert set(summary.timings) == {"start", "plan", "build", "gate", "report"}
    built = build_tasks()
    assert built > 0
    again, again_record = run("counted", validate={"caption": {"required": False}})
    assert all(o.skipped for o in again.outputs) and [o.sha256 for o in again.outputs] == [
        o.sha256 for o in summary.outputs
    ]
    # Nothing to build: no build task ran, and the first run's verdict on these very outputs stands.
    assert build_tasks() == built
    assert again_record.phases[-1].gate["statistics"]["reused_from"] == record.run

    # Requiring the txt the validate phase did not promise: a census, and the two ok rows
    # without one are accounted for with their reason instead of carried.
    census, record = run(
        "census",
        validate={"caption": {"required": False}},
        reshard={"samples_per_shard": 4, "required_members": ["jpg", "json", "txt"]},
    )
    assert (census.samples, census.incomplete) == (25, 2)
    assert [k for o in census.outputs for k in read_keys(storage, o.tar)] == complete
    assert sorted(r["key"] for t in census.incomplete_rows for r in t.to_pylist()) == sorted(
        set(written) - set(complete)
    )
    phase = record.phases[-1]
    assert phase.gate["success"] and phase.rows == 27 and phase.by_reason == {INCOMPLETE: 2}


def build_tasks() -> int:
    """Reshard build task runs the Prefect API has seen."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterName

    with get_client(sync_client=True) as client:
        return len(client.read_task_runs(task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_="reshard-0"))))


def read_keys_with(storage, tar, required):
    with storage.open(tar, "rb") as fh:
        return [s.key for s in iter_samples(fh, required=required)]


def test_a_ledger_whose_members_are_not_named_after_the_key_is_refused(dataset):
    storage, inputs, _ = dataset
    table = read_ledger(storage, inputs[3].ledger).to_pylist()
    first = next(r for r in table if r["status"] == "ok")
    first["key"] = first["key"] + "x"  # the tar's member names still carry the old key
    write_ledger(storage, inputs[3].ledger, [LedgerRow(**{k: v for k, v in r.items() if k != "status"}) for r in table])
    with pytest.raises(ValueError, match="is not named after its key"):
        build_output(storage, plan_reshard(inputs, 10, prefix="ds/reshard").outputs[2])


def test_reading_a_ledger_needs_neither_pyarrow_dataset_nor_pandas(dataset):
    import subprocess
    import sys

    storage, inputs, _ = dataset
    # A worker's first task paid 0.7-1.2 s for those imports; a fresh interpreter shows them.
    code = f"""
import sys
from tasks.formats.ledger import read_ledger
from tasks.formats.storage import Storage
table = read_ledger(Storage({storage.root!r}), {inputs[0].ledger!r}, ["key", "status"])
print(table.num_rows, table.column_names, "pyarrow.dataset" in sys.modules, "pandas" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    rows = read_ledger(storage, inputs[0].ledger).num_rows
    assert out.stdout.split() == [str(rows), "['key',", "'status']", "False", "False"]


def test_a_reshard_with_no_sample_left_fails_on_that_alone():
    # Every row taken down or rejected: the gate says no sample is left, and its other checks
    # judge an empty table as numbers (GE compared '' with 0.0 and raised, which the run printed)
    import pyarrow as pa

    from tasks.audit.gates import reshard_gate

    gate = reshard_gate(pa.table({}), 10, 0)
    failed = [(o.name, o.observed) for o in gate.outcomes if not o.success]
    assert failed == [("at least one shard (a sample left to release)", 0)]
    assert gate.statistics == {"shards": 0, "samples": 0, "expected_samples": 0}


def test_a_reshard_left_empty_by_upkeep_says_so_and_counts_its_reasons():
    import pyarrow as pa

    from flows.reshard import _why_empty

    removed = [pa.table({"reason": ["taken_down", "taken_down"]}), pa.table({"reason": ["opted_out"]})]
    why = _why_empty(0, removed)
    assert why.startswith("upkeep removed every sample left (taken_down 2, opted_out 1)")
    assert "the latest release still holds them" in why
    assert _why_empty(3, removed) == "" and _why_empty(0, []) == ""
