"""Validate benchmark: manifest -> validated 256 px shards, shardsmith beside img2dataset's default run.

One invocation renders (or reuses) one distinct synthetic photo per URL, serves them on
loopback with ``python -m tasks.demo.webserver``, starts one Prefect server (not timed), and then
runs, alternating (the order flips every round), for ``--repeats`` rounds:

- ``shardsmith``: ``shardsmith run RECIPE --phase validate --json`` (download, then validate:
  decode with JPEG draft, EXIF orientation, RGB, resize, re-encode, pixel and perceptual
  hashes, dedup across the dataset, gate and report) with the recipe set to img2dataset's
  defaults: ``resize_mode: border``, ``image_size: 256``, JPEG at quality 95;
- ``i2d-default``: img2dataset with its own resize defaults (``--resize_mode border
  --image_size 256 --encode_quality 95 --encode_format jpg``, stated on the command line so a
  changed default cannot change the baseline): full OpenCV decode, resize, pad, re-encode.

Every URL is a distinct image, so shardsmith's dedup rejects nothing and both tools keep the
same samples. img2dataset lives in its own venv (``.bench/img2dataset-venv``, shared with
bench_download.py). Each run writes into a fresh folder, removed after it is measured.

CPU seconds are user+sys of the tool's whole process tree. While a run goes, the tree is also
sampled every 0.25 s, which splits its CPU by process (the CLI's own process, which also hosts
the Dask scheduler, versus the workers) and, for shardsmith, by phase, at the boundaries
Prefect logs (start-up, download, validate, teardown). Last, each tool's per-image work alone
(decode, resize, re-encode) is timed on the same files in one process, which separates the
image code from downloads, tars and orchestration.
"""

from __future__ import annotations

import argparse
import datetime as dt
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from harness.photos import ensure_unique_pool, write_manifest
from harness.procs import SAMPLE_S, Children, Session, run_json, settle, timed
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
from harness.servers import VENV_PY, child_env, prefect_env, serve
from harness.tools import (
    I2D_ENCODE_QUALITY,
    I2D_IMAGE_SIZE,
    I2D_RESIZE_MODE,
    I2D_VENV,
    REPO,
    ToolRun,
    add_tool_flags,
    ensure_img2dataset,
    first_image_size,
    i2d_command,
    i2d_env,
    i2d_outputs,
    run_command,
    spread,
    summary,
    write_recipe,
)

TOOLS = ("shardsmith", "i2d-default")
TOOL_LABELS = {
    "shardsmith": f"shardsmith download + validate ({I2D_RESIZE_MODE} {I2D_IMAGE_SIZE}, jpeg q{I2D_ENCODE_QUALITY}, dedup)",
    "i2d-default": f"img2dataset default ({I2D_RESIZE_MODE} {I2D_IMAGE_SIZE}, jpg q{I2D_ENCODE_QUALITY})",
}
PHASE_PARTS = ("start-up", "download", "between", "validate", "teardown")
# Prefect's console lines: "HH:MM:SS.mmm | INFO    | Flow run 'name' - message"
_LOG_LINE = re.compile(r"^(\d\d):(\d\d):(\d\d)\.(\d{3}) \| \w+\s*\| (.*)$")


def flow_marks(log: Path, started: float) -> dict[str, float]:
    """Wall-clock times (time.time()) at which the download and validate subflows began and finished.

    From Prefect's console lines: "Beginning subflow run 'NAME' for flow 'PHASE'", then the
    last line of "Flow run 'NAME'" ("Finished in state ..."). A subflow's span includes its
    gate and report, which the JSON's ``seconds`` leave out.
    """
    day = dt.datetime.fromtimestamp(started).replace(hour=0, minute=0, second=0, microsecond=0)
    names: dict[str, str] = {}
    marks: dict[str, float] = {}
    for line in log.read_text(errors="replace").splitlines():
        m = _LOG_LINE.match(line)
        if not m:
            continue
        t = (
            day + dt.timedelta(hours=int(m[1]), minutes=int(m[2]), seconds=int(m[3]), milliseconds=int(m[4]))
        ).timestamp()
        if t < started - 60:  # the run crossed midnight
            t += 86400
        begin = re.match(r"Flow run '([^']+)' - Beginning subflow run '[^']+' for flow '(download|validate)'", m[5])
        if begin:
            names[begin[1]] = begin[2]
            marks[f"{begin[2]}_start"] = t
            continue
        own = re.match(r"Flow run '([^']+)' - ", m[5])
        if own and own[1] in names:
            marks[f"{names[own[1]]}_end"] = t
    return marks


