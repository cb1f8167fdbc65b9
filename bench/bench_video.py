"""Video clips, issue 34: shardsmith's download + cut + transcode beside video2dataset's on the same loopback videos.

One invocation makes (or reuses) a corpus of synthetic videos (``--videos``, 6..12 s, 320x180,
25 fps H.264 with a keyframe a second, 0..3 scene cuts at any frame; bench/video_tools.py),
serves it on loopback with ``python -m tasks.demo.webserver`` and runs, alternating (the order
flips every round), for ``--repeats`` rounds:

- ``ss-equal``: ``shardsmith run RECIPE --phase validate --json`` with ``validate.video.clips``
  set to the equal settings: scenes, 1..10 s, long side ``--side``, ``--fps``, crf 23;
  ``--rows-per-shard`` rows per shard, ``--workers`` workers;
- ``v2d-equal``: video2dataset 1.3.0 with CutDetectionSubsampler (cuts are clips),
  ClippingSubsampler (1..10 s, ``precision: exact``: re-encoded at the cuts, frame-exact as
  shardsmith's), ResolutionSubsampler (the height that gives the same size), FrameSubsampler
  (``--fps``); ``--rows-per-shard`` samples per shard, ``--workers`` processes;
- ``v2d-keyframe``: the same with ``precision: keyframe_adjusted`` (cuts moved to the source's
  keyframes and copied, not re-encoded: video2dataset's faster clipping, other clips);
- ``ss-default``: shardsmith's recipe with ``media: video`` and nothing else set (clips: scenes,
  1..10 s, long side 640, the source's fps, crf 23; 1,000 rows per shard, a worker per core);
- ``v2d-default``: video2dataset with its default config (no subsampling: each video stored as
  fetched; 16 processes, 32 threads, 1,000 samples per shard).

Wall seconds cover the whole command; CPU is the command's process tree (FFmpeg's processes,
Dask's and Prefect's included); peak RSS is the tree's, sampled. Clips are counted in each
tool's output tars and read back with PyAV (first round of each tool): codec, size, rate, length,
and the source span each claims against the corpus's planned scenes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.procs import REPO, Session, TreeSampler, settle, timed  # noqa: E402
from harness.report import (  # noqa: E402
    add_round_flags,
    alternated,
    command,
    emit,
    machine,
    now,
    pick_tools,
    revision,
)
from harness.servers import VENV_PY, child_env, prefect_env, serve  # noqa: E402
from harness.tools import ToolRun, add_tool_flags, i2d_outputs, summary  # noqa: E402
from video_checks import check_clips, clips_in_tars, planned_spans, read_clip  # noqa: E402
from video_tools import (  # noqa: E402
    FPS,
    SIZE,
    ensure_corpus,
    ensure_video2dataset,
    plan,
    pyav_version,
    scaled,
    shardsmith_recipe,
    v2d_command,
    v2d_config,
    v2d_versions,
    write_manifest,
)

TOOLS = ("ss-equal", "ss-warm", "v2d-equal", "v2d-keyframe", "ss-default", "v2d-default")
LABELS = {
    "ss-equal": "shardsmith, equal settings",
    "ss-warm": "shardsmith, equal settings, through the warm service",
    "v2d-equal": "video2dataset, equal settings (precision exact)",
    "v2d-keyframe": "video2dataset, equal but precision keyframe_adjusted",
    "ss-default": "shardsmith, recipe defaults",
    "v2d-default": "video2dataset, default config (no clipping)",
}
PAIRS = (
    ("ss-equal", "v2d-equal"),
    ("ss-warm", "v2d-equal"),
    ("ss-equal", "v2d-keyframe"),
    ("ss-default", "v2d-default"),
)
TARGET = 1.5  # issue 34: shardsmith's clips/s at least 1.5x video2dataset's on equal settings


@dataclass
class Run(ToolRun):
    videos: int = 0  # videos that gave at least one clip (or were stored)
    check: dict = field(default_factory=dict)

    @property
    def cpu_per_clip(self) -> float:
        return self.cpu_s / max(self.ok, 1)

    @property
    def video_rate(self) -> float:
        return self.rows / self.wall_s if self.wall_s else 0.0


def equal_clips(args) -> dict:
    clips = {"split": "scenes", "min_s": 1, "max_s": 10, "max_side": args.side, "crf": 23}
    return clips | ({"fps": args.fps} if args.fps else {})


def run_shardsmith(s: Session, args, tool: str, rnd: int, manifest: Path, env: dict, watch: dict) -> Run:
    """``shardsmith run RECIPE --phase validate --json``; ``watch`` may name the warm service
    (``warm``), whose CPU and peak RSS during the run count as the command's."""
    out = s.work / f"{tool}-{rnd}"
    out.mkdir(parents=True)
    recipe = out / "recipe.yaml"
    if tool == "ss-default":
        shardsmith_recipe(recipe, out / "store", manifest, None, None, None)
    else:
        shardsmith_recipe(recipe, out / "store", manifest, equal_clips(args), args.rows_per_shard, args.workers)
    cmd = [str(VENV_PY), "-m", "cli", "run", str(recipe), "--phase", "validate", "--json"]
    with TreeSampler(watch["warm"]) if "warm" in watch else contextlib.nullcontext() as service:
        t = timed(s.children, cmd, env, REPO, out / "stderr.log", watch, args.run_timeout)
    result = summary(t.stdout)
    dl, val = result["download"], result["validate"]
    n, clips = clips_in_tars([out / "store" / p for p in val["tars"]])
    if n != val["counts"]["ok"]:
        print(f"  warning: {tool}: {val['counts']['ok']} clips ok in the ledgers, {n} mp4s in the tars", flush=True)
    if val["counts"]["ok"] != val["counts"]["rows"] or dl["counts"]["ok"] != dl["counts"]["rows"]:
        print(f"  warning: {tool}: rows not ok: {dl['counts']['by_reason']} {val['counts']['by_reason']}", flush=True)
    run = Run(tool, rnd, ok=n, rows=dl["counts"]["rows"], phase_s=dl["seconds"] + val["seconds"])
    run.videos = len({meta.get("video") for _, _, meta in clips})
    run.took(t, prefect="prefect" in watch)
    run.extra |= {"clips": clips, "split": split(t)}
    if service is not None:
        run.cpu_s += t.watched["warm"]
        run.peak_rss_mb += service.peak_rss / 2**20
        run.extra["split"] = (*run.extra["split"][:2], run.extra["split"][2] + t.watched["warm"])
    return run


