"""The CLI's progress lines (flows/progress.py): shards and rows done per phase, as a user reads them."""

from __future__ import annotations

from flows import progress
from tasks.formats.ledger import Counts
from tasks.stages.runner import ShardResult


def _shard(index: int, samples: int, counts: Counts | None = None) -> ShardResult:
    return ShardResult("pics", index, f"s{index}.tar", f"s{index}.ledger.parquet", counts, 0.1, samples=samples)


def test_a_task_that_returns_several_shards_counts_each_shard_and_its_rows(capsys):
    # A reshard build task writes a run of output shards and returns them as a list; the line
    # counts output shards and their samples, not tasks (it said "1/1 shards, 0 rows").
    with progress.Terminal():
        progress.start("reshard", 4)
        progress.advance("reshard", [_shard(0, 3), _shard(1, 3), _shard(2, 3)])
        progress.advance("reshard", [_shard(3, 2)])
        progress.finish("reshard")
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("reshard: 4/4 shards, 11 rows, "), line


def test_a_shard_counts_its_ledger_rows_and_a_failed_task_counts_none(capsys):
    counts = Counts(rows=17, ok=16, rejected=0, error=1, by_reason={"http_404": 1}, bytes=0)
    with progress.Terminal():
        progress.start("download", 2, rows=20)
        progress.advance("download", _shard(0, 16, counts))
        progress.advance("download")  # failed after its retries: no result
        progress.finish("download")
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("download: 2/2 shards, 17/20 rows, "), line


def test_a_step_whose_results_count_no_rows_shows_shards_only(capsys):
    # Fine-tuning's "verify" step checks finished shards; it said "0 rows, 0/s".
    with progress.Terminal():
        progress.start("verify", 2)
        progress.advance("verify", {"shard": "a.tar", "ok": True})
        progress.advance("verify", {"shard": "b.tar", "ok": True})
        progress.finish("verify")
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("verify: 2/2 shards (") and "rows" not in line, line


def test_outside_a_terminal_block_nothing_is_shown(capsys):
    progress.start("validate", 1)
    progress.advance("validate", _shard(0, 5))
    progress.finish("validate")
    assert capsys.readouterr().err == ""