@dataclass
class Run(ToolRun):
    out_bytes: int = 0
    download_s: float | None = None
    validate_s: float | None = None
    cpu_by_role: dict[str, float] = field(default_factory=dict)
    cpu_by_phase: dict[str, float] = field(default_factory=dict)
    main_cpu_by_phase: dict[str, float] = field(default_factory=dict)
    wall_by_phase: dict[str, float] = field(default_factory=dict)
    sample_size: tuple[int, int] | None = None


def run_shardsmith(s: Session, args, rnd: int, manifest: Path, api: str | None, watch: dict[str, int]) -> Run:
    out_dir = s.work / f"shardsmith-{rnd}"
    out_dir.mkdir(parents=True)
    store, recipe, log = out_dir / "store", out_dir / "recipe.yaml", out_dir / "stderr.log"
    write_recipe(recipe, store, manifest, args.rows_per_shard, args.workers)
    t = timed(s.children, run_command(recipe, "validate"), prefect_env(s.work / "prefect-home", api), REPO, log, watch)
    result = summary(t.stdout)
    dl, val = result["download"], result["validate"]
    tars = [store / rel for rel in val["tars"]]
    run = Run(
        "shardsmith", rnd, ok=val["counts"]["ok"], rows=dl["counts"]["rows"], out_bytes=sum(p.stat().st_size for p in tars),
        phase_s=dl["seconds"] + val["seconds"], download_s=dl["seconds"], validate_s=val["seconds"],
        cpu_by_role=t.sampler.by_role(), sample_size=first_image_size(tars),
        extra={"download_by_reason": dl["counts"]["by_reason"], "validate_by_reason": val["counts"]["by_reason"], "duplicates": val["duplicates"]},
    )  # fmt: skip
    run.took(t)
    marks = flow_marks(log, t.started)
    if all(f"{p}_{e}" in marks for p in ("download", "validate") for e in ("start", "end")):
        bounds = [t.started, *(marks[f"{p}_{e}"] for p in ("download", "validate") for e in ("start", "end"))]
        bounds.append(t.started + t.wall_s)
        for name, a, b in zip(PHASE_PARTS, bounds, bounds[1:]):
            run.wall_by_phase[name] = b - a
            # The first sample is taken just after launch: CPU before it counts as start-up.
            a, b = a - (SAMPLE_S if name == "start-up" else 0), b + (1.0 if name == "teardown" else 0)
            run.cpu_by_phase[name] = t.sampler.cpu_between(a, b)
            run.main_cpu_by_phase[name] = t.sampler.cpu_between(a, b, column=2)
    if run.ok != run.rows:
        print(
            f"  warning: shardsmith: {run.rows - run.ok} rows not ok: download {dl['counts']['by_reason']}, validate {val['counts']['by_reason']}",
            flush=True,
        )
    return run


def run_img2dataset(children: Children, work: Path, args, rnd: int, manifest: Path, watch: dict[str, int]) -> Run:
    """img2dataset's default run into ``work``/i2d-default-ROUND (also bench_byo.py's maker of its input shards)."""
    out_dir = work / f"i2d-default-{rnd}"
    out_dir.mkdir(parents=True)
    cmd = i2d_command(
        manifest, out_dir / "out", args.workers, args.threads, args.rows_per_shard,
        "--resize_mode", I2D_RESIZE_MODE, "--image_size", str(I2D_IMAGE_SIZE),
        "--encode_quality", str(I2D_ENCODE_QUALITY), "--encode_format", "jpg", "--timeout", "20",
    )  # fmt: skip
    t = timed(children, cmd, i2d_env(), out_dir, out_dir / "stderr.log", watch)
    meta, phase = i2d_outputs(out_dir / "out", ["status"])
    statuses = meta.get("status", [])
    tars = sorted((out_dir / "out").glob("*.tar"))
    run = Run(
        "i2d-default", rnd, ok=sum(x == "success" for x in statuses), rows=len(statuses),
        out_bytes=sum(p.stat().st_size for p in tars), phase_s=phase, cpu_by_role=t.sampler.by_role(),
        sample_size=first_image_size(tars),
    )  # fmt: skip
    run.took(t, prefect=False)
    return run


