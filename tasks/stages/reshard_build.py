"""Resharding, the build: each output copied from its inputs' byte ranges, hashed as written, checked, committed by its ledger."""

from __future__ import annotations

import contextlib
import json
import time
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tasks.formats.ledger import MEMBER_TYPE, read_parquet, write_parquet
from tasks.formats.reasons import OK
from tasks.formats.shards import SampleRecord
from tasks.formats.storage import StagedFile, Storage
from tasks.formats.tar_format import BLOCK
from tasks.stages.reshard import METADATA_KEY, RESHARD_SCHEMA, InputShard, OutputPlan, complete_mask, read_input_ledger
from tasks.stages.reshard_check import Layout, check_file
from tasks.stages.reshard_copy import DEFAULT_WINDOW_BYTES, Inputs, Sink, copy_samples
from tasks.stages.runner import ShardResult, records_of_layout

# Input ledgers a build task keeps after use: consecutive outputs share their boundary inputs.
LEDGERS_KEPT = 4
# The output ledger's columns that cross back to the flow (see OutputResult.layout).
LAYOUT_COLUMNS = ["key", "source", "bytes", "offset", "length", "members"]


# What one output reports: references, counts, where its samples lie (``layout``: the output
# ledger's LAYOUT_COLUMNS, what the release indexes and the phase's counts need, so that neither
# reads the tars again), and its gate row (``check``).
@dataclass(frozen=True)
class OutputResult(ShardResult):
    """A reshard output: the shared fields, and

    Args:
        layout: the ledger's key, source, bytes, offset, length and members columns, an Arrow
            table that crosses to the flow far cheaper than a record per sample.
        check: the gate's row for this output (``tasks.stages.reshard_check.check_row``).
        ledger_seconds: seconds of ``seconds`` spent on the ledger.
    """

    layout: pa.Table | None = None
    check: dict[str, Any] = field(default_factory=dict)
    ledger_seconds: float = 0.0

    @property
    def records(self) -> list[SampleRecord]:
        """The samples in tar order (from ``layout`` when that is all there is)."""
        if self.sample_records is not None:
            return self.sample_records
        return records_of_layout(self.layout) if self.layout is not None else []


def build_outputs(
    storage: Storage, outputs: Iterable[OutputPlan], *, window_bytes: int = DEFAULT_WINDOW_BYTES
) -> list[OutputResult]:
    """Build several outputs one after another (one task's worth), reading each input ledger once.

    Each output is committed, on a committer thread, while the next one is copied: its tar is
    fsynced, renamed into place and its ledger written, in that order, so the wait on the disk
    and the copy overlap as they do for ``cp``, and no ledger names a tar that is not durable.
    Until that fsync the kernel writes the pages back when it chooses. An interrupted task
    finishes the commit under way (that output is whole) and leaves the one it was copying
    uncommitted.

    An output that fails does not stop the others: they are built and committed, then the
    first failure is raised (naming the others), so a retry or rerun redoes only what failed.
    """
    ledgers = _Ledgers(storage)
    results: list[OutputResult] = []
    failed: list[tuple[OutputPlan, BaseException]] = []
    pending: tuple[OutputPlan, Future[OutputResult]] | None = None

    def settle() -> None:
        nonlocal pending
        if pending is not None:
            out, commit = pending
            pending = None
            try:
                results.append(commit.result())
            except Exception as err:
                failed.append((out, err))

    # One committer thread: output k's fsync (a wait on the disk) runs while output k+1 is
    # copied, and the commits stay in build order. At most one output waits uncommitted.
    with ThreadPoolExecutor(1, thread_name_prefix="reshard-commit") as committer:
        try:
            for out in outputs:
                try:
                    written = write_output(storage, out, window_bytes=window_bytes, ledgers=ledgers)
                except Exception as err:  # raised below, after the rest of the group is built
                    failed.append((out, err))
                    continue
                settle()
                pending = (out, committer.submit(written.commit))
        finally:
            settle()  # an interrupted task still finishes the commit under way: it is whole
    if failed:
        # in output order: an output's commit fails after the next one was written
        failed.sort(key=lambda f: f[0].index)
        err = failed[0][1]
        if len(failed) > 1:
            err.add_note(f"outputs {[o.index for o, _ in failed]} of this task failed; the others are committed")
        raise err
    return results


