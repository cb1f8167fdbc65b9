"""Untrusted WebDataset shards read one sample at a time, each with a verdict; a fault in the tar ends the shard but keeps what was read before it."""

from __future__ import annotations

import hashlib
import unicodedata
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

from tasks.formats.shards import split_key
from tasks.formats.spooled import SpooledBody
from tasks.formats.tar_format import DEFAULT_MAX_MEMBERS
from tasks.formats.tar_reader import ShardError, iter_tar_members

# Member types that are never loaded, whatever the sample: they execute code when read
# (pickle and the formats built on it: torch checkpoints, joblib), or are code (Python
# sources and bytecode, native libraries, scripts). A sample that carries one is refused
# whole: whoever packed code beside an image is not trusted for the image either.
# ``.npy`` / ``.npz`` are not on the list: numpy refuses pickled arrays unless asked
# (allow_pickle=False), and ingest carries only the image, caption and json members anyway.
FORBIDDEN_EXTENSIONS = frozenset(
    {
        "pickle", "pkl", "pck", "pth", "pt", "ckpt", "joblib", "dill",  # pickle and its kin
        "py", "pyc", "pyo", "pyd", "pyz", "so", "dll", "dylib", "exe", "sh", "bat", "cmd", "ps1",  # code
    }
)  # fmt: skip

# Longest member key taken, in characters (img2dataset's are 9 digits; WebDataset's writers
# stay far below ustar's 100-byte names).
MAX_KEY_CHARS = 200

# Folder keys (``train/cats/0001`` from ``train/cats/0001.jpg``, webdataset's key keeps the
# folders) are rekeyed flat with this between the folders, so a key is one safe name.
FOLDER_SEPARATOR = "__"

# Unicode categories refused in keys: controls (C0, C1), format characters (the bidi
# overrides and isolates, zero-width joiners), surrogates, line and paragraph separators.
_UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})


@dataclass
class TarSample:
    """One sample of an untrusted shard (the consecutive members sharing a key), with its verdict.

    Args:
        key: the members' key as written in the tar (untrusted; see ``shown_key``).
        ordinal: 0-based position among the shard's samples, rejected ones included.
        offset: header offset of its first member.
        members: extension as written -> bytes (a ``SpooledBody`` when spilled); ``None`` for a
            member over ``skip_larger_than``.
        sizes: extension -> data bytes.
        reason: ``None`` for a sample to judge further, else why it is refused
            (``duplicate_key``, ``unsafe_key``, ``forbidden_member``).
        detail: for people, with ``reason``.
        flat_key: the key a folder key is rekeyed to (``flat_key``), else the key itself;
            repeats are judged on it.
    """

    key: str
    ordinal: int
    offset: int
    members: dict[str, bytes | SpooledBody | None] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    reason: str | None = None
    detail: str | None = None
    flat_key: str = ""

    @property
    def shown_key(self) -> str:
        """The key for ledgers and messages: non-ASCII and control characters escaped; cut only
        when over ``MAX_KEY_CHARS`` (a refused key), so an accepted key stays traceable."""
        return shown(self.key, 10 * MAX_KEY_CHARS if len(self.key) <= MAX_KEY_CHARS else 120)


@dataclass(frozen=True)
class ShardFault:
    """A fault that ends the reading of a shard (see ``tasks.formats.tar_format.SHARD_ERROR_REASONS``).

    Args:
        reason: the shard reason (``tar_truncated``, ``not_a_tar``, ``tar_symlink``...).
        detail: the reader's message, and the sample in progress that was dropped, if any.
        samples_before: samples yielded before the fault.
    """

    reason: str
    detail: str
    samples_before: int


def shown(text: str, limit: int = 120) -> str:
    """Untrusted text made safe to print: escaped to ASCII, cut at ``limit`` characters."""
    safe = text.encode("ascii", "backslashreplace").decode("ascii")
    safe = "".join(ch if 32 <= ord(ch) < 127 else f"\\x{ord(ch):02x}" for ch in safe)
    return safe if len(safe) <= limit else safe[:limit] + "..."


def key_problem(key: str) -> str | None:
    """Why a member key is not a safe name, or None; a relative folder key (``a/b/c``) is one."""
    if len(key) > MAX_KEY_CHARS:
        return f"key of {len(key)} characters (more than {MAX_KEY_CHARS})"
    if "\\" in key:
        return "key holds a backslash"
    if key.startswith("/"):
        return "key is an absolute path"
    if any(part in ("", "..") for part in key.split("/")):
        return "key holds an empty or '..' folder"
    for ch in key:
        if unicodedata.category(ch) in _UNSAFE_CATEGORIES:
            return f"key holds the control or format character U+{ord(ch):04X} ({unicodedata.name(ch, 'unnamed')})"
    return None


def flat_key(key: str) -> str:
    """A folder key as one name: folders joined by ``FOLDER_SEPARATOR`` (``a/b`` -> ``a__b``), ``.``
    folders left out (``tar -C dir .`` writes ``./a.jpg``: key ``a``); when that is over
    ``MAX_KEY_CHARS``, its start and a hash of the whole key. Other keys unchanged."""
    if "/" not in key:
        return key
    flat = FOLDER_SEPARATOR.join(part for part in key.split("/") if part != ".")
    if len(flat) <= MAX_KEY_CHARS:
        return flat
    digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return flat[: MAX_KEY_CHARS - len(digest) - len(FOLDER_SEPARATOR)] + FOLDER_SEPARATOR + digest


