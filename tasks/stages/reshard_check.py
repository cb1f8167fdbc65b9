"""Checking a reshard output from what its writer recorded: tar header blocks at the recorded offsets, not every byte."""

from __future__ import annotations

import contextlib
import io
import mmap
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tasks.formats.tar_format import BLOCK
from tasks.formats.tar_reader import ShardError, iter_tar_members

_END = 2 * BLOCK  # the end-of-archive blocks
_NAME = slice(0, 100)
_SIZE = slice(124, 136)
_CHKSUM = slice(148, 156)
_TYPE = 156
_PREFIX = slice(345, 500)
_SPACE = 0x20


@dataclass(frozen=True)
class Layout:
    """Where every sample and member of one output lies, as the writer recorded it (numpy arrays).

    Args:
        keys: sample keys, in tar order.
        offsets: first header byte of each sample.
        lengths: bytes of each sample (headers, data, padding).
        counts: members per sample.
        names: member names, all samples' members in tar order (an Arrow string array).
        data: data offset of each member (its header is the block before).
        sizes: data bytes of each member.
    """

    keys: list[str]
    offsets: np.ndarray
    lengths: np.ndarray
    counts: np.ndarray
    names: pa.Array
    data: np.ndarray
    sizes: np.ndarray

    @classmethod
    def of(cls, table: pa.Table) -> Layout:
        """From a table with the ledger's ``key``, ``offset``, ``length`` and ``members`` columns."""
        members = table.column("members").combine_chunks()
        flat = pc.list_flatten(members)
        return cls(
            keys=table.column("key").to_pylist(),
            offsets=table.column("offset").to_numpy(zero_copy_only=False).astype(np.int64),
            lengths=table.column("length").to_numpy(zero_copy_only=False).astype(np.int64),
            counts=pc.list_value_length(members).to_numpy(zero_copy_only=False).astype(np.int64),
            names=pc.struct_field(flat, "name"),
            data=pc.struct_field(flat, "offset").to_numpy(zero_copy_only=False).astype(np.int64),
            sizes=pc.struct_field(flat, "size").to_numpy(zero_copy_only=False).astype(np.int64),
        )


def check_row(
    shard: str, layout: Layout, size: int, hashed: int, required: tuple[str, ...], buf: Any
) -> dict[str, Any]:
    """The reshard gate's row for one output whose bytes ``buf`` holds (the written tar, mapped).

    ``readable``: the recorded samples tile the tar from byte 0 and the two zero blocks end it
    at ``size``; every member's header block carries a valid checksum, a regular-file type, the
    recorded name and size, and lies right before its recorded data and right after the
    previous member's padding. A sample whose headers are not exactly as Python's tarfile
    writes them is read again by the project's tar reader, and passes if the reader finds the
    recorded members. Only header blocks are read (about 1.5 KB of a 100 KB sample).
    ``complete``: every sample has a member for every ``required`` extension (by the names just
    checked). ``checksum_ok``: the sha256 the writer computed covers ``hashed`` bytes, the
    tar's size (it is computed from the bytes as they are written, so it is not recomputed).
    """
    problem = _tiling_problem(layout, size) or _header_problem(layout, buf, size)
    incomplete = _incomplete(layout, required)
    checksum_ok = hashed == size
    detail = problem
    if detail is None and incomplete is not None:
        detail = f"{incomplete} lacks one of {list(required)}"
    if detail is None and not checksum_ok:
        detail = f"the sha256 covers {hashed} bytes, the tar has {size}"
    return {
        "shard": shard,
        "samples": len(layout.keys),
        "readable": problem is None,
        "complete": incomplete is None,
        "checksum_ok": checksum_ok,
        "detail": detail,
    }


def check_file(shard: str, fd: int, layout: Layout, hashed: int, required: tuple[str, ...]) -> dict[str, Any]:
    """``check_row`` of the tar open at ``fd``, read through a read-only map of it."""
    size = os.fstat(fd).st_size
    if size == 0:
        return check_row(shard, layout, size, hashed, required, b"")
    mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    try:
        return check_row(shard, layout, size, hashed, required, mm)
    finally:
        with contextlib.suppress(BufferError):  # a view still alive after an exception: the collector frees it
            mm.close()


def _tiling_problem(layout: Layout, size: int) -> str | None:
    """Samples back to back from byte 0, whole blocks each, then the end-of-archive blocks."""
    n = len(layout.keys)
    if n == 0:
        return None if size == _END else f"an empty tar is {_END} bytes, not {size}"
    starts = np.concatenate([[0], np.cumsum(layout.lengths)[:-1]])
    bad = np.flatnonzero(
        (layout.offsets != starts) | (layout.lengths <= 0) | (layout.lengths % BLOCK != 0) | (layout.counts < 1)
    )
    if len(bad):
        return f"sample {layout.keys[bad[0]]} does not start where the previous one ends, or is not whole blocks"
    end = int(starts[-1] + layout.lengths[-1])
    if end + _END != size:
        return f"the samples end at byte {end}, so the tar should be {end + _END} bytes, not {size}"
    return None


