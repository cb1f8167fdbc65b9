"""Storage faults: a full disk mid-shard, S3 connections cut mid-upload, two runs of one dataset, two commits of one release."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tasks.formats.faults import FAULT_ENV
from tasks.formats.locks import LockConfig, LockHeld, RunLock, stale_reason
from tasks.formats.manifests import plan_source
from tasks.formats.recipe_download import DownloadConfig, NetworkConfig, SourceConfig
from tasks.formats.shards import iter_samples
from tasks.formats.storage import Storage
from tasks.stages.download import download_shard, shard_paths
from tasks.stages.release import ReleaseError, commit_index

CFG = DownloadConfig(timeout_s=5, retries=0, network=NetworkConfig(allowed_networks=("127.0.0.1/32",), any_port=True))
ROWS = 24


def plan_chunk(storage: Storage, tmp_path: Path, web) -> tuple:
    """One chunk of ``ROWS`` distinct URLs of a ~100 KB photo: a shard of a few MB."""
    manifest = tmp_path / "m.csv"
    manifest.write_text(
        "url,caption,license\n"
        + "".join(f"{web.base_url}/img/photo.jpg?i={i},photo {i},CC0-1.0\n" for i in range(ROWS))
    )
    plan = plan_source(SourceConfig(name="web", manifest=str(manifest), rows_per_shard=ROWS), storage, "ds")
    (ref,) = plan.chunks
    return (ref, *shard_paths("ds", ref, "cfg"))


def assert_nothing_published(folder: Path, tar_rel: str, ledger_rel: str, storage: Storage) -> None:
    assert not storage.exists(tar_rel) and not storage.exists(ledger_rel)
    assert [p.name for p in folder.rglob(".tmp-*")] == []  # the torn temp file is removed too


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str):
    """A real size-limited filesystem, where this machine lets us mount one (root in a container)."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()}); the injected ENOSPC test covers this")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(path: Path, leave: int) -> Path:
    """Fill the filesystem at ``path`` until ``leave`` bytes are free."""
    st = os.statvfs(path)
    filler = path / "filler"
    filler.write_bytes(b"\0" * max(0, st.f_bavail * st.f_frsize - leave))
    return filler


def test_a_full_disk_mid_shard_leaves_no_truncated_shard_and_a_rerun_completes(tmp_path, web):
    with small_tmpfs(tmp_path / "disk", "2m") as disk:
        storage = Storage(str(disk))
        ref, tar_rel, ledger_rel = plan_chunk(storage, tmp_path, web)
        filler = fill(disk, leave=256 * 1024)  # room for a few photos, not for the shard
        with pytest.raises(OSError) as err:
            download_shard(ref, storage, CFG, tar_rel, ledger_rel)
        assert err.value.errno == errno.ENOSPC and "No space left on device" in str(err.value)
        assert_nothing_published(disk, tar_rel, ledger_rel, storage)
        filler.unlink()  # space freed: the same shard now commits
        result = download_shard(ref, storage, CFG, tar_rel, ledger_rel)
        assert result.counts.ok == ROWS and not result.skipped
        with storage.open(tar_rel) as fh:
            assert len(list(iter_samples(fh))) == ROWS


@pytest.mark.parametrize("point", ["before", "write"])
def test_an_injected_enospc_leaves_nothing_under_the_final_name(tmp_path, web, monkeypatch, point):
    storage = Storage(str(tmp_path / "store"))
    ref, tar_rel, ledger_rel = plan_chunk(storage, tmp_path, web)
    monkeypatch.setenv(FAULT_ENV, f"enospc:{point}:ds/download/*.tar")
    with pytest.raises(OSError, match="No space left on device") as err:
        download_shard(ref, storage, CFG, tar_rel, ledger_rel)
    assert err.value.errno == errno.ENOSPC
    assert_nothing_published(tmp_path / "store", tar_rel, ledger_rel, storage)
    monkeypatch.delenv(FAULT_ENV)
    assert download_shard(ref, storage, CFG, tar_rel, ledger_rel).counts.ok == ROWS


