"""Existing WebDataset shards (img2dataset's and video2dataset's layouts included) as a source: one tar in, a row for each of its samples (and of its side file's rows) out, as the download stage takes them."""

from __future__ import annotations

import json
import posixpath
from collections.abc import Iterator
from typing import Any

import fsspec

from tasks.formats.ledger import read_parquet_file
from tasks.formats.manifests.chunks import ChunkRef
from tasks.formats.manifests.files import display, open_options
from tasks.formats.recipe_download import DownloadConfig, SourceConfig
from tasks.policies.personal import masked
from tasks.sources.tarsamples import ShardFault, TarSample, iter_tar_samples, shown
from tasks.stages.fetched import Fetched, judge

# Image members in the order one is picked when a sample has several (webdataset's names).
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "gif", "bmp", "tif", "tiff", "avif", "heic", "heif", "img", "image")
# A video source's members (``media: video``; video2dataset writes ``mp4``, beside ``m4a`` audio).
VIDEO_EXTENSIONS = ("mp4", "webm", "mkv", "mov", "m4v", "avi", "video")


def _is_video(name: str) -> bool:
    return name.rpartition("/")[2].partition(".")[2].lower() in VIDEO_EXTENSIONS


# The reader's hard cap on one member: a larger one ends the shard (tasks.formats.shards); members
# between download.max_bytes and this are skipped unread and refused one sample at a time.
MAX_MEMBER_BYTES = 1 << 30
# A sample's json member and an img2dataset side parquet are read whole: capped.
MAX_JSON_BYTES = 1 << 20
MAX_SIDE_FILE_BYTES = 256 << 20
SUCCESS = "success"  # img2dataset's status of a written sample

Row = dict[str, Any]


def side_file(url: str) -> str | None:
    """img2dataset's per-shard parquet beside a tar (``00012.tar`` -> ``00012.parquet``)."""
    return url[: -len(".tar")] + ".parquet" if url.endswith(".tar") else None


def read_side_rows(url: str, storage_options: dict[str, Any] | None) -> tuple[list[Row], str]:
    """The rows of a tar's img2dataset parquet (none when there is none), and a note for
    people when it exists but cannot be used; transient read errors propagate."""
    side = side_file(url)
    if side is None:
        return [], ""
    fs, path = fsspec.core.url_to_fs(side, **open_options(side, storage_options))
    try:
        size = fs.size(path)
    except FileNotFoundError:
        return [], ""
    if size is None or size > MAX_SIDE_FILE_BYTES:
        return [], f"side file {posixpath.basename(path)} not read: {size} bytes (over {MAX_SIDE_FILE_BYTES})"
    try:
        with fs.open(path, "rb") as fh:
            table = read_parquet_file(fh)
    except (ValueError, OSError) as err:
        if isinstance(err, OSError) and "parquet" not in str(err).lower():
            raise
        return [], f"side file {posixpath.basename(path)} not read: {shown(str(err), 200)}"
    if "key" not in table.column_names:
        return [], f"side file {posixpath.basename(path)} has no key column; not used"
    return table.to_pylist(), ""


def _json_member(data: bytes | None) -> tuple[dict[str, Any] | None, str | None]:
    """The sample's json member as a dict, or None and why it was not read (None: no member)."""
    if data is None:
        return None, None
    if len(data) > MAX_JSON_BYTES:
        return None, f"{len(data)} bytes, over {MAX_JSON_BYTES}"
    try:
        meta = json.loads(data)
    except (ValueError, RecursionError) as err:
        return None, f"not JSON ({shown(str(err), 80)})"
    return (meta, None) if isinstance(meta, dict) else (None, f"a JSON {type(meta).__name__}, not an object")


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _jsonable(row: Row) -> Row:
    """A side-file row for a sample's json: values JSON cannot hold become strings."""
    return json.loads(json.dumps(row, default=str))


