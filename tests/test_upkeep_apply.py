"""Upkeep applied to kept shards: takedowns and recheck fates as overlay ledgers and release-ledger rows, and a release through the CLI that honours them without a fetch."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from tasks.audit.reconcile import Reconciliation
from tasks.formats.ledger import LedgerRow, ledger_table, read_parquet, write_parquet
from tasks.formats.recheck_store import RECHECK_SCHEMA, chunk_stem, write_version
from tasks.formats.recipe_upkeep import RecheckActions
from tasks.formats.storage import Storage
from tasks.formats.takedown import LoadedList, parse_list
from tasks.stages.release_tables import release_tables
from tasks.stages.reshard import count_inputs
from tasks.stages.upkeep import apply_upkeep

ROOT = Path(__file__).resolve().parent.parent
DATASET = "up"
NOW = "2026-12-05T02:00:00Z"


def sha(i: int, salt: str = "") -> str:
    return hashlib.sha256(f"{salt}{i}".encode()).hexdigest()


def url(i: int) -> str:
    return f"http://img{i % 3}.example.com/p/{i}.jpg"


def row(i: int, source: str = "s", reason: str | None = None, **extra) -> LedgerRow:
    fields = dict(
        key=f"{source}-{i:09d}",
        source=source,
        row=i,
        reason=reason,
        url=url(i),
        sha256=sha(i, "stored"),
        pixel_sha256=sha(i, "pixels"),
        phash=(0x9E3779B97F4A7C15 * (i + 1)) % 2**64,
        offset=1024 * i if reason is None else None,
        length=1024 if reason is None else None,
    )
    return LedgerRow(**(fields | extra))


def write(storage: Storage, rel: str, rows: list[LedgerRow]) -> str:
    write_parquet(storage, rel, ledger_table(rows))
    return rel


def listed(name: str, *lines: str, distance: int = 4) -> LoadedList:
    return LoadedList(name, f"{name}.txt", distance, tuple(parse_list("\n".join(lines), name)), "")


@pytest.fixture
def shards(tmp_path) -> tuple[Storage, list[str], list[str], list[str]]:
    """Two validated shards of five rows each (row 3 rejected at validation) and their download
    ledgers (the sha256 of the bytes as fetched)."""
    storage = Storage(str(tmp_path / "store"))
    tars, ledgers, downloads = [], [], []
    for j in range(2):
        rows = [row(i, reason="image_too_small" if i == 3 else None) for i in range(5 * j, 5 * j + 5)]
        tars.append(f"{DATASET}/validate/s/{j:06d}-abc.tar")
        ledgers.append(write(storage, f"{DATASET}/validate/s/{j:06d}-abc.ledger.parquet", rows))
        fetched = [row(i, sha256=sha(i, "fetched")) for i in range(5 * j, 5 * j + 5)]
        downloads.append(write(storage, f"{DATASET}/download/s/{j:06d}-def.ledger.parquet", fetched))
    return storage, tars, ledgers, downloads


def test_listed_rows_are_rejected_in_an_overlay_beside_the_same_tar(shards):
    storage, tars, ledgers, downloads = shards
    legal = listed("legal", url(2), "domain:img0.example.com", f"sha256:{sha(4, 'fetched')}")
    done = apply_upkeep(storage, DATASET, tars, ledgers, lists=[legal], downloads=downloads)
    # img0 hosts rows 0, 3, 6 and 9; row 3 was rejected at validation and stays so.
    assert done.tars == tars
    assert all(led.startswith(f"{DATASET}/upkeep/") for led in done.ledgers)
    assert [led.rsplit("/", 1)[1] for led in done.ledgers] == [led.rsplit("/", 1)[1] for led in ledgers]
    removed = done.removed.sort_by("row").to_pylist()
    assert [(r["row"], r["status"], r["reason"]) for r in removed] == [
        (i, "rejected", "taken_down") for i in (0, 2, 4, 6, 9)
    ]
    assert [r["detail"] for r in removed] == [
        "list legal: entry domain:img0.example.com",
        f"list legal: entry url:{url(2)}",
        f"list legal: entry sha256:{sha(4, 'fetched')}",
        "list legal: entry domain:img0.example.com",
        "list legal: entry domain:img0.example.com",
    ]
    # The overlay is the input with those rows rejected, every other value as it was.
    before, after = read_parquet(storage, ledgers[0]), read_parquet(storage, done.ledgers[0])
    assert after.schema == before.schema
    flipped = {0, 2, 4}
    for i, (old, new) in enumerate(zip(before.to_pylist(), after.to_pylist())):
        if i in flipped:
            assert (new["status"], new["reason"]) == ("rejected", "taken_down")
            assert {k: v for k, v in new.items() if k not in ("status", "reason", "detail")} == {
                k: v for k, v in old.items() if k not in ("status", "reason", "detail")
            }
        else:
            assert new == old
    # The reshard counts what is left.
    assert [s.count for s in count_inputs(storage, done.tars, done.ledgers)] == [1, 3]
    assert done.counts() == {"taken_down": 5}

    # Written once: the same lists find the same overlays and write nothing.
    again = apply_upkeep(storage, DATASET, tars, ledgers, lists=[legal], downloads=downloads)
    assert (again.ledgers, again.digest, again.overlays, done.overlays) == (done.ledgers, done.digest, 0, 2)
    # A shard the lists do not touch keeps its ledger; a new entry names a new overlay.
    narrow = apply_upkeep(storage, DATASET, tars, ledgers, lists=[listed("legal", url(2))])
    assert narrow.ledgers[1] == ledgers[1] and narrow.ledgers[0] not in (ledgers[0], done.ledgers[0])


def test_nothing_to_apply_reads_nothing_and_changes_nothing(shards):
    storage, tars, ledgers, downloads = shards
    done = apply_upkeep(storage, DATASET, tars, ["missing.ledger.parquet"] * 2, lists=[listed("legal", "# none")])
    assert done.ledgers == ["missing.ledger.parquet"] * 2 and done.digest == "" and not done.removed.num_rows
    done = apply_upkeep(storage, DATASET, tars, ledgers, lists=[listed("legal", "nothing.example")])
    assert done.ledgers == ledgers and done.digest == "" and done.overlays == 0


def test_curated_shards_match_on_the_validation_ledgers_facts(shards, tmp_path):
    storage, tars, ledgers, downloads = shards
    # A curated ledger carries keys and the stored image's digest, not the URL or the hashes.
    curated = []
    for j, led in enumerate(ledgers):
        t = read_parquet(storage, led).select(["key", "source", "row", "status", "reason", "sha256", "offset"])
        curated.append(f"{DATASET}/curate/s/{j:06d}-c.ledger.parquet")
        write_parquet(storage, curated[-1], t)
    near = (0x9E3779B97F4A7C15 * 8) % 2**64 ^ 0b1011  # row 7's hash, 3 bits off
    legal = listed("legal", f"phash:{near:016x}", f"{sha(1, 'pixels')}", f"key:s-{5:09d}")
    done = apply_upkeep(storage, DATASET, tars, curated, lists=[legal], facts=ledgers, downloads=downloads)
    assert sorted(done.removed.column("row").to_pylist()) == [1, 5, 7]
    assert done.ledgers[0].startswith(f"{DATASET}/upkeep/") and done.ledgers[0].endswith("000000-c.ledger.parquet")
    out = read_parquet(storage, done.ledgers[1]).to_pylist()
    assert [r["status"] for r in out] == ["rejected", "ok", "rejected", "ok", "ok"]
    assert out[2]["detail"] == f"list legal: entry phash:{near:016x}"  # a column the curated ledger lacked


def recheck_rows(rows: list[tuple[int, str, str | None]]) -> pa.Table:
    when = datetime(2026, 12, 5, 2, tzinfo=UTC)
    return pa.Table.from_pylist(
        [
            {"key": f"s-{i:09d}", "source": "s", "row": i, "url": url(i), "checked_at": when, "outcome": o, "detail": d}
            for i, o, d in rows
        ],
        schema=RECHECK_SCHEMA,
    )


def test_recheck_outcomes_drop_or_flag_as_the_recipe_says(shards):
    storage, tars, ledgers, downloads = shards
    state = recheck_rows(
        [
            (0, "opted_out", "X-Robots-Tag: noai"),
            (1, "link_dead", "HTTP 404 Not Found"),
            (2, "content_changed", None),
            (4, "unchanged", None),
            (5, "unreachable", "connection refused"),
            (6, "opted_out", "tdm-reservation: 1"),
            (3, "link_dead", "HTTP 410 Gone"),  # rejected at validation: neither dropped nor flagged
        ]
    )
    legal = listed("legal", url(6))  # a takedown wins over the recheck where both apply
    done = apply_upkeep(storage, DATASET, tars, ledgers, lists=[legal], recheck=state, downloads=downloads)
    removed = {r["row"]: (r["reason"], r["detail"]) for r in done.removed.to_pylist()}
    assert removed == {
        0: ("opted_out", "recheck on 2026-12-05: X-Robots-Tag: noai"),
        6: ("taken_down", f"list legal: entry url:{url(6)}"),
    }
    flagged = {r["row"]: (r["key"], r["upkeep"], r["detail"]) for r in done.flagged.to_pylist()}
    assert flagged == {
        1: ("s-000000001", "link_dead", "recheck on 2026-12-05: HTTP 404 Not Found"),
        2: ("s-000000002", "content_changed", "recheck on 2026-12-05: content_changed"),
    }
    assert done.counts() == {"opted_out": 1, "taken_down": 1, "kept_content_changed": 1, "kept_link_dead": 1}
    # The recipe may drop dead links too.
    strict = apply_upkeep(
        storage, DATASET, tars, ledgers, recheck=state, actions=RecheckActions(link_dead="drop", opted_out="keep")
    )
    assert sorted((r["row"], r["reason"]) for r in strict.removed.to_pylist()) == [(1, "link_dead")]
    assert sorted(strict.flagged.column("row").to_pylist()) == [0, 2, 6]
    # A flag alone changes no ledger but is part of what was applied.
    assert strict.ledgers[1] == ledgers[1] and strict.digest


def test_the_state_a_recheck_store_keeps_is_what_applies(shards):
    from tasks.formats.recheck_store import read_current

    storage, tars, ledgers, downloads = shards
    chunk = chunk_stem(downloads[0])
    write_version(storage, DATASET, "s", chunk, 1, recheck_rows([(1, "opted_out", "robots.txt: Disallow: /p/")]))
    write_version(storage, DATASET, "s", chunk, 2, recheck_rows([(2, "opted_out", "X-Robots-Tag: noimageai")]))
    done = apply_upkeep(storage, DATASET, tars, ledgers, recheck=read_current(storage, DATASET, downloads))
    assert done.removed.column("row").to_pylist() == [2]  # the latest version is all there is
    # A chunk the download no longer holds (its manifest rows changed) keeps its checks to itself
    gone = apply_upkeep(storage, DATASET, tars, ledgers, recheck=read_current(storage, DATASET, downloads[1:]))
    assert gone.removed.num_rows == 0


def test_a_video_goes_whole_with_every_clip(tmp_path):
    storage = Storage(str(tmp_path / "store"))
    clips = [
        row(0, key=f"s-000000000-{c:03d}", video="s-000000000", phash=0x1234 + c, start_s=float(c), end_s=c + 1.0)
        for c in range(3)
    ]
    clips += [row(1, key="s-000000001-000", video="s-000000001", phash=0xFFFF0000FFFF0000)]
    ledger = write(storage, f"{DATASET}/validate/s/000000-v.ledger.parquet", clips)
    done = apply_upkeep(storage, DATASET, ["t.tar"], [ledger], lists=[listed("l", f"phash:{0x1235:016x}")])
    assert done.removed.column("key").to_pylist() == [f"s-000000000-{c:03d}" for c in range(3)]
    assert done.removed.column("video").to_pylist() == ["s-000000000"] * 3
    assert done.counts() == {"taken_down": 1}  # one manifest row
    # In the release ledger, one fate for the video, under its key.
    output = write(storage, f"{DATASET}/reshard/x/shard-000000.ledger.parquet", [clips[3]])
    _, table = release_tables(storage, [], [], [("shard-000000.tar", output)], [], None, done.removed)
    assert [(r["key"], r["status"], r["reason"], r["phase"]) for r in table.to_pylist()] == [
        ("s-000000000", "rejected", "taken_down", "upkeep"),
        ("s-000000001", "ok", None, "release"),
    ]


# --------------------------------------------------------------------------- the release ledger


def release_of(storage: Storage, downloads: list[str], ledgers: list[str], done) -> pa.Table:
    """The release tables over the shards, as if the reshard carried every ok row upkeep left."""
    kept = [r for led in done.ledgers for r in read_parquet(storage, led).to_pylist() if r["status"] == "ok"]
    output = f"{DATASET}/reshard/x/shard-000000.ledger.parquet"
    write_parquet(storage, output, pa.Table.from_pylist(kept, schema=read_parquet(storage, ledgers[0]).schema))
    samples, table = release_tables(
        storage, downloads, ledgers, [("shard-000000.tar", output)], [], None, done.removed, done.flagged
    )
    tally = Reconciliation(10)
    tally.add_ledger(table)
    tally.add_outputs(samples.select(["source", "row"]))
    s = tally.summary()
    assert (s["accounted"], s["duplicates"], s["unreleased_ok"], s["orphan_outputs"]) == (10, 0, 0, 0)
    return table


def test_the_release_ledger_gains_its_upkeep_columns_only_when_rows_need_them(shards):
    storage, tars, ledgers, downloads = shards
    plain = release_of(storage, downloads, ledgers, apply_upkeep(storage, DATASET, tars, ledgers))
    assert plain.column_names == ["key", "source", "row", "status", "reason", "phase"]

    state = recheck_rows([(0, "opted_out", "X-Robots-Tag: noai"), (1, "link_dead", "HTTP 404 Not Found")])
    done = apply_upkeep(storage, DATASET, tars, ledgers, lists=[listed("legal", url(2))], recheck=state)
    table = release_of(storage, downloads, ledgers, done)
    assert table.column_names == ["key", "source", "row", "status", "reason", "phase", "detail", "upkeep"]
    rows = {r["row"]: r for r in table.to_pylist()}
    assert {i: (r["status"], r["reason"], r["phase"]) for i, r in rows.items() if r["phase"] == "upkeep"} == {
        0: ("rejected", "opted_out", "upkeep"),
        2: ("rejected", "taken_down", "upkeep"),
    }
    assert rows[2]["detail"] == f"list legal: entry url:{url(2)}"
    assert (rows[1]["status"], rows[1]["upkeep"], rows[1]["detail"]) == (
        "ok",
        "link_dead",
        "recheck on 2026-12-05: HTTP 404 Not Found",
    )
    assert [r["upkeep"] for i, r in rows.items() if i != 1] == [None] * 9
    assert (rows[3]["reason"], rows[3]["phase"]) == ("image_too_small", "validate")

    flags_only = apply_upkeep(storage, DATASET, tars, ledgers, recheck=recheck_rows([(1, "link_dead", "gone")]))
    assert release_of(storage, downloads, ledgers, flags_only).column_names[-2:] == ["detail", "upkeep"]
    drops_only = apply_upkeep(storage, DATASET, tars, ledgers, lists=[listed("legal", url(2))])
    assert release_of(storage, downloads, ledgers, drops_only).column_names[-2:] == ["phase", "detail"]


# --------------------------------------------------------------------------- through the CLI


def photo(i: int) -> bytes:
    from tasks.demo.images import render_image

    for index in range(i * 7, i * 7 + 40):  # the first photo-like picture from here on
        name, data, _ = render_image(11, index)
        if name.endswith(".jpg"):
            return data
    raise AssertionError("no JPEG among the demo corpus's pictures")


@pytest.fixture(scope="module")
def photo_web(tmp_path_factory):
    from tasks.demo.webserver import ImageWeb

    root = tmp_path_factory.mktemp("photos")
    for i in range(8):
        (root / f"p{i}.jpg").write_bytes(photo(i))
    server = ImageWeb(root=root)
    server.start()
    yield root, server
    server.stop()


def run(*args: str, api_url: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDSMITH_")}
    env |= {"SHARDSMITH_WARM": "0", "SHARDSMITH_NOW": NOW, "PREFECT_API_URL": api_url}
    return subprocess.run(
        [sys.executable, "-m", "cli", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )


def release_files(base: Path) -> dict[str, str]:
    return {
        str(p.relative_to(base)): hashlib.sha256(p.read_bytes()).hexdigest() for p in base.rglob("*") if p.is_file()
    }


@pytest.mark.slow
def test_takedowns_and_recheck_fates_through_the_cli_without_a_fetch(tmp_path, photo_web, prefect_api_url):
    from tasks.formats.recipe import load_recipe
    from tasks.policies.images import process_image

    root, web = photo_web
    base = f"http://127.0.0.1:{web.port}/img"
    urls = [f"{base}/p{i}.jpg" for i in range(8)]
    urls[1] = f"http://localhost:{web.port}/img/p1.jpg"  # another host, for the domain entry
    manifest = tmp_path / "m.csv"
    manifest.write_text(
        "url,caption,license\n" + "".join(f"{u},photo number {i},CC0-1.0\n" for i, u in enumerate(urls))
    )
    lists = tmp_path / "lists" / "legal.txt"
    lists.parent.mkdir()
    lists.write_text("# takedown requests, one a line (shardsmith takedown add)\n")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"""dataset: kept
