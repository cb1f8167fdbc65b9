"""Reshard copies: input byte ranges into an output tar, as kernel copies of contiguous runs locally, as sorted and merged reads on object stores."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import mmap
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from tasks.formats.storage import Storage
from tasks.formats.tar_format import BLOCK
from tasks.formats.tar_reader import ShardError
from tasks.stages.reshard import OutputPlan

# Bytes of samples buffered at once when inputs cannot be mapped (object stores; see _fetch).
DEFAULT_WINDOW_BYTES = 64 * 2**20
# Neighbouring samples of one input with at most this many bytes between them are fetched in
# one read: a wasted 64 KiB costs less than another request on an object store.
MAX_GAP_BYTES = 64 * 2**10
# copy_file_range errors that mean "not between these two files": copy through memory instead.
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF, errno.ETXTBSY}


def copy_samples(
    sink: Sink,
    inputs: Inputs,
    slots: np.ndarray,
    offsets: np.ndarray,
    lengths: np.ndarray,
    window_bytes: int = DEFAULT_WINDOW_BYTES,
) -> None:
    """Append the samples (input ``slots[i]``, bytes ``offsets[i]`` + ``lengths[i]``) to ``sink`` in this order.

    When every input is mapped (local files): one copy per run of samples that are contiguous
    in their input, whatever the order of the runs. Otherwise: windows of at most
    ``window_bytes`` of the write order, each read sorted by offset and merged (``_fetch``),
    then written in order.
    """
    if inputs.all_mapped(np.unique(slots).tolist()):
        _copy_runs(sink, inputs, slots, offsets, lengths)
        return
    for a, b in _windows(lengths, window_bytes):
        views = _fetch(inputs, slots, offsets, lengths, a, b)
        for i in range(a, b):
            sink.write(views.pop(i))
        del views


class Inputs:
    """The input tars of one output, each opened on first use and kept until the output is done.

    A local tar is kept open (the kernel copies from its descriptor) and mapped read-only (the
    copy is hashed from the map: views of the page cache, no read buffers; the mapped pages are
    clean file pages the kernel can reclaim, so they do not count against memory). Other tars
    (object stores) stay open as file objects and are read with seek and read.
    """

    def __init__(self, storage: Storage, output: OutputPlan) -> None:
        self._storage = storage
        self._output = output
        self._open: dict[int, Any] = {}
        self._maps: dict[int, mmap.mmap] = {}

    def get(self, slot: int) -> tuple[Any, memoryview | None]:
        """(file object, whole-file view or None) of input ``slot``."""
        if slot not in self._open:
            fh = self._storage.open(self._output.inputs[slot].tar, "rb")
            self._open[slot] = fh
            try:
                self._maps[slot] = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            except (AttributeError, OSError, ValueError):  # no descriptor (object store), or an empty file
                pass
        mm = self._maps.get(slot)
        return self._open[slot], memoryview(mm) if mm is not None else None

    def all_mapped(self, slots: list[int]) -> bool:
        return all(self.get(s)[1] is not None for s in slots)

    def path(self, slot: int) -> str:
        return self._storage.url(self._output.inputs[slot].tar)

    def close(self) -> None:
        for mm in self._maps.values():
            # A view still alive (after an exception) keeps its map; the collector frees it.
            with contextlib.suppress(BufferError):
                mm.close()
        for fh in self._open.values():
            fh.close()
        self._open.clear()
        self._maps.clear()


class Sink:
    """The output tar being written: every byte hashed in write order, kernel copies where possible.

    The first write goes through the file object (where the storage's fault injection sits);
    the rest go straight to its descriptor, as ``os.write`` or ``os.copy_file_range``. A kernel
    copy's bytes are hashed on a thread of the sink's own, from the input's map, while the
    kernel copies them and the runs after them (both release the GIL): the task's chain was
    copy, then hash, one after the other. ``hexdigest`` waits for the hashing; so must anyone
    who closes the inputs' maps first (``drain``).
    """

    def __init__(self, fh: Any) -> None:
        self._fh = fh
        self._fd: int | None = None
        self._kernel = hasattr(os, "copy_file_range")
        self._sha = hashlib.sha256()
        self._hasher: ThreadPoolExecutor | None = None
        self._hashing: list[Future[None]] = []
        self.pos = 0

    def fileno(self) -> int:
        return self._fh.fileno()

    def write(self, data: memoryview) -> None:
        if self._fd is None:
            self._fh.write(data)
            self._fh.flush()
            self._fd = self._fh.fileno()
        else:
            _write_all(self._fd, data)
        self.drain()
        self._sha.update(data)
        self.pos += len(data)

    def copy(self, src: Any, view: memoryview, start: int, n: int) -> None:
        """Append ``n`` bytes of the input open as ``src`` (mapped as ``view``) from ``start``."""
        part = view[start : start + n]
        first = 0
        if self._fd is None:
            first = min(n, BLOCK)
            self.write(part[:first])
        if not self._kernel:
            self.write(part[first:])
            return
        # Hashed meanwhile, in order: each run after the one before it.
        if self._hasher is None:
            self._hasher = ThreadPoolExecutor(1, thread_name_prefix="reshard-hash")
        self._hashing.append(self._hasher.submit(self._sha.update, part[first:]))
        done = first
        fd = src.fileno()
        while done < n:
            try:
                k = os.copy_file_range(fd, self._fd, n - done, start + done)
            except OSError as err:
                if err.errno not in _NO_KERNEL_COPY:
                    raise
                self._kernel = False
                _write_all(self._fd, part[done:])
                break
            if k == 0:  # the input shrank under us; the map's length said otherwise
                raise OSError(errno.EIO, f"input ended {n - done} bytes early while copying")
            done += k
        self.pos += n - first

    def drain(self) -> None:
        """Wait until every byte written so far is hashed (the thread holds views of the maps)."""
        if self._hasher is not None:
            self._hasher.shutdown(wait=True)
            self._hasher = None
        hashing, self._hashing = self._hashing, []
        for update in hashing:
            update.result()  # a failed update would leave a wrong digest: raise it

    def hexdigest(self) -> str:
        self.drain()
        return self._sha.hexdigest()


def _write_all(fd: int, data: memoryview) -> None:
    while len(data):
        data = data[os.write(fd, data) :]


def _copy_runs(sink: Sink, inputs: Inputs, slots: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> None:
    """Copy the samples in write order, one copy per run of samples contiguous in their input."""
    n = len(slots)
    if not n:
        return
    ends = offsets + lengths
    breaks = np.flatnonzero((slots[1:] != slots[:-1]) | (offsets[1:] != ends[:-1])) + 1
    firsts = np.concatenate([[0], breaks])
    lasts = np.concatenate([breaks, [n]]) - 1
    for slot, a, b in zip(slots[firsts].tolist(), offsets[firsts].tolist(), ends[lasts].tolist()):
        src, view = inputs.get(slot)
        if b > len(view):
            raise ShardError(
                "tar_truncated", inputs.path(slot), None, f"ledger records bytes {a}..{b}, the tar has {len(view)}", a
            )
        sink.copy(src, view, a, b - a)


def _windows(lengths: np.ndarray, window_bytes: int) -> list[tuple[int, int]]:
    """Cut the write order into consecutive [a, b) slices of at most window_bytes (or one sample)."""
    out = []
    a = 0
    acc = 0
    for i, length in enumerate(lengths.tolist()):
        if i > a and acc + length > window_bytes:
            out.append((a, i))
            a, acc = i, 0
        acc += length
    if a < len(lengths):
        out.append((a, len(lengths)))
    return out


def _fetch(
    inputs: Inputs, slots: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, a: int, b: int
) -> dict[int, memoryview]:
    """The raw bytes of samples a..b of the write order, read grouped by input and sorted by offset.

    Ledger order need not be tar order (downloads store samples as they complete): sorting
    the window's reads by offset makes them sequential, and the caller writes in ledger order.
    """
    idx = np.arange(a, b)
    order = idx[np.lexsort((offsets[a:b], slots[a:b]))]
    views: dict[int, memoryview] = {}
    k = 0
    while k < len(order):
        slot = int(slots[order[k]])
        fh, whole = inputs.get(slot)
        while k < len(order) and int(slots[order[k]]) == slot:
            # One read for a run of neighbouring samples.
            run = [int(order[k])]
            run_start = int(offsets[run[0]])
            run_end = run_start + int(lengths[run[0]])
            k += 1
            while k < len(order) and int(slots[order[k]]) == slot:
                nxt = int(order[k])
                off = int(offsets[nxt])
                if off < run_end or off - run_end > MAX_GAP_BYTES:
                    break
                run.append(nxt)
                run_end = off + int(lengths[nxt])
                k += 1
            if whole is not None:
                view = whole[run_start:run_end]
            else:
                fh.seek(run_start)
                view = memoryview(fh.read(run_end - run_start))
            if len(view) != run_end - run_start:
                raise ShardError(
                    "tar_truncated",
                    inputs.path(slot),
                    None,
                    f"ledger records bytes {run_start}..{run_end}, the tar has fewer",
                    run_start,
                )
            for i in run:
                rel = int(offsets[i]) - run_start
                views[i] = view[rel : rel + int(lengths[i])]
    return views
