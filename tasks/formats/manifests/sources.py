"""Where a source's manifest lives: one file, a folder, a glob or brace pattern, local or remote, listed into its files."""

from __future__ import annotations

import contextlib
import os
import posixpath
from typing import Any
from urllib.parse import urlsplit

import fsspec
from fsspec.core import url_to_fs

from tasks.formats.manifests.files import (
    PERMANENT_OPEN_ERRORS,
    ManifestError,
    ManifestFile,
    cannot,
    display,
    file_tag,
    open_options,
    scheme_of,
)
from tasks.formats.recipe_download import SourceConfig

FORMATS_BY_SUFFIX = (
    (".csv", "csv"),
    (".tsv", "tsv"),
    (".jsonl", "jsonl"),
    (".ndjson", "jsonl"),
    (".parquet", "parquet"),
)
# Spark and Hugging Face write JSON lines as ``.json``: taken from a folder only when the
# source says ``format: jsonl`` (a lone ``.json`` may as well be one JSON array).
_EXTRA_SUFFIXES = {"jsonl": (".json",)}
_OTHER_COMPRESSION = (".bz2", ".xz", ".lzma", ".zst", ".zstd", ".lz4", ".zip", ".snappy")
_MAGIC = "*?[{"


def _name_of(manifest: str) -> str:
    if "://" in manifest:
        with contextlib.suppress(ValueError):
            return urlsplit(manifest).path
    return manifest


def resolve_format(name: str, fmt: str, where: str) -> tuple[str, bool]:
    """(format, gzipped) of a manifest file, from its name unless ``fmt`` is set."""
    name = name.lower()
    gzipped = name.endswith(".gz")
    stem = name[:-3] if gzipped else name
    for suffix in _OTHER_COMPRESSION:
        if stem.endswith(suffix):
            raise ManifestError(where, f"{suffix[1:]} compression is not supported (only gzip, .gz)")
    if fmt != "auto":
        return fmt, gzipped
    for suffix, found in FORMATS_BY_SUFFIX:
        if stem.endswith(suffix):
            return found, gzipped
    raise ManifestError(
        where,
        "cannot tell the format from the name (expected .csv, .tsv, .jsonl, .ndjson or .parquet, "
        "optionally + .gz); set the source's format",
    )


def _takes(name: str, fmt: str) -> bool:
    """Whether a folder or pattern source takes a file of this name."""
    name = name.lower()
    for suffix in _OTHER_COMPRESSION:
        name = name[: -len(suffix)] if name.endswith(suffix) else name  # refused later, by name
    stem = name[:-3] if name.endswith(".gz") else name
    suffixes = [s for s, f in FORMATS_BY_SUFFIX if fmt in ("auto", f)] + list(_EXTRA_SUFFIXES.get(fmt, ()))
    return any(stem.endswith(s) for s in suffixes)


def _side_file(rel: str) -> bool:
    """Spark / Hadoop / git side files and folders: ``_SUCCESS``, ``_committed_*``, ``.crc``, ``.git``."""
    return any(part.startswith(("_", ".")) for part in rel.split("/")) or rel.endswith(".crc")


def _expand_braces(pattern: str) -> list[str]:
    """``a{b,c}d`` -> ``[abd, acd]``, nested braces included; a brace without a comma is literal."""
    depth, start = 0, -1
    for i, ch in enumerate(pattern):
        if ch == "{":
            if depth == 0:
                start = i
            depth += 1
        elif ch == "}" and depth:
            depth -= 1
            if depth == 0:
                inner, parts, level, last = pattern[start + 1 : i], [], 0, 0
                for j, c in enumerate(inner):
                    level += c == "{"
                    level -= c == "}"
                    if c == "," and level == 0:
                        parts.append(inner[last:j])
                        last = j + 1
                parts.append(inner[last:])
                if len(parts) == 1:
                    continue
                head, tail = pattern[:start], pattern[i + 1 :]
                return [x for p in parts for x in _expand_braces(head + p + tail)]
    return [pattern]


def _fs(manifest: str, storage_options: dict[str, Any] | None) -> tuple[fsspec.AbstractFileSystem, str]:
    return url_to_fs(manifest, **open_options(manifest, storage_options))


def _kind(manifest: str, storage_options: dict[str, Any] | None) -> str:
    """``file``, ``folder`` or ``pattern``: how a source's manifest names its files."""
    scheme = scheme_of(manifest)
    if scheme in ("http", "https"):
        return "file"  # no listing over HTTP, and "?" starts a query there
    path = _name_of(manifest)
    if scheme in ("", "file", "local"):
        local = path if scheme == "" else url_to_fs(manifest)[1]
        if os.path.isfile(local):
            return "file"
        if os.path.isdir(local):
            return "folder"
        return "pattern" if any(c in path for c in _MAGIC) else "file"
    if manifest.endswith("/"):
        return "folder"
    if any(c in path for c in _MAGIC):
        return "pattern"
    try:
        fs, fspath = _fs(manifest, storage_options)
        return "folder" if fs.isdir(fspath) else "file"
    except Exception:  # let opening the file report what is wrong
        return "file"