def build_output(
    storage: Storage, output: OutputPlan, *, window_bytes: int = DEFAULT_WINDOW_BYTES, ledgers: _Ledgers | None = None
) -> OutputResult:
    """Build one output shard by copying its samples' byte ranges from the inputs it names.

    Reads only the ledgers and tars of ``output.inputs``. In each ledger the planned positions
    index its complete ok rows in ledger order; when their number differs from the count the
    plan was made from, the plan is stale (or the ledger broke its promise that every ok row
    is complete) and this raises ``ValueError`` rather than write a shard of the wrong size.

    Samples are written in planned (ledger) order, whatever order the input tar holds them in.
    Local inputs: samples that follow each other in the input as in the output form one run,
    copied by the kernel (``os.copy_file_range``) and hashed from a read-only map of the input;
    without a shuffle an output is a handful of runs. Other inputs (object stores) are fetched
    in windows of at most ``window_bytes`` of the write order, each window's reads sorted by
    offset and merged across gaps up to ``MAX_GAP_BYTES``, then written in planned order.
    Nothing is decoded or parsed on the way: each sample's header+data+padding bytes go out as
    they came in, at the offsets the ledger gave.

    The sha256 is computed from the bytes as they are written; the written tar's header blocks
    are then checked against the layout (``tasks.stages.reshard_check``) before it is renamed into
    place. The ledger, written after the tar, commits it and records the digest and the check.
    When the output is committed already (its ledger and its tar are stored), nothing is written
    and the recorded result is returned, its check made again from the committed tar's headers,
    so a rerun converges; a ledger whose tar is gone is written again with the tar.
    """
    return write_output(storage, output, window_bytes=window_bytes, ledgers=ledgers).commit()


def write_output(
    storage: Storage, output: OutputPlan, *, window_bytes: int = DEFAULT_WINDOW_BYTES, ledgers: _Ledgers | None = None
) -> _Written:
    """``build_output`` up to its commit: the tar written and checked under a temp name, not yet durable."""
    start = time.perf_counter()
    if storage.exists(output.ledger) and storage.exists(output.name):  # committed: tar and its ledger
        return _Written(storage, output, recorded=_recorded(storage, output, start))
    if window_bytes < 1:
        raise ValueError(f"window_bytes must be positive, not {window_bytes!r}")
    slots, positions = output.selection()
    if len(slots) != output.samples:
        raise ValueError(f"output {output.index} plans {len(slots)} samples, not {output.samples}")
    picked = _planned_rows(output, slots, positions, ledgers or _Ledgers(storage))
    offsets = picked.column("offset").to_numpy().astype(np.int64)
    lengths = picked.column("length").to_numpy().astype(np.int64)
    layout_table = _output_layout(output, picked, offsets, lengths)
    layout = Layout.of(layout_table)

    inputs = Inputs(storage, output)
    staged = storage.stage(output.name)
    sink = Sink(staged.file)
    try:
        copy_samples(sink, inputs, slots, offsets, lengths, window_bytes)
        sink.write(memoryview(bytes(2 * BLOCK)))  # the end-of-archive blocks
        check = check_file(output.name, sink.fileno(), layout, sink.pos, output.required)
        sha = sink.hexdigest()
    except BaseException:
        staged.discard()
        raise
    finally:
        with contextlib.suppress(Exception):  # the hashing's own failure, if any, was raised above
            sink.drain()
        inputs.close()
    return _Written(storage, output, None, staged, start, picked, slots, layout_table, sink.pos, sha, check)


