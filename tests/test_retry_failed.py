"""Rows whose fetch failed for a passing reason are fetched again by later runs, into a new version of their chunk."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from aiohttp import web

from tasks.demo.tracked import TrackedServer
from tasks.formats.recipe_upkeep import RetryFailed
from tasks.formats.shards import iter_samples
from tasks.stages.retry import due_rows, next_retry_at

ROOT = Path(__file__).resolve().parent.parent
NIGHT1 = datetime(2026, 12, 1, 2, 0, tzinfo=UTC)
ROWS = 12
# What each row's URL answers on the first night, and from the second on ("ok": its picture).
FIRST = {1: 503, 3: 404, 8: "hang", 9: 503, 10: 429}
LATER = {3: 404, 9: 503}
TRANSIENT = {1, 8, 9, 10}
RECOVERED = {1, 8, 10}


class Outage(TrackedServer):
    """``/p/{row}.jpg``: what ``answers[row]`` says (default ``ok``): the row's picture, an HTTP
    status, or ``hang`` (headers never come, until the answer changes or the server stops).

    Args:
        pictures: the body of each row's picture.
    """

    def __init__(self, pictures: dict[int, bytes]):
        super().__init__()
        self.pictures = pictures
        self.answers: dict[int, int | str] = {}

    def application(self) -> web.Application:
        app = web.Application(middlewares=[self._track])
        app.add_routes([web.get("/p/{row}.jpg", self._picture)])
        return app

    async def _picture(self, request: web.Request) -> web.StreamResponse:
        row = int(request.match_info["row"])
        while self.answers.get(row) == "hang" and not await self.stopping_within(0.1):
            pass
        what = self.answers.get(row, "ok")
        if what == "ok" or what == "hang":
            return web.Response(body=self.pictures[row], content_type="image/jpeg")
        return web.Response(status=int(what), text="not now\n")

    def night(self, answers: dict[int, int | str]) -> None:
        self.answers = dict(answers)
        self.reset_stats()

    def fetched(self) -> dict[int, int]:
        """Requests per row since the night began."""
        hits = self.stats()["hits"]
        return {r: hits[f"/p/{r}.jpg"] for r in range(ROWS) if hits[f"/p/{r}.jpg"]}


def picture(i: int) -> bytes:
    """A distinct picture per row (noise: no two are near duplicates)."""
    from PIL import Image

    rng = np.random.default_rng([40, i])
    img = Image.fromarray(rng.integers(0, 256, size=(72, 96, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=85)
    return buf.getvalue()


@pytest.fixture
def outage():
    server = Outage({i: picture(i) for i in range(ROWS)})
    server.start()
    yield server
    server.stop()


def write_recipe(tmp: Path, server: Outage, *, release: bool = False, keep_raw: bool = True) -> Path:
    manifest = tmp / "m.csv"
    lines = ["url,caption,license"] + [f"{server.url(f'/p/{i}.jpg')},picture number {i},CC0-1.0" for i in range(ROWS)]
    manifest.write_text("\n".join(lines) + "\n")
    recipe = tmp / "r.yaml"
    recipe.write_text(
        f"""dataset: heal
storage: {tmp / "store"}
sources:
  - name: s
    manifest: {manifest}
    rows_per_shard: 4
download:
  # the hang row's attempt ends here; loopback answers take milliseconds, but a loaded machine
  # (2 cores, the test workers, their Dask workers) has stalled them past 1 s: 4 rows failed
  timeout_s: 4
  retries: 0
  network: {{allowed_networks: ["127.0.0.1/32"], any_port: true}}
  retry_failed: {{max_attempts: 2}}
  keep_raw: {str(keep_raw).lower()}
validate:
  license: {{review: {{reviewed_by: tests, reviewed_on: 2026-12-01}}}}
  image: {{min_side: 8}}