def test_a_full_disk_fails_the_run_with_a_clear_message_and_the_rerun_completes(
    tmp_path, web, prefect_harness, monkeypatch
):
    from flows.download import PhaseFailed
    from flows.pretraining import run_phases
    from tasks.formats.recipe import Recipe

    manifest = tmp_path / "m.csv"
    manifest.write_text(
        "url,caption,license\n" + "".join(f"{web.base_url}/img/photo.jpg?i={i},photo {i},CC0-1.0\n" for i in range(12))
    )
    recipe = Recipe.model_validate(
        {
            "dataset": "ds",
            "storage": str(tmp_path / "store"),
            "sources": [{"name": "web", "manifest": str(manifest), "rows_per_shard": 6}],
            "download": {
                "timeout_s": 5,
                "retries": 0,
                "network": {"allowed_networks": ["127.0.0.1/32"], "any_port": True},
            },
            "execution": {"workers": 1, "task_retries": 0},
        }
    )
    monkeypatch.setenv(FAULT_ENV, "enospc:write:ds/download/web/000001-*.tar")  # workers inherit it
    with pytest.raises(PhaseFailed) as err:
        run_phases(recipe, ["download"])
    message = str(err.value)
    assert "1 of 2 download shards failed" in message and "000001-" in message and "No space left on device" in message
    download = tmp_path / "store" / "ds" / "download" / "web"
    assert sorted(p.name.split("-")[0] + p.suffix for p in download.iterdir()) == ["000000.parquet", "000000.tar"]
    monkeypatch.delenv(FAULT_ENV)
    out = run_phases(recipe, ["download"])
    assert out["download"].shards_skipped == 1 and out["download"].counts.ok == 12


# --- S3: connections cut mid-upload -----------------------------------------------------------