@dataclass
class _Written:
    """An output's tar, written and checked under a temp name but not committed (or, with
    ``recorded``, the result an earlier run committed)."""

    storage: Storage
    output: OutputPlan
    recorded: OutputResult | None = None
    staged: StagedFile | None = None
    start: float = 0.0
    picked: pa.Table | None = None  # the input ledger rows, in write order
    slots: np.ndarray | None = None  # each sample's input
    layout: pa.Table | None = None  # LAYOUT_COLUMNS in the output
    size: int = 0
    sha256: str = ""
    check: dict | None = None

    def discard(self) -> None:
        if self.staged is not None:
            self.staged.discard()

    def commit(self) -> OutputResult:
        """Make the tar durable and put it in place, then write the ledger that commits it."""
        if self.recorded is not None:
            return self.recorded
        if self.staged is None or self.picked is None or self.layout is None or self.slots is None:
            raise RuntimeError(f"output {self.output.index} was not written")
        output, storage, picked, layout_table = self.output, self.storage, self.picked, self.layout
        self.staged.commit()
        ledger_start = time.perf_counter()
        n = layout_table.num_rows
        columns = {
            **{name: layout_table.column(name) for name in LAYOUT_COLUMNS},
            "row": picked.column("row"),
            "status": pa.array(np.full(n, OK, object), pa.string()),
            "shard": pa.array(np.full(n, output.name, object), pa.string()),
            "sha256": picked.column("sha256"),
            **{name: picked.column(name) for name in ("video", "start_s", "end_s")},  # a clip's video and span
            "input_shard": pa.array(np.array([s.tar for s in output.inputs], object)[self.slots], pa.string()),
        }
        meta = {"index": output.index, "samples": n, "bytes": self.size, "sha256": self.sha256, "check": self.check}
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
            bytes=self.size,
            sha256=self.sha256,
            layout=layout_table,
            seconds=done - self.start,
            ledger_seconds=done - ledger_start,
            check=self.check,
        )


def _output_layout(output: OutputPlan, picked: pa.Table, offsets: np.ndarray, lengths: np.ndarray) -> pa.Table:
    """Where the planned samples will lie in the output (back to back from byte 0), checked first.

    Raises ``ValueError`` for a sample whose recorded range is not whole tar blocks or whose
    members do not lie inside it, and for a key planned twice, before anything is written.
    """
    members = picked.column("members").combine_chunks()
    counts = pc.list_value_length(members).to_numpy(zero_copy_only=False).astype(np.int64)
    flat = pc.list_flatten(members)
    rel = pc.struct_field(flat, "offset").to_numpy(zero_copy_only=False) - np.repeat(offsets, counts)
    sizes = pc.struct_field(flat, "size").to_numpy(zero_copy_only=False)
    bad = (lengths <= 0) | (lengths % BLOCK != 0)
    outside = (rel < BLOCK) | (rel + sizes > np.repeat(lengths, counts))
    bad[np.repeat(np.arange(len(lengths)), counts)[outside]] = True
    if bad.any():
        key = picked.column("key")[int(np.flatnonzero(bad)[0])].as_py()
        raise ValueError(
            f"output {output.index}: the recorded byte range of sample {key!r} is not whole tar blocks holding its members"
        )
    if pc.count_distinct(picked.column("key")).as_py() != picked.num_rows:
        raise ValueError(f"output {output.index} plans a sample key twice")
    # Member names live inside the copied headers: a reader groups members by the key before
    # their first dot (keys hold none: the shard writer refuses them).
    names = pc.struct_field(flat, "name")
    keys = picked.column("key").combine_chunks().take(pa.array(np.repeat(np.arange(len(counts)), counts)))
    parts = pc.split_pattern(names, ".", max_splits=1)
    named = pc.and_(pc.equal(pc.list_value_length(parts), 2), pc.equal(pc.list_element(parts, 0), keys))
    if not pc.all(pc.fill_null(named, False)).as_py():
        k = int(np.flatnonzero(~named.fill_null(False).to_numpy(zero_copy_only=False))[0])
        raise ValueError(
            f"output {output.index}: member {names[k].as_py()!r} of sample {keys[k].as_py()!r} is not named after its key"
        )
    new = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    new_members = pa.ListArray.from_arrays(
        pa.array(np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)),
        pa.StructArray.from_arrays(
            [names, pa.array(rel + np.repeat(new, counts)), pa.array(sizes)], fields=list(MEMBER_TYPE)
        ),
    )
    return pa.table(
        {
            "key": picked.column("key"),
            "source": picked.column("source"),
            "bytes": picked.column("bytes"),
            "offset": pa.array(new),
            "length": pa.array(lengths),
            "members": new_members,
        }
    )