def run_v2d(s: Session, args, tool: str, rnd: int, manifest: Path, watch: dict) -> Run:
    out = s.work / f"{tool}-{rnd}"
    (out / "tmp").mkdir(parents=True)
    config = None
    if tool != "v2d-default":
        config = str(out / "config.yaml")
        precision = "exact" if tool == "v2d-equal" else "keyframe_adjusted"
        v2d_config(Path(config), args.side, args.fps, precision, args.rows_per_shard, args.workers, args.threads)
    cmd = v2d_command(manifest, out / "out", out / "tmp", config)
    env = child_env(WANDB_MODE="disabled", WANDB_SILENT="true", TQDM_DISABLE="1")
    t = timed(s.children, cmd, env, out, out / "stderr.log", watch, args.run_timeout)
    meta, phase = i2d_outputs(out / "out", ["url", "status"])
    n, clips = clips_in_tars(sorted((out / "out").glob("*.tar")))
    failed = sum(1 for x in meta.get("status", []) if x != "success")
    if failed:
        print(f"  warning: {tool}: {failed} rows not 'success' in its parquet", flush=True)
    run = Run(tool, rnd, ok=n, rows=args.videos, phase_s=phase)
    run.videos = len({m.get("url") for _, _, m in clips})
    run.took(t, prefect=False)
    run.extra |= {"clips": clips, "split": split(t)}
    return run


