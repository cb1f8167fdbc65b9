"""Resharding: equal-size output shards planned from input counts and built from byte ranges."""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import operator
import time
from dataclasses import dataclass
from typing import Any, BinaryIO, Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tasks.ledger import LEDGER_SCHEMA, MEMBER_TYPE, read_parquet, write_parquet
from tasks.reasons import OK, REJECTED
from tasks.shards import HashingWriter, MemberRecord, SampleRecord, ShardError, ShardWriter
from tasks.storage import Storage

DEFAULT_REQUIRED = ("jpg", "txt", "json")

# Ledger reason of an ok input row that is not carried because a required member is missing.
# Its status is rejected; tasks/reasons.py should list it beside the other reasons.
INCOMPLETE = "incomplete_sample"

# Output ledgers (and census tables) are ledgers plus the input shard each sample came from.
RESHARD_SCHEMA = LEDGER_SCHEMA.append(pa.field("input_shard", pa.string()))
METADATA_KEY = b"shardsmith.reshard"

_INPUT_COLUMNS = ["key", "source", "row", "status", "offset", "length", "members"]
_CARRIED_COLUMNS = ["bytes", "sha256"]  # copied to the output ledger when the input has them
RESHARD_SCHEMA_INPUT = pa.schema([RESHARD_SCHEMA.field(c) for c in _INPUT_COLUMNS + _CARRIED_COLUMNS])

# Bytes of samples buffered at once while building an output (see build_output).
DEFAULT_WINDOW_BYTES = 64 * 2**20
# Neighbouring samples of one input with at most this many bytes between them are fetched in
# one read: a wasted 64 KiB costs less than another request on an object store.
MAX_GAP_BYTES = 64 * 2**10
PLAN_VERSION = 1  # bump when planning changes, so outputs get new names


@dataclass(frozen=True)
class InputShard:
    """One input shard of a reshard.

    Args:
        tar: the shard, relative to the storage root.
        ledger: its ledger.
        count: its *complete* ok samples: ok rows whose members include every required
            extension. The planner trusts this number and never reads ledgers; ``census_input``
            computes it when the previous phase cannot vouch that every ok sample is complete,
            and ``build_output`` raises if it turns out wrong.
    """

    tar: str
    ledger: str
    count: int


@dataclass(frozen=True)
class OutputPlan:
    """Everything one output task needs, and nothing of the other outputs.

    Args:
        index: the output's number, from 0.
        name: the output tar, relative to the storage root.
        ledger: the output ledger, written after the tar; its presence commits the output.
        inputs: only the inputs this output reads; the slots below index this tuple.
        samples: samples in this output (``samples_per_shard``, or the tail for the last).
        required: member extensions every carried sample has.
        ranges: unshuffled plans: ``(slot, start, stop)`` ranges of complete ok-row positions,
            written in this order.
        picks: shuffled plans: int64 ``(slot, position)`` pairs in write order, as bytes (a
            compact, immutable and picklable array; ``selection()`` decodes it).
    """

    index: int
    name: str
    ledger: str
    inputs: tuple[InputShard, ...]
    samples: int
    required: tuple[str, ...]
    ranges: tuple[tuple[int, int, int], ...] = ()
    picks: bytes = b""

    def selection(self) -> tuple[np.ndarray, np.ndarray]:
        """(slots, positions) of this output's samples in write order, as int64 arrays."""
        if self.picks:
            pairs = np.frombuffer(self.picks, dtype=np.int64).reshape(-1, 2)
            return pairs[:, 0], pairs[:, 1]
        if not self.ranges:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        slots = np.concatenate([np.full(stop - start, slot, np.int64) for slot, start, stop in self.ranges])
        positions = np.concatenate([np.arange(start, stop, dtype=np.int64) for _, start, stop in self.ranges])
        return slots, positions


@dataclass(frozen=True)
class ReshardPlan:
    """The whole reshard: which input positions make up each output.

    Args:
        inputs: every input, in dataset order (global positions follow it).
        samples_per_shard: N; every output but the last holds exactly N samples.
        seed: the shuffle seed, or ``None`` for dataset order.
        required: member extensions every carried sample has.
        total: samples in all outputs (the sum of the input counts).
        tail: samples in the last output (N when N divides ``total``; 0 without outputs).
        outputs: one plan per output, in order.
        digest: hex sha256 of everything the outputs depend on; it names them.
    """

    inputs: tuple[InputShard, ...]
    samples_per_shard: int
    seed: int | None
    required: tuple[str, ...]
    total: int
    tail: int
    outputs: tuple[OutputPlan, ...]
    digest: str


