"""The shard runner every stage shares: skip what is committed, write the shard, then its ledger, count."""

from __future__ import annotations

import pytest

from tasks.formats.ledger import read_ledger
from tasks.formats.shards import iter_samples
from tasks.formats.storage import Storage
from tasks.stages.runner import DECIDE_FAILED, Verdict, run_shard

TAR, LEDGER = "ds/stage/shard-000000.tar", "ds/stage/shard-000000.ledger.parquet"
# (row, caption): an empty caption is rejected, "boom" makes the decide function raise.
ITEMS = [(3, "three"), (0, "zero"), (2, ""), (1, "boom"), (4, "four")]


def decide(item: tuple[int, str]) -> Verdict:
    row, caption = item
    if caption == "boom":
        raise ValueError("injected")
    entry = {"key": f"s-{row:09d}", "source": "s", "row": row, "reason": None, "status": "ok"}
    if not caption:
        entry.update(reason="caption_missing", status="rejected")
        return Verdict(entry)
    return Verdict(entry, {"txt": caption.encode()})


def failed(item: tuple[int, str], err: Exception) -> dict:
    row, _ = item
    detail = f"{type(err).__name__}: {err}"
    return {
        "key": f"s-{row:09d}",
        "source": "s",
        "row": row,
        "status": "error",
        "reason": DECIDE_FAILED,
        "detail": detail,
    }


def run(storage: Storage, items=lambda: ITEMS, **kw):
    return run_shard(storage, TAR, LEDGER, items, decide, source="s", index=0, failed=failed, **kw)


@pytest.mark.parametrize("threads", [0, 2])
def test_every_item_is_one_ledger_row_and_the_counts_are_the_ledgers(tmp_path, threads):
    storage = Storage(str(tmp_path))
    result = run(storage, threads=threads)
    rows = read_ledger(storage, LEDGER).to_pylist()
    assert [r["row"] for r in rows] == [0, 1, 2, 3, 4]  # row order, whatever order they were decided in
    assert {r["row"]: r["reason"] for r in rows} == {0: None, 1: DECIDE_FAILED, 2: "caption_missing", 3: None, 4: None}
    assert (result.counts.rows, result.counts.ok, result.counts.rejected, result.counts.error) == (5, 3, 1, 1)
    assert result.samples == 3 and not result.skipped
    with storage.open(TAR, "rb") as fh:
        written = {s.key: s.members["txt"] for s in iter_samples(fh)}
    assert written == {"s-000000000": b"zero", "s-000000003": b"three", "s-000000004": b"four"}
    for r in rows:  # an ok row says where its sample lies; the others point nowhere
        assert (r["shard"] == TAR and r["offset"] is not None) == (r["status"] == "ok")
    assert result.bytes == storage.size(TAR) and len(result.sha256) == 64


def test_a_failing_decision_is_an_error_row_and_the_shard_goes_on(tmp_path):
    storage = Storage(str(tmp_path))
    run(storage)
    (bad,) = [r for r in read_ledger(storage, LEDGER).to_pylist() if r["status"] == "error"]
    assert bad["reason"] == "fetch_failed" and bad["detail"] == "ValueError: injected"


def test_without_failed_a_decision_error_is_the_shards_and_nothing_is_committed(tmp_path):
    storage = Storage(str(tmp_path))
    with pytest.raises(ValueError, match="injected"):
        run_shard(storage, TAR, LEDGER, lambda: ITEMS, decide)
    assert not storage.exists(TAR) and not storage.exists(LEDGER)


def test_a_committed_shard_is_skipped_without_deciding_anything(tmp_path):
    storage = Storage(str(tmp_path))
    first = run(storage)
    tar_bytes = storage.read_bytes(TAR)

    def never():
        raise AssertionError("a committed shard read its inputs again")

    again = run(storage, items=never)
    assert again.skipped and again.seconds == 0.0
    assert again.counts == first.counts and again.samples == first.samples
    assert storage.read_bytes(TAR) == tar_bytes


def test_the_ledger_is_written_after_the_shard_so_a_crash_between_is_redone(tmp_path):
    storage = Storage(str(tmp_path))

    def crash():
        assert storage.exists(TAR)  # the shard is in place before anything of the ledger
        raise RuntimeError("killed between the shard and its ledger")

    with pytest.raises(RuntimeError, match="killed"):
        run(storage, before_commit=crash)
    assert storage.exists(TAR) and not storage.exists(LEDGER)
    seen = []
    result = run(storage, items=lambda: seen.extend(ITEMS) or ITEMS)
    assert seen == ITEMS and not result.skipped  # not committed: done again, then committed
    assert read_ledger(storage, LEDGER).num_rows == len(ITEMS)


def test_a_check_that_refuses_the_shard_leaves_neither_tar_nor_ledger(tmp_path):
    storage = Storage(str(tmp_path))

    def refuse(rows):
        raise RuntimeError(f"{len(rows)} rows; not committed")

    with pytest.raises(RuntimeError, match="5 rows"):
        run(storage, check=refuse)
    assert not storage.exists(TAR) and not storage.exists(LEDGER)