# Each tool's per-image work (decode, resize to 256 px with a border, JPEG re-encode), timed in
# one process of its own venv with process_time: what the runs above spend per image, without
# downloads, tars, orchestration or contention. Prints {label: {ext: [images, CPU s]}}.
_KERNEL_LOOP = """
files = [Path(p) for p in sys.argv[1:]]
for f in files[:10]:
    one(f.read_bytes())
by = {}
for f in files:
    data = f.read_bytes()
    t = time.process_time()
    err = one(data)
    cpu = time.process_time() - t
    if err is not None:
        raise SystemExit(f"{f}: {err}")
    n, c = by.get(f.suffix[1:], (0, 0.0))
    by[f.suffix[1:]] = (n + 1, c + cpu)
print(json.dumps({LABEL: by}))
"""
_KERNEL_SHARDSMITH = f"""
import json, sys, time
from pathlib import Path
from tasks.policies.images import process_image
from tasks.formats.recipe_download import ImageRules
rules = ImageRules(resize_mode="{I2D_RESIZE_MODE}", image_size={I2D_IMAGE_SIZE}, output_format="jpeg", quality={I2D_ENCODE_QUALITY})
LABEL = "shardsmith process_image (Pillow, JPEG draft; EXIF, RGB, pixel sha256, resize, pHash, encode)"
def one(data):
    return process_image(data, rules).reason
{_KERNEL_LOOP}"""
_KERNEL_I2D = f"""
import io, json, sys, time
from pathlib import Path
from img2dataset.resizer import Resizer
r = Resizer(image_size={I2D_IMAGE_SIZE}, resize_mode="{I2D_RESIZE_MODE}", resize_only_if_bigger=False, encode_quality={I2D_ENCODE_QUALITY}, encode_format="jpg")
LABEL = "img2dataset Resizer (OpenCV decode, albumentations resize + pad, imencode)"
def one(data):
    return r(io.BytesIO(data))[-1]
{_KERNEL_LOOP}"""


def run_kernels(pool_dir: Path, names: list[str], tools: list[str]) -> dict[str, dict[str, tuple[int, float]]]:
    """CPU per image of each tool's image work on the same files (see _KERNEL_SHARDSMITH)."""
    files = [str(pool_dir / n) for n in names]
    out: dict[str, dict[str, tuple[int, float]]] = {}
    if "shardsmith" in tools:
        out.update(run_json([str(VENV_PY), "-c", _KERNEL_SHARDSMITH, *files], child_env(PYTHONPATH=str(REPO)), 1800))
    if "i2d-default" in tools:
        out.update(run_json([str(I2D_VENV / "bin" / "python"), "-c", _KERNEL_I2D, *files], i2d_env(), 1800))
    return out


def summarize(runs: list[Run], tools: list[str]) -> dict[str, dict]:
    out = {}
    for tool in tools:
        rs = [r for r in runs if r.tool == tool]
        if not rs:
            continue
        roles = sorted({k for r in rs for k in r.cpu_by_role})
        phases = [k for k in PHASE_PARTS if any(k in r.cpu_by_phase for r in rs)]
        out[tool] = spread(rs) | {
            "roles": {k: med(per_1k(r.cpu_by_role.get(k), r.ok) for r in rs) for k in roles},
            "phases": {k: med(per_1k(r.cpu_by_phase.get(k), r.ok) for r in rs) for k in phases},
            "phase_walls": {k: med(r.wall_by_phase.get(k) for r in rs) for k in phases},
            "phase_mains": {k: med(per_1k(r.main_cpu_by_phase.get(k), r.ok) for r in rs) for k in phases},
            "sizes": sorted({r.sample_size for r in rs if r.sample_size}),
        }
    return out


