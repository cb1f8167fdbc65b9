"""Open a shardsmith release (local or s3://) for training: resolve LATEST, read index.json, check shards."""

from __future__ import annotations

import hashlib
import json
import posixpath
from dataclasses import dataclass, field
from typing import IO, Any

from tasks.formats.indexes import dali_index_name
from tasks.formats.storage import Storage
from tasks.stages.release import INDEX, VERSION_RE, ReleaseError

__all__ = ["Release", "ReleaseError", "ShardInfo", "IndexEntry", "open_release", "parse_dali_index"]

_HASH_CHUNK = 1 << 20


@dataclass(frozen=True)
class ShardInfo:
    """One tar of a release, as index.json lists it.

    Args:
        name: path relative to the release folder, e.g. ``"shard-000000.tar"`` or
            ``"latents/shard-000000.tar"``.
        samples: samples in the tar.
        bytes: size of the tar.
        sha256: hex digest of the tar's bytes.
        image_shard: for a latent shard, the image shard it mirrors (default ``None``).
    """

    name: str
    samples: int
    bytes: int
    sha256: str
    image_shard: str | None = None

    @property
    def index_name(self) -> str:
        """The DALI ``.idx`` beside the tar."""
        return dali_index_name(self.name)


@dataclass(frozen=True)
class IndexEntry:
    """One sample of a shard, from its DALI index.

    Args:
        key: the sample key.
        start: byte offset of the sample's first header block (where a reader can seek to).
        end: byte offset just past the sample's last member padding.
        members: extension -> (data offset, size).
    """

    key: str
    start: int
    end: int
    members: dict[str, tuple[int, int]] = field(default_factory=dict)