@dataclass(frozen=True)
class OutputResult:
    """What one output task reports: references, counts and the sample records.

    ``records`` are what the release indexes need (DALI .idx, wids, Energon), so the release
    never reads the tars again.
    """

    index: int
    tar: str
    ledger: str
    samples: int
    bytes: int
    sha256: str
    records: list[SampleRecord]
    seconds: float
    skipped: bool = False
    ledger_seconds: float = 0.0  # of ``seconds``: building and writing the output ledger


@dataclass(frozen=True)
class InputCensus:
    """One input's complete-sample count, and a row for every ok sample that will not be carried.

    Args:
        shard: the input, its ``count`` being its complete ok samples.
        ok: all ok rows of its ledger.
        incomplete: ``RESHARD_SCHEMA`` rows with reason ``incomplete_sample`` (``ok - count`` rows).
    """

    shard: InputShard
    ok: int
    incomplete: pa.Table


# ---------------------------------------------------------------------------------------------
# Planning
# ---------------------------------------------------------------------------------------------


def plan_reshard(
    inputs: Iterable[InputShard],
    samples_per_shard: int,
    *,
    prefix: str,
    seed: int | None = None,
    required: Iterable[str] = DEFAULT_REQUIRED,
) -> ReshardPlan:
    """Assign every complete input sample to one output, from the input counts alone.

    Global position ``g`` is the ``g``-th complete ok sample in input order. Without a seed,
    output ``j`` takes positions ``[j*N, (j+1)*N)``: one or a few contiguous ranges. With a
    seed, ``default_rng(seed).permutation(total)`` is cut into runs of N and output ``j``
    writes its samples in permutation order. Outputs are named
    ``{prefix}/{digest[:12]}/shard-{j:06d}.tar``, the digest covering the input names and
    counts, N, the seed, the required members and (shuffled) the permutation itself, so a
    rerun with the same inputs makes the same names and a different plan never reuses them.
    """
    inputs = tuple(inputs)
    n = int(samples_per_shard)
    if n < 1:
        raise ValueError(f"samples_per_shard must be at least 1, not {samples_per_shard!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise ValueError(f"seed must be a non-negative int or None, not {seed!r}")
    required = tuple(required)
    counts = np.fromiter((s.count for s in inputs), dtype=np.int64, count=len(inputs))
    if (counts < 0).any():
        bad = inputs[int(np.flatnonzero(counts < 0)[0])]
        raise ValueError(f"input {bad.tar!r} has a negative count {bad.count}")
    ends = np.cumsum(counts)
    starts = ends - counts
    total = int(ends[-1]) if len(inputs) else 0
    n_out = -(-total // n)
    tail = total - (n_out - 1) * n if n_out else 0

    perm = np.random.default_rng(seed).permutation(total) if seed is not None and total else None
    sha = hashlib.sha256()
    sha.update(
        json.dumps(
            {"version": PLAN_VERSION, "n": n, "seed": seed, "required": required, "prefix": prefix},
            sort_keys=True,
        ).encode()
    )
    for s in inputs:
        sha.update(f"\0{s.tar}\0{s.ledger}\0{s.count}".encode())
    if perm is not None:
        # Names follow the permutation actually drawn: if numpy ever draws another one for the
        # same seed, the outputs get new names instead of mixing two plans under one.
        sha.update(perm.tobytes())
    digest = sha.hexdigest()
    stem = f"{prefix}/{digest[:12]}"

    def output(j: int, used: Iterable[int], **parts: Any) -> OutputPlan:
        size = n if j < n_out - 1 else tail
        return OutputPlan(
            index=j,
            name=f"{stem}/shard-{j:06d}.tar",
            ledger=f"{stem}/shard-{j:06d}.ledger.parquet",
            inputs=_pick(inputs, used),
            samples=size,
            required=required,
            **parts,
        )

    outputs: list[OutputPlan] = []
    if perm is None:
        lo = np.arange(n_out, dtype=np.int64) * n
        hi = np.minimum(lo + n, total)
        first = np.searchsorted(ends, lo, side="right")
        last = np.searchsorted(ends, hi - 1, side="right")
        for j in range(n_out):
            used = [i for i in range(int(first[j]), int(last[j]) + 1) if counts[i]]
            ranges = []
            for slot, i in enumerate(used):
                a = max(int(lo[j]), int(starts[i]))
                b = min(int(hi[j]), int(ends[i]))
                ranges.append((slot, a - int(starts[i]), b - int(starts[i])))
            outputs.append(output(j, used, ranges=tuple(ranges)))
    else:
        # Input of each global position, by a gather (cheaper than a search per sample).
        src = np.repeat(np.arange(len(inputs), dtype=np.int64), counts)[perm]
        pos = perm - starts[src]
        for j in range(n_out):
            s = src[j * n : (j + 1) * n]
            used, slots = np.unique(s, return_inverse=True)
            pairs = np.empty((len(s), 2), np.int64)
            pairs[:, 0] = slots
            pairs[:, 1] = pos[j * n : (j + 1) * n]
            outputs.append(output(j, used.tolist(), picks=pairs.tobytes()))
    return ReshardPlan(
        inputs=inputs,
        samples_per_shard=n,
        seed=seed,
        required=required,
        total=total,
        tail=tail,
        outputs=tuple(outputs),
        digest=digest,
    )


def _pick(inputs: tuple[InputShard, ...], used: list[int]) -> tuple[InputShard, ...]:
    if len(used) == 1:
        return (inputs[used[0]],)
    return operator.itemgetter(*used)(inputs) if used else ()


# ---------------------------------------------------------------------------------------------
# Completeness
# ---------------------------------------------------------------------------------------------


def _read_input_ledger(storage: Storage, ledger: str) -> pa.Table:
    """The columns a reshard uses; carried columns the ledger lacks come back as nulls."""
    with storage.open(ledger, "rb") as fh:
        pf = pq.ParquetFile(fh)
        names = set(pf.schema_arrow.names)
        table = pf.read(columns=_INPUT_COLUMNS + [c for c in _CARRIED_COLUMNS if c in names], use_threads=False)  # see tasks.ledger.read_parquet
    for name in _CARRIED_COLUMNS:
        if name not in names:
            field = RESHARD_SCHEMA.field(name)
            table = table.append_column(field, pa.nulls(table.num_rows, field.type))
    return table.select(_INPUT_COLUMNS + _CARRIED_COLUMNS).cast(RESHARD_SCHEMA_INPUT)


def _complete_mask(table: pa.Table, required: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(ok, complete) row masks: complete rows are ok, have a byte range and every required member.

    A member counts for extension ``ext`` when its name ends in ``.ext``.
    """
    rows = table.num_rows
    ok = pc.fill_null(pc.equal(table.column("status"), OK), False).to_numpy(zero_copy_only=False)
    complete = ok & table.column("offset").is_valid().to_numpy(zero_copy_only=False)
    complete &= table.column("length").is_valid().to_numpy(zero_copy_only=False)
    members = table.column("members").combine_chunks()
    complete &= members.is_valid().to_numpy(zero_copy_only=False)
    if required:
        parents = pc.list_parent_indices(members).to_numpy(zero_copy_only=False)
        names = pc.struct_field(pc.list_flatten(members), "name")
        for ext in required:
            hit = pc.fill_null(pc.ends_with(names, "." + ext), False).to_numpy(zero_copy_only=False)
            complete &= np.bincount(parents[hit], minlength=rows).astype(bool)
    return ok, complete


def census_input(storage: Storage, tar: str, ledger: str, *, required: Iterable[str] = DEFAULT_REQUIRED) -> InputCensus:
    """Count one input's complete samples and write down the ones that are not (reads its ledger only).

    Only needed when the previous phase cannot vouch that every ok sample has every required
    member. The flow writes its ``incomplete`` rows beside the output ledgers, so that carried
    rows plus these account for every ok input row.
    """
    required = tuple(required)
    table = _read_input_ledger(storage, ledger)
    ok, complete = _complete_mask(table, required)
    rows = []
    for i in np.flatnonzero(ok & ~complete).tolist():
        r = {k: v[0] for k, v in table.slice(i, 1).to_pydict().items()}
        if r["offset"] is None or r["length"] is None or r["members"] is None:
            detail = "no byte range recorded for the sample"
        else:
            names = [m["name"] for m in r["members"]]
            missing = [ext for ext in required if not any(name.endswith("." + ext) for name in names)]
            detail = f"missing member(s) {missing}"
        rows.append(
            {
                "key": r["key"],
                "source": r["source"],
                "row": r["row"],
                "status": REJECTED,
                "reason": INCOMPLETE,
                "bytes": r.get("bytes"),
                "sha256": r.get("sha256"),
                "detail": detail,
                "input_shard": tar,
            }
        )
    shard = InputShard(tar=tar, ledger=ledger, count=int(complete.sum()))
    return InputCensus(shard=shard, ok=int(ok.sum()), incomplete=pa.Table.from_pylist(rows, schema=RESHARD_SCHEMA))


# ---------------------------------------------------------------------------------------------
# Building one output
# ---------------------------------------------------------------------------------------------


class _Inputs:
    """The input tars of one output, each opened on first use and kept until the output is done.

    A local tar is memory-mapped and its fd closed at once: samples are then views of the page
    cache, with no read copies or buffers (the mapped pages are clean file pages, reclaimable
    by the kernel, so they do not count against the memory bound). Other tars (object stores)
    stay open as file objects and are read with seek and read.
    """

    def __init__(self, storage: Storage, output: OutputPlan) -> None:
        self._storage = storage
        self._output = output
        self._open: dict[int, Any] = {}
        self._maps: dict[int, mmap.mmap] = {}

    def get(self, slot: int) -> tuple[Any, memoryview | None]:
        """(file object or None, whole-file view or None) of input ``slot``."""
        if slot in self._maps:
            return None, memoryview(self._maps[slot])
        if slot in self._open:
            return self._open[slot], None
        fh = self._storage.open(self._output.inputs[slot].tar, "rb")
        try:
            mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except (AttributeError, OSError, ValueError):  # no fd (object store), or an empty file
            self._open[slot] = fh
            return fh, None
        fh.close()
        self._maps[slot] = mm
        return None, memoryview(mm)

    def close(self) -> None:
        for fh in self._open.values():
            fh.close()
        for mm in self._maps.values():
            # A view still alive (after an exception) keeps its map; the collector frees it.
            with contextlib.suppress(BufferError):
                mm.close()
        self._open.clear()
        self._maps.clear()


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


def build_output(storage: Storage, output: OutputPlan, *, window_bytes: int = DEFAULT_WINDOW_BYTES) -> OutputResult:
    """Build one output shard by copying its samples' byte ranges from the inputs it names.

    Reads only the ledgers and tars of ``output.inputs``. In each ledger the planned positions
    index its complete ok rows in ledger order; when their number differs from the count the
    plan was made from, the plan is stale and this raises ``ValueError`` rather than write a
    shard of the wrong size.

    Samples are fetched in windows of at most ``window_bytes`` of the write order: within a
    window, reads are grouped per input and sorted by offset, neighbouring ranges (gaps up to
    ``MAX_GAP_BYTES``) merge into one read, and the window is then written in planned order.
    Buffered sample bytes are therefore bounded by the window (plus merged gaps), whatever N
    is and with or without a shuffle; unshuffled outputs read each input sequentially in large
    reads, shuffled ones about one read per sample. Local inputs are memory-mapped instead of
    read (see ``_Inputs``), so nothing is buffered at all. Nothing is decoded or parsed: each
    sample's header+data+padding bytes go out as they came in, at the offsets the ledger gave.

    The tar's sha256 is computed as it is written; the ledger is written after the tar and
    commits it. When the ledger exists already, the recorded result is returned and nothing is
    read or written, so a rerun converges.
    """
    start = time.perf_counter()
    if storage.exists(output.ledger):
        return _recorded(storage, output, time.perf_counter() - start)
    if window_bytes < 1:
        raise ValueError(f"window_bytes must be positive, not {window_bytes!r}")

    slots, positions = output.selection()
    if len(slots) != output.samples:
        raise ValueError(f"output {output.index} plans {len(slots)} samples, not {output.samples}")
    picked = _planned_rows(storage, output, slots, positions)

    # Per sample, in write order: key, byte range, and members relative to the range.
    keys = picked.column("key").to_pylist()
    offsets = picked.column("offset").to_numpy()
    lengths = picked.column("length").to_numpy()
    members = picked.column("members").combine_chunks()
    counts = pc.list_value_length(members).to_numpy(zero_copy_only=False).astype(np.int64)
    bounds = np.concatenate([[0], np.cumsum(counts)]).tolist()
    flat = pc.list_flatten(members)
    names_arr = pc.struct_field(flat, "name")
    names = names_arr.to_pylist()
    sizes = pc.struct_field(flat, "size").to_numpy(zero_copy_only=False)
    rel = pc.struct_field(flat, "offset").to_numpy(zero_copy_only=False) - np.repeat(offsets, counts)
    rel_list, size_list = rel.tolist(), sizes.tolist()

    inputs = _Inputs(storage, output)
    try:
        with storage.atomic_writer(output.name) as raw_out:
            out = HashingWriter(raw_out)
            writer = ShardWriter(out)
            for a, b in _windows(lengths, window_bytes):
                views = _fetch(storage, output, inputs, slots, offsets, lengths, a, b)
                for i in range(a, b):
                    lo, hi = bounds[i], bounds[i + 1]
                    writer.copy_sample(keys[i], views.pop(i), zip(names[lo:hi], rel_list[lo:hi], size_list[lo:hi]))
                del views
            writer.close()
    finally:
        inputs.close()
    sha256 = out.sha.hexdigest()
    records = writer.records

    ledger_start = time.perf_counter()
    new_offsets = np.fromiter((rec.offset for rec in records), np.int64, len(records))
    new_members = pa.ListArray.from_arrays(
        pa.array(np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)),
        pa.StructArray.from_arrays(
            [names_arr, pa.array(rel + np.repeat(new_offsets, counts)), pa.array(sizes)],
            fields=list(MEMBER_TYPE),
        ),
    )
    n = len(records)
    columns = {
        "key": picked.column("key"),
        "source": picked.column("source"),
        "row": picked.column("row"),
        "status": pa.array([OK] * n, pa.string()),
        "shard": pa.array([output.name] * n, pa.string()),
        "bytes": picked.column("bytes"),
        "sha256": picked.column("sha256"),
        "offset": pa.array(new_offsets),
        "length": picked.column("length"),
        "members": new_members,
        "input_shard": pa.array([output.inputs[s].tar for s in slots.tolist()], pa.string()),
    }
    meta = {"index": output.index, "samples": n, "bytes": writer.bytes_written, "sha256": sha256}
    table = pa.Table.from_arrays(
        [columns[f.name] if f.name in columns else pa.nulls(n, f.type) for f in RESHARD_SCHEMA],
        schema=RESHARD_SCHEMA.with_metadata({METADATA_KEY: json.dumps(meta).encode()}),
    )
    write_parquet(storage, output.ledger, table)
    done = time.perf_counter()
    return OutputResult(
        index=output.index,
        tar=output.name,
        ledger=output.ledger,
        samples=n,
        bytes=writer.bytes_written,
        sha256=sha256,
        records=records,
        seconds=done - start,
        ledger_seconds=done - ledger_start,
    )


def _planned_rows(storage: Storage, output: OutputPlan, slots: np.ndarray, positions: np.ndarray) -> pa.Table:
    """The input ledger rows of the planned samples, in write order (one ledger read per input)."""
    by_slot = np.argsort(slots, kind="stable")
    bounds = np.searchsorted(slots[by_slot], np.arange(len(output.inputs) + 1))
    parts = []
    for slot, shard in enumerate(output.inputs):
        where = by_slot[bounds[slot] : bounds[slot + 1]]
        if not len(where):
            continue
        table = _read_input_ledger(storage, shard.ledger)
        _, complete = _complete_mask(table, output.required)
        eligible = np.flatnonzero(complete)
        if len(eligible) != shard.count:
            raise ValueError(
                f"stale reshard plan: {shard.ledger!r} has {len(eligible)} complete ok rows, "
                f"the plan was made for {shard.count}"
            )
        wanted = positions[where]
        if wanted.min() < 0 or wanted.max() >= len(eligible):
            raise ValueError(f"output {output.index} plans positions outside {shard.ledger!r}")
        parts.append(table.take(pa.array(eligible[wanted])))
    # by_slot lists write positions slot by slot, as the parts are; invert it.
    order = np.empty(len(by_slot), np.int64)
    order[by_slot] = np.arange(len(by_slot))
    return pa.concat_tables(parts).take(pa.array(order)).combine_chunks()


def _fetch(
    storage: Storage,
    output: OutputPlan,
    inputs: _Inputs,
    slots: np.ndarray,
    offsets: np.ndarray,
    lengths: np.ndarray,
    a: int,
    b: int,
) -> dict[int, memoryview]:
    """The raw bytes of samples a..b of the write order, read grouped by input and offset."""
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
                    storage.url(output.inputs[slot].tar),
                    None,
                    f"ledger records bytes {run_start}..{run_end}, the tar has fewer",
                    run_start,
                )
            for i in run:
                rel = int(offsets[i]) - run_start
                views[i] = view[rel : rel + int(lengths[i])]
    return views


def _recorded(storage: Storage, output: OutputPlan, seconds: float) -> OutputResult:
    table = read_parquet(storage, output.ledger)
    meta = json.loads((table.schema.metadata or {})[METADATA_KEY])
    records = [
        SampleRecord(
            key=r["key"],
            offset=r["offset"],
            length=r["length"],
            members=tuple(MemberRecord(m["name"], m["offset"], m["size"]) for m in r["members"]),
        )
        for r in table.select(["key", "offset", "length", "members"]).to_pylist()
    ]
    return OutputResult(
        index=output.index,
        tar=output.name,
        ledger=output.ledger,
        samples=meta["samples"],
        bytes=meta["bytes"],
        sha256=meta["sha256"],
        records=records,
        seconds=seconds,
        skipped=True,
    )
