"""A fetch can neither hang a shard nor lose a row: faults at every step, the shard deadline, completion order.

Faults are injected by patching one step function of one row's fetch (the fault hook); the rest is
real: the loopback image web, aiohttp, name resolution, the manifest chunk, the tar and the ledger.
"""

from __future__ import annotations

import asyncio
import csv
import io
import socket
import threading

import aiohappyeyeballs
import pytest
from aiohttp.resolver import ThreadedResolver

import tasks.stages.fetch
import tasks.stages.fetchrows
from tasks.demo.webserver import ImageWeb
from tasks.formats.ledger import read_ledger
from tasks.formats.manifests import plan_source
from tasks.formats.reasons import REASONS
from tasks.formats.recipe_download import DownloadConfig, NetworkConfig, SourceConfig
from tasks.formats.shards import iter_samples
from tasks.formats.storage import Storage
from tasks.stages.download import download_shard, shard_paths
from tasks.stages.fetch import Fetcher
from tasks.stages.fetchrows import iter_completed

LOOPBACK = NetworkConfig(allowed_networks=("127.0.0.1/32",), any_port=True)


def cfg(**kw) -> DownloadConfig:
    base = dict(
        timeout_s=10,
        retries=1,
        backoff_s=0.01,
        max_backoff_s=0.02,
        respect_robots_txt=True,
        shard_timeout_s=60,
        network=LOOPBACK,
    )
    base.update(kw)
    return DownloadConfig(**base)


def run_shard(tmp_path, urls: list[str], config: DownloadConfig) -> tuple[list[dict], Storage, str]:
    """download_shard over a CSV manifest of ``urls``; returns (ledger rows, storage, tar)."""
    manifest = tmp_path / "m.csv"
    with open(manifest, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["url", "caption"])
        for i, url in enumerate(urls):
            w.writerow([url, f"caption {i}"])
    storage = Storage(str(tmp_path / "store"))
    plan = plan_source(SourceConfig(name="web", manifest=str(manifest)), storage, "ds")
    tar_rel, ledger_rel = shard_paths("ds", plan.chunks[0], "cfg")
    download_shard(plan.chunks[0], storage, config, tar_rel, ledger_rel)
    return read_ledger(storage, ledger_rel).to_pylist(), storage, tar_rel


# --------------------------------------------------------------------------- fault injection


class Odd(BaseException):
    """Not even an Exception."""


FAULTS = [
    ValueError("injected"),
    UnicodeError("injected"),
    RuntimeError("injected"),
    KeyError("injected"),
    StopIteration("injected"),
    asyncio.CancelledError("injected"),
    Odd("injected"),
    ConnectionResetError("injected"),
    PermissionError("injected"),
    socket.gaierror(socket.EAI_NONAME, "injected"),
    TimeoutError("injected"),
]
STEPS = ["resolution", "connect", "headers", "body", "robots", "judge"]


def expected_reason(step: str, fault: BaseException) -> str:
    """The stable reason one row ends with when ``fault`` is raised at ``step``."""
    if step == "judge":
        return "fetch_failed"  # judging touches no network: any exception there is unexpected
    if isinstance(fault, TimeoutError):
        return "timeout"
    if isinstance(fault, OSError):
        if step == "resolution":
            return "dns_error"  # aiohttp reports any OSError of the resolver as a DNS error
        if isinstance(fault, socket.gaierror) and step != "connect":
            return "dns_error"
        return "connection_error"
    if isinstance(fault, UnicodeError) and step == "resolution":
        return "invalid_url"  # getaddrinfo's IDNA error: GuardedResolver makes it an InvalidHost
    return "fetch_failed"


@pytest.fixture(scope="module")
def other_web(image_dir):
    """A second server, so that the victim row of the connect step has a port of its own."""
    with ImageWeb(image_dir) as site:
        yield site


