"""Manifest planning benchmark: rows/s and peak memory of plan_source over a parquet folder and a CSV, beside the row-at-a-time reader it replaced.

Manifests (generated once under ``.bench/manifests/``, never committed): LAION-like rows
``url,caption,license`` (``http://127.0.0.1:8765/img/pNNN.jpg?u=ROW``, a caption with commas,
so csv quotes it, ``CC-BY-4.0``):

- ``parquet-{N}/``: N rows in parquet files of 100,000 rows (a folder source, as Spark writes
  one: 100 files at 10M rows, 10 at 1M, so that the sizes differ in rows, not in files' shape);
- ``rows-{N}.csv``: N rows in one CSV file.

Each measurement runs in a fresh child process, which reports wall seconds, CPU seconds
(``process_time``, threads included) and peak RSS (``ru_maxrss``) after its imports and after
planning (``plan_source`` into a fresh storage folder, ``--rows-per-shard`` rows per chunk,
chunk files written). Steps, for each of ``--sizes``:

- ``new``: ``tasks.formats.manifests.plan_source`` over the parquet folder, then over the CSV;
- ``new x2``: the parquet folder's files planned by ``plan_file`` in 2 worker processes and
  combined (``combine``), as the download flow does on a 2-worker cluster;
- ``old``: the reader this one replaced (``tasks/manifests.py`` at ``--baseline-commit``, with
  that commit's whole ``tasks`` package taken from git into ``.bench/trees/``), over the first ``--old-rows`` rows only (it
  runs at about 20,000 rows/s); its rows/s is what it would do over the whole manifest.

Printed: rows/s (wall and per CPU second), new / old ratios, peak RSS and the RSS ratio of the
largest size to the smallest. The machine is shared: compare figures from one invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from harness.procs import REPO, children_cpu, clock, peak_rss_mb, run_json
from harness.tools import tree_at

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

BENCH_DIR = REPO / ".bench" / "manifests"
FILE_ROWS = 100_000
BASELINE_COMMIT = "54abba3"  # the last commit with tasks/formats/manifests.py as one row-at-a-time module


def _table(start: int, n: int):
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    i = pa.array(np.arange(start, start + n, dtype=np.int64)).cast(pa.string())
    pool = pa.array([f"p{k:04d}.jpg?u=" for k in range(400)])
    picked = pool.take(pa.array(np.arange(start, start + n) % 400))
    return pa.table(
        {
            "url": pc.binary_join_element_wise("http://127.0.0.1:8765/img/", picked, i, ""),
            "caption": pc.binary_join_element_wise("a generated photo, number ", i, ", of a red shape", ""),
            "license": pa.array(["CC-BY-4.0"] * n),
        }
    )


def make_manifests(rows: int) -> tuple[Path, Path]:
    """(parquet folder of files of FILE_ROWS rows, csv file) of ``rows`` rows each; made once."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    BENCH_DIR.mkdir(parents=True, exist_ok=True)
    folder = BENCH_DIR / f"parquet-{rows}"
    if not (folder / "_SUCCESS").exists():
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        for f, start in enumerate(range(0, rows, FILE_ROWS)):
            n = min(FILE_ROWS, rows - start)
            pq.write_table(_table(start, n), folder / f"part-{f:05d}-bench.snappy.parquet", row_group_size=50_000)
        (folder / "_SUCCESS").write_bytes(b"")
    csv_path = BENCH_DIR / f"rows-{rows}.csv"
    if not csv_path.exists():
        # As Python's csv module and pandas write it: only the caption (it has commas) quoted.
        tmp = csv_path.with_suffix(".tmp")
        with open(tmp, "wb") as out:
            out.write(b"url,caption,license\n")
            for start in range(0, rows, 500_000):
                t = _table(start, min(500_000, rows - start))
                lines = pc.binary_join_element_wise(
                    t["url"], pc.binary_join_element_wise('"', t["caption"], '"', ""), t["license"], ","
                )
                out.write("\n".join(lines.to_pylist()).encode() + b"\n")
        tmp.rename(csv_path)
    return folder, csv_path


def _slice(manifest: Path, rows: int) -> Path:
    """The first ``rows`` rows of a manifest, in the same shape (for the old reader)."""
    import pyarrow.parquet as pq

    if manifest.is_dir():
        out = BENCH_DIR / f"{manifest.name}-first-{rows}"
        if not (out / "_SUCCESS").exists():
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            left = rows
            for f in sorted(manifest.glob("part-*.parquet")):
                if left <= 0:
                    break
                table = pq.read_table(f)
                pq.write_table(table.slice(0, left), out / f.name)
                left -= min(left, table.num_rows)
            (out / "_SUCCESS").write_bytes(b"")
        return out
    out = BENCH_DIR / f"{manifest.stem}-first-{rows}.csv"
    if not out.exists():
        with open(manifest, "rb") as src, open(out.with_suffix(".tmp"), "wb") as dst:
            for _ in range(rows + 1):
                dst.write(src.readline())
        out.with_suffix(".tmp").rename(out)
    return out


def child(kind: str, manifest: str, rows_per_shard: int, commit: str) -> dict:
    """Plan one manifest in this process; seconds, CPU seconds, rows and peak RSS."""
    if kind == "old":  # the old code whole, ``tasks`` being the package at ``commit`` in this process
        sys.path.insert(0, str(tree_at(commit)))
        from tasks import manifests as module
        from tasks.recipe import SourceConfig
        from tasks.storage import Storage
    else:
        from tasks.formats import manifests as module
        from tasks.formats.recipe_download import SourceConfig
        from tasks.formats.storage import Storage
    base_mb = peak_rss_mb()
    root = tempfile.mkdtemp(prefix="plan-", dir=BENCH_DIR)
    try:
        storage = Storage(root)
        with clock() as lap:
            rows = plan(module, SourceConfig, kind, manifest, storage, rows_per_shard)
        seconds, cpu = lap.wall, lap.cpu
        peak = peak_rss_mb()
        if kind == "new x2":  # the workers do the work: their CPU, and the largest worker's peak
            cpu += children_cpu()
            peak = peak_rss_mb(children=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"rows": rows, "seconds": seconds, "cpu": cpu, "base_mb": base_mb, "peak_mb": peak}