class ShardIngest:
    """The rows of one tar, in order, each with the verdict the download stage records.

    Args:
        source: the ``webdataset`` source.
        ref: the tar's chunk (``path`` is the tar's URL, ``first_row`` its first row id).
        cfg: the download settings whose payload rules apply (max_bytes, allowed_formats).
        storage_options: fsspec options for ``s3://`` inputs.

    ``rows`` holds every row handed out so far; iterate to read the tar. Row ids: with an
    img2dataset side file, a sample listed in it takes its row there (the original row),
    others follow after the side file's rows; without one, samples are numbered in order.
    """

    def __init__(
        self, source: SourceConfig, ref: ChunkRef, cfg: DownloadConfig, storage_options: dict[str, Any] | None
    ):
        self.source, self.ref, self.cfg, self.options = source, ref, cfg, storage_options
        self.shard = display(ref.path)
        self.rows: list[Row] = []

    def __iter__(self) -> Iterator[tuple[Row, Fetched]]:
        side, note = read_side_rows(self.ref.path, self.options)
        listed: dict[str, int] = {}
        for i, r in enumerate(side):
            listed.setdefault(str(r.get("key")), i)
        taken: set[int] = set()
        fault: ShardFault | None = None
        with fsspec.open(self.ref.path, "rb", **open_options(self.ref.path, self.options)) as fh:
            samples = iter_tar_samples(
                fh,
                path=self.shard,
                max_member_bytes=MAX_MEMBER_BYTES,
                skip_larger_than=self.cfg.max_bytes,
                # A video source's videos go to local files as they are read, never whole in memory.
                spill=_is_video if self.source.media == "video" else None,
            )
            for item in samples:
                if isinstance(item, ShardFault):
                    fault = item
                    break
                index = listed.get(item.key)
                if index is not None and index not in taken:
                    taken.add(index)
                    upstream = side[index]
                else:
                    index, upstream = len(side) + item.ordinal, None
                yield self._out(
                    self._sample_row(item, index, upstream, note), self._verdict(item, index, upstream, note)
                )
        after = len(side) + (fault.samples_before if fault else 0)
        for i, r in enumerate(side):
            if i in taken:
                continue
            if r.get("status") != SUCCESS:
                yield self._out(
                    self._side_row(i, r),
                    Fetched(
                        reason="upstream_failed",
                        detail=self._upstream(i, r) + f": {shown(masked(str(r.get('error_message'))), 300)}",
                    ),
                )
            elif listed.get(str(r.get("key"))) != i:  # the key listed again: its sample went to the first listing
                first = listed[str(r.get("key"))]
                detail = (
                    f"{self._upstream(i, r)}: key '{shown(str(r.get('key')))}' is listed again in the side file;"
                    f" its first listing, row {first + 1}, is the one {self.shard}'s sample goes with"
                )
                yield self._out(self._side_row(i, r), Fetched(reason="duplicate_key", detail=detail))
            elif fault is None:
                detail = f"{self._upstream(i, r)}, but {self.shard} has no sample '{shown(str(r.get('key')))}'"
                yield self._out(self._side_row(i, r), Fetched(reason="sample_missing", detail=detail))
        if fault is not None:
            row = {
                "row": self.ref.first_row + after,
                "url": None,
                "caption": None,
                "license": None,
                "extra": None,
                "origin": f"{self.shard}:after sample {fault.samples_before}",
            }
            unread = "; rows of its side file not seen in the tar are part of it" if side else ""
            detail = f"{fault.detail}; {fault.samples_before} samples read before the fault; this row stands for the rest of the shard{unread}"
            yield self._out(row, Fetched(reason=fault.reason, detail=detail))

    def _out(self, row: Row, fetched: Fetched) -> tuple[Row, Fetched]:
        self.rows.append(row)
        return row, fetched

    def _upstream(self, index: int, side_row: Row) -> str:
        parquet = posixpath.basename(side_file(self.ref.path) or "")
        tool = "video2dataset" if self.source.media == "video" else "img2dataset"
        return f"{tool} status {shown(str(side_row.get('status')))} ({parquet}:{index + 1})"

    def _field(self, name: str | None, meta: dict[str, Any] | None, upstream: Row | None) -> str | None:
        if name is None:
            return None
        for where in (meta, upstream):
            if where is not None and _text(where.get(name)) is not None:
                return where[name]
        return None

    def _sample_row(self, sample: TarSample, index: int, upstream: Row | None, note: str) -> Row:
        meta, unread = _json_member(sample.members.get("json"))
        caption = None
        txt = sample.members.get("txt")
        if txt is not None and len(txt) <= MAX_JSON_BYTES:
            caption = txt.decode("utf-8", "replace")
        if caption is None:
            caption = self._field(self.source.caption_column, meta, upstream)
        extra: dict[str, Any] = {"origin": {"shard": self.shard, "key": sample.shown_key, "offset": sample.offset}}
        if sample.flat_key != sample.key:
            extra["origin"]["flat_key"] = sample.flat_key
        if meta is not None:
            extra["upstream"] = meta
        if upstream is not None:
            extra["upstream_row"] = _jsonable(upstream)
        if self.source.id_column and meta is not None and meta.get(self.source.id_column) is not None:
            extra["id"] = meta[self.source.id_column]
        if note:
            extra["side_file"] = note
        if unread:  # said where the license or caption it would have held is missing
            extra["json_unread"] = unread
        return {
            "row": self.ref.first_row + index,
            "url": self._field(self.source.url_column, meta, upstream),
            "caption": caption,
            "license": self._field(self.source.license_column, meta, upstream),
            "extra": json.dumps(extra, ensure_ascii=False, default=str),
            "origin": f"{self.shard}:{sample.shown_key}",
        }

    def _side_row(self, index: int, side_row: Row) -> Row:
        parquet = posixpath.basename(side_file(self.ref.path) or "")
        return {
            "row": self.ref.first_row + index,
            "url": _text(side_row.get(self.source.url_column)),
            "caption": _text(side_row.get(self.source.caption_column or "")),
            "license": _text(side_row.get(self.source.license_column or "")),
            "extra": None,
            "origin": f"{posixpath.join(posixpath.dirname(self.shard), parquet)}:{index + 1}",
        }

    def _verdict(self, sample: TarSample, index: int, upstream: Row | None, note: str) -> Fetched:
        where = f"; {self._upstream(index, upstream)}" if upstream is not None else (f"; {note}" if note else "")
        if sample.reason is not None:
            return Fetched(reason=sample.reason, detail=sample.detail + where)
        video = self.source.media == "video"
        wanted = VIDEO_EXTENSIONS if video else IMAGE_EXTENSIONS
        ext = next((e for e in sample.members if e.lower() in wanted), None)
        if ext is None:
            has = ", ".join(shown(e, 40) or "(no extension)" for e in sample.members)
            return Fetched(
                reason="incomplete_sample",
                detail=f"no {'video' if video else 'image'} member ({', '.join(wanted[:4])}, ...); has: {has}" + where,
            )
        data = sample.members[ext]
        if data is None or len(data) > self.cfg.max_bytes:
            return Fetched(
                reason="too_large",
                detail=f"{shown(ext, 40)} member of {sample.sizes[ext]} bytes (download.max_bytes {self.cfg.max_bytes})"
                + where,
            )
        fetched = judge(Fetched(data=data, attempts=0), self.cfg.allowed_formats)
        if fetched.reason is None:
            rekeyed = f"folder key rekeyed '{shown(sample.flat_key)}'" if sample.flat_key != sample.key else ""
            fetched.detail = "; ".join(part for part in (rekeyed, where.lstrip("; ")) if part) or None
        elif where:
            fetched.detail = (fetched.detail or "") + where
        return fetched
