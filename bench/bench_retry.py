"""Issue 40's retries: the night after an outage, a run that fetches again only the rows that failed for a passing reason, beside a run that fetches those rows alone.

One invocation renders (or reuses) a pool of small pictures under ``.bench/retry/``, serves it
with ``tasks.demo.webserver.ImageWeb`` in this process (its request counts say what each run
fetched), starts one Prefect server, and writes a manifest of
``--rows`` URLs in ``--shards`` chunks, a ``--transient`` share of them ``/flaky/1/NAME`` (each its
own picture: the first request of that path answers 500, every later one the picture).

Night 1 (untimed): ``shardsmith run RECIPE --phase PHASE --json`` with ``download.retries: 0``,
so the flaky rows end as ``http_500``, a passing failure. Then, for ``--repeats`` rounds, in
turn (the order flips every round):

- ``retry``: night 2, a day later (``SHARDSMITH_NOW``), on a copy of night 1's store (hard
  links: committed files are never written again); it fetches again only the ``http_500`` rows
  and writes a new version of each chunk that has one;
- ``alone``: the same phase over a fresh manifest of only those URLs (each already asked once,
  so it answers), same settings, a fresh store;
- ``noop``: night 1's store again two hours later (nothing due) with ``--force``: the flows run
  and find nothing to do, what any run over this dataset costs (listing, reading the ledgers,
  the gate); the part of ``retry`` that retrying does not add.

Printed: wall and CPU seconds of each, the rows each fetched (the image server's count), and
the ratio of the medians, against issue 40's target (within 1.5x).
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

from harness.photos import write_manifest
from harness.procs import BENCH_DIR, REPO, Session, settle, timed
from harness.report import add_round_flags, alternated, command, emit, machine, med, now, revision, table
from harness.servers import prefect_env, start_prefect_server
from harness.tools import SHARDSMITH, summary
from tasks.demo.webserver import ImageWeb

TOOLS = ("retry", "alone", "noop")
TARGET = 1.5
NIGHT1 = datetime(2026, 12, 1, 2, 0, tzinfo=UTC)
POOL_VERSION = 2


def render(i: int) -> bytes:
    """Picture ``i`` of the pool: a smooth colour field with grain, 128..320 px, as a JPEG (~10 KB)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng([40, i])
    w, h = int(rng.integers(128, 321)), int(rng.integers(128, 321))
    base = Image.fromarray(rng.integers(0, 256, size=(3, 4, 3), dtype=np.uint8)).resize(
        (w, h), Image.Resampling.BICUBIC
    )
    arr = np.asarray(base, np.int16) + rng.integers(-6, 7, size=(h, w, 1), dtype=np.int16)
    out = io.BytesIO()
    Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8)).save(out, "JPEG", quality=85)
    return out.getvalue()


def ensure_pool(size: int) -> tuple[Path, list[str]]:
    """``size`` pictures under .bench/retry/ (made once, grown when a later invocation wants more)."""
    folder = BENCH_DIR / "retry" / f"pool-v{POOL_VERSION}"
    folder.mkdir(parents=True, exist_ok=True)
    names = [f"r{i:06d}.jpg" for i in range(size)]
    missing = [i for i, name in enumerate(names) if not (folder / name).exists()]
    if missing:
        print(f"rendering {len(missing)} pictures into {folder} (once; reused by later runs) ...", flush=True)
    for i in missing:
        (folder / names[i]).write_bytes(render(i))
    return folder, names


