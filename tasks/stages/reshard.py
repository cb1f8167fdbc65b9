"""Resharding, the plan: equal-size outputs assigned from the input counts, and the counts themselves.

Building the outputs is in tasks/stages/reshard_build.py, checking them in tasks/stages/reshard_check.py.
"""

from __future__ import annotations

import hashlib
import json
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tasks.formats.ledger import RESHARD_SCHEMA, read_ledger_with, read_parquet
from tasks.formats.reasons import OK, REJECTED
from tasks.formats.storage import Storage

DEFAULT_REQUIRED = ("jpg", "txt", "json")

# Ledger reason of an ok input row that is not carried because a required member is missing.
# Its status is rejected; tasks/formats/reasons.py lists it beside the other reasons.
INCOMPLETE = "incomplete_sample"

METADATA_KEY = b"shardsmith.reshard"

_INPUT_COLUMNS = ["key", "source", "row", "status", "offset", "length", "members"]
_CARRIED_COLUMNS = [
    "bytes",
    "sha256",
    "video",
    "start_s",
    "end_s",
]  # copied to the output ledger when the input has them
RESHARD_SCHEMA_INPUT = pa.schema([RESHARD_SCHEMA.field(c) for c in _INPUT_COLUMNS + _CARRIED_COLUMNS])

PLAN_VERSION = 1  # bump when planning changes, so outputs get new names
# Bytes one build task copies, about: at disk speed (~0.5-1 GB/s here) several seconds of work,
# so that Prefect's ~0.2 s per task stays a few percent of the phase (DESIGN.md, Execution).
DEFAULT_TASK_BYTES = 4 * 2**30


@dataclass(frozen=True)
class InputShard:
    """One input shard of a reshard.

    Args:
        tar: the shard, relative to the storage root.
        ledger: its ledger.
        count: its *complete* ok samples: ok rows whose members include every required
            extension. The planner trusts this number and never reads ledgers; ``census_input``
            computes it when the previous phase cannot vouch that every ok sample is complete,
            ``count_inputs`` when it can (the ok rows); ``build_output`` raises if it is wrong.
        bytes: the byte ranges of those samples, summed (0 when unknown); only used to size
            the build tasks (``group_outputs``).
    """

    tar: str
    ledger: str
    count: int
    bytes: int = 0  # of those samples (ledger ``length``s); sizes the build tasks, not in the digest


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


def group_outputs(
    plan: ReshardPlan, slots: int, *, task_bytes: int = DEFAULT_TASK_BYTES
) -> list[tuple[OutputPlan, ...]]:
    """Cut the outputs into runs of consecutive outputs, one build task each.

    As few tasks as keep every slot (a worker thread of the cluster) busy: ``slots`` tasks, or
    a multiple of ``slots`` when each would copy more than ``task_bytes`` (so a task stays a
    few seconds of work and no slot idles in a last, half-empty wave). Consecutive outputs
    share their boundary inputs, whose ledgers a task then reads once. Output bytes are
    estimated from the inputs' ``bytes``; when those are unknown, from sample counts alone.
    """
    n_out = len(plan.outputs)
    if not n_out:
        return []
    slots = max(1, int(slots))
    total = sum(s.bytes for s in plan.inputs)
    waves = max(1, -(-total // (slots * max(1, int(task_bytes)))))
    tasks = min(n_out, slots * waves)
    return [tuple(plan.outputs[int(a) : int(b)]) for a, b in _even_cuts(n_out, tasks)]


def _even_cuts(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` consecutive [a, b) ranges of ``range(n)`` whose lengths differ by at most one."""
    bounds = [n * k // parts for k in range(parts + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


# ---------------------------------------------------------------------------------------------
# Completeness
# ---------------------------------------------------------------------------------------------


def read_input_ledger(storage: Storage, ledger: str) -> pa.Table:
    """The columns a reshard uses; carried columns the ledger lacks come back as nulls."""
    return read_ledger_with(storage, ledger, _INPUT_COLUMNS, _CARRIED_COLUMNS).cast(RESHARD_SCHEMA_INPUT)


def complete_mask(table: pa.Table, required: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
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


def count_inputs(storage: Storage, tars: Sequence[str], ledgers: Sequence[str]) -> list[InputShard]:
    """Inputs counted from their ledgers' ``status`` and ``length`` columns alone: every ok row.

    For inputs whose ledger vouches that every ok sample has every required member (the
    validate phase writes the image and json of every ok sample, and its txt when captions are
    required), so no census is needed. ``build_output`` still checks each planned row's members
    and refuses to build from a ledger that broke that promise.
    """
    out = []
    for tar, ledger in zip(tars, ledgers, strict=True):
        table = read_parquet(storage, ledger, ["status", "length"])
        ok = pc.fill_null(pc.equal(table.column("status"), OK), False)
        total = pc.sum(pc.filter(table.column("length"), ok)).as_py() or 0
        out.append(InputShard(tar=tar, ledger=ledger, count=int(pc.sum(ok).as_py() or 0), bytes=int(total)))
    return out


def census_inputs(
    storage: Storage, tars: Sequence[str], ledgers: Sequence[str], *, required: Iterable[str] = DEFAULT_REQUIRED
) -> list[InputCensus]:
    """``census_input`` of several inputs, one after another (one task's worth)."""
    return [census_input(storage, t, led, required=required) for t, led in zip(tars, ledgers, strict=True)]


def census_input(storage: Storage, tar: str, ledger: str, *, required: Iterable[str] = DEFAULT_REQUIRED) -> InputCensus:
    """Count one input's complete samples and write down the ones that are not (reads its ledger only).

    Only needed when the previous phase cannot vouch that every ok sample has every required
    member (``count_inputs`` is enough when it can). The flow writes its ``incomplete`` rows
    beside the output ledgers, so that carried rows plus these account for every ok input row.
    """
    required = tuple(required)
    table = read_input_ledger(storage, ledger)
    ok, complete = complete_mask(table, required)
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
    lengths = table.column("length").to_numpy(zero_copy_only=False)
    shard = InputShard(
        tar=tar, ledger=ledger, count=int(complete.sum()), bytes=int(np.nansum(lengths[complete], dtype=np.float64))
    )
    return InputCensus(shard=shard, ok=int(ok.sum()), incomplete=pa.Table.from_pylist(rows, schema=RESHARD_SCHEMA))