def split(t) -> tuple[float, float, float]:
    """CPU seconds of the command's own process, of its multiprocessing children (Dask's workers
    and nannies; video2dataset's pool and logger), sampled, and the rest of the tree (Prefect's
    server; FFmpeg's ffmpeg and ffprobe runs, too short-lived to sample): the total less both."""
    roles = t.sampler.by_role()
    main, workers = roles.get("main", 0.0), roles.get("workers", 0.0)
    return main, workers, max(0.0, t.cpu_s - main - workers)


def check(run: Run, args) -> dict:
    """Read every clip back and compare it with what was asked and with the corpus's plan."""
    if run.tool == "ss-default":  # shardsmith's defaults: long side 640 (never upscaled), the source's fps
        width, height, fps = *scaled(640), float(FPS)
    elif run.tool == "v2d-default":  # the videos as fetched
        width, height, fps = *SIZE, float(FPS)
    else:
        width, height, fps = *scaled(args.side), float(args.fps or FPS)
    spans = None if run.tool == "v2d-default" else planned_spans(args.seed, args.videos)
    facts = [read_clip(key, mp4, meta) for key, mp4, meta in run.extra["clips"]]
    out = check_clips(facts, width, height, fps, spans)
    out["expected"] = args.videos if spans is None else sum(len(v) for v in spans.values())
    out["want"] = f"{width}x{height} H.264 {fps:g} fps"
    return out


def report(runs: list[Run], tools: list[str], meta: dict) -> str:
    from video_report import render

    return render(runs, tools, meta, LABELS, PAIRS, TARGET)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench/bench_video.py",
        description="Time shardsmith's video clipping beside video2dataset's on the same loopback videos, and print ratios.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--videos", type=int, default=40, help="videos in the manifest (6..12 s each)")
    p.add_argument("--seed", type=int, default=0, help="seed of the corpus")
    p.add_argument("--side", type=int, default=256, help="equal settings: the clips' long side")
    p.add_argument("--fps", type=float, default=10.0, help="equal settings: the clips' frame rate (0: the source's)")
    add_tool_flags(p, rows_per_shard=5, baseline="video2dataset", threads=32)  # its default thread_count
    p.add_argument("--prefect", choices=("own", "server"), default="own",
                   help="own: each shardsmith command starts its Prefect server (as users run it); server: one is started beforehand")  # fmt: skip
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed first run of each program on 4 videos")
    p.add_argument("--run-timeout", type=float, default=1800, help="stop a command after this many seconds")
    add_round_flags(p, "video", repeats=3, quiet_wait=30.0)
    p.add_argument("--tools", default=",".join(TOOLS), help=f"comma-separated subset of {','.join(TOOLS)}")
    args = p.parse_args(argv)
    args.tools = pick_tools(p, args.tools, TOOLS)
    if args.videos < 1 or args.repeats < 1 or args.rows_per_shard < 1 or args.workers < 1:
        p.error("--videos, --repeats, --rows-per-shard and --workers must be at least 1")
    args.fps = args.fps or None
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    pool, sizes = ensure_corpus(args.videos, args.seed)
    names = sorted(sizes)[: args.videos]
    if any(t.startswith("v2d") for t in args.tools):
        ensure_video2dataset()
    with Session("video", args.keep) as s:
        loop = serve(s, pool, prefect=args.prefect == "server")
        manifest, small = s.work / "manifest.parquet", s.work / "warmup.parquet"
        write_manifest(manifest, [f"{loop.base_url}/img/{n}" for n in names])
        write_manifest(small, [f"{loop.base_url}/img/{n}" for n in names[:4]])
        if not args.no_warmup:
            # One untimed run of each program: Prefect's database, and every import in the page cache.
            firsts = [next((t for t in args.tools if t.startswith(p)), None) for p in ("ss-", "v2d-")]
            for tool in [t for t in firsts if t]:
                print(f"warm-up (not timed): {tool} on 4 videos", flush=True)
                _run(s, args, tool, 0, small, loop)
                shutil.rmtree(s.work / f"{tool}-0", ignore_errors=True)
        warm = None
        try:
            if "ss-warm" in args.tools:
                warm = start_warm(s, args, small, loop)
            print(f"{args.videos} videos at {loop.base_url}; {args.repeats} round(s) of {', '.join(args.tools)}")
            runs = rounds(s, args, manifest, loop, warm)
        finally:
            stop_warm(warm)
    meta = {
        "revision": revision(),
        "command": command("bench_video.py", argv),
        "date": now(),
        "machine": machine(memory=True),
        "load_before": s.load_before,
        "videos": args.videos,
        "corpus_mb": sum(sizes[n] for n in names) / 1e6,
        "seconds": sum(plan(args.seed, i)[0] for i in range(args.videos)) / FPS,
        "args": args,
        "versions": f"{v2d_versions() if any(t.startswith('v2d') for t in args.tools) else '-'}; shardsmith: {pyav_version()}",
    }
    emit(report(runs, args.tools, meta), args.markdown)
    return 0