storage: {tmp_path / "store"}
sources:
  - name: s
    manifest: {manifest}
download:
  network: {{allowed_networks: ["127.0.0.1/32"], any_port: true}}
validate:
  license: {{review: {{reviewed_by: tests, reviewed_on: 2026-12-01}}}}
  image: {{min_side: 8}}
takedown:
  - {{path: lists/legal.txt, name: legal}}
execution: {{cluster: local, workers: 1}}
"""
    )
    store = tmp_path / "store" / "kept"
    first = run("run", str(recipe), api_url=prefect_api_url)
    assert first.returncode == 0, first.stderr[-3000:]
    v1 = store / "releases" / "v0001"
    ledger1 = pq.read_table(v1 / "ledger.parquet")
    assert ledger1.column_names == ["key", "source", "row", "status", "reason", "phase"]
    assert pc.all(pc.equal(ledger1.column("status"), "ok")).as_py() and ledger1.num_rows == 8
    frozen = release_files(v1)

    # A near copy of p3: smaller and re-encoded; its hash is a few bits from the released one.
    from PIL import Image

    im = Image.open(io.BytesIO((root / "p3.jpg").read_bytes())).convert("RGB")
    buf = io.BytesIO()
    im.resize((im.width * 3 // 4, im.height * 3 // 4)).save(buf, format="JPEG", quality=70)
    near = process_image(buf.getvalue(), load_recipe(recipe).validate_.image).phash
    validated = pq.read_table([str(p) for p in store.glob("validate/**/*.ledger.parquet")]).to_pylist()
    hashes = {r["row"]: r["phash"] for r in validated}
    assert 0 < int(np.bitwise_count(np.uint64(near ^ hashes[3]))) <= 4
    assert all(int(np.bitwise_count(np.uint64(near ^ h))) > 4 for r, h in hashes.items() if r != 3)

    digest = hashlib.sha256((root / "p2.jpg").read_bytes()).hexdigest()
    entries = [urls[0], "domain:localhost", f"sha256:{digest}", f"phash:{near:016x}"]
    added = run("takedown", "add", str(lists), *entries, "--by", "legal", "--why", "ticket 7", api_url=prefect_api_url)
    assert added.returncode == 0, added.stderr
    web.reset_stats()
    second = run("run", str(recipe), api_url=prefect_api_url)
    assert second.returncode == 0, second.stderr[-3000:]
    assert web.stats()["requests"] == 0  # nothing fetched: the facts are in the ledgers
    assert (store / "releases" / "LATEST").read_text().strip() == "v0002"
    assert release_files(v1) == frozen
    v2 = store / "releases" / "v0002"
    ledger2 = {r["row"]: r for r in pq.read_table(v2 / "ledger.parquet").to_pylist()}
    gone = {
        i: (r["status"], r["reason"], r["phase"], r["detail"]) for i, r in ledger2.items() if r["phase"] == "upkeep"
    }
    assert gone == {
        0: ("rejected", "taken_down", "upkeep", f"list legal: entry url:{urls[0]}"),
        1: ("rejected", "taken_down", "upkeep", "list legal: entry domain:localhost"),
        2: ("rejected", "taken_down", "upkeep", f"list legal: entry sha256:{digest}"),
        3: ("rejected", "taken_down", "upkeep", f"list legal: entry phash:{near:016x}"),
    }
    released = set(pq.read_table(v2 / "samples.parquet").column("row").to_pylist())
    assert released == {4, 5, 6, 7}
    assert "upkeep" not in pq.read_table(v2 / "ledger.parquet").column_names
    index = json.loads((v2 / "index.json").read_text())
    assert index["totals"]["samples"] == 4 and index["parent"] == "v0001"

    # Rechecks found row 4 opted out and row 5's link dead: dropped and kept (and flagged) by default.
    storage = Storage(str(tmp_path / "store"))
    (download,) = [str(p.relative_to(tmp_path / "store")) for p in store.glob("download/**/*.ledger.parquet")]
    state = recheck_rows([(4, "opted_out", "X-Robots-Tag: noai"), (5, "link_dead", "HTTP 404 Not Found")])
    state = state.set_column(3, "url", pa.array([urls[4], urls[5]]))
    write_version(storage, "kept", "s", chunk_stem(download), 1, state)
    third = run("run", str(recipe), "--force", api_url=prefect_api_url)
    assert third.returncode == 0, third.stderr[-3000:]
    assert web.stats()["requests"] == 0
    v3 = store / "releases" / "v0003"
    ledger3 = {r["row"]: r for r in pq.read_table(v3 / "ledger.parquet").to_pylist()}
    assert (ledger3[4]["status"], ledger3[4]["reason"], ledger3[4]["phase"], ledger3[4]["detail"]) == (
        "rejected",
        "opted_out",
        "upkeep",
        "recheck on 2026-12-05: X-Robots-Tag: noai",
    )
    assert (ledger3[5]["status"], ledger3[5]["upkeep"]) == ("ok", "link_dead")
    assert [ledger3[i]["reason"] for i in range(4)] == ["taken_down"] * 4
    assert set(pq.read_table(v3 / "samples.parquet").column("row").to_pylist()) == {5, 6, 7}
    assert release_files(v1) == frozen


def test_a_key_entry_is_pinned_to_its_sample_and_follows_it_when_rows_move(tmp_path):
    """Keys are positions in a manifest: the first run that applies a key entry pins it to the
    sample's URL and digests, so after a row above it is removed (every key below moves up by
    one) the entry still removes that sample, and not the one its key now names."""
    storage = Storage(str(tmp_path / "store"))
    legal = listed("legal", "key:s-000000002")

    def run(rows: list[LedgerRow], name: str) -> dict[str, str]:
        """The rows removed: key -> detail."""
        ledger = write(storage, f"{DATASET}/validate/s/{name}.ledger.parquet", rows)
        done = apply_upkeep(storage, DATASET, [ledger.replace(".ledger.parquet", ".tar")], [ledger], lists=[legal])
        return {r["key"]: r["detail"] for r in done.removed.to_pylist()} if done.removed is not None else {}

    assert list(run([row(i) for i in range(5)], "000000-a")) == ["s-000000002"]
    # the manifest loses its row 1: rows 2-4 are now rows 1-3, their keys with them
    moved = [row(0)] + [
        row(i - 1, url=url(i), sha256=sha(i, "stored"), pixel_sha256=sha(i, "pixels")) for i in (2, 3, 4)
    ]
    removed = run(moved, "000000-b")
    # the sample that was row 2, by its URL and digests, named after the entry
    assert removed == {"s-000000001": "list legal: entry key:s-000000002"}
    (pins,) = [pq.read_table(tmp_path / "store" / DATASET / "upkeep" / "pins" / "000000.parquet").to_pylist()]
    assert [(p["list"], p["entry"], p["url"], p["sha256"]) for p in pins] == [
        ("legal", "key:s-000000002", url(2), sha(2, "stored"))
    ]


@pytest.mark.slow
def test_new_rows_that_all_fail_make_a_release_whose_ledger_has_them(tmp_path, photo_web, prefect_api_url):
    """Rows added to the manifest that all fail change no shard, but the release ledger has one
    row per input row: the run releases again (the same shards, the longer ledger); a run with
    nothing new after it releases nothing."""
    root, web = photo_web
    base = f"http://127.0.0.1:{web.port}/img"
    manifest = tmp_path / "m.csv"
    rows = "url,caption,license\n" + "".join(f"{base}/p{i}.jpg,photo number {i},CC0-1.0\n" for i in range(3))
    manifest.write_text(rows)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"""dataset: grow
