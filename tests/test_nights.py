"""Four nightly runs over one manifest on a web that fails, heals, changes and opts out: every release says what became of every row."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from tasks.demo.nights import (
    NIGHTS,
    TDM_POLICY,
    Fate,
    Story,
    expected,
    prepare_story,
    set_night,
    takedown_entries,
    tree_digests,
)

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "demo-nights.yaml"


def cli(*args: str, story: Story, night: int, api_url: str) -> subprocess.CompletedProcess:
    """`shardsmith ARGS` as a nightly job runs it: its own process, the night's time."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDSMITH_") or k == "SHARDSMITH_WARM"}
    env["PREFECT_API_URL"] = api_url  # the session's server: no server start per command
    env["SHARDSMITH_DEMO_DIR"] = str(story.root)
    env["SHARDSMITH_NOW"] = NIGHTS[night - 1]
    return subprocess.run(
        [sys.executable, "-m", "cli", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=400
    )


@dataclass
class Night:
    """What one night's run printed, released and asked of the web."""

    number: int
    run: subprocess.CompletedProcess
    releases: list[str]
    web: dict[str, dict[str, Any]]  # origin -> its stats of the night (TrackedServer.stats + not_modified)
    requests: int
    store: dict[str, str]  # sha256 of every stored file after the night, by path
    takedown: subprocess.CompletedProcess | None = None
    diff: subprocess.CompletedProcess | None = None  # `shardsmith diff --json` of the night's release
    diff_text: subprocess.CompletedProcess | None = None


@pytest.fixture(scope="module")
def nights(tmp_path_factory, prefect_api_url) -> Any:
    """The four nights, run once for the module: (story, [Night 1..4])."""
    story = prepare_story(tmp_path_factory.mktemp("nights"))
    done: list[Night] = []
    try:
        for n in (1, 2, 3, 4):
            set_night(story, n)
            story.web.reset_stats()
            added = None
            if n == 3:
                added = cli(
                    "takedown",
                    "add",
                    story.takedown_list.name,  # the list as the recipe names it
                    *takedown_entries(story),
                    "--recipe",
                    str(RECIPE),
                    "--by",
                    "trust-and-safety@example.org",
                    "--why",
                    "requests of 2026-12-04",
                    story=story,
                    night=n,
                    api_url=prefect_api_url,
                )
                assert added.returncode == 0, added.stderr[-3000:]
                checked = cli("takedown", "check", str(RECIPE), story=story, night=n, api_url=prefect_api_url)
                assert checked.returncode == 0, checked.stderr[-3000:]
                assert "4 entries (1 url, 1 domain, 1 sha256, 1 phash)" in checked.stdout, checked.stdout
            run = cli("run", str(RECIPE), story=story, night=n, api_url=prefect_api_url)
            assert run.returncode == 0, f"night {n}:\n{run.stdout[-3000:]}\n{run.stderr[-5000:]}"
            stats = {o.name: {**o.stats(), "not_modified": dict(o.not_modified)} for o in story.web}
            releases = sorted(p.name for p in (story.store / "nights" / "releases").glob("v[0-9]*"))
            night = Night(n, run, releases, stats, story.web.requests(), tree_digests(story.store))
            night.takedown = added
            if n > 1 and len(releases) >= 2:
                versions = (str(RECIPE), releases[-2], releases[-1])
                night.diff = cli("diff", *versions, "--json", story=story, night=n, api_url=prefect_api_url)
                night.diff_text = cli("diff", *versions, story=story, night=n, api_url=prefect_api_url)
            done.append(night)
        yield story, done
    finally:
        story.web.stop()


def release_dir(story: Story, version: str) -> Path:
    return story.store / "nights" / "releases" / version


def ledger_of(story: Story, version: str) -> list[dict[str, Any]]:
    return pq.read_table(release_dir(story, version) / "ledger.parquet").to_pylist()


def fates(rows: list[dict[str, Any]]) -> dict[str, Fate]:
    return {r["key"]: Fate(r["status"], r["reason"], r["phase"], r.get("upkeep")) for r in rows}


def differences(got: dict[str, Fate], want: dict[str, Fate]) -> list[str]:
    return [
        f"{k}: got {got.get(k)}, want {want.get(k)}" for k in sorted(set(got) | set(want)) if got.get(k) != want.get(k)
    ]


def check_release(story: Story, version: str, night: int) -> list[dict[str, Any]]:
    """Release ``version`` says of every row what night ``night`` should give, once each; its
    samples are exactly its ok rows."""
    rows = ledger_of(story, version)
    keys = [r["key"] for r in rows]
    assert len(keys) == len(set(keys)) == len(story.rows), "every row ends as exactly one ledger row"
    assert differences(fates(rows), expected(story, night)) == []
    samples = pq.read_table(release_dir(story, version) / "samples.parquet", columns=["key"]).column("key")
    assert sorted(samples.to_pylist()) == sorted(r["key"] for r in rows if r["status"] == "ok")
    return rows


def by_key(story: Story) -> dict[str, Any]:
    return {p.key: p for p in story.rows}


def sample_bytes(story: Story, version: str, key: str) -> bytes:
    """The bytes of one released sample, as its release's samples table locates them."""
    t = pq.read_table(release_dir(story, version) / "samples.parquet").to_pylist()
    (s,) = [r for r in t if r["key"] == key]
    with (release_dir(story, version) / s["shard"]).open("rb") as fh:
        fh.seek(s["offset"])
        return fh.read(s["length"])


@pytest.mark.slow
def test_night_1_releases_what_answered_and_records_the_outage(nights):
    story, (n1, *_) = nights
    assert n1.releases == ["v0001"]
    rows = check_release(story, "v0001", 1)
    # Nothing was flagged or removed after a release yet: the ledger has today's columns only.
    assert "upkeep" not in rows[0] and "detail" not in rows[0]
    # The down host answered 503 and the other never answered; every other row was fetched once.
    assert n1.web["b"]["requests"] > 0 and n1.web["c"]["requests"] > 0
    for p in story.rows:
        if p.origin not in ("b", "c"):
            assert n1.web[p.origin]["hits"][f"/img/{p.name}"] == 1, p


@pytest.mark.slow
def test_night_2_releases_the_recovered_rows_and_flags_dead_changed_and_opted_out(nights):
    story, (_, n2, *_) = nights
    assert n2.releases == ["v0001", "v0002"]
    rows = {r["key"]: r for r in check_release(story, "v0002", 2)}
    plan = by_key(story)
    for key, row in rows.items():
        p = plan[key]
        if p.role in ("outage_503", "outage_hang"):
            # Fetched again because the last attempt was a passing failure: once, whole.
            assert n2.web[p.origin]["hits"][f"/img/{p.name}"] == 1, p
            assert n2.web[p.origin]["sent"][f"/img/{p.name}"] > 0, p
            continue
        # Every row released the night before was checked again, and no body but the replaced
        # picture's was sent: the others answered 304 to a conditional request or 404, or were
        # not asked (robots.txt now disallows them).
        if p.role != "replaced":
            assert n2.web[p.origin]["sent"][f"/img/{p.name}"] == 0, p
        if p.role in ("steady", "tdmrep") or p.role.startswith("takedown_"):
            assert n2.web[p.origin]["not_modified"].get(f"/img/{p.name}") == 1, p
        # Each flagged or dropped row says what the recheck saw.
        seen = {
            "robots": f"robots.txt disallows /img/{p.name}",
            "tdmrep": TDM_POLICY,  # TDM-Rep's policy, for whoever wants to license the content
            "dead": "404",
            "replaced": f"the released file has {p.size} bytes",
        }.get(p.role)
        if seen is not None:
            assert seen in (row["detail"] or ""), row
    # A flagged row that stays released keeps the bytes released before.
    changed = story.one("replaced").key
    assert sample_bytes(story, "v0002", changed) == sample_bytes(story, "v0001", changed)


@pytest.mark.slow
def test_night_3_takes_down_every_kind_of_entry_without_editing_the_manifest(nights):
    story, (_, _, n3, _) = nights
    assert n3.takedown is not None and n3.takedown.returncode == 0
    assert n3.releases == ["v0001", "v0002", "v0003"]
    rows = {r["key"]: r for r in check_release(story, "v0003", 3)}
    entries = takedown_entries(story)
    plan = by_key(story)
    for key, row in rows.items():
        if row["reason"] == "taken_down":
            # The row names the list and the entry that matched it.
            assert story.takedown_list.name in row["detail"], row
            role = plan[key].role
            entry = entries[("takedown_url", "takedown_domain", "takedown_sha256", "takedown_phash").index(role)]
            assert entry in row["detail"], row
    # Applied from the ledgers' URLs and hashes: no image body was fetched for a taken-down row.
    for p in story.rows:
        if p.role.startswith("takedown_"):
            assert n3.web[p.origin]["sent"][f"/img/{p.name}"] == 0, p
    # The list holds who asked and why beside each entry.
    text = story.takedown_list.read_text()
    assert all(e in text for e in entries) and "trust-and-safety@example.org" in text


@pytest.mark.slow
def test_night_4_with_nothing_due_costs_what_a_noop_costs(nights):
    story, (*_, n3, n4) = nights
    assert "up to date" in n4.run.stdout, n4.run.stdout[-2000:]
    assert n4.releases == n3.releases  # no new release
    assert n4.requests == 0  # the web was not asked anything
    assert n4.store == n3.store  # and nothing was written


@pytest.mark.slow
def test_releases_and_committed_shards_stay_byte_identical(nights):
    _, done = nights
    for earlier, later in zip(done, done[1:], strict=False):
        for path, digest in earlier.store.items():
            # Every release and every committed shard or ledger stays as it was written.
            if path.startswith(("nights/releases/v", "nights/download/", "nights/validate/")):
                assert later.store.get(path) == digest, f"{path} changed on night {later.number}"


@pytest.mark.slow
def test_each_diff_names_what_changed_since_the_night_before(nights):
    story, (_, n2, n3, _) = nights
    # Row by row: the rows whose fate changed between two releases are exactly those the story changes.
    for a, b, night in (("v0001", "v0002", 2), ("v0002", "v0003", 3)):
        fa, fb = fates(ledger_of(story, a)), fates(ledger_of(story, b))
        got = {k: (fa[k], fb[k]) for k in fa if fa[k] != fb[k]}
        before, after = expected(story, night - 1), expected(story, night)
        assert got == {k: (before[k], after[k]) for k in before if before[k] != after[k]}
    # What `shardsmith diff` says: the night's changes by kind, with their counts.
    want = {
        2: {"recovered": 6, "dead": 3, "changed": 1, "opted_out": 3, "removed": 3},
        3: {"taken_down": 5, "removed": 5},
    }
    for night in (n2, n3):
        assert night.diff is not None and night.diff.returncode == 0, night.diff.stderr if night.diff else None
        cats = json.loads(night.diff.stdout)["changes"]["categories"]
        counts = {name: c["count"] for name, c in cats.items() if c["count"]}
        assert counts == want[night.number], night.diff.stdout[-3000:]
    cats = json.loads(n2.diff.stdout)["changes"]["categories"]
    assert (cats["dead"]["kept"], cats["changed"]["kept"], cats["opted_out"]["kept"]) == (3, 1, 0)
    assert n2.diff_text is not None and n2.diff_text.returncode == 0
    for label in ("recovered", "dead links", "changed content", "opted out"):
        assert label in n2.diff_text.stdout, n2.diff_text.stdout


def test_the_night_web_answers_as_a_server_would(tmp_path):
    """The loopback web the nights run on: validators and 304s, ranges, outages, dead links,
    replaced files, opt-out headers, per origin; and it counts what it was asked and sent."""
    import urllib.error
    import urllib.request

    from tasks.demo.nightweb import NightWeb

    def get(url: str, headers: dict[str, str] | None = None, timeout: float = 5) -> tuple[int, Any, bytes]:
        """(status, headers, body) of a GET (headers read case-insensitively)."""
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as r:
                return r.status, r.headers, r.read()
        except urllib.error.HTTPError as err:
            return err.code, err.headers, err.read()

    body = bytes(range(256)) * 40
    with NightWeb(tmp_path, ["a", "b"], url_hosts={"b": "localhost"}) as web:
        a = web["a"]
        a.replace("x.jpg", body, mtime=1_800_000_000)
        url = a.file_url("x.jpg")
        assert web["b"].base_url.startswith("http://localhost:")
        status, headers, got = get(url)
        assert (status, got) == (200, body)
        etag, modified = headers["ETag"], headers["Last-Modified"]
        # Conditional requests: a matching ETag or a date no older than the file is a 304, no body.
        assert get(url, {"If-None-Match": etag})[0] == 304
        assert get(url, {"If-None-Match": f'"other", W/{etag}'})[0] == 304
        assert get(url, {"If-Modified-Since": modified})[0] == 304
        assert get(url, {"If-None-Match": '"other"', "If-Modified-Since": modified})[0] == 200  # the ETag decides
        status, headers, got = get(url, {"Range": "bytes=10-19"})
        assert (status, got, headers["Content-Range"]) == (206, body[10:20], f"bytes 10-19/{len(body)}")
        assert a.stats()["sent"]["/img/x.jpg"] == len(body) * 2 + 10 and a.not_modified == {"/img/x.jpg": 3}
        # A replaced file has new validators; the old ETag no longer matches.
        a.replace("x.jpg", body[::-1])
        status, headers, got = get(url, {"If-None-Match": etag})
        assert (status, got) == (200, body[::-1]) and headers["ETag"] != etag and headers["Last-Modified"] != modified
        # Opt-out headers ride on every file answer, a 304 included; robots.txt and tdmrep.json per origin.
        a.tdm_reservation, a.tdm_policy, a.x_robots_tag = 1, "https://a.example/policy", "noai"
        status, headers, _ = get(url, {"If-None-Match": headers["ETag"]})
        assert (
            status == 304 and headers["tdm-reservation"] == "1" and headers["tdm-policy"] == "https://a.example/policy"
        )
        assert headers["X-Robots-Tag"] == "noai"
        a.robots_txt, a.tdmrep = "User-agent: *\nDisallow: /img/\n", [{"location": "/img/*", "tdm-reservation": 1}]
        assert get(a.base_url + "/robots.txt")[2] == b"User-agent: *\nDisallow: /img/\n"
        assert get(a.base_url + "/.well-known/tdmrep.json")[2].startswith(b'[{"location": "/img/*"')
        assert get(web["b"].url("/robots.txt"))[0] == 404 and get(web["b"].url("/.well-known/tdmrep.json"))[0] == 404
        # A dead link, an origin that is down, one that never answers.
        a.gone["x.jpg"] = 410
        assert get(url)[0] == 410
        a.mode = "down"
        assert get(a.base_url + "/robots.txt")[0] == 503
        a.mode = "hang"
        with pytest.raises(TimeoutError):
            get(url, timeout=0.5)
        web.reset_stats()
        assert web.requests() == 0 and web.bodies() == 0
