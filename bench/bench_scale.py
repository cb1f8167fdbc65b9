"""Scale benchmark: peak memory of manifest planning and ledger reconciliation at 100k and 1M rows, and reshard planning and index writing for 10,000 shards.

Part 1, memory. For each ``--rows`` size (default 100,000 and 1,000,000), a CSV manifest is
generated under ``.bench/scale/`` (``url,caption,license``; every URL points at a small pool
of images on a loopback server, ``http://127.0.0.1:8765/img/pNNN.jpg?u=ROW``; nothing is
downloaded). A fresh child process per size then runs, and reports its peak RSS
(``ru_maxrss``) after each step:

- ``imports``: every module the steps use, Great Expectations included (the baseline);
- ``plan``: ``plan_source`` reads the manifest as a stream and writes its chunk files
  (``--rows-per-shard`` rows each);
- ``ledgers``: one synthetic ledger per chunk, as the download phase writes them (90% ok,
  7% rejected, 3% error), written one at a time;
- ``reconcile``: every ledger read back one at a time into ``tasks.audit.gates.Reconciliation``,
  the ok rows added as released outputs, and the release gate (Great Expectations) run.

Printed: seconds and peak RSS per step for each size, and the ratio of the largest size's
figures to the smallest's (1.00x = memory does not grow with the row count).

Part 2, time. ``plan_reshard`` over ``--shards`` input shards of ``--per-shard`` samples
(10,000 x 100 by default, with and without a shuffle seed), then the release indexes
(``all_indexes``: DALI ``.idx``, Energon ``.tar.idx`` and ``.nv-meta``, wids) built from
synthetic writer records and written through ``Storage.write_bytes`` (atomic, fsynced), as
the release phase does (no fsync per file, one ``sync()`` before index.json), beside the same
files written with an fsync each (the baseline), and the whole for a tenth of the shards
(10x the shards should cost about 10x the time).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from harness.procs import REPO, peak_rss_mb, run_json

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

BENCH_DIR = REPO / ".bench" / "scale"
STATUS_CYCLE = ["ok"] * 90 + ["rejected"] * 7 + ["error"] * 3


def write_manifest(path: Path, rows: int) -> None:
    """``rows`` rows over a pool of 400 image names on a loopback server, written as a stream."""
    if path.exists():
        return
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["url", "caption", "license"])
        for i in range(rows):
            w.writerow(
                [
                    f"http://127.0.0.1:8765/img/p{i % 400:04d}.jpg?u={i}",
                    f"a generated photo, number {i}, of a red shape",
                    "CC-BY-4.0",
                ]
            )
    tmp.rename(path)


def child(manifest: Path, rows_per_shard: int) -> dict:
    """Run the steps in this process; returns seconds and peak RSS (MB) after each."""
    import numpy as np
    import pyarrow as pa

    from tasks.audit.ge_runner import import_gx
    from tasks.audit.reconcile import Reconciliation, release_gate
    from tasks.formats.ledger import read_ledger, write_parquet
    from tasks.formats.manifests import plan_source
    from tasks.formats.recipe_download import SourceConfig
    from tasks.formats.storage import Storage

    import_gx()
    out: dict = {"imports": {"seconds": 0.0, "peak_mb": peak_rss_mb()}}
    root = tempfile.mkdtemp(prefix="scale-", dir=BENCH_DIR)
    try:
        storage = Storage(root)
        t = time.perf_counter()
        plan = plan_source(
            SourceConfig(name="web", manifest=str(manifest), rows_per_shard=rows_per_shard), storage, "scale"
        )
        out["plan"] = {
            "seconds": time.perf_counter() - t,
            "peak_mb": peak_rss_mb(),
            "chunks": len(plan.chunks),
            "rows": plan.rows,
        }

        t = time.perf_counter()
        cycle = np.array(STATUS_CYCLE)
        ledgers = []
        for ref in plan.chunks:
            rows = np.arange(ref.first_row, ref.first_row + ref.rows)
            table = pa.table(
                {
                    "key": [f"web-{r:09d}" for r in rows],
                    "source": pa.array(["web"] * ref.rows),
                    "row": rows,
                    "status": cycle[rows % len(cycle)],
                }
            )
            rel = f"scale/download/web/{ref.index:06d}.ledger.parquet"
            write_parquet(storage, rel, table)
            ledgers.append(rel)
        out["ledgers"] = {"seconds": time.perf_counter() - t, "peak_mb": peak_rss_mb()}

        t = time.perf_counter()
        tally = Reconciliation(plan.rows)
        for rel in ledgers:
            table = read_ledger(storage, rel, ["source", "row", "status"])
            tally.add_ledger(table)
            tally.add_outputs(table.filter(pa.compute.equal(table.column("status"), "ok")).select(["source", "row"]))
        gate = release_gate(tally)
        out["reconcile"] = {
            "seconds": time.perf_counter() - t,
            "peak_mb": peak_rss_mb(),
            "gate": gate.success,
            "ok": tally.status["ok"],
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


def memory_part(sizes: list[int], rows_per_shard: int) -> None:
    BENCH_DIR.mkdir(parents=True, exist_ok=True)
    results = {}
    for n in sizes:
        manifest = BENCH_DIR / f"manifest-{n}.csv"
        write_manifest(manifest, n)
        results[n] = run_json(
            [sys.executable, __file__, "--child", str(manifest), "--rows-per-shard", str(rows_per_shard)]
        )
        if not results[n]["reconcile"]["gate"]:
            raise SystemExit(f"{n} rows: the release gate failed")
    steps = ["imports", "plan", "ledgers", "reconcile"]
    lo, hi = min(sizes), max(sizes)
    print(
        f"\nmanifest -> plan -> ledgers -> reconciliation ({rows_per_shard} rows per shard); peak RSS after each step"
    )
    print(
        f"{'step':<10}" + "".join(f"{f'{n:,} rows s':>16}{f'{n:,} rows MB':>17}" for n in sizes) + f"{'RSS ratio':>11}"
    )
    for step in steps:
        line = f"{step:<10}"
        for n in sizes:
            r = results[n][step]
            line += f"{r['seconds']:>16.1f}{r['peak_mb']:>17.0f}"
        line += f"{results[hi][step]['peak_mb'] / results[lo][step]['peak_mb']:>10.2f}x"
        print(line)
    for n in sizes:
        base = results[n]["imports"]["peak_mb"]
        print(
            f"  {n:>9,} rows: {results[n]['plan']['chunks']} chunks; peak over the import baseline {results[n]['reconcile']['peak_mb'] - base:.0f} MB"
        )


def synthetic_records(shard: int, samples: int):
    from tasks.formats.shards import MemberRecord, SampleRecord

    out = []
    offset = 0
    for i in range(samples):
        key = f"s{shard:06d}-{i:06d}"
        members = []
        pos = offset
        for ext, size in (("jpg", 100_000 + i), ("json", 300), ("txt", 60)):
            members.append(MemberRecord(f"{key}.{ext}", pos + 512, size))
            pos += 512 + (size + 511) // 512 * 512
        out.append(SampleRecord(key, offset, pos - offset, tuple(members)))
        offset = pos
    return out, offset + 1024


def shards_part(shards: int, per_shard: int) -> None:
    from tasks.formats.indexes import ShardIndexInput, all_indexes
    from tasks.formats.storage import Storage
    from tasks.stages.reshard import InputShard, plan_reshard

    print(f"\nreshard plan and release indexes ({per_shard} samples per shard)")
    print(
        f"{'shards':>8}{'plan s':>9}{'plan+seed s':>13}{'records s':>11}{'indexes s':>11}{'write s':>9}{'fsync each s':>14}{'ratio':>9}{'files':>8}"
    )
    rows = {}
    for n in (max(1, shards // 10), shards):
        inputs = [
            InputShard(f"ds/validate/web/{i:06d}.tar", f"ds/validate/web/{i:06d}.ledger.parquet", per_shard)
            for i in range(n)
        ]
        t = time.perf_counter()
        plan = plan_reshard(inputs, per_shard, prefix="ds/reshard")
        plan_s = time.perf_counter() - t
        t = time.perf_counter()
        plan_reshard(inputs, per_shard, prefix="ds/reshard", seed=1234)
        seed_s = time.perf_counter() - t
        t = time.perf_counter()
        index_inputs = []
        for o in plan.outputs:
            records, size = synthetic_records(o.index, o.samples)
            index_inputs.append(ShardIndexInput(name=f"shard-{o.index:06d}.tar", size=size, samples=records))
        records_s = time.perf_counter() - t
        t = time.perf_counter()
        files = all_indexes(index_inputs, name="ds")
        index_s = time.perf_counter() - t
        root = tempfile.mkdtemp(prefix="indexes-", dir=BENCH_DIR)
        try:
            storage = Storage(root)
            t = time.perf_counter()
            for rel, data in files.items():
                storage.write_bytes(f"ds/releases/v0001/{rel}", data, fsync=False)
            storage.sync()
            write_s = time.perf_counter() - t
            t = time.perf_counter()
            for rel, data in files.items():  # the baseline: an fsync per file
                storage.write_bytes(f"ds/releases/v0000/{rel}", data)
            fsync_each_s = time.perf_counter() - t
        finally:
            shutil.rmtree(root, ignore_errors=True)
        rows[n] = (plan_s, seed_s, records_s, index_s, write_s)
        print(
            f"{n:>8,}{plan_s:>9.2f}{seed_s:>13.2f}{records_s:>11.2f}{index_s:>11.2f}{write_s:>9.2f}{fsync_each_s:>14.2f}{fsync_each_s / write_s:>8.1f}x{len(files):>8,}"
        )
    small, big = rows[max(1, shards // 10)], rows[shards]
    print(
        f"ratio {shards:,} / {max(1, shards // 10):,} shards: "
        + ", ".join(
            f"{name} {b / a:.1f}x"
            for name, a, b in zip(("plan", "plan+seed", "records", "indexes", "write"), small, big)
            if a > 0
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--rows", default="100000,1000000", help="manifest sizes, comma-separated (default: 100000,1000000)"
    )
    ap.add_argument(
        "--rows-per-shard", type=int, default=10_000, help="manifest rows per chunk and ledger (default 10000)"
    )
    ap.add_argument("--shards", type=int, default=10_000, help="shards for the plan and index timing (default 10000)")
    ap.add_argument(
        "--per-shard", type=int, default=100, help="samples per shard for the plan and index timing (default 100)"
    )
    ap.add_argument("--skip", choices=["memory", "shards"], help="leave one part out")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(Path(args.child), args.rows_per_shard)))
        return
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs")
    if args.skip != "memory":
        memory_part(sorted(int(x) for x in args.rows.split(",")), args.rows_per_shard)
    if args.skip != "shards":
        BENCH_DIR.mkdir(parents=True, exist_ok=True)
        shards_part(args.shards, args.per_shard)


if __name__ == "__main__":
    main()
