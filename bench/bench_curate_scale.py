"""Curation at scale (``--stage``), synthetic tables made once under ``.bench/``.

``decide`` (issue 41): wall and peak memory of decide over N score rows beside the concatenating decide it replaced.
``semdedup`` (issue 32): N stored embeddings through SemDeDup on 2 Dask workers, recall and precision of planted
copies; ``--exact``: beside exact all-pairs dedup with the same rule.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from harness.procs import BENCH_DIR, TreeSampler, measured, run_child
from harness.report import emit, fmt, parse, parser, table
from harness.tools import tree_at

PER_FILE, DATASET, DIM, TOPICS = 10_000, "ds", 512, 2_000
BASELINE_COMMIT = "f63c020"  # the last commit with the concatenating decide (tasks/curate/decide.py, scores.py)
KEEP_TOP, AESTHETIC_MIN = 0.3, 4.5
ROWS = {"decide": [100_000, 10_000_000], "semdedup": [100_000, 1_000_000]}


def scores_rel(f: int) -> str:
    return f"{DATASET}/curate/scores/bench/{f:05d}.parquet"


def make_scores(rows: int, seed: int = 0) -> dict:
    """Score tables: alignment ~ N(0.28, 0.05), aesthetic ~ N(5.0, 0.7), 0.5% without a caption, 0.1% undecodable."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from tasks.formats.ledger import write_parquet
    from tasks.formats.storage import Storage

    base, t0 = BENCH_DIR / "decide" / str(rows), time.perf_counter()
    n_files = -(-rows // PER_FILE)
    if (base / ".complete").exists():
        return {"files": n_files, "made_s": 0.0}
    for f in range(n_files):
        start, n = f * PER_FILE, min(PER_FILE, rows - f * PER_FILE)
        if (base / scores_rel(f)).exists():  # made by a run that stopped before the end
            continue
        rng = np.random.default_rng([seed, f])
        row, draws = pa.array(np.arange(start, start + n, dtype=np.int64)), rng.random((2, n))
        error, no_caption = draws[0] < 0.001, draws[1] < 0.005
        align, aesthetic = rng.normal(0.28, 0.05, n).astype(np.float32), rng.normal(5.0, 0.7, n).astype(np.float32)
        write_parquet(
            Storage(str(base)),
            scores_rel(f),
            pa.table(
                {
                    "key": pc.binary_join_element_wise("bench-", pc.utf8_lpad(row.cast(pa.string()), 9, "0"), ""),
                    "source": pa.array(["bench"] * n, pa.string()),
                    "row": row,
                    "error": pa.array(np.where(error, "cannot identify image file", None), pa.string()),
                    "alignment": pa.array(align, pa.float32(), mask=error | no_caption),
                    "aesthetic": pa.array(aesthetic, pa.float32(), mask=error),
                }
            ),
        )
    (base / ".complete").write_text(str(rows))
    return {"files": n_files, "made_s": time.perf_counter() - t0}


def decide_child(kind: str, rows: int, duplicates: float, threads: int, commit: str) -> dict:
    """``cut`` (dataset_cuts), ``decide`` (every fates table written), or ``old cut`` / ``old decide`` of ``commit``."""
    if kind.startswith("old"):  # the old code whole: ``tasks`` is the package at ``commit``
        sys.path.insert(0, str(tree_at(commit)))
    import pyarrow as pa

    from tasks.curate import decide as decide_mod
    from tasks.curate.scores import cuts
    from tasks.formats.ledger import read_tables
    from tasks.formats.recipe_curate import CurateConfig, HeadConfig, ScoreRule
    from tasks.formats.storage import Storage

    base = BENCH_DIR / "decide" / str(rows)
    storage = Storage(str(base))
    shards = [
        decide_mod.ShardInput(f"t/{f}.tar", f"l/{f}.parquet", "bench", f, f"e/{f}", scores_rel(f), "run-1")
        for f in range(-(-rows // PER_FILE))
    ]
    cfg = CurateConfig(
        model="m", alignment=ScoreRule(keep_top=KEEP_TOP), heads={"aesthetic": HeadConfig(path="x", min=AESTHETIC_MIN)}
    )
    dups: dict[str, tuple[str, float]] = {}
    if duplicates:
        picked = np.flatnonzero(np.random.default_rng(1).random(rows) < duplicates)
        dups = {f"bench-{i:09d}": (f"bench-{i - 1:09d}", 0.97) for i in picked.tolist()}
    shutil.rmtree(base / DATASET / "curate" / "fates", ignore_errors=True)
    pa.array(np.zeros(1))  # pyarrow's first array from numpy imports pandas (about 48 MB): an import

    def work() -> dict:
        if kind == "cut":
            applied, decisions = decide_mod.dataset_cuts(storage, cfg, shards, threads), []
        elif kind == "old cut":  # what the old decide did before its per-shard loop
            tables = read_tables(storage, [s.scores for s in shards])
            applied, decisions = cuts(cfg, pa.concat_tables([tables[s.scores] for s in shards])), []
        else:
            more = {"threads": threads} if kind == "decide" else {}
            applied, decisions = decide_mod.decide(storage, DATASET, cfg, shards, dups, **more)
        return {
            "cuts": [[c.name, c.low, c.high, c.rule] for c in applied],
            "digests": [d.digest for d in decisions],
            "removed": sum(d.removed for d in decisions),
        }

    return measured(work)


def decide(args) -> list[str]:
    tree_at(args.baseline_commit)
    kinds = ["cut", "old cut", "decide"] + ([] if args.skip_old_decide else ["old decide"])
    rows, lines = [], []
    for n in args.rows:
        common = [
            "--rows",
            n,
            "--duplicates",
            args.duplicates,
            "--threads",
            args.threads,
            "--baseline-commit",
            args.baseline_commit,
        ]
        made = run_child(__file__, "make", *common)
        print(f"{n:,} score rows in {made['files']:,} tables (made in {made['made_s']:.0f} s; 0: reused)", flush=True)
        res = {}
        for _ in range(args.repeats):  # the last round's figures
            for kind in kinds:
                res[kind] = r = run_child(__file__, *kind.split(), *common)
                print(f"  {kind}: {r['seconds']:.1f} s, {r['peak_mb']:.0f} MB", flush=True)
        for kind, r in res.items():
            rows.append(
                (
                    f"{n:,}",
                    kind,
                    f"{r['seconds']:.1f}",
                    f"{r['cpu']:.1f}",
                    f"{r['peak_mb']:.0f}",
                    f"{r['peak_mb'] - r['base_mb']:.0f}",
                    f"{r['removed']:,}" if r["digests"] else "",
                )
            )
        for new, old in (("cut", "old cut"), ("decide", "old decide")):
            if old in res:
                o, x = res[old], res[new]
                lines.append(
                    f"- {n:,} rows, {new}: old / new **{o['seconds'] / x['seconds']:.2f}x** wall, {o['peak_mb'] / x['peak_mb']:.2f}x peak RSS"
                )
        same = all(r["cuts"] == res["cut"]["cuts"] for r in res.values())
        fates = fmt(None) if "old decide" not in res else res["decide"]["digests"] == res["old decide"]["digests"]
        lines.append(
            f"- {n:,} rows: the cuts the same in every run: {same} ({res['cut']['cuts']}); every fates table the same: {fates}"
        )
    head = ("rows", "", "wall s", "CPU s", "peak RSS MB", "over imports MB", "removed")
    return [
        f"Keep the top {KEEP_TOP:.0%} by alignment and aesthetic >= {AESTHETIC_MIN}; a fresh process each",
        "",
        *table(head, rows, "llrrrrr"),
        "",
        *lines,
    ]


def make_embeddings(base: Path, rows: int, seed: int = 0) -> tuple[list[str], set[tuple[str, str]]]:
    """Side shards of float16 embeddings around 2,000 topics, 2% planted copies at cosine 0.96-0.99 and 1% near
    misses at 0.85-0.90 (which must stay); the files and the planted (copy key, original key) pairs."""
    import pyarrow as pa

    from tasks.curate.embed import embedding_schema
    from tasks.formats.ledger import write_parquet
    from tasks.formats.storage import Storage

    rng = np.random.default_rng(seed)
    topics = rng.normal(size=(TOPICS, DIM)).astype(np.float32)
    topics /= np.linalg.norm(topics, axis=1, keepdims=True)
    files, planted, recent = [], set(), []
    for f in range(-(-rows // PER_FILE)):
        n = min(PER_FILE, rows - f * PER_FILE)
        x = topics[rng.integers(TOPICS, size=n)] + rng.normal(size=(n, DIM)).astype(np.float32) * (1.0 / np.sqrt(DIM))
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        keys = [f"bench-{f * PER_FILE + i:09d}" for i in range(n)]
        pool = recent + list(zip(keys[: n // 2], x[: n // 2]))  # copies of earlier files' rows, or this one's
        for kind, share, lo, hi in (("copy", 0.02, 0.96, 0.99), ("miss", 0.01, 0.85, 0.90)):
            for i in rng.choice(np.arange(n // 2, n), size=int(n * share), replace=False):
                okey, ovec = pool[rng.integers(len(pool))]
                cos, noise = rng.uniform(lo, hi), rng.normal(size=DIM).astype(np.float32)
                noise -= (noise @ ovec) * ovec
                noise /= np.linalg.norm(noise)
                x[i] = cos * ovec + np.sqrt(1 - cos * cos) * noise
                if kind == "copy":
                    planted.add((keys[i], okey))
        recent = list(zip(keys[: n // 2], x[: n // 2]))[:2000]
        files.append(path := f"emb/{f:05d}.parquet")
        vec = pa.FixedSizeListArray.from_arrays(pa.array(x.astype(np.float16).reshape(-1)), DIM)
        if not (base / path).exists():
            write_parquet(
                Storage(str(base)),
                path,
                pa.table(
                    {
                        "key": keys,
                        "source": ["bench"] * n,
                        "row": pa.array(range(f * PER_FILE, f * PER_FILE + n), pa.int64()),
                        "image": vec,
                        "text": vec,
                        "error": pa.nulls(n, pa.string()),
                    },
                    schema=embedding_schema(DIM),
                ),
            )
    return files, planted


def exact(storage, files: list[str], threshold: float) -> dict[str, str]:
    """The baseline: the same greedy rule over every pair (no clusters)."""
    from tasks.curate import semdedup as sd
    from tasks.formats.ledger import read_parquet

    xs, keys = [], []
    for f in files:
        t = read_parquet(storage, f, ["key", "image"])
        col = t.column("image").combine_chunks()
        xs.append(col.values.to_numpy(zero_copy_only=False).astype(np.float32).reshape(len(col), DIM))
        keys += t.column("key").to_pylist()
    x = np.concatenate(xs)
    by, _ = sd._greedy(x / np.linalg.norm(x, axis=1, keepdims=True), threshold)
    return {keys[i]: keys[by[i]] for i in np.nonzero(by >= 0)[0]}


def semdedup(args) -> list[str]:
    from dask.distributed import Client, LocalCluster

    from tasks.curate import semdedup as sd
    from tasks.formats.storage import Storage

    rows_out, lines = [], []
    for rows in args.rows:
        base = BENCH_DIR / "semdedup" / str(rows)
        files, planted = make_embeddings(base, rows)
        for rnd in range(1, args.repeats + 1):
            shutil.rmtree(base / "sd", ignore_errors=True)
            storage, steps = Storage(str(base)), {}
            with (
                TreeSampler(interval=0.2) as mem,
                LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=None) as cluster,
                Client(cluster) as client,
            ):

                def mapper(fn, arglist, steps=steps, client=client):
                    t0 = time.perf_counter()
                    out = client.gather(client.map(fn, *zip(*arglist), pure=False)) if arglist else []
                    steps[fn.__name__] = steps.get(fn.__name__, 0.0) + time.perf_counter() - t0
                    return out

                t = time.perf_counter()
                decisions, _ = sd.semantic_duplicates(storage, "sd", files, args.threshold, {"bench": 0}, map_fn=mapper)
                wall = time.perf_counter() - t
            found, copies = sd.read_duplicates(storage, decisions), {c for c, _ in planted}
            recall = len(copies & set(found)) / max(len(copies), 1)
            precision = len({(k, v[0]) for k, v in found.items()} & planted) / max(len(found), 1)
            print(f"  round {rnd}, {rows:,} rows: {wall:.1f} s", flush=True)
        rows_out.append(
            (
                f"{rows:,}",
                f"{wall:.1f}",
                " / ".join(f"{v:.1f}" for v in steps.values()),
                f"{mem.peak_rss / 2**30:.2f}",
                f"{recall:.3f}",
                f"{precision:.3f}",
                f"{len(found):,}",
            )
        )
        if args.exact and rows <= 200_000:
            t = time.perf_counter()
            ex = exact(storage, files, args.threshold)
            et, agree = time.perf_counter() - t, len(set(found) & set(ex)) / max(len(ex), 1)
            lines.append(
                f"- baseline at {rows:,} rows, exact all pairs: {et:.1f} s (**{et / wall:.2f}x** the clustered method's time), {len(ex):,} duplicates, of which the clustered method finds {agree:.3f}"
            )
    head = (
        "rows",
        "wall s",
        f"{' / '.join(steps)} s",
        "peak RSS GiB, process tree",
        "recall of planted copies",
        "precision",
        "duplicates",
    )
    return [f"threshold {args.threshold}; the last round of each size", "", *table(head, rows_out), "", *lines]


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, repeats=1)
    p.add_argument("--stage", choices=tuple(ROWS), default="decide", help="what is measured (default decide)")
    p.add_argument(
        "--rows",
        type=int,
        nargs="+",
        help="rows, each size in turn (default: decide 100000 10000000, semdedup 100000 1000000)",
    )
    p.add_argument(
        "--duplicates", type=float, default=0.0, help="decide: share of keys with a semantic duplicate (default 0)"
    )
    p.add_argument("--threads", type=int, default=4, help="decide's threads (default 4, its default)")
    p.add_argument("--baseline-commit", default=BASELINE_COMMIT, help=f"the old decide's commit ({BASELINE_COMMIT})")
    p.add_argument("--skip-old-decide", action="store_true", help="leave the old decide out (the old cut stays)")
    p.add_argument("--threshold", type=float, default=0.95, help="semdedup: the cosine of a duplicate (default 0.95)")
    p.add_argument(
        "--exact", action="store_true", help="semdedup: also the exact all-pairs baseline (sizes <= 200,000)"
    )
    args = parse(p, argv)
    args.rows = args.rows or ROWS[args.stage]
    if args.child:
        rows, kind = args.rows[0], " ".join(args.child)
        print(
            json.dumps(
                make_scores(rows)
                if kind == "make"
                else decide_child(kind, rows, args.duplicates, args.threads, args.baseline_commit)
            )
        )
        return 0
    lines = decide(args) if args.stage == "decide" else semdedup(args)
    title = "Decisions at scale" if args.stage == "decide" else "Semantic dedup at scale"
    emit(f"{title} (`bench_curate_scale.py --stage {args.stage}`)", lines, argv, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