def rounds(s: Session, args, manifest: Path, loop, warm: dict | None) -> list[Run]:
    """The timed runs, the tools alternated; each tool's first run's clips are checked."""
    runs: list[Run] = []
    for rnd, tool in alternated(args.tools, args.repeats):
        settle(args.quiet_wait)
        run = _run(s, args, tool, rnd, manifest, loop, warm)
        if not any(r.tool == tool for r in runs):
            run.check = check(run, args)
        run.extra.pop("clips", None)
        runs.append(run)
        phase = f", phase {run.phase_s:.1f} s" if run.phase_s else ""
        print(
            f"  round {rnd} {tool:<12} {run.wall_s:6.1f} s wall{phase}: {run.ok} clips of {run.videos}/{run.rows} "
            f"videos, {run.rate:.2f} clips/s, {run.cpu_per_clip:.2f} CPU s/clip, peak {run.peak_rss_mb:.0f} MB; "
            f"other load {run.other_load:.2f} cores",
            flush=True,
        )
        if not args.keep:
            shutil.rmtree(s.work / f"{tool}-{rnd}", ignore_errors=True)
    return runs


def _run(s: Session, args, tool: str, rnd: int, manifest: Path, loop, warm: dict | None = None) -> Run:
    try:
        if tool.startswith("ss"):
            home = s.work / "prefect-home"
            if tool == "ss-warm" and warm is not None:
                return run_shardsmith(s, args, tool, rnd, manifest, warm["env"], loop.watch | {"warm": warm["pid"]})
            return run_shardsmith(s, args, tool, rnd, manifest, prefect_env(home, loop.api), loop.watch)
        return run_v2d(s, args, tool, rnd, manifest, {"server": loop.watch["server"]})
    except SystemExit:
        s.keep = True  # the failed run's folder and log stay for a look
        raise


def start_warm(s: Session, args, manifest: Path, loop) -> dict:
    """The warm service a user's first command starts as it exits (that command untimed, on
    ``manifest``), once it takes commands with its cluster up: its environment and pid."""
    folder = s.work / "warm"
    env = prefect_env(s.work / "prefect-home", loop.api, SHARDSMITH_WARM="1", SHARDSMITH_WARM_DIR=str(folder))
    print("starting the warm service (not timed) ...", flush=True)
    run_shardsmith(s, args, "ss-warm", 0, manifest, env, loop.watch)
    shutil.rmtree(s.work / "ss-warm-0", ignore_errors=True)
    deadline = time.monotonic() + 180
    while not (any(folder.glob("*.sock")) and any(folder.glob("*.scheduler"))):
        if time.monotonic() > deadline:
            raise SystemExit(f"the warm service did not start; see {folder}")
        time.sleep(0.2)
    return {"env": env, "pid": json.loads(next(folder.glob("*.json")).read_text())["pid"]}


def stop_warm(warm: dict | None) -> None:
    """Stop the warm service and wait (up to 60 s) for it to be gone."""
    import psutil

    if warm is None:
        return
    subprocess.run([str(VENV_PY), "-m", "cli", "warm", "--stop"], env=warm["env"], cwd=REPO, capture_output=True)
    with contextlib.suppress(psutil.Error):
        psutil.Process(warm["pid"]).wait(60)


if __name__ == "__main__":
    sys.exit(main())
