"""Releases: immutable, versioned folders whose index.json, written last, is the commit point."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import posixpath
import re
from dataclasses import dataclass
from typing import Any, BinaryIO, cast

import pyarrow as pa

from tasks.formats.faults import fault_point
from tasks.formats.indexes import dali_index_name
from tasks.formats.ledger import read_parquet, write_parquet
from tasks.formats.storage import Storage

VERSION_RE = re.compile(r"^v(\d{4,})$")
INDEX = "index.json"


class ReleaseError(RuntimeError):
    """A release that cannot be made or read (exists already, missing, corrupt)."""


def code_version() -> str:
    """The installed shardsmith version, plus the git commit when run from a checkout."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        v = version("shardsmith")
    except PackageNotFoundError:
        v = "0+unknown"
    head = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), ".git", "HEAD")
    try:
        ref = open(head).read().strip()
        if ref.startswith("ref: "):
            ref = open(os.path.join(os.path.dirname(head), ref[5:])).read().strip()
        return f"{v}+g{ref[:12]}"
    except OSError:
        return v


def releases_dir(dataset: str) -> str:
    return f"{dataset}/releases"


def list_versions(storage: Storage, dataset: str) -> list[str]:
    """Committed versions (those with an index.json), oldest first."""
    base = releases_dir(dataset)
    out = [n for n in storage.listdir(base) if VERSION_RE.match(n) and storage.exists(f"{base}/{n}/{INDEX}")]
    return sorted(out, key=lambda n: int(n[1:]))  # VERSION_RE: "v" then the number


def latest_named(storage: Storage, dataset: str) -> str | None:
    """The version LATEST names, whether or not that release is still there."""
    rel = f"{releases_dir(dataset)}/LATEST"
    if not storage.exists(rel):
        return None
    name = storage.read_bytes(rel).decode().strip()
    return name if VERSION_RE.match(name) else None


def latest(storage: Storage, dataset: str) -> str | None:
    """The latest release: the one LATEST names, when it is there (its index.json is stored);
    ``None`` when LATEST names a release that was deleted, so it is never reported as the latest."""
    name = latest_named(storage, dataset)
    if name is None or not storage.exists(f"{releases_dir(dataset)}/{name}/{INDEX}"):
        return None
    return name


def release_problems(storage: Storage, dataset: str, version: str) -> list[str]:
    """What is missing from a committed release: its index.json, or a file it lists (every shard
    and latent shard, with its recorded size; a DALI index per shard, the wids index, Energon's
    metadata, the tables). Sizes come from one listing per folder; checksums are not read
    again (that would read every byte). Empty when the release is whole."""
    base = f"{releases_dir(dataset)}/{version}"
    try:
        index = json.loads(storage.read_bytes(f"{base}/{INDEX}"))
    except FileNotFoundError:
        return [f"{base}/{INDEX} is missing"]
    files = [(s["name"], s.get("bytes")) for s in index.get("shards", [])]
    files += [(s["name"], s.get("bytes")) for s in (index.get("precache") or {}).get("shards", [])]
    files += [(dali_index_name(name), None) for name, _ in files]
    files += (
        [(name, None) for name in ("samples.parquet", "ledger.parquet")] if index.get("kind") == "pretraining" else []
    )
    if (index.get("indexes") or {}).get("wids"):
        files.append((index["indexes"]["wids"], None))
    sizes: dict[str, int] = {}
    for folder in sorted({posixpath.dirname(f"{base}/{name}") for name, _ in files}):
        try:
            listing = storage.fs.ls(storage.path(folder), detail=True)
        except FileNotFoundError:
            continue
        for e in listing:
            sizes[f"{folder}/{posixpath.basename(str(e['name']).rstrip('/'))}"] = int(e.get("size") or 0)
    problems = []
    for name, size in files:
        got = sizes.get(f"{base}/{name}")
        if got is None:
            problems.append(f"{name} is missing")
        elif size is not None and got != size:
            problems.append(f"{name} is {got} bytes, index.json records {size}")
    return problems


def read_index(storage: Storage, dataset: str, version: str) -> dict[str, Any]:
    if version == "latest":
        version = latest(storage, dataset) or ""
    rel = f"{releases_dir(dataset)}/{version}/{INDEX}"
    if not version or not storage.exists(rel):
        raise ReleaseError(f"no release {version or 'latest'} of {dataset} under {storage.url(releases_dir(dataset))}")
    return json.loads(storage.read_bytes(rel))