def report(runs: list[Run], tools: list[str], meta: dict, kernels: dict | None = None) -> str:
    """The per-run lines, the summary table and the ratios, as markdown."""
    s = summarize(runs, tools)
    lines = [
        f"- command: `{meta['command']}`",
        f"- date: {meta['date']}; machine: {meta['machine']}; load average before: {meta['load_before']}; code: {meta['revision']}",
        f"- corpus: {meta['rows']} URLs, each a distinct synthetic image ({meta['url_mb']:.0f} MB, mean {meta['mean_kb']:.0f} KB, "
        "200..2000 px; ~80% JPEG, 10% PNG, 10% WebP), served on loopback",
        f"- both tools: {meta['workers']} processes, {meta['rows_per_shard']} rows per shard, resize_mode {I2D_RESIZE_MODE}, "
        f"image_size {I2D_IMAGE_SIZE}, JPEG quality {I2D_ENCODE_QUALITY}; img2dataset --thread_count {meta['threads']}; "
        "shardsmith: recipe defaults otherwise (dedup exact + near on, gates, HTML report)",
        "",
        "Per run (wall = whole command; phase = shardsmith's JSON download.seconds + validate.seconds / img2dataset's first shard "
        "start to last shard end; CPU = the tool's process tree; other load = CPU used meanwhile outside the benchmark, in cores):",
        "",
    ]
    lines += table(
        ["tool", "round", "wall s", "phase s (download + validate)", "ok / rows", "samples/s (wall)", "samples/s (phase)",
         "CPU s / 1k", "Prefect server CPU s / 1k", "image server CPU s / 1k", "output KB / sample", "first image",
         "other load, cores"],
        [[r.tool, r.round, f"{r.wall_s:.1f}",
          fmt(r.phase_s) + (f" ({r.download_s:.1f} + {r.validate_s:.1f})" if r.download_s is not None else ""),
          f"{r.ok} / {r.rows}", f"{r.rate:.1f}", fmt(r.phase_rate), f"{r.cpu_per_1k:.2f}",
          fmt(per_1k(r.prefect_cpu_s, r.ok), ".2f"), f"{per_1k(r.server_cpu_s, r.ok):.2f}",
          f"{r.out_bytes / max(r.ok, 1) / 1e3:.1f}", "x".join(map(str, r.sample_size)) if r.sample_size else "-",
          f"{r.other_load:.2f}"] for r in runs],
    )  # fmt: skip
    lines += ["", "Summary (median over rounds; best in brackets):", ""]
    lines += table(
        ["tool", "runs", "wall s", "samples/s (wall)", "samples/s (phase)", "CPU s / 1k samples", "ok"],
        [[TOOL_LABELS[tool], v["n"], f"{v['wall']:.1f} ({v['wall_best']:.1f})", f"{v['rate']:.1f} ({v['rate_best']:.1f})",
          fmt(v["phase_rate"]), f"{v['cpu_1k']:.2f} ({v['cpu_1k_best']:.2f})",
          f"{'/'.join(map(str, v['ok']))} of {v['rows']}"] for tool, v in s.items()],
    )  # fmt: skip
    lines += [
        "",
        "Where the CPU goes (CPU s per 1k samples, medians; sampled every 0.25 s, so parts need not add up to the total; "
        "main = the command's own process: for shardsmith the flow, the Dask scheduler, gates and reports, for img2dataset "
        "the reader and the pool; workers = the Dask workers / img2dataset's download processes):",
        "",
    ]
    for tool, v in s.items():
        lines.append(f"- {tool}: by process: " + ", ".join(f"{k} {fmt(x, '.2f')}" for k, x in v["roles"].items()))
        if v["phases"]:
            phases = ", ".join(
                f"{k} {fmt(x, '.2f')} (main {fmt(v['phase_mains'][k], '.2f')}; {fmt(v['phase_walls'][k])} s wall)"
                for k, x in v["phases"].items()
            )
            lines.append(
                f"- {tool}: by part of the run (subflow spans from Prefect's log lines, gates and reports included): {phases}"
            )
    if kernels:
        exts = sorted(
            {e for by in kernels.values() for e in by},
            key=lambda e: -max(by.get(e, (0, 0))[0] for by in kernels.values()),
        )
        counts = next(iter(kernels.values()))
        mix = ", ".join(f"{counts[e][0]} {e}" for e in exts if e in counts)
        lines += [
            "",
            f"Per-image work alone (CPU ms per image, one process, no downloads or tars; the corpus's first {meta['kernel_images']} images: {mix}):",
            "",
        ]
        lines += table(
            ["code", *exts, "all"],
            [[label, *(fmt(1000 * by[e][1] / by[e][0]) if e in by else "-" for e in exts),
              f"{1000 * sum(c for _, c in by.values()) / max(sum(n for n, _ in by.values()), 1):.1f}"]
             for label, by in kernels.items()],
        )  # fmt: skip
    if "shardsmith" in s and "i2d-default" in s:
        a, b = s["shardsmith"], s["i2d-default"]
        phase = a["phase_rate"] / b["phase_rate"] if a["phase_rate"] and b["phase_rate"] else None
        lines += [
            "",
            "Ratios, shardsmith / img2dataset default (medians; > 1 means shardsmith is faster or, for CPU, cheaper):",
            "",
            f"- samples/s, whole command: {a['rate'] / b['rate']:.2f}x ({a['rate']:.1f} vs {b['rate']:.1f}; target 1.5x)",
            f"- samples/s, phases only: {fmt(phase, '.2f')}x ({fmt(a['phase_rate'])} vs {fmt(b['phase_rate'])})",
            f"- CPU per sample: {b['cpu_1k'] / a['cpu_1k']:.2f}x ({a['cpu_1k']:.2f} vs {b['cpu_1k']:.2f} CPU s / 1k)",
        ]
        oks = sorted({ok for v in s.values() for ok in v["ok"]})
        if oks and oks[-1] - oks[0] > 5:
            lines.append(f"- WARNING: the tools kept different numbers of samples: {oks}")
        sizes = {size for v in s.values() for size in v["sizes"]}
        if len(sizes) > 1:
            lines.append(f"- WARNING: the tools' first images differ in size: {sorted(sizes)}")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench/bench_validate.py",
        description="Time shardsmith's download + validate phases (256 px border resize) beside img2dataset's default run, and print ratios.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--rows", type=int, default=4000, help="URLs in the manifest, each a distinct image (e.g. 300 for a smoke run)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the image pool")
    add_round_flags(p, "validate", repeats=2)
    add_tool_flags(p, rows_per_shard=500)
    p.add_argument("--tools", default=",".join(TOOLS), help=f"comma-separated subset of {','.join(TOOLS)}")
    p.add_argument(
        "--kernel-images",
        type=int,
        default=300,
        help="after the runs, time each tool's per-image work alone on this many of the images (0: skip)",
    )
    args = p.parse_args(argv)
    args.tools = pick_tools(p, args.tools, TOOLS)
    if args.rows < 1 or args.repeats < 1:
        p.error("--rows and --repeats must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    pool_dir, sizes = ensure_unique_pool(args.rows, args.seed)
    if "i2d-default" in args.tools:
        ensure_img2dataset()
    runs: list[Run] = []
    kernels = None
    with Session("validate", args.keep) as s:
        loop = serve(s, pool_dir, prefect="shardsmith" in args.tools)
        manifest = s.work / "manifest.parquet"
        write_manifest(manifest, [f"{loop.base_url}/img/{name}" for name in sizes])
        print(
            f"{args.rows} URLs at {loop.base_url}, {sum(sizes.values()) / 1e6:.0f} MB; {args.repeats} round(s) of {', '.join(args.tools)}",
            flush=True,
        )
        for rnd, tool in alternated(args.tools, args.repeats):
            settle(args.quiet_wait)
            if tool == "shardsmith":
                run = run_shardsmith(s, args, rnd, manifest, loop.api, loop.watch)
            else:
                run = run_img2dataset(s.children, s.work, args, rnd, manifest, {"server": loop.watch["server"]})
            runs.append(run)
            phase = f", phase {run.phase_s:.1f} s = {run.phase_rate:.1f} samples/s" if run.phase_s else ""
            print(
                f"  round {rnd} {tool:<12} {run.wall_s:6.1f} s wall = {run.rate:6.1f} samples/s{phase}; "
                f"{run.cpu_per_1k:.2f} CPU s/1k; {run.ok}/{run.rows} ok; other load {run.other_load:.2f} cores",
                flush=True,
            )
            if not args.keep:
                shutil.rmtree(s.work / f"{tool}-{rnd}", ignore_errors=True)
        if args.kernel_images > 0:
            settle(args.quiet_wait)
            print(f"timing each tool's per-image work on {min(args.kernel_images, args.rows)} images ...", flush=True)
            kernels = run_kernels(pool_dir, list(sizes)[: args.kernel_images], args.tools)
    meta = {
        "revision": revision(),
        "command": command("bench_validate.py", argv),
        "date": now(),
        "machine": machine(),
        "load_before": s.load_before,
        "rows": args.rows,
        "url_mb": sum(sizes.values()) / 1e6,
        "mean_kb": sum(sizes.values()) / len(sizes) / 1e3,
        "workers": args.workers,
        "threads": args.threads,
        "rows_per_shard": args.rows_per_shard,
        "kernel_images": min(args.kernel_images, args.rows),
    }
    emit(report(runs, args.tools, meta, kernels), args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