class CuttingProxy:
    """A loopback TCP proxy in front of an S3 endpoint that cuts PUT requests mid-body.

    Args:
        port: the endpoint's port on 127.0.0.1.
        cuts: how many PUTs to cut (after their headers and 100 body bytes); the rest pass.
    """

    def __init__(self, port: int, cuts: int):
        self.port, self.cuts, self.cut = port, cuts, 0
        self._lock = threading.Lock()
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._sock.close()

    def sever(self) -> None:
        """The store gone: no new connection (a listening socket closed under a blocked accept
        keeps accepting: it is shut down first), and the open ones (a client's pool) cut."""
        self._shut(self._sock, *self._open)
        self.close()

    _open: list[socket.socket]

    def _accept(self) -> None:
        self._open = []
        with contextlib.suppress(OSError):
            while True:
                client, _ = self._sock.accept()
                upstream = socket.create_connection(("127.0.0.1", self.port))
                self._open += [client, upstream]
                threading.Thread(target=self._up, args=(client, upstream), daemon=True).start()
                threading.Thread(target=self._down, args=(upstream, client), daemon=True).start()

    @staticmethod
    def _shut(*socks: socket.socket) -> None:
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def _down(self, upstream: socket.socket, client: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := upstream.recv(65536):
                client.sendall(data)
        self._shut(client, upstream)

    def _take_cut(self) -> bool:
        with self._lock:
            if self.cuts <= 0:
                return False
            self.cuts -= 1
            self.cut += 1
            return True

    def _up(self, client: socket.socket, upstream: socket.socket) -> None:
        pending = False  # a PUT's headers passed; cut within its body
        with contextlib.suppress(OSError):
            while data := client.recv(65536):
                if pending or (self.cuts > 0 and b"PUT /" in data):
                    end = data.find(b"\r\n\r\n")
                    start = 0 if pending else (end + 4 if end >= 0 else None)
                    if start is not None and len(data) > start + 100:
                        if self._take_cut():
                            upstream.sendall(data[: start + 100])
                            time.sleep(0.1)  # the server has read a torn body when the line drops
                            self._shut(client, upstream)
                            return
                        pending = False
                    else:
                        pending = True
                upstream.sendall(data)
        self._shut(client, upstream)


@pytest.fixture
def s3_direct(s3_bucket):
    """The bucket, options for the direct endpoint, and a factory of cutting proxies in front of it."""
    bucket, options = s3_bucket
    endpoint = options["client_kwargs"]["endpoint_url"]
    proxies = []

    def through_proxy(cuts: int, **extra) -> tuple[CuttingProxy, dict]:
        proxy = CuttingProxy(int(endpoint.rsplit(":", 1)[1]), cuts)
        proxies.append(proxy)
        return proxy, {**options, "client_kwargs": {"endpoint_url": proxy.url}, "skip_instance_cache": True, **extra}

    yield bucket, options, through_proxy
    for p in proxies:
        p.close()


def test_an_s3_upload_cut_mid_body_is_retried_and_lands_whole(s3_direct):
    bucket, options, through_proxy = s3_direct
    proxy, cut_options = through_proxy(cuts=1)
    payload = os.urandom(300_000)
    Storage(f"s3://{bucket}/root", cut_options).write_bytes("ds/download/x.tar", payload)
    assert proxy.cut == 1
    assert Storage(f"s3://{bucket}/root", options).read_bytes("ds/download/x.tar") == payload


def test_an_s3_upload_that_keeps_failing_publishes_nothing(s3_direct):
    bucket, options, through_proxy = s3_direct
    # Few retries keep the test short; the outcome is the same with the defaults.
    proxy, cut_options = through_proxy(cuts=1000, config_kwargs={"retries": {"max_attempts": 1, "mode": "standard"}})
    with pytest.raises(Exception) as err:
        Storage(f"s3://{bucket}/root", cut_options).write_bytes("ds/download/x.tar", os.urandom(300_000))
    assert "closed" in str(err.value).lower() or "connection" in str(err.value).lower()
    assert proxy.cut >= 2
    direct = Storage(f"s3://{bucket}/root", options)
    assert not direct.exists("ds/download/x.tar") and direct.listdir("ds/download") == []


# --- the dataset lock ---------------------------------------------------------------------------


@pytest.fixture(params=["local", "s3"])
def lock_storage(request, tmp_path) -> Storage:
    """A storage root for tests of exclusive creates (the lock, index.json): a local folder,
    or a fresh bucket on the moto server."""
    if request.param == "local":
        return Storage(str(tmp_path / "store"))
    bucket, options = request.getfixturevalue("s3_bucket")
    return Storage(f"s3://{bucket}/root", options)


def test_a_second_run_refuses_naming_the_holder_then_gets_the_lock_after_release(lock_storage):
    storage = lock_storage
    first = RunLock(storage, "ds", "run-1", LockConfig(heartbeat_s=0.2)).acquire()
    with pytest.raises(LockHeld, match=r"held by run run-1 \(host .*, pid \d+, started "):
        RunLock(storage, "ds", "run-2").acquire()
    time.sleep(0.5)  # heartbeats rewrite the lock; it stays ours
    first.check()
    assert (
        json.loads(storage.read_bytes("ds/run.lock"))["heartbeat"]
        > json.loads(storage.read_bytes("ds/run.lock"))["started"]
    )
    first.release()
    assert not storage.exists("ds/run.lock")
    with RunLock(storage, "ds", "run-2"):
        assert json.loads(storage.read_bytes("ds/run.lock"))["run"] == "run-2"


def test_a_waiting_run_gets_the_lock_when_the_holder_finishes(lock_storage):
    storage = lock_storage
    first = RunLock(storage, "ds", "run-1").acquire()
    threading.Timer(0.6, first.release).start()
    started = time.monotonic()
    with RunLock(storage, "ds", "run-2", LockConfig(wait_s=30, poll_s=0.1)):
        assert time.monotonic() - started < 30
    with pytest.raises(LockHeld):  # and a wait that runs out refuses
        with (
            RunLock(storage, "ds", "run-3", LockConfig(wait_s=0.3, poll_s=0.1)),
            RunLock(storage, "ds", "run-4", LockConfig(wait_s=0.3, poll_s=0.1)),
        ):
            pass


def test_stale_locks_are_broken_a_dead_pid_at_once_a_silent_holder_after_the_ttl(lock_storage):
    storage = lock_storage
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that was a process on this host and is no longer
    now = time.time()
    lock = {
        "run": "crashed",
        "host": socket.gethostname(),
        "pid": dead.pid,
        "started": now,
        "heartbeat": now,
        "token": "t",
    }
    storage.write_bytes("ds/run.lock", json.dumps(lock).encode())
    with RunLock(storage, "ds", "run-2"):
        assert json.loads(storage.read_bytes("ds/run.lock"))["run"] == "run-2"
    # Another host: its pid says nothing here; only a heartbeat older than the TTL breaks it.
    silent = {**lock, "host": "elsewhere", "pid": 1, "heartbeat": now - 120}
    storage.write_bytes("ds/run.lock", json.dumps(silent).encode())
    with pytest.raises(LockHeld, match="host elsewhere"):
        RunLock(storage, "ds", "run-3", LockConfig(ttl_s=600)).acquire()
    with RunLock(storage, "ds", "run-3", LockConfig(ttl_s=60)):
        assert json.loads(storage.read_bytes("ds/run.lock"))["run"] == "run-3"


def test_a_broken_lock_is_noticed_by_its_old_holder_before_it_commits(tmp_path):
    storage = Storage(str(tmp_path / "store"))
    slow = RunLock(storage, "ds", "slow", LockConfig(heartbeat_s=3600, ttl_s=0.2)).acquire()
    time.sleep(0.4)  # missed its heartbeats: stale for anyone with the same TTL
    with RunLock(storage, "ds", "fast", LockConfig(ttl_s=0.2, heartbeat_s=3600)):
        slow.heartbeat()
        with pytest.raises(Exception, match="taken over by another run"):
            slow.check()
    slow.release()
    assert not storage.exists("ds/run.lock")


def test_two_processes_racing_for_one_lock_never_both_hold_it(tmp_path):
    import multiprocessing as mp

    root = str(tmp_path / "store")
    ctx = mp.get_context("spawn")
    with ctx.Pool(4) as pool:
        results = pool.map(_hold_briefly, [(root, i) for i in range(8)])
    # Each process held the lock for 0.2 s and logged its interval: none overlap.
    intervals = sorted(r for r in results if r is not None)
    assert len(intervals) >= 2
    for (_a0, a1), (b0, _b1) in zip(intervals, intervals[1:]):
        assert a1 <= b0


def _hold_briefly(args: tuple[str, int]) -> tuple[float, float] | None:
    root, i = args
    with RunLock(Storage(root), "ds", f"run-{i}", LockConfig(wait_s=30, poll_s=0.02)):
        start = time.time()
        time.sleep(0.2)
        return start, time.time()


def test_the_pretraining_run_refuses_while_another_holds_the_dataset(tmp_path, prefect_harness):
    from flows.pretraining import run_phases
    from tasks.formats.recipe import Recipe

    manifest = tmp_path / "m.csv"
    manifest.write_text("url,caption,license\nhttp://127.0.0.1:9/x.jpg,x,CC0-1.0\n")
    recipe = Recipe.model_validate(
        {"dataset": "ds", "storage": str(tmp_path / "store"), "sources": [{"name": "web", "manifest": str(manifest)}]}
    )
    with RunLock(Storage(recipe.storage), "ds", "the-nightly"):
        with pytest.raises(LockHeld, match="held by run the-nightly"):
            run_phases(recipe, ["download"])
    # Refused before any work: nothing of the second run was written.
    assert sorted(p.name for p in (tmp_path / "store" / "ds").iterdir()) == []


def test_stale_reason_reads_unparsable_locks_by_age():
    assert stale_reason(None, ttl_s=60, age_s=5) is None
    assert stale_reason(None, ttl_s=60, age_s=120) == "unreadable lock file"


def test_taking_the_lock_sweeps_killed_writers_temp_files_but_not_a_rival_lock_attempt(tmp_path):
    storage = Storage(str(tmp_path / "store"))
    base = tmp_path / "store" / "ds"
    (base / "releases" / "v0001").mkdir(parents=True)
    torn = [
        base / "releases" / "v0001" / ".tmp-abc-shard-000000.tar",
        base / "releases" / "v0001" / "index.json.0123abcd.tmp",
    ]
    for path in torn:
        path.write_bytes(b"torn")
    rival = base / "run.lock.4567cdef.tmp"  # another run's lock attempt, about to be linked
    rival.write_bytes(b"{}")
    with RunLock(storage, "ds", "r1") as lock:
        assert not any(p.exists() for p in torn) and rival.exists()
        assert lock.sweep() == 0


# --- the release commit ---------------------------------------------------------------------------


def _race(storage: Storage, rel: str, writers: int = 2) -> tuple[list[int], list[BaseException]]:
    """``writers`` threads commit different index.json bodies to ``rel`` at the same moment;
    returns which writers committed and what the others raised."""
    barrier = threading.Barrier(writers)
    won: list[int] = []
    lost: list[BaseException] = []
    lock = threading.Lock()

    def commit(i: int) -> None:
        # A Storage per writer, as two runs on two machines would have.
        mine = Storage(storage.root, storage.options)
        barrier.wait()
        try:
            commit_index(mine, rel, {"version": "v0001", "writer": i})
        except BaseException as err:  # noqa: BLE001 - collected for the assertions
            with lock:
                lost.append(err)
        else:
            with lock:
                won.append(i)

    threads = [threading.Thread(target=commit, args=(i,)) for i in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return won, lost


def test_two_racing_index_commits_one_wins_the_other_gets_a_clear_error(lock_storage):
    storage = lock_storage
    # Many rounds: a check-then-PUT commit lets both writers through in most of them.
    for n in range(12):
        rel = f"ds/releases/v{n + 1:04d}/index.json"
        won, lost = _race(storage, rel)
        assert len(won) == 1, f"round {n}: {len(won)} writers committed {rel}"
        assert len(lost) == 1 and isinstance(lost[0], ReleaseError), lost
        assert "exists; releases are immutable" in str(lost[0]) and storage.url(rel) in str(lost[0])
        assert json.loads(storage.read_bytes(rel))["writer"] == won[0]


def test_an_index_commit_never_overwrites_and_a_repeat_of_the_same_bytes_is_not_a_conflict(lock_storage):
    storage = lock_storage
    rel = "ds/releases/v0001/index.json"
    commit_index(storage, rel, {"version": "v0001", "writer": 0})
    # The same bytes again: this writer's own PUT, retried after its reply was lost.
    commit_index(storage, rel, {"version": "v0001", "writer": 0})
    with pytest.raises(ReleaseError, match="exists; releases are immutable"):
        commit_index(storage, rel, {"version": "v0001", "writer": 1})
    assert json.loads(storage.read_bytes(rel))["writer"] == 0
    if storage.is_local:
        # Nothing left beside it: the temp file the link was made from is gone.
        assert storage.listdir("ds/releases/v0001") == ["index.json"]


def test_object_store_listings_are_never_served_stale(s3_bucket):
    """Workers in other processes write ledgers while the flow reads: a listing or an open in
    the flow's process must see them, never a listing cached before they were written (s3fs
    caches listings by default, and an open then fails as if the object were missing)."""
    import s3fs

    bucket, options = s3_bucket
    storage = Storage(f"s3://{bucket}/store", options)
    storage.write_bytes("ds/download/000000-a.ledger.parquet", b"first")
    assert storage.listdir("ds/download") == ["000000-a.ledger.parquet"]
    worker = s3fs.S3FileSystem(**options, skip_instance_cache=True)  # another process's client
    worker.pipe(f"{bucket}/store/ds/download/000001-b.ledger.parquet", b"second")
    assert storage.listdir("ds/download") == ["000000-a.ledger.parquet", "000001-b.ledger.parquet"]
    assert storage.exists("ds/download/000001-b.ledger.parquet")
    assert storage.read_bytes("ds/download/000001-b.ledger.parquet") == b"second"
    with storage.open("ds/download/000001-b.ledger.parquet") as fh:
        assert fh.read() == b"second"


def test_a_lock_that_cannot_be_released_never_hides_the_error_the_run_stops_on(s3_direct):
    """A run that stops because its store stopped answering reports that, not the failure to
    delete its lock on the same store afterwards (the next run breaks a lock left so)."""
    bucket, options, through_proxy = s3_direct
    fast = {"config_kwargs": {"retries": {"max_attempts": 1, "mode": "standard"}, "connect_timeout": 2}}
    proxy, cut_options = through_proxy(cuts=0, **fast)
    storage = Storage(f"s3://{bucket}/root", cut_options)
    with pytest.raises(RuntimeError, match="the store stopped answering"):
        with RunLock(storage, "ds", "run-1", LockConfig(heartbeat_s=60)):
            proxy.sever()
            raise RuntimeError("the store stopped answering")
    assert Storage(f"s3://{bucket}/root", options).exists("ds/run.lock")  # left for the next run to break
    # Leaving without an error, a release that fails still raises: nothing else would say so.
    proxy, cut_options = through_proxy(cuts=0, **fast)
    lock = RunLock(Storage(f"s3://{bucket}/other", cut_options), "ds", "run-2", LockConfig(heartbeat_s=60))
    with pytest.raises(Exception, match="(?i)connect"):
        with lock:
            proxy.sever()