def next_version(storage: Storage, dataset: str) -> str:
    """One past the highest version folder, committed or not, and past the one LATEST names: an
    abandoned attempt's number is never reused, so a half-written folder can never be mistaken
    for a later release, nor a release made after one was deleted for the deleted one (a reader
    may still hold its index)."""
    base = releases_dir(dataset)
    numbers = [int(m.group(1)) for n in storage.listdir(base) if (m := VERSION_RE.match(n))]
    named = latest_named(storage, dataset)
    numbers += [int(named[1:])] if named else []
    return f"v{(max(numbers) + 1) if numbers else 1:04d}"


def release_shard_names(shas: list[str]) -> list[str]:
    """The names of a release's shards, unique across releases: ``shard-{tag}-{n:06d}.tar``, the
    tag a digest of every shard's content. A reader's cache keyed by file name (webdataset's and
    wids' ``cache_dir``) then never mixes two releases' samples; the same content (a release
    made again whole) gets the same names."""
    from tasks.formats.names import digest_of

    tag = digest_of(shas)[:8]
    return [f"shard-{tag}-{i:06d}.tar" for i in range(len(shas))]


def fingerprint(shards: list[dict[str, Any]], recipe_hash: str) -> str:
    """What makes two releases the same: their shards' bytes and the recipe."""
    blob = json.dumps([recipe_hash, [(s["sha256"], s["samples"]) for s in shards]])
    return hashlib.sha256(blob.encode()).hexdigest()


@dataclass(frozen=True)
class ReleaseResult:
    version: str
    path: str
    created: bool  # False when the latest release already has the same content
    samples: int
    shards: int


def place_file(storage: Storage, src_rel: str, dst_rel: str) -> None:
    """Put a work file into a release: a hard link where the storage is local (the work files
    are content addressed and never rewritten), a server-side copy on object stores.

    Locally the placed file gets the storage's file mode (0644 by default), and so does the
    work file it shares an inode with: work files written before modes were set, or under
    another ``file_mode``, would otherwise carry their old mode into the release.
    """
    if storage.is_local:
        dst = storage.path(dst_rel)
        storage.make_folder(posixpath.dirname(dst_rel))
        try:
            os.link(storage.path(src_rel), dst)
        except OSError:
            storage.fs.copy(storage.path(src_rel), dst)
        storage.set_mode(dst_rel)
    else:
        storage.fs.copy(storage.path(src_rel), storage.path(dst_rel))


