"""Dask workers that die mid-task: the run completes without duplicates, or fails a shard, never hangs."""

from __future__ import annotations

import pyarrow as pa
import pytest

from tasks.formats.faults import FAULT_ENV
from tasks.formats.ledger import read_ledger
from tasks.formats.recipe import Recipe
from tasks.formats.storage import Storage

ROWS, PER_SHARD = 12, 4


def recipe_for(tmp_path, web) -> Recipe:
    manifest = tmp_path / "m.csv"
    manifest.write_text(
        "url,caption,license\n"
        + "".join(f"{web.base_url}/img/photo.jpg?i={i},photo {i},CC0-1.0\n" for i in range(ROWS))
    )
    return Recipe.model_validate(
        {
            "dataset": "ds",
            "storage": str(tmp_path / "store"),
            "sources": [{"name": "web", "manifest": str(manifest), "rows_per_shard": PER_SHARD}],
            "download": {
                "timeout_s": 5,
                "retries": 0,
                "network": {"allowed_networks": ["127.0.0.1/32"], "any_port": True},
            },
            "execution": {"workers": 2, "task_retries": 0},
        }
    )


# Worker deaths cost a respawn each (a process start and the imports of the stages: seconds
# alone, tens of seconds on a 2-core machine busy with the rest of the suite). Alone these tests
# take about a minute; 300 s ran out when the machine was oversubscribed, so their limit is
# the suite's own (pyproject.toml) plus headroom.
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_workers_dying_mid_task_are_replaced_and_the_run_has_no_duplicates(tmp_path, web, prefect_harness, monkeypatch):
    from flows.pretraining import run_phases
    from tasks.formats.locks import RunLock

    recipe = recipe_for(tmp_path, web)
    # One worker exits mid-write (a crash in native code), another is SIGKILLed mid-write (as
    # the kernel's OOM killer does); each once, so the rescheduled task then succeeds.
    monkeypatch.setenv(
        FAULT_ENV,
        f"exit:write:ds/download/web/000001-*.tar:{tmp_path / 'exit-once'};sigkill:write:ds/download/web/000002-*.tar:{tmp_path / 'kill-once'}",
    )
    out = run_phases(recipe, ["download"])
    assert (tmp_path / "exit-once").exists() and (tmp_path / "kill-once").exists()  # both faults fired
    dl = out["download"]
    assert dl.shards == 3 and dl.shards_failed == [] and dl.counts.rows == ROWS and dl.counts.ok == ROWS
    storage = Storage(recipe.storage)
    ledger = pa.concat_tables([read_ledger(storage, rel) for rel in dl.ledgers])
    keys = ledger.column("key").to_pylist()
    assert len(keys) == len(set(keys)) == ROWS
    assert sorted(ledger.column("row").to_pylist()) == list(range(ROWS))
    # The dead workers' torn temp files never took a final name; the next run sweeps them. Torn:
    # the two faulted tars, and whatever else their worker had in flight (a shard whose fetching
    # was done commits beside the worker's next shard, so its files may be torn too; it ran again).
    download = tmp_path / "store" / "ds" / "download" / "web"
    torn = [p.name for p in download.iterdir() if p.name.startswith(".tmp-")]
    assert {n.split("-")[2] for n in torn if n.endswith(".tar")} >= {"000001", "000002"}, torn
    assert len([p for p in download.iterdir() if p.suffix == ".tar" and not p.name.startswith(".")]) == 3
    with RunLock(storage, "ds", "next-run"):
        assert [p.name for p in download.iterdir() if p.name.startswith(".tmp-")] == []


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_task_that_kills_every_worker_fails_its_shard_and_the_run_ends(tmp_path, web, prefect_harness, monkeypatch):
    import dask

    from flows.download import PhaseFailed
    from flows.pretraining import run_phases

    recipe = recipe_for(tmp_path, web)
    monkeypatch.setenv(FAULT_ENV, "exit:write:ds/download/web/000001-*.tar")  # every attempt
    # The scheduler gives up on a task after this many worker deaths (default 3).
    with dask.config.set({"distributed.scheduler.allowed-failures": 1}), pytest.raises(PhaseFailed) as err:
        run_phases(recipe, ["download"])
    message = str(err.value)
    assert "1 of 3 download shards failed" in message and "000001-" in message
    assert "KilledWorker" in message and "died" in message
    # The other shards are committed: a rerun without the fault downloads only the failed one
    # (one worker is enough for one shard, and starts in half the time of two).
    monkeypatch.delenv(FAULT_ENV)
    one = recipe.model_copy(update={"execution": recipe.execution.model_copy(update={"workers": 1})})
    out = run_phases(one, ["download"])
    assert out["download"].shards_skipped == 2 and out["download"].counts.rows == ROWS


# --- one hostile image cannot take a worker's memory ------------------------------------------

_BOMB_PROBE = r"""
import json, resource, struct, sys, zlib

from tasks.policies.images import process_image
from tasks.formats.recipe_download import ImageRules


def png(width, height, rows):
    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    z = zlib.compressobj(9)
    row = b"\0" * (width + 1)  # filter byte + one grey byte per pixel
    idat = b"".join(z.compress(row) for _ in range(rows)) + z.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


rules = ImageRules(max_pixels=4_000_000, min_side=1, max_aspect_ratio=100.0)
cases = {
    # A real zlib bomb: 1.2 MB of file, 400 MB of pixels, every row present.
    "png_bomb": png(20_000, 20_000, 20_000),
    # Just under the cap: decoded for real, so its cost is the most one image may take.
    "png_under_cap": png(2_000, 1_999, 1_999),
}
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = {}
for name, data in cases.items():
    outcome = process_image(data, rules)
    out[name] = {"reason": outcome.reason, "file_bytes": len(data), "peak_growth_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024}
print(json.dumps(out))
"""


def test_a_real_decompression_bomb_is_refused_without_taking_memory_and_the_cap_bounds_the_rest():
    """Pixels are capped before decoding (tests/test_images.py checks the header paths with
    decoding disabled); this measures a real zlib bomb's memory in a fresh process."""
    import json
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _BOMB_PROBE],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(__import__("pathlib").Path(__file__).parent.parent),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    bomb, under = out["png_bomb"], out["png_under_cap"]
    assert bomb["reason"] == "decompression_bomb" and bomb["file_bytes"] < 2_000_000
    # Decoding it would take 400 MB; refusing it takes next to nothing.
    assert bomb["peak_growth_mb"] < 40
    # An image at the cap is decoded (4 Mpx of grey, re-encoded as RGB): bounded by max_pixels.
    assert under["reason"] is None
    assert under["peak_growth_mb"] < 4_000_000 * 4 * 4 / 2**20
