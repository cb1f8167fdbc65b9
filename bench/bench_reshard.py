"""Reshard benchmark: the reshard phase as the flow runs it, beside `cp -r` + `sync` of the same bytes, in one run.

For each ``--sizes`` (GB of validated input shards) one invocation generates (or reuses) a
corpus under ``.bench/reshard/``: WebDataset tars of ``--samples`` samples each (``--sample-kb``
KB of random bytes as the jpg, a caption txt and a json), written with ShardWriter, with
ledgers as the validate phase writes them (a rejected row after every tenth sample).
``--completion-order`` stores each tar's samples in a shuffled order while its ledger stays
sorted by row, as download shards will hold samples in the order they completed.

The inputs are read once with ``cp`` to warm the page cache (it cannot be dropped without
root), one Prefect server and one Dask LocalCluster of ``--workers`` processes are started
(untimed, as a run has them before its third phase) and a small reshard warms the workers'
imports. Then every round runs, in alternating order, each into a fresh folder removed after
it is measured, with a ``sync`` (untimed) before each and, with ``--quiet-wait``, a wait for
the load other work puts on the machine to settle:

- ``cp+sync``: ``cp -r`` of the input folder, then ``sync`` of the copies (the baseline: the
  reshard makes every output durable before its ledger commits it); ``cp`` alone is printed
  too;
- ``reshard phase``: ``flows.reshard.reshard_flow`` on a DaskTaskRunner over that cluster, as
  ``flows/pretraining.py`` runs it: counting, planning, the build tasks (copy, sha256, header
  checks, fsyncs, output ledgers), the Great Expectations gate, its JSON and Data Docs, the
  phase record and the HTML report;
- ``phase without the gate``: the same run less the gate and its reports (from the flow's
  own step timings).

Printed: per size, median wall seconds over the rounds, MB/s (input tar bytes / wall), the
ratio ``cp+sync`` / phase (>= 0.9 is the goal), CPU seconds per GB (``cp`` and ``sync``; for
the phase, this process and every descendant: flow, Prefect server, Dask workers), the
phase's step timings, and the load average other work put on the machine during the rounds.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from harness.procs import REPO, children_cpu, clock, tree_cpu, wait_for_load
from harness.report import in_turn, table

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

BENCH_DIR = REPO / ".bench" / "reshard"
CORPUS_VERSION = 2  # bump when the generator changes


@dataclass
class Validated:
    """What the reshard flow reads of the validate phase's summary."""

    tars: list[str]
    ledgers: list[str]


@dataclass
class Rounds:
    wall: dict[str, list[float]] = field(default_factory=dict)
    cpu: dict[str, list[float]] = field(default_factory=dict)
    steps: dict[str, list[float]] = field(default_factory=dict)
    load: list[float] = field(default_factory=list)

    def add(self, table: dict[str, list[float]], key: str, value: float) -> None:
        table.setdefault(key, []).append(value)


def ensure_corpus(shards: int, samples: int, sample_kb: int, completion_order: bool = False):
    """The input shards and their ledgers, made once and reused (a shard's ledger says it is complete)."""
    import numpy as np

    from tasks.formats.ledger import LedgerRow, write_ledger
    from tasks.formats.shards import ShardWriter
    from tasks.formats.storage import Storage

    name = f"v{CORPUS_VERSION}-s{shards}-n{samples}-kb{sample_kb}" + ("-completion" if completion_order else "")
    storage = Storage(str(BENCH_DIR / name))
    tars, ledgers = [], []
    for i in range(shards):
        tar, ledger = f"inputs/{i:04d}.tar", f"ledgers/{i:04d}.ledger.parquet"
        tars.append(tar)
        ledgers.append(ledger)
        if storage.exists(ledger):
            continue
        rng = np.random.default_rng(i)
        rows, members = [], {}
        row = 0
        for n in range(samples):
            key = f"src{i:04d}-{row:07d}"
            size = int(sample_kb * 1024 * rng.uniform(0.5, 1.5))
            members[row] = (
                key,
                {
                    "jpg": rng.bytes(size),
                    "txt": f"caption of sample {row} of shard {i}".encode(),
                    "json": f'{{"row": {row}, "shard": {i}}}'.encode(),
                },
            )
            row += 1
            if n % 10 == 9:
                rows.append(LedgerRow(key=f"src{i:04d}-{row:07d}", source=f"src{i:04d}", row=row, reason="too_large"))
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
                        source=f"src{i:04d}",
                        row=r,
                        shard=tar,
                        bytes=len(m["jpg"]),
                        offset=rec.offset,
                        length=rec.length,
                        members=rec.members_as_dicts(),
                    )
                )
        rows.sort(key=lambda x: x.row)  # ledgers stay in row order, whatever order the tar holds
        write_ledger(storage, ledger, rows)
    return storage, Validated(tars, ledgers)


