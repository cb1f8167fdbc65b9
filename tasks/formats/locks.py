"""A per-dataset run lock in storage, so that two runs of one dataset never write at once."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import Field

from tasks.formats.recipe_base import Frozen
from tasks.formats.storage import Storage, lost_race

log = logging.getLogger("shardsmith")

LOCK_NAME = "run.lock"

# The locks this process holds now, for a process that must exit at once (release_held).
_held: set[RunLock] = set()


class LockHeld(RuntimeError):
    """Another run holds the dataset's lock (and did not let go within the wait)."""


class LockLost(RuntimeError):
    """This run's lock was broken by another run (it missed its heartbeats for longer than the TTL)."""


class LockConfig(Frozen):
    """How a run takes its dataset's lock.

    Args:
        wait_s: how long to wait for a live holder before refusing; 0 (default) refuses at once.
        ttl_s: a lock whose heartbeat is older than this is stale and may be broken (default
            600 s); a dead pid on the same host makes it stale at once.
        heartbeat_s: how often the holder refreshes its heartbeat (default 30 s); well under
            ``ttl_s``.
        poll_s: how often a waiting run looks again (default 2 s).
    """

    wait_s: float = Field(0.0, ge=0)
    ttl_s: float = Field(600.0, gt=0)
    heartbeat_s: float = Field(30.0, gt=0)
    poll_s: float = Field(2.0, gt=0)

    @classmethod
    def from_env(cls) -> LockConfig:
        """Defaults, overridden by ``SHARDSMITH_LOCK_WAIT_S`` / ``_TTL_S`` / ``_HEARTBEAT_S``."""
        env = {k: os.environ.get(f"SHARDSMITH_LOCK_{k.upper()}") for k in ("wait_s", "ttl_s", "heartbeat_s", "poll_s")}
        return cls(**{k: float(v) for k, v in env.items() if v})


@dataclass(frozen=True)
class Holder:
    """Who holds a lock: the run, where it runs, since when, and its last heartbeat."""

    run: str
    host: str
    pid: int
    started: float
    heartbeat: float
    token: str

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.started))
        return f"run {self.run} (host {self.host}, pid {self.pid}, started {since}, last heartbeat {time.time() - self.heartbeat:.0f} s ago)"

    def to_bytes(self) -> bytes:
        return (json.dumps(self.__dict__, sort_keys=True) + "\n").encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Holder | None:
        try:
            d = json.loads(data)
            return cls(
                run=str(d["run"]),
                host=str(d["host"]),
                pid=int(d["pid"]),
                started=float(d["started"]),
                heartbeat=float(d["heartbeat"]),
                token=str(d["token"]),
            )
        except (ValueError, KeyError, TypeError):
            return None  # a torn or foreign file: judged by its age alone


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def stale_reason(
    holder: Holder | None, ttl_s: float, now: float | None = None, age_s: float | None = None
) -> str | None:
    """Why a lock may be broken (its holder's process is gone, or it missed its heartbeats), or None."""
    now = time.time() if now is None else now
    if holder is None:
        return "unreadable lock file" if age_s is None or age_s > ttl_s else None
    if holder.host == socket.gethostname() and not _pid_alive(holder.pid):
        return f"pid {holder.pid} is not running on {holder.host}"
    if now - holder.heartbeat > ttl_s:
        return f"no heartbeat for {now - holder.heartbeat:.0f} s (ttl {ttl_s:.0f} s)"
    return None


class _LocalBackend:
    """Exclusive create by link(): the name appears complete, and only if it did not exist."""

    def __init__(self, storage: Storage, rel: str):
        self.storage = storage
        self.rel = rel
        self.path = storage.path(rel)

    def create(self, data: bytes) -> Any:
        """The new version, or None when the lock exists."""
        try:
            self.storage.create_exclusive(self.rel, data)
        except FileExistsError:
            return None
        return data

    def read(self) -> tuple[bytes, Any, float] | None:
        """(content, version, age in seconds), or None when there is no lock."""
        try:
            with open(self.path, "rb") as fh:
                data = fh.read()
                age = time.time() - os.fstat(fh.fileno()).st_mtime
        except FileNotFoundError:
            return None
        return data, data, age

    def replace(self, data: bytes, version: Any) -> Any:
        """The new version, or None when the lock is no longer at ``version``."""
        current = self.read()
        if current is None or current[1] != version:
            return None
        self.storage.replace_local(self.rel, data)
        return data

    def delete(self, version: Any) -> bool:
        # Rename first: of two runs breaking the same stale lock, only one gets the file, and
        # a fresh lock taken in between is put back instead of removed.
        aside = f"{self.path}.{uuid.uuid4().hex}.broken"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False
        with open(aside, "rb") as fh:
            ours = fh.read() == version
        if not ours:
            with contextlib.suppress(FileExistsError):
                os.link(aside, self.path)
        os.unlink(aside)
        return ours