storage: {tmp_path / "store"}
sources: [{{name: s, manifest: {manifest}}}]
download:
  network: {{allowed_networks: ["127.0.0.1/32"], any_port: true}}
validate:
  license: {{review: {{reviewed_by: tests, reviewed_on: 2026-12-01}}}}
  image: {{min_side: 8}}
execution: {{cluster: local, workers: 1}}
"""
    )
    releases = tmp_path / "store" / "grow" / "releases"
    assert run("run", str(recipe), api_url=prefect_api_url).returncode == 0
    manifest.write_text(rows + f"{base}/missing.jpg,a photo gone,CC0-1.0\nnot a url,a typo,CC0-1.0\n")
    second = run("run", str(recipe), api_url=prefect_api_url)
    assert second.returncode == 0, second.stderr[-3000:]
    assert (releases / "LATEST").read_text().strip() == "v0002"
    v1, v2 = (json.loads((releases / v / "index.json").read_text()) for v in ("v0001", "v0002"))
    assert [s["sha256"] for s in v2["shards"]] == [s["sha256"] for s in v1["shards"]]
    assert (v1["ledger"]["rows"], v2["ledger"]["rows"], v2["ledger"]["ok"]) == (3, 5, 3)
    ledger = pq.read_table(releases / "v0002" / "ledger.parquet").to_pylist()
    assert len(ledger) == 5 and sorted(r["row"] for r in ledger if r["status"] != "ok") == [3, 4]
    third = run("run", str(recipe), api_url=prefect_api_url)
    assert third.returncode == 0 and (releases / "LATEST").read_text().strip() == "v0002"