def run_cp(src: Path, dst: Path) -> tuple[float, float, float]:
    """(wall of cp -r, wall of cp -r then sync of the copies, CPU seconds of both)."""
    with clock(children_cpu) as both:
        with clock() as cp:
            subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
        subprocess.run(["sync", *map(str, sorted(dst.iterdir()))], check=True)
    return cp.wall, both.wall, both.cpu


def _tree_cpu() -> float:
    """CPU seconds so far of this process and every live descendant: the flow, the Prefect
    server, the Dask scheduler's nannies and workers."""
    return tree_cpu(reaped=False)


def recipe_for(storage_root: str, dataset: str, n: int, workers: int, seed: int | None):
    from tasks.formats.recipe import parse_recipe

    data = {
        "dataset": dataset,
        "storage": storage_root,
        "sources": [{"name": "bench", "manifest": "unused.csv"}],
        "reshard": {"samples_per_shard": n, "seed": seed},
        "execution": {"workers": workers},
    }
    return parse_recipe(data, Path(storage_root) / "recipe.yaml")


def run_phase(
    address: str, storage_root: str, dataset: str, validated: Validated, n: int, workers: int, seed: int | None
):
    """(wall seconds, CPU seconds of the whole process tree, summary) of the reshard flow on the cluster at ``address``."""
    from prefect_dask import DaskTaskRunner

    from flows.audit import new_run
    from flows.reshard import reshard_flow

    recipe = recipe_for(storage_root, dataset, n, workers, seed)
    record = new_run(recipe, f"bench-{dataset}")
    with clock(_tree_cpu) as lap:
        summary, _ = reshard_flow.with_options(task_runner=DaskTaskRunner(address=address))(
            recipe=recipe, validated=validated, run=record
        )
    wall, cpu = lap.wall, lap.cpu
    if summary.samples != sum(o.samples for o in summary.outputs):
        raise SystemExit("reshard lost samples")
    return wall, cpu, summary


def bench_size(gb: float, args: argparse.Namespace, address: str) -> tuple[str, Rounds, int, int]:
    per_shard = args.samples * args.sample_kb * 1024
    shards = max(1, round(gb * 1e9 / per_shard))
    storage, validated = ensure_corpus(shards, args.samples, args.sample_kb, args.completion_order)
    in_dir = Path(storage.path("inputs"))
    total_bytes = sum(p.stat().st_size for p in in_dir.iterdir())
    work = Path(storage.path("work"))
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    run_cp(in_dir, work / "warm")  # warm the page cache
    shutil.rmtree(work / "warm")
    # Warm the workers (imports, pyarrow kernels) and the flow's first calls on two inputs.
    run_phase(
        address,
        storage.root,
        "warm",
        Validated(validated.tars[:2], validated.ledgers[:2]),
        args.samples_per_shard,
        args.workers,
        args.seed,
    )
    shutil.rmtree(storage.path("warm"), ignore_errors=True)

    rounds = Rounds()
    for r in range(args.rounds):
        for what in in_turn(("cp", "phase"), r, first=0):
            subprocess.run(["sync"], check=True)
            load0 = wait_for_load(args.quiet_load, args.quiet_wait)
            if what == "cp":
                cp, cp_sync, cpu = run_cp(in_dir, work / f"cp-{r}")
                rounds.add(rounds.wall, "cp", cp)
                rounds.add(rounds.wall, "cp+sync", cp_sync)
                rounds.add(rounds.cpu, "cp+sync", cpu)
                shutil.rmtree(work / f"cp-{r}")
                print(
                    f"  {gb:g} GB round {r}: cp {cp:.2f} s, cp+sync {cp_sync:.2f} s, CPU {cpu:.2f} s (load {load0:.1f})",
                    flush=True,
                )
            else:
                dataset = f"round{r}"
                wall, cpu, summary = run_phase(
                    address, storage.root, dataset, validated, args.samples_per_shard, args.workers, args.seed
                )
                t = getattr(summary, "timings", {})  # (absent before the flow recorded them)
                rounds.add(rounds.wall, "reshard phase", wall)
                rounds.add(rounds.cpu, "reshard phase", cpu)
                if t:
                    rounds.add(rounds.wall, "phase without the gate", wall - t["gate"] - t["report"])
                for step, s in t.items():
                    rounds.add(rounds.steps, step, s)
                rounds.add(rounds.steps, "flow overhead", wall - sum(t.values()))
                shutil.rmtree(storage.path(dataset), ignore_errors=True)
                print(
                    f"  {gb:g} GB round {r}: phase {wall:.2f} s, CPU {cpu:.2f} s, steps { ({k: round(v, 2) for k, v in t.items()}) }, "
                    f"{len(summary.outputs)} outputs (load {load0:.1f})",
                    flush=True,
                )
            rounds.load.append(os.getloadavg()[0])
    shutil.rmtree(work, ignore_errors=True)
    label = f"{gb:g} GB: {shards} input shards x {args.samples} samples of ~{args.sample_kb} KB, {total_bytes / 1e6:,.0f} MB"
    return label, rounds, total_bytes, shards