class _S3Backend:
    """Conditional requests: PUT with If-None-Match: * creates, If-Match on the ETag updates and deletes."""

    def __init__(self, storage: Storage, rel: str):
        self.storage = storage
        self.rel = rel
        self.fs = storage.fs
        self.path = storage.path(rel)
        self.bucket, _, self.key = self.path.partition("/")

    def create(self, data: bytes) -> Any:
        try:
            return self.storage.create_exclusive(self.rel, data)
        except FileExistsError:
            return None

    def read(self) -> tuple[bytes, Any, float] | None:
        self.fs.invalidate_cache(self.path)
        try:
            # ETag first: the content read after it is as new or newer, so a conditional
            # request on this ETag can never act on a version we did not judge.
            info = self.fs.info(self.path)
            data = self.fs.cat_file(self.path)
        except FileNotFoundError:
            return None
        modified = info.get("LastModified")
        age = time.time() - modified.timestamp() if modified is not None else 0.0
        return data, info.get("ETag"), age

    def replace(self, data: bytes, version: Any) -> Any:
        try:
            resp = self.fs.call_s3("put_object", Bucket=self.bucket, Key=self.key, Body=data, IfMatch=version)
        except FileNotFoundError:
            return None
        except OSError as err:
            if lost_race(err):  # 412: no longer at this version
                return None
            raise
        self.fs.invalidate_cache(self.path)
        return resp.get("ETag")

    def delete(self, version: Any) -> bool:
        try:
            self.fs.call_s3("delete_object", Bucket=self.bucket, Key=self.key, IfMatch=version)
        except OSError:
            return False
        self.fs.invalidate_cache(self.path)
        return True