def inject(monkeypatch, step: str, fault: BaseException, web: ImageWeb, other_web: ImageWeb) -> str:
    """Make ``step`` raise ``fault`` for one row only; returns that row's URL."""

    def boom():
        raise fault

    if step == "resolution":
        real = ThreadedResolver.resolve

        async def resolve(self, host, port=0, family=socket.AF_INET):
            if host == "localhost":
                boom()
            return await real(self, host, port, family)

        monkeypatch.setattr(ThreadedResolver, "resolve", resolve)
        return f"http://localhost:{web.port}/img/c.webp?victim"
    if step == "connect":
        real_connect = aiohappyeyeballs.start_connection

        async def start_connection(addr_infos, *args, **kwargs):
            if any(info[4][1] == other_web.port for info in addr_infos):
                boom()
            return await real_connect(addr_infos, *args, **kwargs)

        monkeypatch.setattr(aiohappyeyeballs, "start_connection", start_connection)
        return f"{other_web.base_url}/img/c.webp?victim"
    if step == "headers":
        real_x_robots = tasks.stages.fetch.x_robots_verdict

        def x_robots_verdict(values, directives, ua_token):
            if "otherbot: noai" in values:
                boom()
            return real_x_robots(values, directives, ua_token)

        monkeypatch.setattr(tasks.stages.fetch, "x_robots_verdict", x_robots_verdict)
        return f"{web.base_url}/optout-other-bot/c.webp?victim"
    if step == "body":
        real_read = Fetcher._read_capped

        async def read_capped(self, resp):
            if "victim" in str(resp.url):
                boom()
            return await real_read(self, resp)

        monkeypatch.setattr(Fetcher, "_read_capped", read_capped)
        return f"{web.base_url}/img/c.webp?victim"
    if step == "robots":
        real_robots = Fetcher._robots_verdict

        async def robots_verdict(self, url):
            if "victim" in url:
                boom()
            return await real_robots(self, url)

        monkeypatch.setattr(Fetcher, "_robots_verdict", robots_verdict)
        return f"{web.base_url}/img/c.webp?victim"
    if step == "judge":
        real_judge = tasks.stages.fetchrows.judge

        def judge(fetched, allowed_formats):
            if fetched.data is not None and fetched.data.startswith(b"BM"):
                boom()
            return real_judge(fetched, allowed_formats)

        monkeypatch.setattr(tasks.stages.fetchrows, "judge", judge)
        return f"{web.base_url}/img/e.bmp?victim"
    raise AssertionError(step)


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: type(f).__name__)
@pytest.mark.parametrize("step", STEPS)
def test_a_fault_at_any_step_is_that_rows_record(tmp_path, monkeypatch, web, other_web, step, fault):
    victim = inject(monkeypatch, step, fault, web, other_web)
    urls = [
        f"{web.base_url}/img/a.jpg?n=1",
        victim,
        f"{web.base_url}/status/404",
        f"{web.base_url}/img/b.png?n=2",
        "ftp://example.com/x.jpg",
    ]
    # robots.txt is fetched through the same resolver and connector: a fault there would end
    # the row as robots_disallowed (RFC 9309: unreachable means disallow), not at the step.
    ledger, _, _ = run_shard(tmp_path, urls, cfg(respect_robots_txt=step not in ("resolution", "connect")))
    assert [r["row"] for r in ledger] == list(range(len(urls)))  # every row, exactly once, in row order
    reasons = [r["reason"] for r in ledger]
    assert reasons[:1] + reasons[2:] == [None, "http_404", None, "unsupported_scheme"]
    hit = ledger[1]
    assert hit["reason"] == expected_reason(step, fault), hit["detail"]
    assert hit["reason"] in REASONS
    assert type(fault).__name__ in hit["detail"] or "injected" in hit["detail"], hit["detail"]
    if step == "judge":  # the fetch itself went well, and the record still says so
        assert (hit["http_status"], hit["attempts"]) == (200, 1)
        assert hit["detail"].startswith("judging the bytes: ")


