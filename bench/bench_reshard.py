"""Reshard, issues 4, 8 and 17: the reshard phase as the flow runs it beside ``cp -r`` + ``sync`` of the same bytes (>= 0.9x).

A corpus of validated shards per ``--sizes`` (GB) made once under ``.bench/reshard/``; page cache warm, a Prefect server
and ``--workers`` Dask workers up and warmed (untimed). Printed: wall, MB/s, cp+sync / phase, CPU s per GB, the phase's steps.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from harness.procs import REPO, children_cpu, clock, settle, tree_cpu
from harness.report import emit, in_turn, med, parse, parser, table

BENCH_DIR = REPO / ".bench" / "reshard"
CORPUS_VERSION = 2  # bump when the generator changes


@dataclass
class Validated:
    """What the reshard flow reads of the validate phase's summary."""

    tars: list[str]
    ledgers: list[str]


def ensure_corpus(shards: int, samples: int, sample_kb: int, completion_order: bool = False):
    """The input shards and their ledgers, made once and reused (a shard's ledger says it is complete)."""
    import numpy as np

    from tasks.formats.ledger import LedgerRow, write_ledger
    from tasks.formats.shards import ShardWriter
    from tasks.formats.storage import Storage

    name = f"v{CORPUS_VERSION}-s{shards}-n{samples}-kb{sample_kb}" + ("-completion" if completion_order else "")
    storage = Storage(str(BENCH_DIR / name))
    tars, ledgers = (
        [f"inputs/{i:04d}.tar" for i in range(shards)],
        [f"ledgers/{i:04d}.ledger.parquet" for i in range(shards)],
    )
    for i, (tar, ledger) in enumerate(zip(tars, ledgers)):
        if storage.exists(ledger):
            continue
        rng, src = np.random.default_rng(i), f"src{i:04d}"
        rows, members, row = [], {}, 0
        for n in range(samples):
            size = int(sample_kb * 1024 * rng.uniform(0.5, 1.5))
            jpg, txt, meta = rng.bytes(size), f"caption of sample {row} of shard {i}", f'{{"row": {row}, "shard": {i}}}'
            members[row], row = (f"{src}-{row:07d}", {"jpg": jpg, "txt": txt.encode(), "json": meta.encode()}), row + 1
            if n % 10 == 9:
                rows.append(LedgerRow(key=f"{src}-{row:07d}", source=src, row=row, reason="too_large"))
                row += 1
        order = list(members)
        if completion_order:
            order = [order[k] for k in rng.permutation(len(order))]
        with storage.atomic_writer(tar) as fh, ShardWriter(fh) as writer:
            for r in order:
                key, m = members[r]
                rec = writer.write_sample(key, m)
                rows.append(
                    LedgerRow(
                        key=key,
                        source=src,
                        row=r,
                        shard=tar,
                        bytes=len(m["jpg"]),
                        offset=rec.offset,
                        length=rec.length,
                        members=rec.members_as_dicts(),
                    )
                )
        write_ledger(storage, ledger, sorted(rows, key=lambda x: x.row))  # ledgers in row order, whatever the tar holds
    return storage, Validated(tars, ledgers)


def run_cp(src: Path, dst: Path) -> tuple[float, float, float]:
    """(wall of cp -r, wall of cp -r then sync of the copies, CPU seconds of both)."""
    with clock(children_cpu) as both:
        with clock() as cp:
            subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
        subprocess.run(["sync", *map(str, sorted(dst.iterdir()))], check=True)
    return cp.wall, both.wall, both.cpu


def run_phase(address: str, root: str, dataset: str, validated: Validated, args):
    """(wall seconds, CPU seconds of this process and every live descendant: the flow, the Prefect
    server, Dask's nannies and workers; summary) of the reshard flow on the cluster at ``address``."""
    from prefect_dask import DaskTaskRunner

    from flows.audit import new_run
    from flows.reshard import reshard_flow
    from tasks.formats.recipe import parse_recipe

    data = {
        "dataset": dataset,
        "storage": root,
        "sources": [{"name": "bench", "manifest": "unused.csv"}],
        "reshard": {"samples_per_shard": args.samples_per_shard, "seed": args.seed},
        "execution": {"workers": args.workers},
    }
    recipe = parse_recipe(data, Path(root) / "recipe.yaml")
    record = new_run(recipe, f"bench-{dataset}")
    with clock(lambda: tree_cpu(reaped=False)) as lap:
        summary, _ = reshard_flow.with_options(task_runner=DaskTaskRunner(address=address))(
            recipe=recipe, validated=validated, run=record
        )
    if summary.samples != sum(o.samples for o in summary.outputs):
        raise SystemExit("reshard lost samples")
    return lap.wall, lap.cpu, summary


