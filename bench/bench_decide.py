"""Curation's decisions at scale: wall seconds and peak memory of ``decide`` over N stored score rows, beside the concatenating one it replaced.

Synthesises ``--rows`` score rows (once per size, under ``.bench/decide/ROWS/``) as the curation
flow stores them: scores tables of 10,000 rows (``key, source, row, error, alignment,
aesthetic``; 1,000 tables at 10,000,000 rows), alignment a ViT-B/32-like cosine (float32,
normal around 0.28, sd 0.05; 0.5% null for a missing caption), aesthetic a LAION-like score
(float32, normal around 5.0, sd 0.7), 0.1% undecodable images (an error, no scores). The recipe
keeps the top 30% by alignment (``keep_top: 0.3``, a cut over the whole dataset) and drops
aesthetic below 4.5 (``min``). ``--duplicates`` gives that share of the keys a semantic
duplicate (none by default: the key -> kept key map is the caller's input, read before decide).

Each measurement runs in a fresh child process, which reports wall seconds, CPU seconds
(``process_time``, threads included) and peak RSS (``ru_maxrss``) after its imports and at the
end (this process imports neither numpy nor pyarrow, so that the children's peaks are their
own):

- ``cut``: today's ``tasks.curate.decide.dataset_cuts`` alone: the cut columns read a shard at
  a time, in two passes (``scores.cuts_over``);
- ``decide``: today's ``decide`` whole: the cuts, then per shard its scores table read, its
  fates found and its fates table written;
- ``old cut`` (the baseline): the cuts as they were (``tasks`` at ``--baseline-commit``, taken
  from git into ``.bench/trees/``): every scores table read whole, concatenated, sorted;
- ``old decide``: that commit's ``decide`` whole (``--skip-old-decide`` leaves it out).

The fates tables are removed before each decide, so each writes them all. Printed per size: a
row per measurement, the ratios of old to new, and whether the cuts and every shard's fates
table (its content digest) are the same in both.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

from harness.procs import REPO, clock, peak_rss_mb, run_json
from harness.tools import tree_at

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

BENCH_DIR = REPO / ".bench" / "decide"
PER_FILE = 10_000
DATASET = "ds"
# The last commit with the concatenating decide (tasks/curate/decide.py, scores.py as of 80bdf0b).
BASELINE_COMMIT = "f63c020"
KEEP_TOP, AESTHETIC_MIN = 0.3, 4.5


def synthesise(rows: int, seed: int = 0) -> dict:
    """The scores tables of ``rows`` rows under ``BENCH_DIR/ROWS/`` (kept once complete)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from tasks.formats.ledger import write_parquet
    from tasks.formats.storage import Storage

    base = BENCH_DIR / str(rows)
    done = base / ".complete"
    n_files = -(-rows // PER_FILE)
    if done.exists():
        return {"files": n_files, "made_s": 0.0}
    t0 = time.perf_counter()
    storage = Storage(str(base))
    for f in range(n_files):
        rel = _scores_rel(f)
        start, n = f * PER_FILE, min(PER_FILE, rows - f * PER_FILE)
        if (base / rel).exists():  # made by a run that stopped before the end
            continue
        rng = np.random.default_rng([seed, f])
        row = pa.array(np.arange(start, start + n, dtype=np.int64))
        draws = rng.random((2, n))
        error = draws[0] < 0.001
        no_caption = draws[1] < 0.005
        align = rng.normal(0.28, 0.05, n).astype(np.float32)
        aesthetic = rng.normal(5.0, 0.7, n).astype(np.float32)
        table = pa.table(
            {
                "key": pc.binary_join_element_wise("bench-", pc.utf8_lpad(row.cast(pa.string()), 9, "0"), ""),
                "source": pa.array(["bench"] * n, pa.string()),
                "row": row,
                "error": pa.array(np.where(error, "cannot identify image file", None), pa.string()),
                "alignment": pa.array(align, pa.float32(), mask=error | no_caption),
                "aesthetic": pa.array(aesthetic, pa.float32(), mask=error),
            }
        )
        write_parquet(storage, rel, table)
    done.write_text(str(rows))
    return {"files": n_files, "made_s": time.perf_counter() - t0}


def _scores_rel(f: int) -> str:
    return f"{DATASET}/curate/scores/bench/{f:05d}.parquet"


def child(kind: str, rows: int, duplicates: float, threads: int, commit: str) -> dict:
    """One measurement in this process (see the module's docstring)."""
    if kind.startswith("old"):  # the old code whole: ``tasks`` is the package at ``commit``
        sys.path.insert(0, str(tree_at(commit)))
    import numpy as np
    import pyarrow as pa

    from tasks.curate import decide as decide_mod
    from tasks.curate.scores import cuts
    from tasks.formats.ledger import read_tables
    from tasks.formats.recipe_curate import CurateConfig, HeadConfig, ScoreRule
    from tasks.formats.storage import Storage

    base = BENCH_DIR / str(rows)
    storage = Storage(str(base))
    n_files = -(-rows // PER_FILE)
    shards = [
        decide_mod.ShardInput(f"t/{f}.tar", f"l/{f}.parquet", "bench", f, f"e/{f}", _scores_rel(f), "run-1")
        for f in range(n_files)
    ]
    cfg = CurateConfig(
        model="m",
        alignment=ScoreRule(keep_top=KEEP_TOP),
        heads={"aesthetic": HeadConfig(path="x", min=AESTHETIC_MIN)},
    )
    dups: dict[str, tuple[str, float]] = {}
    if duplicates:
        picked = np.flatnonzero(np.random.default_rng(1).random(rows) < duplicates)
        dups = {f"bench-{i:09d}": (f"bench-{i - 1:09d}", 0.97) for i in picked.tolist()}
    shutil.rmtree(base / DATASET / "curate" / "fates", ignore_errors=True)
    pa.array(np.zeros(1))  # pyarrow's first array from numpy imports pandas (about 48 MB): an import
    base_mb = peak_rss_mb()
    with clock() as lap:
        if kind == "cut":
            applied, decisions = decide_mod.dataset_cuts(storage, cfg, shards, threads), []
        elif kind == "old cut":  # what the old decide did before its per-shard loop
            tables = read_tables(storage, [s.scores for s in shards])
            applied, decisions = cuts(cfg, pa.concat_tables([tables[s.scores] for s in shards])), []
        elif kind == "decide":
            applied, decisions = decide_mod.decide(storage, DATASET, cfg, shards, dups, threads=threads)
        else:
            applied, decisions = decide_mod.decide(storage, DATASET, cfg, shards, dups)
    return {
        "seconds": lap.wall,
        "cpu": lap.cpu,
        "base_mb": base_mb,
        "peak_mb": peak_rss_mb(),
        "cuts": [[c.name, c.low, c.high, c.rule] for c in applied],
        "digests": [d.digest for d in decisions],
        "removed": sum(d.removed for d in decisions),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[100_000, 10_000_000], help="score rows (each size in turn)")
    ap.add_argument("--duplicates", type=float, default=0.0, help="share of keys with a semantic duplicate (default 0)")
    ap.add_argument("--threads", type=int, default=4, help="decide's threads (default 4, its default)")
    ap.add_argument("--baseline-commit", default=BASELINE_COMMIT, help=f"the old decide's commit ({BASELINE_COMMIT})")
    ap.add_argument("--skip-old-decide", action="store_true", help="leave the old decide out (the old cut stays)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        rows = args.rows[0]
        out = (
            synthesise(rows)
            if args.child == "make"
            else child(args.child, rows, args.duplicates, args.threads, args.baseline_commit)
        )
        print(json.dumps(out))
        return 0

    tree_at(args.baseline_commit)
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start")
    kinds = ["cut", "old cut", "decide"] + ([] if args.skip_old_decide else ["old decide"])
    for rows in args.rows:
        common = ["--rows", str(rows), "--duplicates", str(args.duplicates), "--threads", str(args.threads)]
        common += ["--baseline-commit", args.baseline_commit]
        made = run_json([sys.executable, __file__, "--child", "make", *common])
        print(f"\n{rows:,} score rows in {made['files']:,} tables (made in {made['made_s']:.0f} s; reused when 0)")
        print(f"{'':<12}{'wall s':>9}{'cpu s':>8}{'peak MB':>9}{'over imports MB':>17}{'removed':>12}")
        res = {}
        for kind in kinds:
            r = res[kind] = run_json([sys.executable, __file__, "--child", kind, *common])
            removed = f"{r['removed']:,}" if r["digests"] else ""
            print(
                f"{kind:<12}{r['seconds']:>9.1f}{r['cpu']:>8.1f}{r['peak_mb']:>9.0f}"
                f"{r['peak_mb'] - r['base_mb']:>17.0f}{removed:>12}"
            )
        for new, old in (("cut", "old cut"), ("decide", "old decide")):
            if old in res:
                n, o = res[new], res[old]
                print(
                    f"{new}: old / new {o['seconds'] / n['seconds']:.2f}x wall, {o['peak_mb'] / n['peak_mb']:.2f}x peak RSS "
                    f"({o['peak_mb'] - o['base_mb']:.0f} MB / {n['peak_mb'] - n['base_mb']:.0f} MB over imports)"
                )
        same_cuts = all(res[k]["cuts"] == res["cut"]["cuts"] for k in res)
        line = f"cuts the same in all {len(res)} runs: {same_cuts} ({res['cut']['cuts']})"
        if "old decide" in res:
            line += f"; every fates table the same (content digests): {res['decide']['digests'] == res['old decide']['digests']}"
        print(line)
        print(f"load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