def test_a_broken_fetch_machine_raises_instead_of_hanging(tmp_path, monkeypatch, web):
    """The fetch loop itself failing (not one row) is a shard error: raised, nothing committed."""

    async def broken(self):
        raise RuntimeError("no session today")

    monkeypatch.setattr(Fetcher, "__aenter__", broken)
    with pytest.raises(RuntimeError, match="no session today"):
        run_shard(tmp_path, [f"{web.base_url}/img/a.jpg"], cfg())
    assert not list((tmp_path / "store").rglob("*.ledger.parquet"))


# --------------------------------------------------------------------------- the shard deadline


def test_the_shard_deadline_records_pending_rows_and_commits(tmp_path, web, image_dir):
    urls = [
        f"{web.base_url}/img/a.jpg",
        f"{web.base_url}/hang?i=1",
        f"{web.base_url}/img/b.png",
        f"{web.base_url}/hang?i=2",
        f"{web.base_url}/img/c.webp",
    ]
    ledger, storage, tar_rel = run_shard(tmp_path, urls, cfg(timeout_s=300, retries=0, shard_timeout_s=2))
    assert [r["reason"] for r in ledger] == [None, "timeout", None, "timeout", None]
    for r in (ledger[1], ledger[3]):
        assert r["status"] == "error"
        assert r["detail"] == "the shard deadline (download.shard_timeout_s = 2 s) passed before this row finished"
    samples = {s.key: s for s in iter_samples(io.BytesIO(storage.read_bytes(tar_rel)))}
    assert sorted(samples) == ["web-000000000", "web-000000002", "web-000000004"]
    assert samples["web-000000002"].members["png"] == (image_dir / "b.png").read_bytes()


def test_rows_never_started_by_the_deadline_are_recorded_too(tmp_path, web):
    # One request at a time: the hanging first row holds the only slot until the deadline.
    urls = (
        [f"{web.base_url}/hang?i=0"]
        + [f"{web.base_url}/img/a.jpg?i={i}" for i in range(1, 12)]
        + ["ftp://example.com/x.jpg"]
    )
    ledger, _, _ = run_shard(tmp_path, urls, cfg(timeout_s=300, retries=0, max_inflight=1, shard_timeout_s=1))
    assert [r["row"] for r in ledger] == list(range(13))
    assert [r["reason"] for r in ledger] == ["timeout"] * 12 + ["unsupported_scheme"]
    details = [r["detail"] for r in ledger[:12]]
    assert details[0].endswith("passed before this row finished")
    assert details[-1].endswith("passed before this row was started")  # beyond the 8-row window


# --------------------------------------------------------------------------- completion order


def test_rows_are_written_as_they_complete_and_the_ledger_is_in_row_order(tmp_path, web, image_dir):
    urls = [f"{web.base_url}/delay/3000/a.jpg", f"{web.base_url}/img/b.png", f"{web.base_url}/img/c.webp"]
    ledger, storage, tar_rel = run_shard(tmp_path, urls, cfg())
    assert [r["reason"] for r in ledger] == [None, None, None]
    assert [r["row"] for r in ledger] == [0, 1, 2]
    tar = storage.read_bytes(tar_rel)
    # The slow first row did not hold back the two after it: it is the last in the tar.
    assert [s.key for s in iter_samples(io.BytesIO(tar))][-1] == "web-000000000"
    assert ledger[0]["offset"] > max(ledger[1]["offset"], ledger[2]["offset"])
    for row in ledger:  # the ledger's byte ranges still find each sample
        sample = next(iter_samples(io.BytesIO(tar[row["offset"] : row["offset"] + row["length"]] + bytes(1024))))
        assert sample.key == row["key"]


def test_manifest_rejects_keep_their_detail():
    rows = [
        {"row": 0, "url": "not a url", "reason": "invalid_url", "detail": "no scheme"},
        {"row": 1, "url": None, "reason": None},
    ]
    got = {row["row"]: fetched for row, fetched in iter_completed(rows, cfg())}
    assert (got[0].reason, got[0].detail, got[0].attempts) == ("invalid_url", "no scheme", 0)
    assert (got[1].reason, got[1].detail) == ("missing_url", "the row has no URL")