def plan(module, source_config: type, kind: str, manifest: str, storage, rows_per_shard: int) -> int:
    """Plan the manifest with the reader ``kind`` names (``module``, with its ``SourceConfig``); returns its rows."""
    if kind == "old":  # one file at a time: it reads single files only
        files = sorted(Path(manifest).glob("part-*.parquet")) if Path(manifest).is_dir() else [Path(manifest)]
        return sum(
            module.plan_source(
                source_config(name=f"web{i}", manifest=str(f), rows_per_shard=rows_per_shard), storage, "b"
            ).rows
            for i, f in enumerate(files)
        )
    src = source_config(name="web", manifest=manifest, rows_per_shard=rows_per_shard)
    if kind == "new x2":
        import concurrent.futures

        files = module.list_manifest_files(src)
        n = len(files)
        with concurrent.futures.ProcessPoolExecutor(2) as pool:
            plans = list(pool.map(module.plan_file, [src] * n, files, [storage] * n, ["b"] * n, chunksize=4))
        return module.combine(src, plans).rows
    return module.plan_source(src, storage, "b").rows


def run_child(kind: str, manifest: Path, args: argparse.Namespace) -> dict:
    common = ["--rows-per-shard", str(args.rows_per_shard), "--baseline-commit", args.baseline_commit]
    return run_json([sys.executable, __file__, "--child", kind, str(manifest), *common])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--sizes", default="1000000,10000000", help="manifest rows, comma-separated (default 1000000,10000000)"
    )
    ap.add_argument("--rows-per-shard", type=int, default=10_000, help="rows per chunk (default 10000)")
    ap.add_argument("--old-rows", type=int, default=200_000, help="rows the old reader plans (default 200000)")
    ap.add_argument(
        "--baseline-commit", default=BASELINE_COMMIT, help=f"commit of the old reader (default {BASELINE_COMMIT})"
    )
    ap.add_argument("--skip-old", action="store_true", help="leave the old reader out")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--prepare", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sizes = sorted(int(x) for x in args.sizes.split(","))
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], args.rows_per_shard, args.baseline_commit)))
        return
    if args.prepare:
        made = {n: [str(p) for p in make_manifests(n)] for n in sizes}
        if not args.skip_old:
            tree_at(args.baseline_commit)
            made["old"] = [str(_slice(Path(p), min(args.old_rows, sizes[-1]))) for p in made[sizes[-1]]]
        print(json.dumps(made))
        return
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start")
    # Made in a child: Linux carries a parent's peak RSS into the children it starts, so this
    # process stays small (no pyarrow) for the children's peaks to be their own.
    prepare = [sys.executable, __file__, "--prepare", "--sizes", args.sizes, "--old-rows", str(args.old_rows)]
    made = run_json(prepare + ["--baseline-commit", args.baseline_commit] + (["--skip-old"] if args.skip_old else []))
    results: dict[tuple[str, str, int], dict] = {}
    for n in sizes:
        folder, csv_path = made[str(n)]
        for i, (shape, manifest) in enumerate((("parquet folder", folder), ("csv, 1 file", csv_path))):
            results[("new", shape, n)] = run_child("new", Path(manifest), args)
            if shape.startswith("parquet"):
                results[("new x2", shape, n)] = run_child("new x2", Path(manifest), args)
            if not args.skip_old and n == sizes[-1]:
                results[("old", shape, n)] = run_child("old", Path(made["old"][i]), args)
    print(f"\nplan_source, {args.rows_per_shard:,} rows per chunk; load average {os.getloadavg()[0]:.1f} at the end")
    print(
        f"{'manifest':<20}{'rows':>12}{'reader':>8}{'wall s':>9}{'rows/s':>11}{'cpu s':>8}{'rows/cpu-s':>12}{'peak MB':>9}{'over imports MB':>17}"
    )
    for (kind, shape, _n), r in results.items():
        print(
            f"{shape:<20}{r['rows']:>12,}{kind:>8}{r['seconds']:>9.1f}{r['rows'] / r['seconds']:>11,.0f}{r['cpu']:>8.1f}"
            f"{r['rows'] / r['cpu']:>12,.0f}{r['peak_mb']:>9.0f}{r['peak_mb'] - r['base_mb']:>17.0f}"
        )
    big, small = sizes[-1], sizes[0]
    for shape in ("parquet folder", "csv, 1 file"):
        new = results[("new", shape, big)]
        line = f"{shape}: new {new['rows'] / new['seconds']:,.0f} rows/s"
        if ("old", shape, big) in results:
            old = results[("old", shape, big)]
            line += (
                f", old {old['rows'] / old['seconds']:,.0f} rows/s (over {old['rows']:,} rows): {new['rows'] / new['seconds'] / (old['rows'] / old['seconds']):.1f}x wall,"
                f" {new['rows'] / new['cpu'] / (old['rows'] / old['cpu']):.1f}x per CPU second"
            )
        if big != small:
            line += f"; peak RSS {big:,} / {small:,} rows: {new['peak_mb'] / results[('new', shape, small)]['peak_mb']:.2f}x"
        print(line)


if __name__ == "__main__":
    main()