def commit_index(storage: Storage, rel: str, index: dict[str, Any]) -> None:
    """Write index.json so that it is never overwritten: an existing one is an error.

    The create is exclusive on every storage (``Storage.create_exclusive``: link() locally, a
    PUT with ``If-None-Match: *`` on S3), so of two writers racing for one version exactly one
    commits and the other gets ``ReleaseError``. An index.json that already holds exactly these
    bytes is this writer's own (a PUT retried after its reply was lost), not a conflict.
    """
    data = (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()
    fault_point(rel, "before")
    try:
        storage.create_exclusive(rel, data)
    except FileExistsError:
        try:
            ours = storage.read_bytes(rel) == data
        except FileNotFoundError:
            ours = False
        if not ours:
            raise ReleaseError(
                f"{storage.url(rel)} exists; releases are immutable (another run committed this version)"
            ) from None


# Where each reader finds its index in a release (the same for both kinds).
READER_INDEXES = {"dali": "*.idx", "energon": ".nv-meta/", "wids": "wids-index.json"}


def commit_release_index(
    storage: Storage,
    base: str,
    *,
    version: str,
    dataset: str,
    kind: str,
    fp: str,
    parent: str | None,
    run: str,
    shards: list[dict[str, Any]],
    totals: dict[str, Any],
    schema: dict[str, Any],
    shuffle_seed: int,
    recipe_hash: str,
    sources: dict[str, Any],
    gates: Any,
    ledger_rows: int,
    released: int,
    reports: str,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Build a release's index.json and commit it, for both release kinds; returns the index.

    The fields every release has are set here; the caller gives its kind's ``totals``, ``schema``
    and ``extra`` top-level entries (``precache``, ``packing``). ``released``: the ledger rows
    that are in the release (``ledger.ok``). Every file the index names is synced first.
    """
    index: dict[str, Any] = {
        "version": version,
        "dataset": dataset,
        "kind": kind,
        "created": now(),
        "fingerprint": fp,
        "parent": parent,
        "run": run,
        "shards": shards,
        "totals": totals,
        "schema": schema,
        "shuffle_seed": shuffle_seed,
        "recipe_hash": recipe_hash,
        "sources": sources,
        "code_version": code_version(),
        "gates": gates,
        "ledger": {"rows": ledger_rows, "ok": released, "not_released": ledger_rows - released},
        "indexes": dict(READER_INDEXES),
        "data_docs": f"{reports}/gates/data_docs/index.html",
        **(extra or {}),
    }
    storage.sync()  # every file above (links included) is on disk before index.json names it
    commit_index(storage, f"{base}/{INDEX}", index)
    return index


def set_latest(storage: Storage, dataset: str, version: str) -> None:
    if not storage.exists(f"{releases_dir(dataset)}/{version}/{INDEX}"):
        raise ReleaseError(f"refusing to point LATEST at {version}: it has no {INDEX}")
    storage.write_bytes(f"{releases_dir(dataset)}/LATEST", (version + "\n").encode())


def diff(storage: Storage, dataset: str, a: str, b: str) -> dict[str, Any]:
    """Samples added and removed between two releases, and why (from the later ledger). What
    changed row by row (recovered, dead, taken down ...) is ``tasks.audit.changes.between``."""
    ia, ib = read_index(storage, dataset, a), read_index(storage, dataset, b)
    base = releases_dir(dataset)
    ka = set(read_parquet(storage, f"{base}/{ia['version']}/samples.parquet", ["key"]).column("key").to_pylist())
    kb = set(read_parquet(storage, f"{base}/{ib['version']}/samples.parquet", ["key"]).column("key").to_pylist())
    ledger = read_parquet(storage, f"{base}/{ib['version']}/ledger.parquet", ["key", "status", "reason", "phase"])
    why = {
        k: (r or s, p)
        for k, s, r, p in zip(*(ledger.column(c).to_pylist() for c in ("key", "status", "reason", "phase")))
    }
    removed = sorted(ka - kb)
    reasons: dict[str, int] = {}
    for k in removed:
        reason, phase = why.get(k, ("not_in_manifest", "manifest"))
        label = f"{phase}: {reason}"
        reasons[label] = reasons.get(label, 0) + 1
    return {
        "a": ia["version"],
        "b": ib["version"],
        "added": len(kb - ka),
        "removed": len(removed),
        "kept": len(ka & kb),
        "removed_by_reason": dict(sorted(reasons.items(), key=lambda kv: -kv[1])),
        "added_keys": sorted(kb - ka)[:20],
        "removed_keys": removed[:20],
    }


def write_tables(storage: Storage, base: str, samples: pa.Table, ledger: pa.Table) -> None:
    write_parquet(storage, f"{base}/samples.parquet", samples)
    write_parquet(storage, f"{base}/ledger.parquet", ledger)


def now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


class _HashingReader:
    """A read-only stream that hashes what passes through it."""

    def __init__(self, fh: Any):
        self.fh = fh
        self.sha = hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        data = self.fh.read(n)
        self.sha.update(data)
        return data


def verify_shard(storage: Storage, tar: str, sha256: str, required: tuple[str, ...]) -> dict[str, Any]:
    """Read a shard back as a reader would: readable, every sample complete, bytes as recorded."""
    from tasks.formats.shards import iter_samples
    from tasks.formats.tar_reader import ShardError

    samples = 0
    complete = True
    readable = True
    detail = None
    with storage.open(tar, "rb") as fh:
        reader = _HashingReader(fh)
        try:
            for sample in iter_samples(cast(BinaryIO, reader), path=storage.url(tar)):  # reads only
                samples += 1
                if not all(ext in sample.members for ext in required):
                    complete = False
                    detail = detail or f"{sample.key} lacks one of {list(required)}"
            while reader.read(1 << 20):  # hash the end-of-archive blocks too
                pass
        except ShardError as err:
            readable, detail = False, str(err)
    return {
        "shard": tar,
        "samples": samples,
        "readable": readable,
        "complete": complete,
        "checksum_ok": readable and reader.sha.hexdigest() == sha256,
        "detail": detail,
    }