class _Ledgers:
    """Input ledgers' complete ok rows, read once per task and the last few kept."""

    def __init__(self, storage: Storage, keep: int = LEDGERS_KEPT) -> None:
        self._storage = storage
        self._keep = keep
        self._rows: OrderedDict[tuple[str, tuple[str, ...]], pa.Table] = OrderedDict()

    def complete_rows(self, shard: InputShard, required: tuple[str, ...]) -> pa.Table:
        key = (shard.ledger, required)
        if key in self._rows:
            self._rows.move_to_end(key)
            return self._rows[key]
        table = read_input_ledger(self._storage, shard.ledger)
        ok, complete = complete_mask(table, required)
        eligible = np.flatnonzero(complete)
        if len(eligible) != shard.count:
            why = ""
            if int(ok.sum()) == shard.count:
                why = f" (every ok row, as its ledger vouches; but {shard.count - len(eligible)} lack a byte range or one of {list(required)})"
            raise ValueError(
                f"stale reshard plan: {shard.ledger!r} has {len(eligible)} complete ok rows, the plan was made for {shard.count}{why}"
            )
        self._rows[key] = table.take(pa.array(eligible))
        while len(self._rows) > self._keep:
            self._rows.popitem(last=False)
        return self._rows[key]


def _planned_rows(output: OutputPlan, slots: np.ndarray, positions: np.ndarray, ledgers: _Ledgers) -> pa.Table:
    """The input ledger rows of the planned samples, in write order."""
    by_slot = np.argsort(slots, kind="stable")
    bounds = np.searchsorted(slots[by_slot], np.arange(len(output.inputs) + 1))
    parts = []
    for slot, shard in enumerate(output.inputs):
        where = by_slot[bounds[slot] : bounds[slot + 1]]
        if not len(where):
            continue
        rows = ledgers.complete_rows(shard, output.required)
        wanted = positions[where]
        if wanted.min() < 0 or wanted.max() >= rows.num_rows:
            raise ValueError(f"output {output.index} plans positions outside {shard.ledger!r}")
        parts.append(rows.take(pa.array(wanted)))
    # by_slot lists write positions slot by slot, as the parts are; invert it.
    order = np.empty(len(by_slot), np.int64)
    order[by_slot] = np.arange(len(by_slot))
    return pa.concat_tables(parts).take(pa.array(order)).combine_chunks()


def recorded_output(storage: Storage, output: OutputPlan) -> OutputResult:
    """The result of an output an earlier run committed (its ledger exists), as ``build_output`` returns it."""
    return _recorded(storage, output, time.perf_counter())


def _recorded(storage: Storage, output: OutputPlan, start: float) -> OutputResult:
    """A committed output's result from its ledger, its gate row checked again from its tar.

    Locally the committed tar's header blocks are read again (cheap). On an object store that
    would mean downloading the tar, so the check the writer recorded stands, provided the
    object still has the recorded size; a ledger from before checks were recorded gets the
    full read-back of ``tasks.stages.release.verify_shard``.
    """
    table = read_parquet(storage, output.ledger)
    meta = json.loads((table.schema.metadata or {})[METADATA_KEY])
    layout_table = table.select(LAYOUT_COLUMNS)
    if storage.is_local:
        with storage.open(output.name, "rb") as fh:
            check = check_file(output.name, fh.fileno(), Layout.of(layout_table), meta["bytes"], output.required)
    elif meta.get("check"):
        check = dict(meta["check"])
        size = storage.size(output.name)
        if size != meta["bytes"]:
            check.update(
                readable=False,
                checksum_ok=False,
                detail=f"the tar is {size} bytes, its ledger recorded {meta['bytes']}",
            )
    else:
        from tasks.stages.release import verify_shard

        check = verify_shard(storage, output.name, meta["sha256"], output.required)
    return OutputResult(
        index=output.index,
        tar=output.name,
        ledger=output.ledger,
        samples=meta["samples"],
        bytes=meta["bytes"],
        sha256=meta["sha256"],
        layout=layout_table,
        seconds=time.perf_counter() - start,
        skipped=True,
        check=check,
    )
