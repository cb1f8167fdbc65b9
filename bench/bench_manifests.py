"""Manifest planning, issues 8 and 17: rows/s and peak memory of plan_source over a parquet folder and a CSV, beside the reader it replaced.

Manifests of ``--sizes`` LAION-like rows made once under ``.bench/manifests/``; a fresh child each: ``new``, ``new x2``
(the folder's files planned in 2 processes, as the download flow does) and ``old`` (the row-at-a-time reader of
``--baseline-commit``, from git, over the first ``--old-rows`` rows).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

from harness.procs import REPO, measured, run_child
from harness.report import emit, parse, parser, table
from harness.tools import tree_at

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


def child(kind: str, manifest: str, rows_per_shard: int, commit: str) -> dict:
    """Plan one manifest in this process; its figures."""
    if kind == "old":  # the old code whole, ``tasks`` being the package at ``commit`` in this process
        sys.path.insert(0, str(tree_at(commit)))
        from tasks import manifests as module
        from tasks.recipe import SourceConfig
        from tasks.storage import Storage
    else:
        from tasks.formats import manifests as module
        from tasks.formats.recipe_download import SourceConfig
        from tasks.formats.storage import Storage
    root = tempfile.mkdtemp(prefix="plan-", dir=BENCH_DIR)
    try:
        storage = Storage(root)
        return measured(lambda: {"rows": plan(module, SourceConfig, kind, manifest, storage, rows_per_shard)})
    finally:
        shutil.rmtree(root, ignore_errors=True)


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

        n = len(files := module.list_manifest_files(src))
        with concurrent.futures.ProcessPoolExecutor(2) as pool:
            plans = list(pool.map(module.plan_file, [src] * n, files, [storage] * n, ["b"] * n, chunksize=4))
        return module.combine(src, plans).rows
    return module.plan_source(src, storage, "b").rows


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, repeats=1)
    p.add_argument(
        "--sizes", default="1000000,10000000", help="manifest rows, comma-separated (default 1000000,10000000)"
    )
    p.add_argument("--rows-per-shard", type=int, default=10_000, help="rows per chunk (default 10000)")
    p.add_argument("--old-rows", type=int, default=200_000, help="rows the old reader plans (default 200000)")
    p.add_argument(
        "--baseline-commit", default=BASELINE_COMMIT, help=f"commit of the old reader (default {BASELINE_COMMIT})"
    )
    p.add_argument("--skip-old", action="store_true", help="leave the old reader out")
    args = parse(p, argv)
    sizes = sorted(int(x) for x in args.sizes.split(","))
    common = [
        "--rows-per-shard",
        args.rows_per_shard,
        "--baseline-commit",
        args.baseline_commit,
        "--sizes",
        args.sizes,
        "--old-rows",
        args.old_rows,
    ]
    if args.child and args.child[0] == "prepare":
        made = {n: [str(x) for x in make_manifests(n)] for n in sizes}
        if not args.skip_old:
            tree_at(args.baseline_commit)
            made["old"] = [str(x) for x in make_manifests(min(args.old_rows, sizes[-1]))]  # the first rows, alike
        print(json.dumps(made))
        return 0
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], args.rows_per_shard, args.baseline_commit)))
        return 0
    # Made in a child: Linux carries a parent's peak RSS into the children it starts, so this
    # process stays small (no pyarrow) for the children's peaks to be their own.
    made = run_child(__file__, "prepare", *common, *(["--skip-old"] if args.skip_old else []))
    res: dict[tuple[str, str, int], dict] = {}
    for _ in range(args.repeats):  # the last round's figures
        for n in sizes:
            for i, (shape, manifest) in enumerate(zip(("parquet folder", "csv, 1 file"), made[str(n)])):
                kinds = (
                    ["new"] + (["new x2"] if i == 0 else []) + (["old"] if not args.skip_old and n == sizes[-1] else [])
                )
                for kind in kinds:
                    res[(kind, shape, n)] = r = run_child(
                        __file__, kind, made["old"][i] if kind == "old" else manifest, *common
                    )
                    print(f"  {shape}, {n:,} rows, {kind}: {r.get('seconds', 0):.1f} s", flush=True)
    rows = [
        (
            shape,
            f"{r['rows']:,}",
            kind,
            f"{r['seconds']:.1f}",
            f"{r['rows'] / r['seconds']:,.0f}",
            f"{r['cpu']:.1f}",
            f"{r['rows'] / r['cpu']:,.0f}",
            f"{r['peak_mb']:.0f} ({r['peak_mb'] - r['base_mb']:.0f})",
        )
        for (kind, shape, n), r in res.items()
    ]
    lines = [
        f"plan_source, {args.rows_per_shard:,} rows per chunk, chunk files written",
        "",
        *table(
            ("manifest", "rows", "reader", "wall s", "rows/s", "CPU s", "rows per CPU s", "peak RSS MB (over imports)"),
            rows,
            "lrlrrrrr",
        ),
        "",
    ]
    big, small = sizes[-1], sizes[0]
    for shape in ("parquet folder", "csv, 1 file"):
        new, old = res[("new", shape, big)], res.get(("old", shape, big))
        line = f"- {shape}, {big:,} rows: new {new['rows'] / new['seconds']:,.0f} rows/s"
        if old:
            line += f"; new / old **{new['rows'] / new['seconds'] / (old['rows'] / old['seconds']):.1f}x** wall, {new['rows'] / new['cpu'] / (old['rows'] / old['cpu']):.1f}x per CPU second"
        lines.append(
            line + f"; peak RSS {big:,} / {small:,} rows: {new['peak_mb'] / res[('new', shape, small)]['peak_mb']:.2f}x"
        )
    emit("Manifest planning (`bench_manifests.py`)", lines, argv, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