def _root_of(manifest: str, kind: str) -> str:
    """The folder a multi-file source's relative paths start from (the part before any magic)."""
    if kind == "folder":
        return manifest.rstrip("/")
    head, sep, rest = manifest.partition("://")
    parts = (rest if sep else head).split("/")
    keep = []
    for part in parts:
        if any(c in part for c in _MAGIC):
            break
        keep.append(part)
    root = "/".join(keep)
    return f"{head}://{root}" if sep else root


def _is_file(path: str, info: dict[str, Any]) -> bool:
    """A listed entry that is a file; fsspec lists a local symlink to a file as ``other``."""
    if info.get("type") == "file":
        return True
    return bool(info.get("islink")) and os.path.isfile(path)


def list_manifest_files(source: SourceConfig, storage_options: dict[str, Any] | None = None) -> list[ManifestFile]:
    """The files of a source in sorted order of their path under the source's root.

    A manifest that names one file is a single-file source (one entry, empty tag). A folder
    (local, or ``s3://bucket/prefix/``) is listed recursively; a glob (``*``, ``?``, ``[..]``,
    ``**``) or brace pattern (``{a,b}``) is expanded. Both take files named like manifests
    (``.csv``, ``.tsv``, ``.jsonl``, ``.ndjson``, ``.parquet``, each + ``.gz``; with
    ``format: jsonl`` also ``.json``) and skip side files (names or folders starting with
    ``_`` or ``.``: Spark's ``_SUCCESS``, ``_committed_*``, ``.crc``). Raises ManifestError
    when nothing is left, when the files mix formats or a name collision would mix keys.
    """
    manifest = source.manifest
    where = display(manifest)
    kind = _kind(manifest, storage_options)
    if kind == "file":
        fmt, gzipped = resolve_format(_name_of(manifest), source.format, where)
        return [ManifestFile(manifest, where, posixpath.basename(_name_of(manifest).rstrip("/")), "", fmt, gzipped)]

    root, listed = find_files(manifest, storage_options, kind)
    files: list[ManifestFile] = []
    skipped: list[str] = []
    for rel, info in listed:
        if not _takes(posixpath.basename(rel), source.format):
            skipped.append(rel)
            continue
        url = f"{root.rstrip('/')}/{rel}" if root else rel
        shown = display(url)
        fmt, gzipped = resolve_format(rel, source.format, shown)
        files.append(ManifestFile(url, shown, rel, file_tag(rel), fmt, gzipped, int(info.get("size") or 0)))
    files.sort(key=lambda f: f.rel)
    if not files:
        what = "no files match" if kind == "pattern" and not skipped else "no manifest files"
        seen = f" (found: {', '.join(skipped[:10])}{', ...' if len(skipped) > 10 else ''})" if skipped else ""
        raise ManifestError(
            where, f"{what}{seen}; a folder or pattern takes .csv, .tsv, .jsonl, .ndjson or .parquet files (+ .gz)"
        )
    formats = sorted({f.fmt for f in files})
    if len(formats) > 1:
        firsts = ", ".join(next(f.rel for f in files if f.fmt == fmt) + f" ({fmt})" for fmt in formats)
        raise ManifestError(where, f"files of more than one format ({firsts}); one source takes one format")
    check_tags(files, where)
    return files


def source_kind(manifest: str, storage_options: dict[str, Any] | None = None) -> str:
    """``file``, ``folder`` or ``pattern``: how a source names its files."""
    return _kind(manifest, storage_options)


def find_files(
    manifest: str, storage_options: dict[str, Any] | None, kind: str
) -> tuple[str, list[tuple[str, dict[str, Any]]]]:
    """(root, [(path under the root, fsspec info)]) of a folder or pattern, sorted, side files
    (see ``_side_file``) left out; ManifestError when it cannot be listed."""
    where = display(manifest)
    root = _root_of(manifest, kind)
    try:
        fs, root_path = _fs(root or ".", storage_options)
        found: dict[str, dict[str, Any]] = {}
        if kind == "folder":
            entries = fs.find(root_path, detail=True)
            for path, info in entries.items():
                if _is_file(path, info):
                    found[path] = info
            if not entries and not fs.exists(root_path):
                raise FileNotFoundError(root_path)
        else:
            for pattern in _expand_braces(manifest):
                pattern_path = _fs(pattern, storage_options)[1]
                for path, info in fs.glob(pattern_path, detail=True).items():
                    if _is_file(path, info):
                        found[path] = info
    except PERMANENT_OPEN_ERRORS as err:
        raise cannot(where, "list", err) from None
    except (ValueError, ImportError) as err:
        raise ManifestError(where, f"cannot list: {err}") from None

    prefix = root_path.rstrip("/") + "/" if root_path else ""
    listed = []
    for path in sorted(found):
        rel = path[len(prefix) :] if prefix and path.startswith(prefix) else path.lstrip("/")
        if not _side_file(rel):
            listed.append((rel, found[path]))
    return root, listed


def check_tags(files: list[ManifestFile], where: str) -> None:
    """ManifestError when two files of a source share a file tag (their keys would mix)."""
    tags: dict[str, str] = {}
    for f in files:
        if f.tag in tags:
            raise ManifestError(
                where,
                f"{tags[f.tag]} and {f.rel} share the key prefix {f.tag} (a 1 in 4 billion collision); "
                "split the source in two (two patterns) or rename one of them",
            )
        tags[f.tag] = f.rel