def report(label: str, rounds: Rounds, total_bytes: int) -> list[str]:
    med = {k: statistics.median(v) for k, v in rounds.wall.items()}
    cpu = {k: statistics.median(v) for k, v in rounds.cpu.items()}
    lines = [f"### {label}", ""]
    lines += table(
        ["method", "median wall s", "MB/s", "cp+sync / method", "CPU s per GB"],
        [[m, f"{med[m]:.2f}", f"{total_bytes / 1e6 / med[m]:.0f}", f"{med['cp+sync'] / med[m]:.2f}",
          f"{cpu[m] / (total_bytes / 1e9):.2f}" if m in cpu else ""]
         for m in ("cp", "cp+sync", "reshard phase", "phase without the gate") if m in med],
    )  # fmt: skip
    steps = ", ".join(f"{k} {statistics.median(v):.2f}" for k, v in rounds.steps.items()) or "not recorded"
    lines += [
        "",
        f"Phase steps, median s: {steps}. Load average during the rounds: "
        f"{min(rounds.load):.1f}-{max(rounds.load):.1f}.",
        "",
    ]
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1,10", help="GB of input shards, comma-separated (default 1,10)")
    p.add_argument("--samples", type=int, default=500, help="samples per input shard (default 500)")
    p.add_argument("--sample-kb", type=int, default=100, help="mean jpg size in KB (default 100)")
    p.add_argument("--samples-per-shard", type=int, default=1000, help="N of the outputs (default 1000)")
    p.add_argument("--seed", type=int, default=None, help="shuffle seed of the reshard (default: none)")
    p.add_argument("--completion-order", action="store_true", help="inputs hold samples out of ledger order")
    p.add_argument("--rounds", type=int, default=3, help="rounds per size (default 3)")
    p.add_argument("--workers", type=int, default=2, help="Dask worker processes (default 2)")
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=0.0,
        help="seconds to wait, before each run, for other work to settle (default 0)",
    )
    p.add_argument(
        "--quiet-load", type=float, default=1.0, help="the 1-minute load average that counts as settled (default 1.0)"
    )
    p.add_argument("--markdown", type=Path, default=None, help="also write the tables to this file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    home = Path(tempfile.mkdtemp(prefix="prefect-", dir=BENCH_DIR.parent if BENCH_DIR.parent.exists() else None))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ["PREFECT_HOME"] = str(home)
    from flows.runtime import dask_cluster, prefect_api
    from tasks.audit.ge_runner import preload

    out = [
        f"# reshard benchmark: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        f"# N={args.samples_per_shard}, seed {args.seed}, {'completion' if args.completion_order else 'ledger'} order in the inputs, "
        f"{args.workers} Dask workers, {args.rounds} rounds, page cache warm",
        "",
    ]
    try:
        with prefect_api(), dask_cluster("local", args.workers) as address:
            preload()
            for gb in (float(s) for s in args.sizes.split(",")):
                label, rounds, total, _ = bench_size(gb, args, address)
                out += report(label, rounds, total)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    text = "\n".join(out)
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")


if __name__ == "__main__":
    main()
