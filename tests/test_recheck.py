"""Rechecks of released rows over nights: a dataset released by `shardsmith run`, then a web that changes, and every outcome in the recheck state."""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NIGHT = ["2026-01-01T02:00:00Z", "2026-02-02T02:00:00Z", "2026-03-06T02:00:00Z"]
POLICY = "https://rights.example/policies/7.json"

# name in the manifest -> (host, path). Hosts are separate servers: each origin has its own
# robots.txt, tdmrep.json and headers, which night 2 changes.
ROWS = {
    "keep": ("main", "/img/keep.jpg"),
    "swap": ("main", "/img/swap.jpg"),
    "gone": ("main", "/img/gone.jpg"),
    "plain": ("main", "/plain/plain.jpg"),
    "plain_swap": ("main", "/plain/plain_swap.jpg"),
    "xrobots": ("xrobots", "/img/x.jpg"),
    "tdm": ("tdm", "/img/t.jpg"),
    "tdmfile": ("tdmfile", "/img/f.jpg"),
    "robots": ("robots", "/img/r.jpg"),
    "down": ("down", "/img/d.jpg"),
    "reserved": ("main", "/tdm/keep.jpg"),  # refused at the first download already
}


def image(i: int, size: tuple[int, int] = (96, 80)) -> bytes:
    from PIL import Image

    im = Image.new("RGB", size, (25 * i % 256, 200 - 15 * i, 60 + 10 * i))
    for x in range(0, size[0], 5 + i):
        for y in range(size[1]):
            im.putpixel((x, y), (0, 0, 0))
    buf = io.BytesIO()
    im.save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def cli(*args: str, api_url: str, now: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDSMITH_") or k == "SHARDSMITH_WARM"}
    env.update(PREFECT_API_URL=api_url, SHARDSMITH_NOW=now)
    return subprocess.run(
        [sys.executable, "-m", "cli", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )


def states(store: Path) -> dict[str, dict]:
    from tasks.formats.recheck_store import read_current
    from tasks.formats.storage import Storage

    ledgers = [f"rc/download/web/{p.name}" for p in (store / "rc" / "download" / "web").glob("*.ledger.parquet")]
    return {r["key"]: r for r in read_current(Storage(str(store)), "rc", ledgers).to_pylist()}


@pytest.fixture(scope="module")
def nights(tmp_path_factory, prefect_api_url):
    """Night 1 releases every row; the web changes; nights 2 and 3 recheck (30 days apart)."""
    from tasks.demo.webserver import ImageWeb

    tmp = tmp_path_factory.mktemp("recheck")
    hosts = {name: ImageWeb(tmp / name) for name in ("main", "xrobots", "tdm", "tdmfile", "robots", "down")}
    for name, (host, path) in ROWS.items():
        (tmp / host).mkdir(exist_ok=True)
        file = tmp / host / path.rsplit("/", 1)[1]
        if not file.exists():
            file.write_bytes(image(list(ROWS).index(name)))
    for server in hosts.values():
        server.start()
    manifest = tmp / "m.csv"
    lines = ["url,caption,license"]
    lines += [f"{hosts[host].base_url}{path},picture of {name},CC0-1.0" for name, (host, path) in ROWS.items()]
    manifest.write_text("\n".join(lines) + "\n")
    recipe = tmp / "r.yaml"
    recipe.write_text(
        f"""dataset: rc
storage: {tmp / "store"}
sources:
  - name: web
    manifest: {manifest}
    rows_per_shard: 4
download:
  retries: 0
  timeout_s: 5
  respect_robots_txt: true
  network: {{allowed_networks: ["127.0.0.1/32"], any_port: true}}
  recheck: {{every_days: 30, fraction: 1, dead_after: 2}}
validate:
  license: {{review: {{reviewed_by: tests, reviewed_on: 2026-12-01}}}}
  image: {{min_side: 8}}
  dedup: {{exact: false, near: false}}
execution: {{cluster: local, workers: 1}}
"""
    )
    keys = {name: f"web-{i:09d}" for i, name in enumerate(ROWS)}
    try:
        first = cli("run", str(recipe), "--json", api_url=prefect_api_url, now=NIGHT[0])
        assert first.returncode == 0, first.stderr[-3000:]
        night1 = tmp / "night1"
        shutil.copytree(tmp / "store", night1)  # for the tests that recheck from night 1 on their own
        # The web changes.
        main = tmp / "main"
        (main / "swap.jpg").write_bytes(image(40, (120, 90)))
        (main / "gone.jpg").unlink()
        (main / "plain_swap.jpg").write_bytes(image(41, (130, 70)))
        hosts["xrobots"].img_headers = {"X-Robots-Tag": "noai"}
        hosts["tdm"].img_headers = {"tdm-reservation": "1", "tdm-policy": POLICY}
        hosts["tdmfile"].tdmrep_json = json.dumps([{"location": "/img/", "tdm-reservation": 1, "tdm-policy": POLICY}])
        hosts["robots"].robots_txt = "User-agent: *\nDisallow: /img/\n"
        hosts["down"].stop()
        hosts["main"].reset_stats()
        second = cli("run", str(recipe), "--json", api_url=prefect_api_url, now=NIGHT[1])
        assert second.returncode == 0, second.stderr[-3000:]
        served = hosts["main"].stats() | {"not_modified": dict(hosts["main"].not_modified)}
        after2 = states(tmp / "store")
        third = cli("run", str(recipe), "--json", api_url=prefect_api_url, now=NIGHT[2])
        assert third.returncode == 0, third.stderr[-3000:]
        after3 = states(tmp / "store")
    finally:
        for server in hosts.values():
            server.stop()
    yield {
        "tmp": tmp,
        "recipe": recipe,
        "keys": keys,
        "night1": night1,
        "out": [json.loads(run.stdout) for run in (first, second, third)],
        "served": served,
        "after2": after2,
        "after3": after3,
    }


def test_tdm_at_first_download_rejects_with_the_policy(nights):
    import pyarrow.parquet as pq

    ledger = pq.read_table(nights["tmp"] / "store" / "rc" / "releases" / "v0001" / "ledger.parquet").to_pylist()
    row = next(r for r in ledger if r["key"] == nights["keys"]["reserved"])
    assert (row["status"], row["reason"], row["phase"]) == ("rejected", "opted_out", "download")
    download = [
        r
        for p in (nights["tmp"] / "store" / "rc" / "download" / "web").glob("*.ledger.parquet")
        for r in pq.read_table(p).to_pylist()
    ]
    detail = next(r["detail"] for r in download if r["key"] == nights["keys"]["reserved"])
    assert detail == (
        "TDM-Rep: the tdm-reservation: 1 header reserves TDM rights (tdm-policy https://rights.example/policies/tdm.json)"
    )
    # Night 1 had no release to recheck, and says when the first falls due.
    first = nights["out"][0]["recheck"]
    assert (first["checked"], first["counts"]) == (0, {})
    assert first["next_recheck_at"].startswith("2026-01-31")


def test_each_change_of_the_web_is_its_outcome(nights):
    keys, after = nights["keys"], nights["after2"]
    got = {
        name: (after[keys[name]]["outcome"], after[keys[name]]["http_status"]) for name in ROWS if name != "reserved"
    }
    assert got == {
        "keep": ("unchanged", 304),
        "swap": ("content_changed", 200),
        "gone": ("link_dead", 404),
        "plain": ("unchanged", 206),
        "plain_swap": ("content_changed", 206),
        # A 304 carries the site's headers: its opt-outs are read there.
        "xrobots": ("opted_out", 304),
        "tdm": ("opted_out", 304),
        "tdmfile": ("opted_out", 304),
        "robots": ("opted_out", None),
        "down": ("unreachable", None),
    }
    assert keys["reserved"] not in after  # never released, never rechecked
    detail = {name: after[keys[name]]["detail"] for name in ROWS if name != "reserved"}
    assert detail["xrobots"] == "X-Robots-Tag: noai"
    assert detail["tdm"] == f"TDM-Rep: the tdm-reservation: 1 header reserves TDM rights (tdm-policy {POLICY})"
    assert detail["tdmfile"].startswith("TDM-Rep: http://127.0.0.1:") and POLICY in detail["tdmfile"]
    assert "robots.txt disallows /img/r.jpg" in detail["robots"]
    assert detail["down"].startswith("connection_error: ")
    assert "Content-Range bytes 0-" in detail["plain_swap"]  # the size told it: nothing read on
    assert after[keys["down"]]["misses"] == 1
    checked = {r["checked_at"] for r in after.values()}
    assert checked == {datetime(2026, 2, 2, 2, tzinfo=UTC)}
    # The content that was read is hashed; the same bytes keep their hash, and their validators.
    assert after[keys["plain"]]["sha256"] is not None and after[keys["keep"]]["etag"]
    summary = nights["out"][1]["recheck"]
    assert summary["checked"] == 10 and summary["released"] == 10 and summary["due"] == 10
    assert summary["counts"] == {"content_changed": 2, "link_dead": 1, "opted_out": 4, "unchanged": 2, "unreachable": 1}
    assert summary["next_recheck_at"].startswith("2026-03-04")


def test_a_304_reads_no_body(nights):
    served = nights["served"]
    # The server answered the unchanged image with a 304 and sent none of its bytes.
    assert served["not_modified"] == {"/img/keep.jpg": 1}
    assert served["sent"]["/img/keep.jpg"] == 0
    # The conditional request had no Range; the image without validators got a ranged GET.
    asked = {path: rng for path, rng, _ in served["ranges"]}
    assert "/img/keep.jpg" not in asked and asked["/plain/plain.jpg"].startswith("bytes=0-")


def test_misses_accumulate_to_link_dead(nights):
    keys, after = nights["keys"], nights["after3"]
    down = after[keys["down"]]
    assert (down["outcome"], down["misses"]) == ("link_dead", 2)
    assert down["detail"].startswith("not reached in 2 checks in a row; the last: connection_error: ")
    assert after[keys["keep"]]["outcome"] == "unchanged"
    assert after[keys["keep"]]["checked_at"] == datetime(2026, 3, 6, 2, tzinfo=UTC)


def test_the_fraction_caps_a_run_and_the_share_rolls(nights, tmp_path):
    """From night 1's store: a third of the released rows a run, oldest check first, until all are checked."""
    from tasks.formats.recipe import load_recipe
    from tasks.formats.storage import Storage
    from tasks.stages.recheck import plan_recheck, recheck

    store = tmp_path / "store"
    shutil.copytree(nights["night1"], store)
    recipe = load_recipe(
        str(nights["recipe"]),
        {"storage": str(store), "download.recheck.fraction": 0.3, "download.recheck.every_days": 30},
    )
    storage = Storage(str(store))
    ledgers = sorted(f"rc/download/web/{p.name}" for p in (store / "rc" / "download" / "web").glob("*.ledger.parquet"))
    when = datetime(2026, 2, 2, 2, tzinfo=UTC)
    plan = plan_recheck(storage, recipe, ledgers, when)
    assert plan.released == 10 and plan.due == 10 and plan.rows == math.ceil(0.3 * 10)
    seen: set[str] = set()
    for run in range(4):
        summary = recheck(storage, recipe, ledgers, when.replace(hour=2 + run))
        checked = {k for k, r in states(store).items() if r["checked_at"] == when.replace(hour=2 + run)}
        assert summary.checked == len(checked) == (3 if run < 3 else 1)
        assert not checked & seen  # a row checked this month is not due again
        seen |= checked
    assert len(seen) == 10
    # Everything checked: nothing is due until 30 days after the first of them.
    after = plan_recheck(storage, recipe, ledgers, when.replace(hour=6))
    assert after.due == 0 and after.next_at == datetime(2026, 3, 4, 2, tzinfo=UTC)


def test_recheck_off_or_fraction_0_does_nothing(nights, tmp_path):
    from tasks.formats.recipe import load_recipe
    from tasks.formats.storage import Storage
    from tasks.stages.recheck import recheck

    store = tmp_path / "store"
    shutil.copytree(nights["night1"], store)
    storage = Storage(str(store))
    ledgers = [f"rc/download/web/{p.name}" for p in (store / "rc" / "download" / "web").glob("*.ledger.parquet")]
    when = datetime(2026, 2, 2, 2, tzinfo=UTC)
    for override in ({"download.recheck.enabled": False}, {"download.recheck.fraction": 0}):
        recipe = load_recipe(str(nights["recipe"]), {"storage": str(store), **override})
        summary = recheck(storage, recipe, ledgers, when)
        assert summary.checked == 0 and summary.next_recheck_at is None
    assert not (store / "rc" / "recheck").exists()


# --------------------------------------------------------------------------- one row's check, each answer


def _check(url: str, data: bytes | None, **kw):
    """One row's check against the session's web: (Check, the row)."""
    import asyncio
    import hashlib

    from tasks.formats.recipe_download import DownloadConfig, NetworkConfig
    from tasks.stages.recheck import DueRow, check_rows

    fields = dict(key="k", source="s", row=0, url=url, sha256=None, bytes=None)
    if data is not None:
        fields |= dict(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
    dead_after = kw.pop("dead_after", 3)
    config = kw.pop("config", {})
    row = DueRow(**(fields | kw))
    cfg = DownloadConfig(
        timeout_s=2,
        retries=0,
        network=NetworkConfig(allowed_networks=("127.0.0.1/32",), any_port=True, file_root=config.pop("root", None)),
        **config,
    )
    return asyncio.run(check_rows([row], cfg, dead_after))["k"], row


def test_a_304_to_either_validator_reads_nothing(web, image_dir):
    data = (image_dir / "a.jpg").read_bytes()
    f = web._file("a.jpg")
    for validators in ({"etag": f.etag}, {"last_modified": f.last_modified}):
        web.reset_stats()
        got, _ = _check(f"{web.base_url}/img/a.jpg", data, **validators)
        assert (got.outcome, got.http_status, got.bytes_read, got.sha256) == ("unchanged", 304, 0, None)
        assert web.not_modified["/img/a.jpg"] == 1 and web.sent["/img/a.jpg"] == 0


def test_new_validators_over_the_same_bytes_are_unchanged_and_kept(web, image_dir):
    data = (image_dir / "a.jpg").read_bytes()
    got, _ = _check(
        f"{web.base_url}/img/a.jpg", data, etag='"an-old-etag"', last_modified="Mon, 01 Jan 2001 00:00:00 GMT"
    )
    assert (got.outcome, got.http_status, got.bytes_read) == ("unchanged", 200, len(data))
    assert got.etag == web._file("a.jpg").etag and got.sha256 is not None


def test_other_bytes_of_the_same_size_are_a_change(web, image_dir):
    data = bytearray((image_dir / "a.jpg").read_bytes())
    data[-10] ^= 0xFF
    got, _ = _check(f"{web.base_url}/img/a.jpg", bytes(data), etag='"old"')
    assert got.outcome == "content_changed" and got.bytes_read == len(data)
    assert "the released" in got.detail


def test_a_change_found_earlier_is_compared_with_what_that_check_saw(web, image_dir):
    # The released bytes were other bytes; the last check saw a.jpg as it is served now and kept
    # its validators: a 304 to those says "still changed", with no body read...
    released = b"the bytes of the released picture"
    f = web._file("a.jpg")
    seen = "HTTP 200: other bytes than the released (on 2026-12-03)"
    web.reset_stats()
    got, _ = _check(f"{web.base_url}/img/a.jpg", released, etag=f.etag, changed=seen, changed_sha256="ab" * 32)
    assert (got.outcome, got.http_status, got.bytes_read, got.detail) == ("content_changed", 304, 0, seen)
    assert got.sha256 == "ab" * 32 and web.sent["/img/a.jpg"] == 0
    # ...while a 200 with the released bytes again (the site put the picture back) is unchanged.
    data = (image_dir / "a.jpg").read_bytes()
    back, _ = _check(f"{web.base_url}/img/a.jpg", data, etag='"the-changed-one"', changed=seen)
    assert (back.outcome, back.http_status) == ("unchanged", 200)


def test_without_validators_a_ranged_get_and_the_size_decide(web, image_dir):
    data = (image_dir / "a.jpg").read_bytes()
    same, _ = _check(f"{web.base_url}/plain/a.jpg", data)
    assert (same.outcome, same.http_status) == ("unchanged", 206)
    longer, _ = _check(f"{web.base_url}/plain/a.jpg", data[:100])
    assert (longer.outcome, longer.http_status, longer.bytes_read) == ("content_changed", 206, 0)
    assert f"Content-Range bytes 0-99/{len(data)}" in longer.detail
    shorter, _ = _check(f"{web.base_url}/plain/a.jpg", data + b"\0" * 10)
    assert (shorter.outcome, shorter.http_status, shorter.bytes_read) == ("content_changed", 206, 0)


def test_an_endless_body_is_read_only_to_the_released_size(web, image_dir):
    got, _ = _check(f"{web.base_url}/endless", b"x" * 5000)
    assert got.outcome == "content_changed" and got.detail == "more than the released size (5000) received"
    assert got.bytes_read <= 5000


def test_gone_links_and_unreachable_hosts(web, image_dir):
    data = (image_dir / "a.jpg").read_bytes()
    for code in (404, 410, 451):
        got, _ = _check(f"{web.base_url}/status/{code}", data, etag='"x"')
        assert (got.outcome, got.http_status, got.misses) == ("link_dead", code, 0)
    flaky, _ = _check(f"{web.base_url}/status/503", data, etag='"x"', misses=1)
    assert (flaky.outcome, flaky.misses, flaky.detail) == ("unreachable", 2, "http_503: HTTP 503 Service Unavailable")
    assert flaky.etag == '"x"'  # the validators of the released bytes are kept for the next check
    dead, _ = _check(f"{web.base_url}/status/503", data, etag='"x"', misses=2)
    assert (dead.outcome, dead.misses) == ("link_dead", 3)
    slow, _ = _check(f"{web.base_url}/hang?recheck", data, etag='"x"')
    assert (slow.outcome, slow.misses) == ("unreachable", 1) and slow.detail.startswith("timeout: ")
    refused, _ = _check("http://10.1.2.3/a.jpg", data, etag='"x"')  # the URL policy refuses it now
    assert refused.outcome == "unreachable" and refused.detail.startswith("blocked_address: ")


def test_redirects_are_followed_and_opt_outs_read(web, image_dir):
    data = (image_dir / "a.jpg").read_bytes()
    moved, _ = _check(f"{web.base_url}/redirect-chain/2/a.jpg", data)
    assert moved.outcome == "unchanged"
    out, _ = _check(f"{web.base_url}/optout/a.jpg", data)
    assert (out.outcome, out.detail) == ("opted_out", "X-Robots-Tag: noai, noimageai")
    robots, _ = _check(f"{web.base_url}/private/a.jpg", data, config={"respect_robots_txt": True})
    assert robots.outcome == "opted_out" and "robots.txt disallows /private/a.jpg" in robots.detail
    tdm, _ = _check(f"{web.base_url}/tdm/a.jpg", data)
    assert tdm.outcome == "opted_out" and "tdm-policy https://rights.example/policies/tdm.json" in tdm.detail


def test_a_file_url_is_hashed_from_the_file(tmp_path):
    (tmp_path / "x.bin").write_bytes(b"released bytes")
    same, _ = _check(f"file://{tmp_path}/x.bin", b"released bytes", config={"root": str(tmp_path)})
    assert (same.outcome, same.detail) == ("unchanged", "the released bytes")
    other, _ = _check(f"file://{tmp_path}/x.bin", b"released bytez", config={"root": str(tmp_path)})
    assert other.outcome == "content_changed"


def test_only_the_current_chunks_rechecks_count_and_a_key_keeps_its_latest_check(tmp_path):
    """A chunk the manifest moved away from (a row inserted above it, a caption edited) is
    fetched again under another name: what was seen of the old one follows neither its row
    numbers to other URLs nor its keys to the bytes fetched since."""
    import pyarrow as pa

    from tasks.formats.recheck_store import RECHECK_SCHEMA, read_current, write_version
    from tasks.formats.storage import Storage

    storage = Storage(str(tmp_path))

    def state(*rows):
        fields = ("key", "row", "url", "checked_at", "outcome")
        return pa.Table.from_pylist([dict(zip(fields, r), source="web") for r in rows], schema=RECHECK_SCHEMA)

    night2, night3 = datetime(2026, 12, 3, tzinfo=UTC), datetime(2026, 12, 4, tzinfo=UTC)
    # The old chunk saw row 3 (p3) opt out; the manifest then moved p3 to row 4, p2 to row 3.
    write_version(
        storage, "rc", "web", "000000-old", 1, state(("web-000000003", 3, "http://h/p3", night2, "opted_out"))
    )
    # The current chunk's version holds a key twice (a store written before the rule): the latest wins.
    write_version(
        storage,
        "rc",
        "web",
        "000000-new",
        2,
        state(
            ("web-000000004", 4, "http://h/p3", night2, "unchanged"),
            ("web-000000004", 4, "http://h/p3", night3, "opted_out"),
        ),
    )
    write_version(
        storage, "rc", "web", "000000-new", 1, state(("web-000000001", 1, "http://h/p0", night2, "link_dead"))
    )
    current = ["rc/download/web/000000-new.ledger.parquet", "rc/download/web/000004-x.r001-0123abcd.ledger.parquet"]
    got = read_current(storage, "rc", current).to_pylist()
    assert [(r["key"], r["outcome"], r["checked_at"]) for r in got] == [("web-000000004", "opted_out", night3)]
    assert read_current(storage, "rc", []).num_rows == 0
    assert read_current(storage, "rc", ["rc/download/web/000000-old.ledger.parquet"]).column("key").to_pylist() == [
        "web-000000003"
    ]
