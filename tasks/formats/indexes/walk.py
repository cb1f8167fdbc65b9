"""One pass over a release's shard records: checked, and turned into what every index needs (DALI lines, energon offsets)."""

from __future__ import annotations

import re
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tasks.formats.shards import SampleRecord, split_key
from tasks.formats.tar_format import BLOCK

# Formats, as their own tools write them (checked byte for byte in tests/test_indexes.py):
#
# DALI `fn.readers.webdataset` index, as tools/wds2idx.py (shipped in the DALI wheel as the
# `wds2idx` module) writes it: a line "v1.2 <samples>", then one line per sample of
# "<ext> <data offset> <size> <member name>" groups joined by single spaces, "\n" after every
# line. The offset is the member's DATA offset (wds2idx: `offset = (offset + 1) * 512` from the
# header block number; DALI's own tar scan uses `TellArchive() + HeaderSize()`), and the reader
# refuses one that is not a multiple of 512. DALI 2.4 accepts "v1.1" (no names) and "v1.2"
# (names required): dali/operators/reader/loader/webdataset_loader.h,
# `kSupportedIndexVersions = {"v1.1", kCurrentIndexVersion}` with `kCurrentIndexVersion =
# "v1.2"`, parsed by ParseSampleDesc in webdataset_loader.cc.
DALI_INDEX_VERSION = "v1.2"

# Megatron-Energon 7.4.1 (`energon prepare`, itar.py; its .nv-meta/ folder: indexes/energon.py):
# - "<shard>.tar.idx" (itar.py ITAR_SUFFIX, TarIndexWriter.append: `struct.pack("Q", offset)`):
#   one unsigned 64-bit offset per sample, the tar HEADER offset of the sample's first member
#   (tarfile's `member.offset`), then one more: the offset where the end-of-archive blocks
#   start (`iw.append(tar.offset)` after the last member), so sample i spans idx[i]..idx[i+1].
#   Energon packs in native byte order; we write little-endian, which is native on the x86-64
#   and aarch64 machines energon runs on.
#
# Energon skips members that match this (flavors/webdataset/config.py skip_meta_re).
_ENERGON_SKIPPED = re.compile(r"__[^/]*__($|/)")

# Shard names go into space-separated index lines, brace-expanded split lists and URLs.
_SHARD_NAME_RE = re.compile(r"[A-Za-z0-9_-]+(?:[./][A-Za-z0-9_-]+)*\.tar")
_END_OF_ARCHIVE = 2 * BLOCK


@dataclass(frozen=True)
class ShardIndexInput:
    """What the release step knows about one shard, enough to index it without reading it.

    Args:
        name: the tar's path relative to the release folder, e.g. ``"shard-000000.tar"``.
        size: bytes of the tar.
        samples: the writer's records, in order, offsets relative to the tar's start.
    """

    name: str
    size: int
    samples: Sequence[SampleRecord]


@dataclass(frozen=True)
class ShardWalk:
    """One shard as the indexes need it, gathered in one pass over its records."""

    name: str
    count: int
    dali: bytes
    energon_offsets: bytes


def dali_index_name(shard_name: str) -> str:
    """``"a/shard-000000.tar"`` -> ``"a/shard-000000.idx"``: wds2idx's default, beside the tar."""
    return shard_name.removesuffix(".tar") + ".idx"


def energon_index_name(shard_name: str) -> str:
    """``"a/shard-000000.tar"`` -> ``"a/shard-000000.tar.idx"`` (energon's ITAR_SUFFIX)."""
    return shard_name.removesuffix(".tar") + ".tar.idx"


def walk(shard: ShardIndexInput) -> ShardWalk:
    """Check one shard's records and build its DALI lines and energon offsets together.

    Raises ``ValueError`` for records no reader could use: a bad shard name, an empty shard,
    samples that overlap, leave gaps or run past the tar, members that do not belong to their
    sample, and data offsets off the 512-byte grid.
    """
    name = shard.name
    if not isinstance(name, str) or not _SHARD_NAME_RE.fullmatch(name):
        raise ValueError(
            f"shard name {name!r}: use a relative path of [A-Za-z0-9_-] parts ending in '.tar' "
            "(names go into space-separated DALI indexes and brace-expanded energon splits)"
        )
    if not shard.samples:
        raise ValueError(f"shard {name!r} has no samples; DALI and energon cannot index an empty tar")
    lines = [b""]  # the version line, once the count is known
    offsets = bytearray()
    expected = 0
    for sample in shard.samples:
        if sample.offset != expected:
            raise ValueError(
                f"shard {name!r}: sample {sample.key!r} starts at byte {sample.offset}, expected "
                f"{expected} (records must be the shard's samples, in order, without gaps)"
            )
        if not sample.members:
            raise ValueError(f"shard {name!r}: sample {sample.key!r} has no members")
        end = sample.offset + sample.length
        groups = []
        for member in sample.members:
            parts = split_key(member.name)
            if parts is None or parts[0] != sample.key:
                raise ValueError(f"shard {name!r}: member {member.name!r} is not part of sample {sample.key!r}")
            if _ENERGON_SKIPPED.match(member.name):
                raise ValueError(f"shard {name!r}: energon skips member {member.name!r} (a __name__ key)")
            if member.offset % BLOCK or not sample.offset < member.offset <= end - member.size:
                raise ValueError(
                    f"shard {name!r}: member {member.name!r} data at byte {member.offset} "
                    f"({member.size} bytes) is not block-aligned inside its sample"
                )
            groups.append(f"{parts[1]} {member.offset} {member.size} {member.name}")
        lines.append(" ".join(groups).encode("utf-8"))
        offsets += struct.pack("<Q", sample.offset)
        expected = end
    if expected + _END_OF_ARCHIVE > shard.size:
        raise ValueError(
            f"shard {name!r}: samples end at byte {expected}, but the tar is {shard.size} bytes "
            "(no room for the end-of-archive blocks)"
        )
    offsets += struct.pack("<Q", expected)  # where the end-of-archive blocks start
    lines[0] = f"{DALI_INDEX_VERSION} {len(shard.samples)}".encode("ascii")
    lines.append(b"")
    return ShardWalk(name=name, count=len(shard.samples), dali=b"\n".join(lines), energon_offsets=bytes(offsets))


def walk_all(shards: Iterable[ShardIndexInput]) -> list[ShardWalk]:
    walked = [walk(shard) for shard in shards]
    if not walked:
        raise ValueError("no shards to index")
    names = [w.name for w in walked]
    if len(set(names)) != len(names):
        raise ValueError("shard names repeat")
    return walked