def bench_size(gb: float, args, address: str) -> tuple[str, dict, int]:
    shards = max(1, round(gb * 1e9 / (args.samples * args.sample_kb * 1024)))
    storage, validated = ensure_corpus(shards, args.samples, args.sample_kb, args.completion_order)
    in_dir, work = Path(storage.path("inputs")), Path(storage.path("work"))
    total_bytes = sum(p.stat().st_size for p in in_dir.iterdir())
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    run_cp(in_dir, work / "warm")  # the page cache warm
    shutil.rmtree(work / "warm")
    # The workers warm (imports, pyarrow kernels) and the flow's first calls, on two inputs.
    run_phase(address, storage.root, "warm", Validated(validated.tars[:2], validated.ledgers[:2]), args)
    shutil.rmtree(storage.path("warm"), ignore_errors=True)
    rounds: dict = {"wall": {}, "cpu": {}, "steps": {}, "load": []}
    for r in range(args.repeats):
        for what in in_turn(("cp", "phase"), r, first=0):
            subprocess.run(["sync"], check=True)
            settle(args.quiet_wait)
            if what == "cp":
                cp, cp_sync, cpu = run_cp(in_dir, work / f"cp-{r}")
                got, t = {"cp": cp, "cp+sync": cp_sync}, {}
                rounds["cpu"].setdefault("cp+sync", []).append(cpu)
                shutil.rmtree(work / f"cp-{r}")
            else:
                wall, cpu, summary = run_phase(address, storage.root, f"round{r}", validated, args)
                t = getattr(summary, "timings", {})
                got = {"reshard phase": wall} | (
                    {"phase without the gate": wall - t["gate"] - t["report"]} if t else {}
                )
                t = t | {"flow overhead": wall - sum(t.values())}
                rounds["cpu"].setdefault("reshard phase", []).append(cpu)
                shutil.rmtree(storage.path(f"round{r}"), ignore_errors=True)
            for key, table_ in (("wall", got), ("steps", t)):
                for k, v in table_.items():
                    rounds[key].setdefault(k, []).append(v)
            rounds["load"].append(os.getloadavg()[0])
            print(
                f"  {gb:g} GB round {r}: " + ", ".join(f"{k} {v:.2f} s" for k, v in got.items()) + f", CPU {cpu:.2f} s",
                flush=True,
            )
    shutil.rmtree(work, ignore_errors=True)
    return (
        f"{gb:g} GB: {shards} input shards x {args.samples} samples of ~{args.sample_kb} KB, {total_bytes / 1e6:,.0f} MB",
        rounds,
        total_bytes,
    )


def report(label: str, rounds: dict, total_bytes: int) -> list[str]:
    wall = {k: med(v) for k, v in rounds["wall"].items()}
    cpu = {k: med(v) for k, v in rounds["cpu"].items()}
    rows = [
        [
            m,
            f"{wall[m]:.2f}",
            f"{total_bytes / 1e6 / wall[m]:.0f}",
            f"{wall['cp+sync'] / wall[m]:.2f}",
            f"{cpu[m] / (total_bytes / 1e9):.2f}" if m in cpu else "",
        ]
        for m in ("cp", "cp+sync", "reshard phase", "phase without the gate")
        if m in wall
    ]
    steps = ", ".join(f"{k} {med(v):.2f}" for k, v in rounds["steps"].items()) or "not recorded"
    return [
        f"### {label}",
        "",
        *table(["method", "median wall s", "MB/s", "cp+sync / method", "CPU s per GB"], rows),
        "",
        f"Phase steps, median s: {steps}. Load average during the rounds: {min(rounds['load']):.1f}-{max(rounds['load']):.1f}.",
        "",
    ]


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, repeats=3, quiet_wait=0.0)
    p.add_argument("--sizes", default="1,10", help="GB of input shards, comma-separated (default 1,10)")
    p.add_argument("--samples", type=int, default=500, help="samples per input shard (default 500)")
    p.add_argument("--sample-kb", type=int, default=100, help="mean jpg size in KB (default 100)")
    p.add_argument("--samples-per-shard", type=int, default=1000, help="N of the outputs (default 1000)")
    p.add_argument("--seed", type=int, default=None, help="shuffle seed of the reshard (default: none)")
    p.add_argument("--completion-order", action="store_true", help="inputs hold samples out of ledger order")
    p.add_argument("--workers", type=int, default=2, help="Dask worker processes (default 2)")
    args = parse(p, argv)
    home = Path(tempfile.mkdtemp(prefix="prefect-", dir=BENCH_DIR.parent if BENCH_DIR.parent.exists() else None))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ["PREFECT_HOME"] = str(home)
    from flows.runtime import dask_cluster, prefect_api
    from tasks.audit.ge_runner import preload

    lines = [
        f"N={args.samples_per_shard}, seed {args.seed}, {'completion' if args.completion_order else 'ledger'} order in the inputs, "
        f"{args.workers} Dask workers, {args.repeats} rounds, page cache warm",
        "",
    ]
    try:
        with prefect_api(), dask_cluster("local", args.workers) as address:
            preload()
            for gb in (float(x) for x in args.sizes.split(",")):
                label, rounds, total = bench_size(gb, args, address)
                lines += report(label, rounds, total)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    emit("Reshard (`bench_reshard.py`)", lines, argv, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