class RunLock:
    """The exclusive lock of one dataset under a storage root, held for a whole run.

    Args:
        storage: the storage root (local or ``s3://``).
        dataset: the dataset; the lock is ``{dataset}/run.lock``.
        run: this run's id, recorded in the lock for the message a second run gets.
        config: waiting, staleness and heartbeat settings (``LockConfig()`` by default).

    Use as a context manager. While held, a daemon thread refreshes the heartbeat; ``check()``
    raises ``LockLost`` if another run broke the lock meanwhile.
    """

    def __init__(self, storage: Storage, dataset: str, run: str, config: LockConfig | None = None):
        self.storage = storage
        self.rel = f"{dataset}/{LOCK_NAME}"
        self.run = run
        self.config = config or LockConfig()
        self._backend = _LocalBackend(storage, self.rel) if storage.is_local else _S3Backend(storage, self.rel)
        self._holder: Holder | None = None
        self._version: Any = None
        self._stop = threading.Event()
        self._lost: str | None = None
        self._thread: threading.Thread | None = None

    def _new_holder(self) -> Holder:
        now = time.time()
        return Holder(
            run=self.run, host=socket.gethostname(), pid=os.getpid(), started=now, heartbeat=now, token=uuid.uuid4().hex
        )

    def acquire(self) -> RunLock:
        deadline = time.monotonic() + self.config.wait_s
        holder = self._new_holder()
        while True:
            version = self._backend.create(holder.to_bytes())
            if version is not None:
                return self._acquired(holder, version)
            current = self._backend.read()
            if current is None:
                continue  # released between our two requests: try again at once
            data, version, age = current
            other = Holder.from_bytes(data)
            if other is not None and other.token == holder.token:
                return self._acquired(holder, version)  # our create went through; its reply was lost
            why = stale_reason(other, self.config.ttl_s, age_s=age)
            if why is not None:
                if self._backend.delete(version):
                    log.warning(
                        "broke the stale lock %s of %s: %s",
                        self.storage.url(self.rel),
                        other.describe() if other else "an unknown run",
                        why,
                    )
                continue
            if time.monotonic() >= deadline:
                who = other.describe() if other else "an unknown run"
                raise LockHeld(
                    f"dataset lock {self.storage.url(self.rel)} is held by {who}; "
                    f"wait for it to finish, or remove the lock if that run is gone (it is broken automatically "
                    f"once its pid is gone on the same host or it has missed heartbeats for {self.config.ttl_s:.0f} s)"
                )
            time.sleep(min(self.config.poll_s, max(0.0, deadline - time.monotonic())) or self.config.poll_s)

    def _acquired(self, holder: Holder, version: Any) -> RunLock:
        self._holder, self._version, self._lost = holder, version, None
        removed = self.sweep()
        if removed:
            log.warning(
                "removed %d temp file(s) left by killed writers under %s",
                removed,
                self.storage.url(self.rel.rsplit("/", 1)[0]),
            )
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name=f"lock-heartbeat-{self.run}", daemon=True)
        self._thread.start()
        _held.add(self)
        return self

    def sweep(self) -> int:
        """Remove temp files that writers killed mid-write left under the dataset; returns how many.

        Safe only while holding the lock: no other writer of the dataset can be running. Object
        stores have none (uploads are invisible until complete).
        """
        if not self.storage.is_local:
            return 0
        removed = 0
        for folder, _dirs, files in os.walk(os.path.dirname(self.storage.path(self.rel))):
            for name in files:
                # The atomic writer's temp files, and create_exclusive's (index.json's); not the
                # lock's own, which a run trying to take the lock right now may be about to link.
                if name.startswith(".tmp-") or (name.endswith(".tmp") and not name.startswith(LOCK_NAME + ".")):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(folder, name))
                        removed += 1
        return removed

    def _beat(self) -> None:
        while not self._stop.wait(self.config.heartbeat_s):
            self.heartbeat()

    def heartbeat(self) -> None:
        """Refresh the heartbeat, unless the lock is no longer ours."""
        if self._holder is None or self._lost:
            return
        fresh = Holder(**{**self._holder.__dict__, "heartbeat": time.time()})
        try:
            version = self._backend.replace(fresh.to_bytes(), self._version)
        except OSError as err:  # storage unreachable for now: the next beat tries again
            log.warning("lock heartbeat failed: %s", err)
            return
        if version is not None:
            self._holder, self._version = fresh, version
        else:
            self._lost = f"lock {self.storage.url(self.rel)} was taken over by another run"
            log.error("%s", self._lost)

    def check(self) -> None:
        """Raise ``LockLost`` if another run broke this lock; call it before committing anything."""
        if self._lost:
            raise LockLost(self._lost)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        if self._holder is not None and not self._lost:
            self._backend.delete(self._version)
        self._holder = None
        _held.discard(self)

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.release()
            return
        # Leaving on an error (a store that stopped answering, say): the error is what the run
        # reports. A lock that cannot be deleted now is broken by the next run (its holder's
        # pid, or its missed heartbeats), so its own failure is logged, never raised over it.
        try:
            self.release()
        except Exception as err:  # noqa: BLE001 - the error in flight wins
            log.warning("could not release the lock %s (%s): the next run breaks it", self.storage.url(self.rel), err)


def release_held(timeout_s: float = 5.0) -> None:
    """Release every lock this process holds, within ``timeout_s``; for a process about to
    ``os._exit`` while its main thread is stuck (the stop watchdog), so the dataset is free
    for the next run at once instead of when it notices the dead pid or the missed heartbeats.
    """

    def release() -> None:
        for lock in list(_held):
            with contextlib.suppress(Exception):
                lock.release()

    worker = threading.Thread(target=release, name="lock-release", daemon=True)
    worker.start()
    worker.join(timeout_s)


@contextlib.contextmanager
def run_lock(storage: Storage, dataset: str, run: str, config: LockConfig | None = None) -> Iterator[RunLock]:
    """Hold ``dataset``'s lock for the block (settings from the environment by default)."""
    with RunLock(storage, dataset, run, config or LockConfig.from_env()) as lock:
        yield lock