def parse_dali_index(data: bytes, name: str = "<index>") -> list[IndexEntry]:
    """Parse a DALI webdataset index (``v1.2``, names included) into per-sample entries.

    Samples are contiguous in shardsmith tars, so a sample's first header starts where the
    previous sample's last member (padded to 512 bytes) ends; this holds for any header form
    (ustar, GNU long names, PAX), unlike ``data offset - 512``.
    """
    lines = data.decode("utf-8").splitlines()
    head = lines[0].split() if lines else []
    if len(head) != 2 or head[0] != "v1.2" or not head[1].isdigit():
        raise ReleaseError(f"{name}: not a v1.2 DALI index (first line {lines[:1]!r})")
    count = int(head[1])
    body = [line for line in lines[1:] if line]
    if len(body) != count:
        raise ReleaseError(f"{name}: header says {count} samples, found {len(body)} lines")
    entries: list[IndexEntry] = []
    start = 0
    for i, line in enumerate(body):
        parts = line.split(" ")
        if len(parts) % 4:
            raise ReleaseError(f"{name}: line {i + 2} is not groups of 'ext offset size name'")
        members: dict[str, tuple[int, int]] = {}
        key = None
        end = start
        for j in range(0, len(parts), 4):
            ext, offset, size, member = parts[j], int(parts[j + 1]), int(parts[j + 2]), parts[j + 3]
            member_key = member[: -len(ext) - 1] if member.endswith("." + ext) else None
            if member_key is None or (key is not None and member_key != key):
                raise ReleaseError(f"{name}: line {i + 2}: member {member!r} does not belong to its sample")
            key = member_key
            members[ext] = (offset, size)
            end = max(end, offset + (size + 511) // 512 * 512)
        entries.append(IndexEntry(key=key or "", start=start, end=end, members=members))
        start = end
    return entries


class Release:
    """A committed release folder and its index.json; made by ``open_release``.

    Args:
        storage: a ``Storage`` rooted at the release folder (``.../releases/vNNNN``).
        index: the parsed index.json.

    Attributes:
        url: the release folder (local path or URL).
        dataset, kind, version: from index.json; ``kind`` is ``"pretraining"`` or ``"finetuning"``.
        shards: the image (or pack) shards, in release order.
        precache_shards: latent shards mirroring ``shards`` one to one (empty when nothing
            was precached).
        encodings: what was precached: ``{"image_latents": {...}, "text": {...},
            "vision": {...}}``, only those present.
        schema: index.json's schema (members and image format, or the packing settings).
    """

    def __init__(self, storage: Storage, index: dict[str, Any]) -> None:
        self.storage = storage
        self.index = index
        self.url = storage.url()
        self.dataset: str = index.get("dataset", "")
        self.kind: str = index.get("kind", "pretraining")
        self.version: str = index.get("version", "")
        self.schema: dict[str, Any] = dict(index.get("schema") or {})
        self.shards: tuple[ShardInfo, ...] = tuple(
            ShardInfo(name=s["name"], samples=int(s["samples"]), bytes=int(s["bytes"]), sha256=s["sha256"])
            for s in index.get("shards", [])
        )
        precache = index.get("precache") or {}
        self.encodings: dict[str, dict[str, Any]] = dict(precache.get("encodings") or {})
        self.precache_shards: tuple[ShardInfo, ...] = tuple(
            ShardInfo(
                name=s["name"],
                samples=int(s["samples"]),
                bytes=int(s["bytes"]),
                sha256=s["sha256"],
                image_shard=s.get("image_shard"),
            )
            for s in precache.get("shards", [])
        )
        self._check_consistent()

    def __repr__(self) -> str:
        return f"Release({self.url!r}, kind={self.kind!r}, shards={len(self.shards)}, samples={self.samples})"

    def __getstate__(self) -> dict[str, Any]:
        # DataLoader workers receive the dataset, and so the release, by pickling.
        return {"storage": self.storage, "index": self.index}

    def __setstate__(self, state: dict[str, Any]) -> None:
        type(self).__init__(self, state["storage"], state["index"])

    @property
    def samples(self) -> int:
        """Samples in the release (packs, for a release packed offline)."""
        return sum(s.samples for s in self.shards)

    @property
    def packed(self) -> bool:
        return self.kind == "finetuning" and bool(self.schema.get("packed"))

    def latent_shard_for(self, shard: ShardInfo) -> ShardInfo:
        """The latent shard that mirrors an image shard; ``ReleaseError`` when none exists."""
        for latent in self.precache_shards:
            if latent.image_shard == shard.name:
                return latent
        raise ReleaseError(f"{self.url}: no precached latent shard for {shard.name}")

    def path(self, name: str) -> str:
        """Filesystem path (no protocol) of a file in the release, as fsspec sees it."""
        return self.storage.path(name)

    def local_path(self, name: str) -> str | None:
        """A local filesystem path for ``name``, or None on object stores (DALI needs one)."""
        return self.storage.path(name) if self.storage.is_local else None

    def open(self, name: str, mode: str = "rb") -> IO[bytes]:
        return self.storage.open(name, mode)

    def read_bytes(self, name: str) -> bytes:
        return self.storage.read_bytes(name)

    def read_index(self, shard: ShardInfo) -> list[IndexEntry]:
        """The shard's samples and member byte ranges, from its DALI index (no tar read)."""
        entries = parse_dali_index(self.read_bytes(shard.index_name), name=self.storage.url(shard.index_name))
        if len(entries) != shard.samples:
            raise ReleaseError(
                f"{self.storage.url(shard.index_name)}: {len(entries)} samples, index.json says {shard.samples}"
            )
        return entries

    def verify(self) -> None:
        """Check every shard's size and sha256 against index.json; ``ReleaseError`` lists mismatches."""
        problems = []
        for shard in self.shards + self.precache_shards:
            sha = hashlib.sha256()
            size = 0
            try:
                with self.open(shard.name) as fh:
                    while chunk := fh.read(_HASH_CHUNK):
                        sha.update(chunk)
                        size += len(chunk)
            except FileNotFoundError:
                problems.append(f"{shard.name}: missing")
                continue
            if size != shard.bytes:
                problems.append(f"{shard.name}: {size} bytes, index.json says {shard.bytes}")
            elif sha.hexdigest() != shard.sha256:
                problems.append(f"{shard.name}: sha256 {sha.hexdigest()} != {shard.sha256}")
        if problems:
            raise ReleaseError(f"{self.url}: shards do not match index.json: " + "; ".join(problems))

    def _check_consistent(self) -> None:
        if not self.shards:
            raise ReleaseError(f"{self.url}: index.json lists no shards")
        totals = self.index.get("totals") or {}
        if "samples" in totals and int(totals["samples"]) != self.samples:
            raise ReleaseError(f"{self.url}: shards hold {self.samples} samples, totals say {totals['samples']}")
        if self.precache_shards:
            mirrored = [s.image_shard for s in self.precache_shards]
            if sorted(mirrored) != sorted(s.name for s in self.shards):
                raise ReleaseError(f"{self.url}: latent shards do not mirror the image shards one to one")
            counts = {s.name: s.samples for s in self.shards}
            for latent in self.precache_shards:
                if counts[latent.image_shard] != latent.samples:
                    raise ReleaseError(
                        f"{self.url}: {latent.name} holds {latent.samples} samples, "
                        f"{latent.image_shard} holds {counts[latent.image_shard]}"
                    )


def _resolve(storage: Storage, version: str) -> str:
    """The release folder, relative to ``storage``, for a version folder, a releases folder or a
    dataset folder."""
    if version == "latest":
        if storage.exists(INDEX) and not storage.exists("LATEST"):
            return ""  # pointed straight at a version folder
        for base in ("", "releases"):
            pointer = posixpath.join(base, "LATEST") if base else "LATEST"
            if storage.exists(pointer):
                name = storage.read_bytes(pointer).decode().strip()
                if not VERSION_RE.match(name):
                    raise ReleaseError(f"{storage.url(pointer)} holds {name!r}, not a version name")
                return posixpath.join(base, name) if base else name
        raise ReleaseError(f"{storage.url()}: no index.json, no LATEST and no releases/LATEST")
    if not VERSION_RE.match(version):
        raise ReleaseError(f"version {version!r}: use 'latest' or a name like 'v0001'")
    if posixpath.basename(storage.root.rstrip("/")) == version and storage.exists(INDEX):
        return ""
    for base in ("", "releases"):
        rel = posixpath.join(base, version) if base else version
        if storage.exists(posixpath.join(rel, INDEX)):
            return rel
    raise ReleaseError(f"{storage.url()}: no release {version} (no {version}/{INDEX} here or under releases/)")


def open_release(
    path_or_url: str,
    version: str = "latest",
    verify: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> Release:
    """Open a committed release for reading.

    Args:
        path_or_url: a release folder (``.../releases/v0003``), a releases folder, or a
            dataset folder (``{storage}/{dataset}``); local path or ``s3://bucket/prefix``.
        version: ``"latest"`` (follows ``LATEST``) or a version name like ``"v0003"``
            (default ``"latest"``).
        verify: read every shard (and latent shard) and check its size and sha256 against
            index.json before returning (default False: it reads the whole release).
        storage_options: fsspec options, e.g. ``{"client_kwargs": {"endpoint_url": ...}}``
            (default none).

    Raises ``ReleaseError`` when there is no committed release there, or when index.json is
    inconsistent (counts, latent shards that do not mirror the image shards), or on a
    checksum mismatch with ``verify=True``.
    """
    root = Storage(path_or_url, storage_options)
    rel = _resolve(root, version)
    storage = Storage(root.url(rel), storage_options) if rel else root
    try:
        index = json.loads(storage.read_bytes(INDEX))
    except FileNotFoundError:
        raise ReleaseError(f"{storage.url(INDEX)} does not exist: the release was never committed") from None
    except json.JSONDecodeError as err:
        raise ReleaseError(f"{storage.url(INDEX)} is not JSON: {err}") from None
    release = Release(storage, index)
    if verify:
        release.verify()
    return release