def is_meta_member(name: str) -> bool:
    """Tar meta members, not samples: ``__index__.json``, ``__meta__...``, hidden folders (``.nv-meta/``)."""
    parts = name.split("/")
    return parts[-1].startswith("__") or any(part.startswith(".") and part != "." for part in parts)


def forbidden(ext: str) -> bool:
    """Whether any dot-part of an extension is a type never loaded (``latent.pth`` is)."""
    return any(part in FORBIDDEN_EXTENSIONS for part in ext.lower().split("."))


def iter_tar_samples(
    fileobj: BinaryIO,
    *,
    path: str | None = None,
    max_member_bytes: int,
    skip_larger_than: int,
    max_members: int = DEFAULT_MAX_MEMBERS,
    spill: Callable[[str], bool] | None = None,
) -> Iterator[TarSample | ShardFault]:
    """Every sample of an untrusted tar with a verdict, then at most one ``ShardFault``.

    Unlike ``tasks.formats.shards.iter_samples``, which gives up the shard at the first odd sample,
    this judges samples one by one: a key seen before (again later, or the same member twice
    in a row) is ``duplicate_key`` (the first is kept); a key that is not a safe name is
    ``unsafe_key``; a member of a type never loaded (``FORBIDDEN_EXTENSIONS``) makes the
    sample ``forbidden_member``; a safe folder key (``a/b``, webdataset's key of ``a/b.jpg``) is
    rekeyed flat (``flat_key``) and judged a repeat on that, so ``a/b`` after ``a__b`` is
    ``duplicate_key``; a member without an extension is kept under the empty
    extension for the caller to refuse. Meta members (``is_meta_member``) are skipped. What
    ``iter_tar_members`` refuses (truncation, not a tar, compression, bad headers, links,
    absolute or ``..`` names, too many or too large members) ends the iteration with a
    ``ShardFault``; the sample in progress is kept when the fault names a member of another
    key, and dropped with the fault otherwise (more of its members may lie past it).

    Args:
        fileobj: the shard's bytes, read sequentially.
        path: the shard's name, for messages.
        max_member_bytes: a larger member is a fault of the shard (the reader's hard cap).
        skip_larger_than: a larger member is not read: its data is ``None``, for the caller
            to refuse that one sample (``too_large``).
        max_members: most members in the shard.
        spill: members whose name it accepts go to a local file (``SpooledBody``) as they are
            read, not into memory.
    """
    seen: set[str] = set()
    current: TarSample | None = None
    ordinal = 0
    members = iter_tar_members(
        fileobj,
        path=path,
        max_member_bytes=max_member_bytes,
        max_members=max_members,
        skip_larger_than=skip_larger_than,
        spill=spill,
    )
    while True:
        try:
            member = next(members, None)
        except ShardError as err:
            # The sample in progress is complete when the fault names a member of another key
            # (members of a key are consecutive); otherwise more of it may lie past the fault.
            dropped = ""
            if current is not None:
                # a name without an extension is a key of its own, as below
                named = (split_key(err.member) or (err.member, "")) if err.member is not None else None
                if named is not None and named[0] != current.key:
                    yield finish(current)
                    ordinal += 1
                else:
                    dropped = f"; sample '{current.shown_key}' in progress dropped"
            yield ShardFault(err.reason, shown(str(err), 400) + dropped, ordinal)
            return
        if member is None:
            break
        if is_meta_member(member.name):
            continue
        parts = split_key(member.name)
        key, ext = parts if parts is not None else (member.name, "")
        if current is None or key != current.key or ext in current.members:
            if current is not None:
                yield finish(current)
                ordinal += 1
            flat = flat_key(key) if key_problem(key) is None else key
            current = TarSample(key=key, ordinal=ordinal, offset=member.header_offset, flat_key=flat)
            if flat in seen:
                rekeyed = f" (rekeyed '{shown(flat)}')" if flat != key else ""
                current.reason, current.detail = (
                    "duplicate_key",
                    f"key '{current.shown_key}'{rekeyed} appeared earlier in the shard; the first is kept",
                )
            seen.add(flat)
        current.members[ext] = member.data
        current.sizes[ext] = member.size
    if current is not None:
        yield finish(current)


def finish(sample: TarSample) -> TarSample:
    """The sample's own verdict, unless it already has one (a repeat)."""
    if sample.reason is not None:
        return sample
    problem = key_problem(sample.key)
    if problem is not None:
        sample.reason, sample.detail = "unsafe_key", f"{problem}: '{sample.shown_key}'"
        return sample
    bad = sorted(ext for ext in sample.members if forbidden(ext))
    if bad:
        sample.reason, sample.detail = (
            "forbidden_member",
            f"member type(s) never loaded: {', '.join(shown(e, 40) for e in bad)}; sample refused",
        )
    return sample
