"""A folder, glob or object-store prefix of video files as a source: one file in, one row out, its caption from a sidecar file.

A ``kind: files`` source names media files instead of a manifest of URLs. Each file is one row
and one ingest chunk (a video is seconds to minutes of work, worth a task of its own). Beside
``clip.mp4`` a ``clip.txt`` is its caption and a ``clip.json`` may give ``caption``,
``license`` and ``url`` (and anything else, carried into the sample's json); a sidecar's
version is part of the chunk's, so an edited caption is judged again.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import fsspec

from tasks.formats.manifests.chunks import ChunkRef
from tasks.formats.manifests.files import display, open_options
from tasks.formats.recipe_download import DownloadConfig, SourceConfig

if TYPE_CHECKING:  # the fetch machinery (aiohttp) loads where a file is read, not where it is planned
    from tasks.stages.fetched import Fetched

# The files a ``files`` source takes: video containers (the rows of a ``media: video`` source).
MEDIA_SUFFIXES = (".mp4", ".m4v", ".mov", ".webm", ".mkv", ".avi")
SIDECARS = (".txt", ".json")
MAX_SIDECAR_BYTES = 1 << 20

Row = dict[str, Any]


def sidecars_of(rel: str, listed: set[str]) -> list[str]:
    """The sidecar files of the media file ``rel`` that the listing has (``a/b.txt`` for ``a/b.mp4``)."""
    stem = posixpath.splitext(rel)[0]
    return [stem + ext for ext in SIDECARS if stem + ext in listed]


class FileIngest:
    """The one row of a ``files`` chunk: the media file's bytes, judged as a fetched body is.

    Args:
        source: the ``files`` source.
        ref: the chunk (``path`` is the file's URL, ``first_row`` its row id).
        cfg: the download settings of the source (``max_bytes``, ``allowed_formats``).
        storage_options: fsspec options for ``s3://`` inputs.
    """

    def __init__(
        self, source: SourceConfig, ref: ChunkRef, cfg: DownloadConfig, storage_options: dict[str, Any] | None
    ):
        self.source, self.ref, self.cfg, self.options = source, ref, cfg, storage_options
        self.rows: list[Row] = []

    def __iter__(self) -> Iterator[tuple[Row, Fetched]]:
        url = self.ref.path
        meta, note = self._sidecars(url)
        caption = meta.pop("caption", None)
        row = {
            "row": self.ref.first_row,
            "url": meta.pop("url", None) if isinstance(meta.get("url"), str) else url,
            "caption": caption if isinstance(caption, str) else None,
            "license": meta.pop("license", None) if isinstance(meta.get("license"), str) else None,
            "extra": json.dumps({"file": url, **({"sidecar": meta} if meta else {})}, ensure_ascii=False, default=str),
            "origin": display(url),
        }
        self.rows.append(row)
        yield row, self._read(url, note)

    def _read(self, url: str, note: str) -> Fetched:
        from tasks.formats.spooled import SpooledBody
        from tasks.stages.fetched import Fetched, judge

        cap = self.cfg.max_bytes
        try:
            # Copied to a local file in chunks, never whole in memory (videos run to hundreds of MB).
            with fsspec.open(url, "rb", **open_options(url, self.options)) as fh:
                data = SpooledBody.copy_from(fh, cap + 1)
        except FileNotFoundError:
            return Fetched(reason="read_error", detail=f"{display(url)}: gone since it was listed")
        if len(data) > cap:
            return Fetched(reason="too_large", detail=f"more than download.video_max_bytes ({cap})")
        fetched = judge(Fetched(data=data, attempts=1), self.cfg.allowed_formats)
        if note:
            fetched.detail = "; ".join(p for p in (fetched.detail, note) if p)
        return fetched

    def _sidecars(self, url: str) -> tuple[dict[str, Any], str]:
        """The sidecars' fields (``caption`` from the .txt, the .json's object), and a note on
        a sidecar that could not be used."""
        stem = url[: -len(posixpath.splitext(url)[1])]
        meta: dict[str, Any] = {}
        notes = []
        for ext in (".json", ".txt"):  # the .txt caption wins over a caption in the .json
            try:
                with fsspec.open(stem + ext, "rb", **open_options(stem + ext, self.options)) as fh:
                    data = fh.read(MAX_SIDECAR_BYTES + 1)
            except FileNotFoundError:
                continue
            name = posixpath.basename(stem + ext)
            if len(data) > MAX_SIDECAR_BYTES:
                notes.append(f"{name} not read: over {MAX_SIDECAR_BYTES} bytes")
            elif ext == ".txt":
                meta["caption"] = data.decode("utf-8", "replace").strip()
            else:
                try:
                    value = json.loads(data)
                except (ValueError, RecursionError) as err:
                    notes.append(f"{name} not read: {err}")
                    continue
                if isinstance(value, dict):
                    meta.update(value)
                else:
                    notes.append(f"{name} not read: a JSON {type(value).__name__}, not an object")
        return meta, "; ".join(notes)