def _header_problem(layout: Layout, buf: Any, size: int) -> str | None:
    """Every member's header block as tarfile writes it, else the sample as the tar reader reads it."""
    if len(buf) < size or memoryview(buf)[size - _END : size] != bytes(_END):
        return "the tar does not end with two zero blocks"
    n = len(layout.keys)
    first = np.concatenate([[0], np.cumsum(layout.counts)[:-1]])
    last = first + layout.counts - 1
    # Member k's header starts where member k-1's padding ends, or where its sample starts.
    padded_end = layout.data + -(-layout.sizes // BLOCK) * BLOCK
    expected = np.concatenate([[0], padded_end[:-1]])
    expected[first] = layout.offsets
    header = layout.data - BLOCK
    placed = (
        (header == expected)
        & (header >= 0)
        & (header % BLOCK == 0)
        & (layout.sizes >= 0)
        & (layout.data + layout.sizes <= size)
    )
    sample_of = np.repeat(np.arange(n), layout.counts)
    sample_ok = np.ones(n, bool)
    sample_ok &= padded_end[last] == layout.offsets + layout.lengths
    names = layout.names.cast(pa.binary())
    idx = np.flatnonzero(placed & (pc.binary_length(names).to_numpy(zero_copy_only=False) <= 100))
    good = np.zeros(len(header), bool)
    if len(idx):
        # Every header is block-aligned: gather them as rows of the tar seen as 512-byte blocks.
        blocks = np.frombuffer(buf, np.uint8, count=size // BLOCK * BLOCK).reshape(-1, BLOCK)[header[idx] // BLOCK]
        want_names = (
            names.take(pa.array(idx)).to_numpy(zero_copy_only=False).astype("S100").view(np.uint8).reshape(-1, 100)
        )
        stored = blocks[:, _CHKSUM]
        digits = stored[:, :6]
        chk = ((digits.astype(np.int64) - ord("0")) * (8 ** np.arange(5, -1, -1))).sum(axis=1)
        summed = blocks.sum(axis=1, dtype=np.int64) - stored.sum(axis=1, dtype=np.int64) + 8 * _SPACE
        size_digits = blocks[:, _SIZE][:, :11]
        recorded = ((size_digits.astype(np.int64) - ord("0")) * (8 ** np.arange(10, -1, -1))).sum(axis=1)
        good[idx] = (
            ((digits >= ord("0")) & (digits <= ord("7"))).all(axis=1)
            & (stored[:, 6] == 0)
            & (stored[:, 7] == _SPACE)
            & (chk == summed)
            & ((blocks[:, _TYPE] == ord("0")) | (blocks[:, _TYPE] == 0))
            & ~blocks[:, _PREFIX].any(axis=1)
            & ((size_digits >= ord("0")) & (size_digits <= ord("7"))).all(axis=1)
            & (blocks[:, _SIZE][:, 11] == 0)
            & (recorded == layout.sizes[idx])
            & (blocks[:, _NAME] == want_names).all(axis=1)
        )
        del blocks
    sample_ok[sample_of[~good]] = False
    for i in np.flatnonzero(~sample_ok).tolist():
        problem = _read_sample(layout, buf, i, int(first[i]))
        if problem is not None:
            return problem
    return None


def _read_sample(layout: Layout, buf: Any, i: int, first: int) -> str | None:
    """One sample's bytes read by the tar reader (as a tar of its own): do they hold the recorded members?"""
    a, b = int(layout.offsets[i]), int(layout.offsets[i] + layout.lengths[i])
    want = [
        (layout.names[k].as_py(), int(layout.data[k]) - a, int(layout.sizes[k]))
        for k in range(first, first + int(layout.counts[i]))
    ]
    raw = bytes(memoryview(buf)[a:b])
    try:
        members = list(iter_tar_members(io.BytesIO(raw + bytes(_END)), read_data=False))
    except ShardError as err:
        return f"sample {layout.keys[i]}: {err}"
    got = [(m.name, m.offset, m.size) for m in members]
    if got != want or (members and members[-1].end != len(raw)):
        return f"sample {layout.keys[i]}: the tar holds members {got}, the record says {want}"
    return None


def _incomplete(layout: Layout, required: tuple[str, ...]) -> str | None:
    """The first sample without a member for every required extension, or None."""
    if not required or not layout.keys:
        return None
    n = len(layout.keys)
    sample_of = np.repeat(np.arange(n), layout.counts)
    names = layout.names
    complete = np.ones(n, bool)
    for ext in required:
        hit = pc.ends_with(names, "." + ext).to_numpy(zero_copy_only=False)
        complete &= np.bincount(sample_of[hit], minlength=n).astype(bool)
    bad = np.flatnonzero(~complete)
    return layout.keys[int(bad[0])] if len(bad) else None