def recipe(path: Path, store: Path, manifest: Path, rows_per_shard: int, workers: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f"""dataset: bench
kind: pretraining
storage: {store}
sources:
  - name: bench
    manifest: {manifest}
    rows_per_shard: {rows_per_shard}
download:
  retries: 0
  network: {{allowed_networks: ["127.0.0.1/32"], any_port: true}}
validate:
  license:
    allow: [CC-BY-4.0]
    source_defaults: {{bench: CC-BY-4.0}}
    review: {{reviewed_by: bench/bench_retry.py, reviewed_on: 2026-12-01}}
  image: {{min_side: 32}}
gates:
  download: {{min_success_rate: 0.5}}
execution:
  cluster: local
  workers: {workers}
"""
    )
    return path


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    every = max(1, round(1 / args.transient))
    flaky = [i for i in range(args.rows) if i % every == every // 2]
    # Validation deduplicates: a picture per row there; the download phase reuses a small pool.
    pool_dir, names = ensure_pool(args.rows if args.phase == "validate" else max(len(flaky), 200))
    rows_per_shard = -(-args.rows // args.shards)
    runs: list[dict] = []
    with Session("retry", args.keep) as s:
        web = ImageWeb(root=pool_dir).start()
        home = s.work / "prefect-home"
        home.mkdir()
        print("starting a Prefect server (not timed) ...", flush=True)
        proc, api = start_prefect_server(s.children, home, s.work / "prefect-server.log")
        watch = {"prefect": proc.pid}
        flaky_set = set(flaky)
        urls, k = [], 0
        for i in range(args.rows):
            name = names[i] if len(names) >= args.rows else names[k] if i in flaky_set else names[i % len(names)]
            if i in flaky_set:
                urls.append(web.url(f"/flaky/1/{name}"))  # its own path: its own first 500
                k += 1
            else:
                urls.append(web.url(f"/img/{name}?u={i}"))
        manifest = s.work / "manifest.parquet"
        write_manifest(manifest, urls, license=["CC-BY-4.0"] * args.rows)
        alone_manifest = s.work / "alone.parquet"
        write_manifest(alone_manifest, [urls[i] for i in flaky], license=["CC-BY-4.0"] * len(flaky))
        env = prefect_env(home, api)
        night1 = s.work / "night1"
        print(
            f"night 1 (untimed): {args.rows} rows in {args.shards} chunks, {len(flaky)} of them failing once; --phase {args.phase}",
            flush=True,
        )
        t = timed(
            s.children,
            [str(SHARDSMITH), "run", str(recipe(night1 / "r.yaml", night1 / "store", manifest, rows_per_shard, args.workers)),
             "--phase", args.phase, "--json"],
            env | {"SHARDSMITH_NOW": NIGHT1.isoformat()}, REPO, night1 / "stderr.log", watch,
        )  # fmt: skip
        night1_s, first = t.wall_s, summary(t.stdout)["download"]
        c = first["counts"]
        print(f"  {t.wall_s:.1f} s; {c['ok']} ok of {c['rows']}; {c['by_reason']}", flush=True)
        if c["by_reason"].get("http_500") != len(flaky) or c["ok"] != args.rows - len(flaky):
            raise SystemExit("night 1 did not end with exactly the flaky rows failed (http_500)")
        for rnd, tool in alternated(list(TOOLS), args.repeats):
            settle(args.quiet_wait)
            work = s.work / f"{tool}-{rnd}"
            force: list[str] = []
            if tool == "alone":
                r = recipe(work / "r.yaml", work / "store", alone_manifest, rows_per_shard, args.workers)
                when = NIGHT1 + timedelta(days=1)
            else:
                # Night 1's store as it was: committed files are never written again, so links do.
                shutil.copytree(night1 / "store", work / "store", copy_function=os.link)
                r = recipe(work / "r.yaml", work / "store", manifest, rows_per_shard, args.workers)
                when = NIGHT1 + (timedelta(days=1) if tool == "retry" else timedelta(hours=2))
                force = ["--force"] if tool == "noop" else []
            before = web.stats()
            t = timed(
                s.children,
                [str(SHARDSMITH), "run", str(r), "--phase", args.phase, "--json", *force],
                env | {"SHARDSMITH_NOW": when.isoformat()}, REPO, work / "stderr.log", watch,
            )  # fmt: skip
            # Requests for pictures (by path: each is counted by path and by path with query).
            asked = web.stats()["hits"] - before["hits"]
            fetched = sum(n for p, n in asked.items() if "?" not in p and p.startswith(("/img/", "/flaky/")))
            dl = summary(t.stdout)["download"]
            ok = {"retry": dl["rows_recovered"], "alone": dl["counts"]["ok"], "noop": dl["rows_retried"]}[tool]
            if ok != (0 if tool == "noop" else len(flaky)) or (tool != "alone" and fetched != ok):
                raise SystemExit(f"{tool}: {ok} rows ok or retried, {fetched} pictures asked for; {len(flaky)} flaky")
            runs.append(
                {"tool": tool, "round": rnd, "wall": t.wall_s, "cpu": t.cpu_s, "fetched": fetched, "ok": ok,
                 "phase_s": dl["seconds"], "rows": dl["counts"]["rows"]}
            )  # fmt: skip
            print(
                f"  round {rnd} {tool:<6} {t.wall_s:6.1f} s wall, phase {dl['seconds']:.1f} s, {t.cpu_s:.1f} CPU s; "
                f"{fetched} pictures asked for; {ok} rows recovered of {len(flaky)}",
                flush=True,
            )
            if not args.keep:
                shutil.rmtree(work, ignore_errors=True)
        web.stop()
    meta = {
        "command": command("bench_retry.py", argv),
        "date": now(),
        "machine": machine(),
        "revision": revision(),
        "rows": args.rows,
        "shards": args.shards,
        "flaky": len(flaky),
        "phase": args.phase,
        "night1_s": night1_s,
        "pool_kb": sum((pool_dir / n).stat().st_size for n in names) / len(names) / 1e3,
        "workers": args.workers,
    }
    emit(report(runs, meta), args.markdown)
    return 0


def report(runs: list[dict], meta: dict) -> str:
    lines = [
        f"- command: `{meta['command']}`",
        f"- date: {meta['date']}; machine: {meta['machine']}; code: {meta['revision']}",
        f"- {meta['rows']:,} rows in {meta['shards']} chunks, {meta['flaky']:,} of them failing once on night 1 "
        f"(`http_500`, download.retries 0); pictures of {meta['pool_kb']:.0f} KB on average; "
        f"`--phase {meta['phase']}`, {meta['workers']} workers; night 1 took {meta['night1_s']:.0f} s (untimed)",
        "",
    ]
    lines += table(
        ["run", "round", "wall s", "phase s", "CPU s", "pictures asked for", "rows recovered / ok", "ledger rows"],
        [[r["tool"], r["round"], f"{r['wall']:.1f}", f"{r['phase_s']:.1f}", f"{r['cpu']:.1f}", r["fetched"], r["ok"],
          r["rows"]] for r in runs],
    )  # fmt: skip
    wall = {tool: med(r["wall"] for r in runs if r["tool"] == tool) for tool in TOOLS}
    phase = {tool: med(r["phase_s"] for r in runs if r["tool"] == tool) for tool in TOOLS}
    if wall["retry"] and wall["alone"]:
        ratio = wall["retry"] / wall["alone"]
        verdict = "within" if ratio <= TARGET else "over"
        lines += [
            "",
            f"Night 2 / the failed rows alone (medians): {ratio:.2f}x wall ({wall['retry']:.1f} s vs "
            f"{wall['alone']:.1f} s), {(phase['retry'] or 0) / (phase['alone'] or 1):.2f}x the download "
            f"phase's own seconds ({phase['retry']:.1f} s vs {phase['alone']:.1f} s); {verdict} issue 40's {TARGET}x.",
        ]
        if wall["noop"]:
            lines.append(
                f"A run over the same dataset with nothing due (`--force`): {wall['noop']:.1f} s wall, phase "
                f"{phase['noop']:.1f} s; what retrying adds to it: {wall['retry'] - wall['noop']:.1f} s wall, "
                f"{(phase['retry'] or 0) - (phase['noop'] or 0):.1f} s of the phase."
            )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench/bench_retry.py",
        description="Time the night after an outage (only the failed rows fetched again) beside fetching those rows alone.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--rows", type=int, default=100_000, help="manifest rows (e.g. 5000 for a quick run)")
    p.add_argument("--shards", type=int, default=100, help="chunks the rows are in")
    p.add_argument("--transient", type=float, default=0.02, help="share of the rows that fail once on night 1")
    p.add_argument("--phase", choices=("download", "validate"), default="download", help="the phase both runs run to")
    p.add_argument("--workers", type=int, default=2, help="Dask workers of each run")
    add_round_flags(p, "retry", repeats=3)
    args = p.parse_args(argv)
    if args.rows < 1 or args.shards < 1 or not 0 < args.transient < 1 or args.repeats < 1:
        p.error("--rows, --shards and --repeats must be at least 1, --transient between 0 and 1")
    return args


if __name__ == "__main__":
    sys.exit(main())