reshard: {{samples_per_shard: 8}}
execution: {{cluster: local, workers: {1 if release else 2}}}
"""
    )
    return recipe


def run_night(recipe: Path, when: datetime, monkeypatch, phase: str = "validate") -> dict:
    from flows.pretraining import pretraining_flow

    monkeypatch.setenv("SHARDSMITH_NOW", when.isoformat())
    return pretraining_flow(recipe_path=str(recipe), phases=[phase], workers=2)


def files(store: Path) -> dict[str, str]:
    """sha256 of every download and candidate file."""
    found = [p for part in ("download", "validate/candidates") for p in (store / "heal" / part).rglob("*")]
    return {str(p.relative_to(store)): hashlib.sha256(p.read_bytes()).hexdigest() for p in found if p.is_file()}


def rows_of(store: Path, ledgers: list[str]) -> dict[int, dict]:
    rows = [r for rel in ledgers for r in pq.read_table(store / rel).to_pylist()]
    by_row = {r["row"]: r for r in rows}
    assert len(by_row) == len(rows), "a row has two ledger rows"
    return by_row


def test_transient_failures_are_fetched_again_on_a_later_night(
    prefect_harness, shared_cluster, outage, tmp_path, monkeypatch
):
    recipe = write_recipe(tmp_path, outage)
    store = tmp_path / "store"

    # Night 1: an outage. Every row has its fetch facts: the run's time, one fetch.
    outage.night(FIRST)
    first = run_night(recipe, NIGHT1, monkeypatch)
    dl = first["download"]
    assert dl.counts.rows == ROWS and dl.counts.ok == ROWS - len(FIRST)
    rows = rows_of(store, dl.ledgers)
    assert {r: rows[r]["reason"] for r in FIRST} == {
        1: "http_503",
        3: "http_404",
        8: "timeout",
        9: "http_503",
        10: "http_429",
    }
    assert {r["fetched_at"] for r in rows.values()} == {NIGHT1} and {r["fetches"] for r in rows.values()} == {1}
    assert dl.rows_retried == 0 and dl.next_retry_at == NIGHT1 + timedelta(hours=20)
    assert first["validate"].counts.ok == ROWS - len(FIRST)
    before = files(store)

    # Two hours later: nothing is due, nothing is fetched, nothing is written.
    outage.night(LATER)
    soon = run_night(recipe, NIGHT1 + timedelta(hours=2), monkeypatch)
    assert outage.fetched() == {}
    assert soon["download"].rows_retried == 0 and soon["download"].shards_skipped == soon["download"].shards
    assert files(store) == before

    # Night 2: only the rows that failed for a passing reason are asked for again, once each;
    # the 404 and the rows already fetched are not.
    night2 = NIGHT1 + timedelta(days=1)
    outage.night(LATER)
    second = run_night(recipe, night2, monkeypatch)
    assert outage.fetched() == dict.fromkeys(TRANSIENT, 1)
    dl2 = second["download"]
    assert (dl2.rows_retried, dl2.rows_recovered) == (len(TRANSIENT), len(RECOVERED))
    # Row 9 failed again on its second of two attempts: final, nothing will be retried.
    assert dl2.next_retry_at is None
    assert dl2.counts.rows == ROWS and dl2.counts.ok == ROWS - len(FIRST) + len(RECOVERED)
    # One ledger per chunk: new versions of the chunks that had due rows (0 and 2), the base of the other.
    assert len(dl2.ledgers) == 3
    assert [".r001-" in rel for rel in dl2.ledgers] == [True, False, True]
    rows2 = rows_of(store, dl2.ledgers)
    for r in range(ROWS):
        if r in TRANSIENT:
            assert (rows2[r]["fetches"], rows2[r]["fetched_at"]) == (2, night2)
        else:
            assert {k: v for k, v in rows2[r].items() if k not in ("shard", "offset", "members")} == {
                k: v for k, v in rows[r].items() if k not in ("shard", "offset", "members")
            }
    assert {r for r in TRANSIENT if rows2[r]["status"] == "ok"} == RECOVERED
    assert rows2[9]["reason"] == "http_503" and rows2[3]["reason"] == "http_404"
    # The new versions' samples are whole: every ok row's picture, byte for byte, where its ledger row says.
    for r, entry in rows2.items():
        if entry["status"] == "ok":
            data = (store / entry["shard"]).read_bytes()
            jpg = next(m for m in entry["members"] if m["name"].endswith(".jpg"))
            assert data[jpg["offset"] : jpg["offset"] + jpg["size"]] == outage.pictures[r]
    # The new versions are whole tars: the previous samples, then the recovered ones.
    for rel in dl2.tars:
        with open(store / rel, "rb") as fh:
            keys = {sample.key for sample in iter_samples(fh)}
        assert keys == {e["key"] for e in rows2.values() if e["shard"] == rel}
    # The recovered rows were judged into the new versions' candidates; the others' copied.
    assert sorted((c.index, c.skipped) for c in dl2.candidates) == [(0, False), (2, False)]
    cands = rows_of(store, [c.table for c in dl2.candidates])
    assert {r for r, c in cands.items() if c["status"] == "ok"} == {0, 2, 11} | RECOVERED
    assert second["validate"].counts.ok == ROWS - len(FIRST) + len(RECOVERED)
    # What night 1 committed is still there, byte for byte.
    after = files(store)
    assert {k: after.get(k) for k in before} == before

    # Night 3: nothing due (row 9 used its attempts), nothing fetched, nothing written.
    outage.night({})
    third = run_night(recipe, night2 + timedelta(days=1), monkeypatch)
    assert outage.fetched() == {}
    assert third["download"].rows_retried == 0 and sorted(third["download"].ledgers) == sorted(dl2.ledgers)
    assert files(store) == after


def test_without_raw_shards_a_retry_writes_a_ledger_and_candidates(
    prefect_harness, shared_cluster, outage, tmp_path, monkeypatch
):
    recipe = write_recipe(tmp_path, outage, keep_raw=False)
    store = tmp_path / "store"
    outage.night(FIRST)
    run_night(recipe, NIGHT1, monkeypatch)
    before = files(store)
    outage.night(LATER)
    second = run_night(recipe, NIGHT1 + timedelta(days=1), monkeypatch)
    assert outage.fetched() == dict.fromkeys(TRANSIENT, 1)
    dl = second["download"]
    assert (dl.rows_retried, dl.rows_recovered) == (len(TRANSIENT), len(RECOVERED))
    # The new versions are ledgers only (no raw shard), and their candidates hold the recovered rows.
    assert not list((store / "heal" / "download").rglob("*.tar"))
    versions = [rel for rel in dl.ledgers if ".r001-" in rel]
    assert len(versions) == 2 and all((store / rel).is_file() for rel in versions)
    rows = rows_of(store, dl.ledgers)
    assert all(r["shard"] is None for r in rows.values())
    assert {r for r in TRANSIENT if rows[r]["status"] == "ok"} == RECOVERED
    cands = rows_of(store, [c.table for c in dl.candidates])
    assert RECOVERED <= {r for r, c in cands.items() if c["status"] == "ok"}
    assert second["validate"].counts.ok == ROWS - len(FIRST) + len(RECOVERED)
    after = files(store)
    assert {k: after.get(k) for k in before} == before


def test_the_download_phase_alone_retries_then_validation_judges_the_new_version(
    prefect_harness, shared_cluster, outage, tmp_path, monkeypatch
):
    recipe = write_recipe(tmp_path, outage)
    store = tmp_path / "store"
    outage.night(FIRST)
    run_night(recipe, NIGHT1, monkeypatch, phase="download")
    outage.night(LATER)
    night2 = NIGHT1 + timedelta(days=1)
    dl = run_night(recipe, night2, monkeypatch, phase="download")["download"]
    assert outage.fetched() == dict.fromkeys(TRANSIENT, 1)
    assert (dl.rows_retried, dl.rows_recovered) == (len(TRANSIENT), len(RECOVERED))
    assert dl.candidates == [] and sum(".r001-" in rel for rel in dl.ledgers) == 2
    # Validation later the same night: the new versions judged from their raw shards, nothing fetched.
    outage.night(LATER)
    out = run_night(recipe, night2 + timedelta(minutes=5), monkeypatch)
    assert outage.fetched() == {}
    assert out["download"].rows_retried == 0 and out["download"].ledgers == dl.ledgers
    assert out["validate"].counts.ok == ROWS - len(FIRST) + len(RECOVERED)
    cands = rows_of(store, out["validate"].ledgers)
    assert RECOVERED <= {r for r, c in cands.items() if c["status"] == "ok"}


def cli(*args: str, api_url: str, now: datetime) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDSMITH_") or k == "SHARDSMITH_WARM"}
    env.update(PREFECT_API_URL=api_url, SHARDSMITH_NOW=now.isoformat())
    return subprocess.run(
        [sys.executable, "-m", "cli", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )


@pytest.mark.slow
def test_a_nightly_after_an_outage_releases_the_recovered_rows(outage, tmp_path, prefect_api_url):
    recipe = write_recipe(tmp_path, outage, release=True)
    store = tmp_path / "store" / "heal"
    outage.night(FIRST)
    first = cli("run", str(recipe), "--json", api_url=prefect_api_url, now=NIGHT1)
    assert first.returncode == 0, first.stderr[-3000:]
    v1 = store / "releases" / "v0001"
    released1 = pq.read_table(v1 / "ledger.parquet").to_pylist()
    assert {r["row"]: r["reason"] for r in released1 if r["status"] != "ok"}.keys() == FIRST.keys()
    v1_files = {p: p.read_bytes() for p in v1.rglob("*") if p.is_file()}

    # The next night the hosts answer again: the run (no --force) has work, fetches only the
    # rows that failed for a passing reason, and releases the recovered ones.
    outage.night(LATER)
    second = cli("run", str(recipe), "--json", api_url=prefect_api_url, now=NIGHT1 + timedelta(days=1))
    assert second.returncode == 0, second.stderr[-3000:]
    assert outage.fetched() == dict.fromkeys(TRANSIENT, 1)
    out = json.loads(second.stdout)
    assert out["download"]["rows_retried"] == len(TRANSIENT) and out["download"]["rows_recovered"] == len(RECOVERED)
    released2 = pq.read_table(store / "releases" / "v0002" / "ledger.parquet")
    fates = {r["row"]: (r["status"], r["reason"]) for r in released2.to_pylist()}
    assert len(fates) == ROWS == released2.num_rows
    assert {r for r, (status, _) in fates.items() if status == "ok"} == set(range(ROWS)) - set(LATER)
    assert fates[9] == ("error", "http_503") and fates[3] == ("error", "http_404")
    samples = pq.read_table(store / "releases" / "v0002" / "samples.parquet").column("row").to_pylist()
    assert RECOVERED <= set(samples)
    # The first release is as it was.
    assert {p: p.read_bytes() for p in v1.rglob("*") if p.is_file()} == v1_files


def _ledger(rows: list[tuple[str, str | None, int | None, datetime | None]]) -> pa.Table:
    return pa.table(
        {
            "row": pa.array(range(len(rows)), pa.int64()),
            "status": [r[0] for r in rows],
            "reason": [r[1] for r in rows],
            "fetches": pa.array([r[2] for r in rows], pa.int32()),
            "fetched_at": pa.array([r[3] for r in rows], pa.timestamp("us", tz="UTC")),
        }
    )


def test_a_retry_run_again_counts_the_version_it_committed(outage, tmp_path):
    """A retry task that Prefect runs again (the worker died after the commit) fetches nothing."""
    from tasks.formats.manifests import plan_source
    from tasks.formats.recipe import load_recipe
    from tasks.formats.storage import Storage
    from tasks.stages.download import download_shard, shard_paths
    from tasks.stages.retry import retry_chunk, version_paths

    recipe = load_recipe(write_recipe(tmp_path, outage))
    storage = Storage(recipe.storage)
    ref = plan_source(recipe.sources[0], storage, "heal").chunks[0]  # rows 0..3: row 1 answers 503, row 3 404
    outage.night(FIRST)
    base = shard_paths("heal", ref, "x")
    download_shard(ref, storage, recipe.download, *base, now=NIGHT1)
    outage.night(LATER)
    version = version_paths(base, [1])
    got, _ = retry_chunk(ref, storage, recipe.download, None, (base, None), (version, None), [1], now=NIGHT1)
    assert (got.skipped, got.retried, got.recovered) == (False, 1, 1) and outage.fetched() == {1: 1}
    again, _ = retry_chunk(ref, storage, recipe.download, None, (base, None), (version, None), [1], now=NIGHT1)
    assert (again.skipped, again.retried, again.recovered, again.counts) == (True, 1, 1, got.counts)
    assert outage.fetched() == {1: 1}


def test_which_rows_are_due_backoff_cap_and_final_reasons():
    t0 = NIGHT1
    table = _ledger(
        [
            ("ok", None, 1, t0),  # 0: fetched
            ("error", "http_404", 1, t0),  # 1: final
            ("rejected", "opted_out", 1, t0),  # 2: final
            ("error", "http_503", 1, t0),  # 3: due after 20 h
            ("error", "timeout", 2, t0),  # 4: second attempt: due after 40 h
            ("error", "connection_error", 4, t0),  # 5: four fetches, the cap: final
            ("error", "rate_limited", None, None),  # 6: a ledger of an older run: due at once
            ("error", "http_501", 1, t0),  # 7: Not Implemented: final
            ("error", "fetch_failed", 1, t0),  # 8: our own failure: final
        ]
    )
    cfg = RetryFailed()
    assert due_rows(table, cfg, t0 + timedelta(hours=2)) == [6]
    assert due_rows(table, cfg, t0 + timedelta(hours=20)) == [3, 6]
    assert due_rows(table, cfg, t0 + timedelta(hours=39)) == [3, 6]
    assert due_rows(table, cfg, t0 + timedelta(hours=40)) == [3, 4, 6]
    assert next_retry_at(table, cfg) == datetime(1970, 1, 1, tzinfo=UTC)  # row 6: due now
    assert next_retry_at(table.slice(0, 6), cfg) == t0 + timedelta(hours=20)
    assert next_retry_at(table.slice(0, 3), cfg) is None
    assert due_rows(table, RetryFailed(enabled=False), t0 + timedelta(days=30)) == []
    assert next_retry_at(table, RetryFailed(enabled=False)) is None
    assert due_rows(table, RetryFailed(max_attempts=1), t0 + timedelta(days=30)) == []