def test_chunk_detail_and_origin_reach_the_ledger(tmp_path, monkeypatch, web):
    """Chunks that carry ``detail`` and ``origin`` columns (the manifest reader adds them) fill the ledger's."""
    import pyarrow as pa

    import tasks.stages.download

    real_read_chunk = tasks.stages.download.read_chunk

    def read_chunk(storage, ref):
        table = real_read_chunk(storage, ref)
        origins = [f"m.csv line {line}" for line in table.column("line").to_pylist()]
        details = ["a made-up manifest detail" if reason else None for reason in table.column("reason").to_pylist()]
        return table.append_column("detail", pa.array(details, pa.string())).append_column(
            "origin", pa.array(origins, pa.string())
        )

    monkeypatch.setattr(tasks.stages.download, "read_chunk", read_chunk)
    ledger, _, _ = run_shard(tmp_path, [f"{web.base_url}/img/a.jpg", "ftp://example.com/x.jpg"], cfg())
    assert [(r["reason"], r["detail"], r["origin"]) for r in ledger] == [
        (None, None, "m.csv line 2"),
        ("unsupported_scheme", "a made-up manifest detail", "m.csv line 3"),
    ]


def test_bodies_waiting_for_a_slow_caller_are_bounded(web):
    """2 x max_inflight rows under way or done, max_inflight handed over, one held: never all of them."""
    import time

    rows = [{"row": i, "url": f"{web.base_url}/img/a.jpg?bound={i}", "reason": None} for i in range(100)]
    before = web.stats()["requests"]
    results = iter_completed(rows, cfg(max_inflight=2, respect_robots_txt=False))
    try:
        next(results)
        time.sleep(1.0)  # the caller is busy; the fetch thread runs on until the bound stops it
        started = web.stats()["requests"] - before
    finally:
        results.close()
    assert 1 <= started <= 1 + 8 + 2 + 1  # taken + window + handed over + one waiting for room


def test_leaving_early_stops_the_fetching(web):
    rows = [{"row": i, "url": f"{web.base_url}/hang?early={i}", "reason": None} for i in range(3)]
    rows.append({"row": 3, "url": f"{web.base_url}/img/a.jpg?early", "reason": None})
    results = iter_completed(rows, cfg(timeout_s=300))
    row, fetched = next(results)
    assert (row["row"], fetched.reason) == (3, None)
    results.close()  # stops the hanging fetches and joins the fetch thread
    assert not [t for t in threading.enumerate() if t.name == "shardsmith-fetch"]


def test_on_idle_is_called_once_when_the_last_result_has_been_taken(web):
    """No row is slow, so the caller never waits IDLE_S: ``on_idle`` (the flows' secede) comes
    when nothing is left to fetch, before the caller's commit, and only once."""
    rows = [{"row": i, "url": f"{web.base_url}/img/a.jpg?idle={i}", "reason": None} for i in range(6)]
    taken: list[int] = []
    calls: list[int] = []
    for row, fetched in iter_completed(rows, cfg(respect_robots_txt=False), on_idle=lambda: calls.append(len(taken))):
        assert fetched.reason is None and not calls
        taken.append(row["row"])
    assert sorted(taken) == list(range(6))
    assert calls == [6]


def test_on_idle_is_not_called_twice_when_the_last_rows_were_slow(web):
    """Called while the caller waits on a slow last row; the end of the rows does not call it again."""
    rows = [{"row": 0, "url": f"{web.base_url}/delay/2500/a.jpg", "reason": None}]
    rows += [{"row": i, "url": f"{web.base_url}/img/a.jpg?slow={i}", "reason": None} for i in range(1, 4)]
    taken: list[int] = []
    calls: list[int] = []
    for row, _ in iter_completed(rows, cfg(respect_robots_txt=False), on_idle=lambda: calls.append(len(taken))):
        taken.append(row["row"])
    assert taken[-1] == 0  # the slow row came last
    assert calls == [3]  # once, while it was awaited
