"""Download benchmark: shardsmith's download phase beside img2dataset on the same loopback URLs.

One invocation generates (or reuses) a pool of synthetic photos, serves them on loopback with
``python -m tasks.demo.webserver``, starts one Prefect server, and then runs, alternating (the
order flips every round), for ``--repeats`` rounds:

- ``shardsmith``: ``shardsmith run RECIPE --phase download --json`` (Dask LocalCluster);
- ``i2d-reencode``: img2dataset with ``--resize_mode no`` (it still decodes and re-encodes
  every image: more work than shardsmith does);
- ``i2d-raw``: img2dataset with ``--resize_mode no --disable_all_reencoding True`` (bytes
  stored as fetched: the same work as shardsmith's download phase).

img2dataset lives in its own venv (``.bench/img2dataset-venv``, made on first use), never in
the project's dependencies. Each run writes into a fresh folder, removed after it is measured.

CPU seconds are user+sys of the tool's whole process tree (``harness.procs.timed``). The image
server and the Prefect server are long-lived and not counted there; their CPU during each run
is shown separately, since both take cores from the tool on a small machine. So is the CPU that
other work on the machine used meanwhile; before each run the script waits (``--quiet-wait``)
for that to settle, since a shared 2-core machine is the usual place this runs.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from harness.photos import ensure_pool, write_manifest
from harness.procs import Session, settle, timed
from harness.report import (
    add_round_flags,
    alternated,
    command,
    emit,
    fmt,
    machine,
    med,
    now,
    per_1k,
    pick_tools,
    revision,
    table,
)
from harness.servers import prefect_env, serve
from harness.tools import (
    REPO,
    ToolRun,
    add_tool_flags,
    ensure_img2dataset,
    i2d_command,
    i2d_env,
    i2d_outputs,
    run_command,
    spread,
    summary,
)

TOOLS = ("shardsmith", "i2d-reencode", "i2d-raw")
TOOL_LABELS = {
    "shardsmith": "shardsmith download phase",
    "i2d-reencode": "img2dataset resize_mode=no (decode + re-encode)",
    "i2d-raw": "img2dataset resize_mode=no, disable_all_reencoding (bytes as fetched)",
}


@dataclass
class Run(ToolRun):
    bytes: int = 0  # of the samples kept, as fetched

    @property
    def mb_s(self) -> float:
        return self.bytes / 1e6 / self.wall_s


def write_urls(path: Path, base_url: str, sizes: dict[str, int], rows: int, seed: int) -> int:
    """A parquet of ``rows`` distinct URLs over the pool (``?u=ROW``); returns their total bytes."""
    import numpy as np

    names = sorted(sizes)
    picks = np.random.default_rng([seed, 1]).integers(0, len(names), size=rows)
    urls = [f"{base_url}/img/{names[k]}?u={i}" for i, k in enumerate(picks)]
    write_manifest(path, urls, license=["cc-by-4.0"] * rows)
    return int(sum(sizes[names[k]] for k in picks))


def run_shardsmith(s: Session, args, rnd: int, manifest: Path, api: str | None, watch: dict[str, int]) -> Run:
    out_dir = s.work / f"shardsmith-{rnd}"
    out_dir.mkdir(parents=True)
    recipe = out_dir / "recipe.yaml"
    recipe.write_text(
        "dataset: bench\nkind: pretraining\n"
        f"storage: {out_dir / 'store'}\n"
        f"sources:\n  - name: bench\n    manifest: {manifest}\n    rows_per_shard: {args.rows_per_shard}\n"
        'download:\n  network:\n    allowed_networks: ["127.0.0.1/32"]\n    any_port: true\n'
        f"execution:\n  cluster: local\n  workers: {args.workers}\n"
    )
    env = prefect_env(s.work / "prefect-home", api)
    t = timed(s.children, run_command(recipe, "download"), env, REPO, out_dir / "stderr.log", watch)
    dl = summary(t.stdout)["download"]
    c = dl["counts"]
    if c["ok"] != c["rows"]:
        print(f"  warning: shardsmith: {c['rows'] - c['ok']} rows not ok: {c['by_reason']}", flush=True)
    run = Run("shardsmith", rnd, ok=c["ok"], rows=c["rows"], bytes=c["bytes"], phase_s=dl["seconds"])
    run.took(t)
    run.extra = {"by_reason": c["by_reason"], "shards": dl["shards"], "json_samples_per_s": dl["samples_per_s"]}
    return run


def run_img2dataset(s: Session, args, tool: str, rnd: int, manifest: Path, sizes: dict, watch: dict[str, int]) -> Run:
    out_dir = s.work / f"{tool}-{rnd}"
    out_dir.mkdir(parents=True)
    cmd = i2d_command(
        manifest, out_dir / "out", args.workers, args.threads, args.rows_per_shard,
        "--resize_mode", "no", "--disable_all_reencoding", str(tool == "i2d-raw"), "--timeout", "20",
    )  # fmt: skip
    t = timed(s.children, cmd, i2d_env(), out_dir, out_dir / "stderr.log", watch)
    meta, phase = i2d_outputs(out_dir / "out", ["url", "status"])
    ok = [url for url, status in zip(meta.get("url", []), meta.get("status", [])) if status == "success"]
    nbytes = sum(sizes[url.rsplit("/", 1)[1].split("?", 1)[0]] for url in ok)
    run = Run(tool, rnd, ok=len(ok), rows=len(meta.get("status", [])), bytes=nbytes, phase_s=phase)
    run.took(t, prefect=False)
    return run


def report(runs: list[Run], tools: list[str], meta: dict) -> str:
    """The per-run lines, the summary table and the ratios, as markdown."""
    lines = [
        f"- command: `{meta['command']}`",
        f"- date: {meta['date']}; machine: {meta['machine']}; load average before: {meta['load_before']}; code: {meta['revision']}",
        f"- corpus: {meta['rows']} URLs over a pool of {meta['pool']} images ({meta['pool_mb']:.0f} MB, mean "
        f"{meta['pool_mean_kb']:.0f} KB, 200..2000 px; 80% JPEG, 10% PNG, 10% WebP); {meta['url_mb']:.0f} MB behind the URLs",
        f"- both tools: {meta['workers']} processes, {meta['rows_per_shard']} rows per shard; img2dataset --thread_count {meta['threads']}; "
        "shardsmith's recipe defaults (max_inflight 64, per_host 16)",
        "",
        "Per run (wall = whole command; phase = shardsmith's JSON `seconds` / img2dataset's first shard start to last shard end;",
        "CPU = the tool's process tree; other load = CPU used meanwhile by processes outside the benchmark, in cores):",
        "",
    ]
    lines += table(
        ["tool", "round", "wall s", "phase s", "ok / rows", "samples/s (wall)", "samples/s (phase)", "MB/s (wall)",
         "CPU s / 1k", "image server CPU s / 1k", "Prefect server CPU s / 1k", "other load, cores"],
        [[r.tool, r.round, f"{r.wall_s:.1f}", fmt(r.phase_s), f"{r.ok} / {r.rows}", f"{r.rate:.1f}", fmt(r.phase_rate),
          f"{r.mb_s:.1f}", f"{r.cpu_per_1k:.2f}", f"{per_1k(r.server_cpu_s, r.ok):.2f}",
          fmt(per_1k(r.prefect_cpu_s, r.ok), ".2f"), f"{r.other_load:.2f}"] for r in runs],
    )  # fmt: skip
    s = {
        tool: spread(rs) | {"mb_s": med(r.mb_s for r in rs)}
        for tool in tools
        if (rs := [r for r in runs if r.tool == tool])
    }
    lines += ["", "Summary (median over rounds; best in brackets):", ""]
    lines += table(
        ["tool", "runs", "wall s", "samples/s (wall)", "samples/s (phase)", "MB/s (wall)", "CPU s / 1k samples", "ok"],
        [[TOOL_LABELS[tool], v["n"], f"{v['wall']:.1f} ({v['wall_best']:.1f})", f"{v['rate']:.1f} ({v['rate_best']:.1f})",
          f"{fmt(v['phase_rate'])} ({fmt(v['phase_rate_best'])})", f"{v['mb_s']:.1f}",
          f"{v['cpu_1k']:.2f} ({v['cpu_1k_best']:.2f})", f"{'/'.join(map(str, v['ok']))} of {v['rows']}"]
         for tool, v in s.items()],
    )  # fmt: skip
    if "shardsmith" in s:
        a = s["shardsmith"]
        lines += [
            "",
            "Ratios, shardsmith / baseline (medians; > 1 means shardsmith is faster or, for CPU, cheaper):",
            "",
        ]
        for base in ("i2d-reencode", "i2d-raw"):
            if base in s:
                b = s[base]
                phase = a["phase_rate"] / b["phase_rate"] if a["phase_rate"] and b["phase_rate"] else None
                lines.append(
                    f"- vs {TOOL_LABELS[base]}: samples/s {a['rate'] / b['rate']:.2f}x whole command, "
                    f"{fmt(phase, '.2f')}x phase; CPU per sample {b['cpu_1k'] / a['cpu_1k']:.2f}x "
                    f"({a['cpu_1k']:.2f} vs {b['cpu_1k']:.2f} CPU s / 1k)"
                )
        oks = sorted({ok for v in s.values() for ok in v["ok"]})
        if oks and oks[-1] - oks[0] > 5:
            lines.append(f"- WARNING: the tools kept different numbers of samples: {oks}")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench/bench_download.py",
        description="Time shardsmith's download phase beside img2dataset on the same loopback URLs, and print ratios.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--rows", type=int, default=10_000, help="URLs in the manifest (e.g. 500 for a smoke run)")
    p.add_argument("--pool", type=int, default=400, help="distinct image files behind the URLs")
    p.add_argument("--seed", type=int, default=0, help="seed of the image pool and of the URL-to-image mapping")
    add_round_flags(p, "download", repeats=3)
    add_tool_flags(p, rows_per_shard=500)
    p.add_argument("--tools", default=",".join(TOOLS), help=f"comma-separated subset of {','.join(TOOLS)}")
    args = p.parse_args(argv)
    args.tools = pick_tools(p, args.tools, TOOLS)
    if args.rows < 1 or args.pool < 1 or args.repeats < 1:
        p.error("--rows, --pool and --repeats must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    pool_dir, sizes = ensure_pool(args.pool, args.seed)
    if any(t.startswith("i2d") for t in args.tools):
        ensure_img2dataset()
    runs: list[Run] = []
    with Session("download", args.keep) as s:
        loop = serve(s, pool_dir, prefect="shardsmith" in args.tools)
        manifest = s.work / "manifest.parquet"
        url_bytes = write_urls(manifest, loop.base_url, sizes, args.rows, args.seed)
        print(
            f"{args.rows} URLs at {loop.base_url}, {url_bytes / 1e6:.0f} MB; {args.repeats} round(s) of {', '.join(args.tools)}",
            flush=True,
        )
        for rnd, tool in alternated(args.tools, args.repeats):
            settle(args.quiet_wait)
            if tool == "shardsmith":
                run = run_shardsmith(s, args, rnd, manifest, loop.api, loop.watch)
            else:
                run = run_img2dataset(s, args, tool, rnd, manifest, sizes, {"server": loop.watch["server"]})
            runs.append(run)
            phase = f", phase {run.phase_s:.1f} s = {run.phase_rate:.1f} samples/s" if run.phase_s else ""
            print(
                f"  round {rnd} {tool:<12} {run.wall_s:6.1f} s wall = {run.rate:6.1f} samples/s{phase}; "
                f"{run.mb_s:.1f} MB/s; {run.cpu_per_1k:.2f} CPU s/1k; {run.ok}/{run.rows} ok; other load {run.other_load:.2f} cores",
                flush=True,
            )
            if not args.keep:
                shutil.rmtree(s.work / f"{tool}-{rnd}", ignore_errors=True)
    meta = {
        "revision": revision(),
        "command": command("bench_download.py", argv),
        "date": now(),
        "machine": machine(),
        "load_before": s.load_before,
        "rows": args.rows,
        "pool": args.pool,
        "pool_mb": sum(sizes.values()) / 1e6,
        "pool_mean_kb": sum(sizes.values()) / len(sizes) / 1e3,
        "url_mb": url_bytes / 1e6,
        "workers": args.workers,
        "threads": args.threads,
        "rows_per_shard": args.rows_per_shard,
    }
    emit(report(runs, args.tools, meta), args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
