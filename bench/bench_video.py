"""Video, issue 34 (``--stage``), on a corpus of 6..12 s 320x180 H.264 videos whose scene cuts both tools' detectors find.

``clips``: shardsmith's download + cut + transcode beside video2dataset 1.3.0's on the same loopback videos (>= 1.5x
clips/s), at equal settings, through the warm service and at each one's defaults; video2dataset needs ``ffmpeg``.
``decode``: precache's frames of clips through DALI's decoder (``--device mixed``: NVDEC) beside PyAV's, equal settings.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
import tarfile
from collections import namedtuple
from pathlib import Path

import numpy as np

from harness.photos import write_manifest
from harness.procs import BENCH_DIR, REPO, Session, TreeSampler, clock, timed
from harness.report import emit, fmt, med, medians, parse, parser, ratio, rounds, table
from harness.servers import VENV_PY, child_env, prefect_env, serve, stop_warm, wait_warm
from harness.tools import ToolRun, add_tool_flags, ensure_venv, i2d_outputs, summary

FPS, SIZE, LICENSE, TARGET = 25, (320, 180), "CC-BY-4.0", 1.5
SECONDS = (6, 7, 8, 9, 10, 12)  # no 11: a 1 s remainder after a 10 s clip is a clip for one tool only
# Scenes alternate a dark and a bright palette (background, square, bar) whose hues differ too, so
# that both detectors see every cut (grey levels for shardsmith, HSV for PySceneDetect).
DARK = (
    ((20, 40, 110), (240, 200, 40), (250, 250, 250)),
    ((90, 20, 30), (60, 220, 120), (230, 230, 90)),
    ((20, 70, 40), (240, 80, 200), (200, 240, 255)),
    ((50, 30, 80), (250, 150, 30), (120, 240, 240)),
)
BRIGHT = (
    ((230, 200, 60), (30, 40, 160), (90, 20, 20)),
    ((120, 220, 230), (150, 20, 40), (20, 60, 20)),
    ((240, 170, 190), (20, 90, 40), (40, 20, 90)),
    ((200, 240, 150), (90, 30, 120), (120, 50, 10)),
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
V2D_VENV, V2D_REQUIREMENT = BENCH_DIR / "video2dataset-venv", "video2dataset==1.3.0"
# Its pins would pull a CUDA torch that its download stage imports but never runs: the venv gets the
# project's CPU torch and the rest unpinned (numpy < 2; pyarrow < 20 and opencv < 4.12 take numpy 1).
V2D_DEPS = (
    "numpy<2",
    "fire>=0.4,<0.6",
    "requests",
    "ffmpeg-python",
    "yt-dlp",
    "pyarrow<20",
    "fsspec",
    "webdataset",
    "webvtt-py",
    "wandb",
    "pandas",
    "tqdm",
    "timeout-decorator",
    "scenedetect==0.6.2",
    "opencv-python-headless<4.12",
    "decord",
    "langdetect",
    "soundfile",
    "omegaconf",
    "einops",
    "transformers==4.37.1",
    "Pillow",
    "accelerate",
    "scipy",
    "torchdata==0.9.0",
)
TORCH_WHEEL = Path("/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl")
# Its open download-stage bugs (upstream issues 263, 311), fixed as FrameSubsampler is on its main
# branch: the writer asks the first subsampler for ``encode_formats``, which two lack; FrameSubsampler
# pops the stream dict the worker iterates. No ffmpeg call changes.
_ENC = (
    "        self.encode_format = encode_format\n",
    '        self.encode_format = encode_format\n        self.encode_formats = {"video": encode_format}  # bench patch\n',
)
V2D_PATCHES = {
    "subsamplers/resolution_subsampler.py": [_ENC],
    "subsamplers/frame_subsampler.py": [
        _ENC,
        ('video_bytes = streams.pop("video")', 'video_bytes = streams["video"]  # bench patch'),
    ],
}
Scene = namedtuple("Scene", "start palette side speed bar_speed phase")


def plan(seed: int, index: int) -> tuple[int, list[Scene]]:
    """Video ``index``'s frames and scenes: 6..12 s, 0..3 cuts at any frame, every scene 2..10 s (a
    lone 12 s scene gives 10 + 2 s of clips)."""
    rng = np.random.default_rng([seed, index])
    seconds = int(rng.choice(SECONDS))
    frames, k = seconds * FPS, min(int(rng.integers(0, 4)), seconds // 2 - 1) + 1
    for _ in range(100):
        lengths = [2 * FPS + int(x) for x in rng.multinomial(frames - k * 2 * FPS, [1 / k] * k)]
        if k == 1 or max(lengths) <= 10 * FPS:
            break
    dark_first, first, scenes, start = bool(rng.integers(0, 2)), int(rng.integers(0, 4)), [], 0
    for j, length in enumerate(lengths):
        bank = DARK if (j % 2 == 0) == dark_first else BRIGHT
        scenes.append(
            Scene(
                start,
                bank[(first + j // 2 + index) % 4],
                *(int(rng.integers(*r)) for r in ((40, 70), (4, 10), (3, 7), (0, 400))),
            )
        )
        start += length
    return frames, scenes


def _bounce(x: int, span: int) -> int:
    x %= 2 * span
    return x if x < span else 2 * span - x


def frame(scenes: list[Scene], i: int) -> np.ndarray:
    """Frame ``i``: the scene's background, a square bouncing across and a bar bouncing down."""
    sc = [s for s in scenes if s.start <= i][-1]
    (w, h), img = SIZE, np.empty((SIZE[1], SIZE[0], 3), np.uint8)
    img[:] = sc.palette[0]
    x, y, yb = (
        _bounce(sc.phase + i * sc.speed, w - sc.side),
        (h - sc.side) // 3,
        _bounce(sc.phase + i * sc.bar_speed, h - 12),
    )
    img[y : y + sc.side, x : x + sc.side] = sc.palette[1]
    img[yb : yb + 12, 10:80] = sc.palette[2]
    return img


def expected_spans(frames: int, scenes: list[Scene], max_s: float = 10.0, min_s: float = 1.0) -> list[tuple[int, int]]:
    """The clips both tools owe, as frame spans: each scene in windows of ``max_s``, a rest kept from ``min_s``."""
    bounds, step, out = [s.start for s in scenes] + [frames], int(round(max_s * FPS)), []
    for a, b in zip(bounds, bounds[1:]):
        out += [(lo, min(lo + step, b)) for lo in range(a, b, step) if (min(lo + step, b) - lo) / FPS >= min_s]
    return out


def ensure_corpus(videos: int, seed: int) -> tuple[Path, dict[str, int]]:
    """``videos`` mp4s under ``.bench/video/pool-v1-sSEED/``, made once each: the folder, {name: bytes}."""
    from tasks.demo.videos import make_video

    folder, sizes = BENCH_DIR / "video" / f"pool-v1-s{seed}", {}
    folder.mkdir(parents=True, exist_ok=True)
    for index in range(videos):
        path = folder / f"v{index:04d}.mp4"
        if not path.exists():
            frames, scenes = plan(seed, index)
            path.with_suffix(".part").write_bytes(
                make_video(seconds=frames / FPS, fps=FPS, size=SIZE, draw=lambda i, t, s=scenes: frame(s, i))
            )
            path.with_suffix(".part").rename(path)
        sizes[path.name] = path.stat().st_size
    return folder, sizes


def scaled(side: int) -> tuple[int, int]:
    """The corpus's size with its long side at most ``side``, both even (tasks.video.clips.clip_size)."""
    scale = min(1.0, side / max(SIZE))
    return max(2, int(SIZE[0] * scale) // 2 * 2), max(2, int(SIZE[1] * scale) // 2 * 2)


def shardsmith_recipe(
    path: Path, store: Path, manifest: Path, clips: dict | None, per_shard: int | None, workers: int | None
) -> None:
    """A ``media: video`` recipe; ``clips`` (``validate.video.clips``), ``per_shard``, ``workers`` None: the defaults."""
    lines = [
        "dataset: bench",
        "kind: pretraining",
        f"storage: {store}",
        "sources:",
        "  - name: bench",
        f"    manifest: {manifest}",
        "    media: video",
        *([f"    rows_per_shard: {per_shard}"] if per_shard else []),
        "download:",
        '  network: {allowed_networks: ["127.0.0.1/32"], any_port: true}',
        "validate:",
        f"  license: {{allow: [{LICENSE}],",
        "    review: {reviewed_by: bench/bench_video.py, reviewed_on: 2026-12-04, notes: videos rendered locally}}",
        *([f"  video: {{clips: {json.dumps(clips)}}}"] if clips else []),
        *([f"execution: {{cluster: local, workers: {workers}}}"] if workers else []),
    ]
    path.write_text("\n".join(lines) + "\n")


def v2d_config(
    path: Path, side: int, fps: float | None, precision: str, per_shard: int, workers: int, threads: int
) -> None:
    """video2dataset's config for the settings shardsmith gets (cuts as clips, 1..10 s, the same size and rate). JSON is YAML."""
    sub = {
        "CutDetectionSubsampler": {
            "cuts_are_clips": True,
            "args": {"cut_detection_mode": "all", "framerates": None, "threshold": 27, "min_scene_len": 15},
        },
        "ClippingSubsampler": {
            "args": {"min_length": 1.0, "max_length": 10.0, "max_length_strategy": "all", "precision": precision}
        },
        "ResolutionSubsampler": {"args": {"height": scaled(side)[1], "resize_mode": "scale"}},
    } | ({"FrameSubsampler": {"args": {"frame_rate": fps}}} if fps else {})
    config = {
        "subsampling": sub,
        "reading": {
            "yt_args": {"download_size": 360, "download_audio_rate": 44100, "yt_metadata_args": None},
            "timeout": 60,
            "sampler": None,
        },
        "storage": {"number_sample_per_shard": per_shard, "oom_shard_count": 5, "captions_are_subtitles": False},
        "distribution": {
            "processes_count": workers,
            "thread_count": threads,
            "subjob_size": 1000,
            "distributor": "multiprocessing",
        },
    }
    path.write_text(json.dumps(config, indent=1) + "\n")


def patch_video2dataset(package: Path) -> None:
    """Apply ``V2D_PATCHES``, each once; an edit not found is an error."""
    for rel, edits in V2D_PATCHES.items():
        text = (package / rel).read_text()
        for old, new in edits:
            if new not in text and text.count(old) != 1:
                raise SystemExit(f"cannot patch {package / rel}: {old.strip()!r} found {text.count(old)} times")
            text = text if new in text else text.replace(old, new)
        (package / rel).write_text(text)


def ensure_video2dataset() -> None:
    def finish(site: Path) -> None:  # torchaudio's ops are built for another torch: it imports as Python only
        for lib in (site / "torchaudio" / "lib").glob("*.so"):
            lib.unlink()
        patch_video2dataset(site / "video2dataset")

    if missing := [x for x in ("ffmpeg", "ffprobe") if shutil.which(x) is None]:
        raise SystemExit(f"video2dataset runs {missing}: install FFmpeg (apt-get install ffmpeg)")
    torch = str(TORCH_WHEEL) if TORCH_WHEEL.exists() else "torch==2.13.0"
    ensure_venv(
        V2D_VENV,
        [[torch], ["--no-deps", V2D_REQUIREMENT, "torchaudio==2.11.1"], V2D_DEPS],
        finish,
        V2D_VENV / ".bench-complete",
    )


def clips_in_tars(tars: list[Path]) -> int:
    """How many clips (mp4 members) the tars hold."""
    n = 0
    for path in tars:
        with tarfile.open(path) as tf:
            n += sum(1 for m in tf if m.isfile() and m.name.partition(".")[2] == "mp4")
    return n


class Run(ToolRun):
    @property
    def cpu_per_clip(self) -> float:
        return self.cpu_s / max(self.ok, 1)


def run_tool(s: Session, args, loop, tool: str, rnd: int, manifest: Path, warm: dict | None = None) -> Run:
    """One timed command into ``WORK/TOOL-ROUND``; the warm service's CPU and peak RSS count as ``ss-warm``'s."""
    out, a = s.work / f"{tool}-{rnd}", args
    (out / "tmp").mkdir(parents=True)
    if tool.startswith("v2d"):
        cmd = [
            str(V2D_VENV / "bin" / "video2dataset"),
            "--url_list",
            str(manifest),
            "--input_format",
            "parquet",
            "--url_col",
            "url",
            "--caption_col",
            "caption",
            "--output_format",
            "webdataset",
            "--output_folder",
            str(out / "out"),
            "--tmp_dir",
            str(out / "tmp"),
            "--enable_wandb",
            "False",
        ]
        if tool != "v2d-default":
            v2d_config(
                out / "c.yaml",
                a.side,
                a.fps,
                "exact" if tool == "v2d-equal" else "keyframe_adjusted",
                a.rows_per_shard,
                a.workers,
                a.threads,
            )
            cmd += ["--config", str(out / "c.yaml")]
        env, watch = (
            child_env(WANDB_MODE="disabled", WANDB_SILENT="true", TQDM_DISABLE="1"),
            {"server": loop.watch["server"]},
        )
    else:
        clips = {"split": "scenes", "min_s": 1, "max_s": 10, "max_side": a.side, "crf": 23} | (
            {"fps": a.fps} if a.fps else {}
        )
        equal = tool != "ss-default"
        shardsmith_recipe(
            out / "r.yaml",
            out / "store",
            manifest,
            *((clips, a.rows_per_shard, a.workers) if equal else (None, None, None)),
        )
        cmd = [str(VENV_PY), "-m", "cli", "run", str(out / "r.yaml"), "--phase", "validate", "--json"]
        env, watch = prefect_env(s.work / "prefect-home", loop.api), loop.watch
        if tool == "ss-warm" and warm:  # (its pid None: the untimed command that starts it)
            env, watch = warm["env"], loop.watch | ({"warm": warm["pid"]} if warm["pid"] else {})
    try:
        with TreeSampler(watch["warm"]) if "warm" in watch else contextlib.nullcontext() as service:
            t = timed(
                s.children, cmd, env, out if tool.startswith("v2d") else REPO, out / "stderr.log", watch, a.run_timeout
            )
    except SystemExit:
        s.keep = True  # the failed run's folder and log stay for a look
        raise
    if tool.startswith("v2d"):
        meta, phase = i2d_outputs(out / "out", ["url", "status"])
        run = Run(tool, rnd, ok=clips_in_tars(list((out / "out").glob("*.tar"))), rows=a.videos, phase_s=phase).took(
            t, False
        )
        bad = sum(1 for x in meta.get("status", []) if x != "success")
    else:
        res = summary(t.stdout)
        dl, val = res["download"], res["validate"]
        n = clips_in_tars([out / "store" / x for x in val["tars"]])
        run = Run(tool, rnd, ok=n, rows=dl["counts"]["rows"], phase_s=dl["seconds"] + val["seconds"])
        run.took(t, "prefect" in watch)
        bad = dl["counts"]["rows"] - val["counts"]["ok"] + abs(n - val["counts"]["ok"])
        if service is not None:
            run.cpu_s, run.peak_rss_mb = run.cpu_s + t.watched["warm"], run.peak_rss_mb + service.peak_rss / 2**20
    if bad:
        print(f"  warning: {tool}: {bad} rows not ok or clips not in the tars", flush=True)
    return run


def render(runs: list[Run], tools: list[str], args) -> list[str]:
    """Medians and the ratios with the target."""
    s = {}
    for tool in tools:
        if rs := [r for r in runs if r.tool == tool]:
            s[tool] = {
                "n": len(rs),
                "wall": med(r.wall_s for r in rs),
                "rate": med(r.rate for r in rs),
                "best": max(r.rate for r in rs),
                "phase": med(r.phase_rate for r in rs),
                "cpu": med(r.cpu_per_clip for r in rs),
                "rss": med(r.peak_rss_mb for r in rs),
                "videos_s": med(r.rows / r.wall_s for r in rs),
                "clips": sorted({r.ok for r in rs}),
            }
    lines = [
        "Medians over rounds (best clips/s in brackets):",
        "",
        *table(
            [
                "tool",
                "runs",
                "wall s",
                "clips/s (wall)",
                "clips/s (phase)",
                "videos/s (wall)",
                "CPU s / clip",
                "peak RSS MB",
                "clips",
            ],
            [
                [
                    LABELS[t],
                    v["n"],
                    f"{v['wall']:.1f}",
                    f"{v['rate']:.2f} ({v['best']:.2f})",
                    fmt(v["phase"], ".2f"),
                    f"{v['videos_s']:.2f}",
                    f"{v['cpu']:.3f}",
                    f"{v['rss']:.0f}",
                    "/".join(map(str, v["clips"])),
                ]
                for t, v in s.items()
            ],
        ),
    ]
    lines.append("")
    for ss, base in [(x, b) for x, b in PAIRS if x in s and b in s]:
        x, b, key = s[ss], s[base], "videos_s" if base.endswith("default") else "rate"
        phase = "" if key == "videos_s" else f", {fmt(ratio(x['phase'], b['phase']), '.2f')}x over the phase"
        lines.append(
            f"- {LABELS[ss]} vs {LABELS[base]}: {'videos/s' if key == 'videos_s' else 'clips/s'} {fmt(ratio(x[key], b[key]), '.2f')}x over the whole command{phase}; "
            f"CPU per clip {fmt(ratio(b['cpu'], x['cpu']), '.2f')}x ({x['cpu']:.3f} vs {b['cpu']:.3f} s); peak RSS {x['rss']:.0f} vs {b['rss']:.0f} MB"
        )
    if "ss-equal" in s and "v2d-equal" in s:
        r = ratio(s["ss-equal"]["rate"], s["v2d-equal"]["rate"])
        lines.append(
            f"- issue 34's target, >= {TARGET:g}x video2dataset's clips/s on equal settings: {fmt(r, '.2f')}x, {'met' if r and r >= TARGET else 'NOT met'}"
        )
    return lines


def ensure_clips(args) -> list[bytes]:
    """The corpus's clips in ``args.codec``, cut as validate cuts them (made once per corpus, codec and length)."""
    from tasks.video.clips import ClipConfig, cut, signals
    from tasks.video.clips import render as render_clips
    from tasks.video.probe import VideoLimits, probe

    corpus, sizes = ensure_corpus(args.videos, args.seed)
    folder = BENCH_DIR / "clip_decode" / f"clips-v1-s{args.seed}-n{args.videos}-{args.codec}-max{args.max_s:g}"
    if not (folder / ".complete").exists():
        folder.mkdir(parents=True, exist_ok=True)
        cfg = ClipConfig(split="scenes", min_s=1, max_s=args.max_s, codec=args.codec)
        for name in sorted(sizes):
            data = (corpus / name).read_bytes()
            info = probe(data, VideoLimits()).value
            kept = [c for c in cut(signals(data, info), info, cfg) if c.reason is None]
            for index, (mp4, _) in render_clips(data, info, kept, cfg).items():
                (folder / f"{Path(name).stem}_c{index:03d}.mp4").write_bytes(mp4 or b"")
        (folder / ".complete").touch()
    return [p.read_bytes() for p in sorted(folder.glob("*.mp4"))]


def decode(tool: str, clips: list[bytes], args) -> list:
    """Each clip's frames, by ``pyav`` (clip by clip, as a CPU worker's precache) or ``dali`` (in batches)."""
    if tool == "pyav":
        from tasks.video.frames import decode_clip

        return [decode_clip(c, args.frames, args.fps, args.size)[0] for c in clips]
    from tasks.video.dali_frames import dali_decode

    out = []
    for i in range(0, len(clips), args.batch):
        out += [
            t
            for t, _ in dali_decode(
                clips[i : i + args.batch], args.frames, args.fps, args.size, args.device, args.batch
            )
        ]
    if args.device == "mixed":
        import torch

        torch.cuda.synchronize()
    return out


def decode_stage(args, p) -> list[str]:
    import torch

    args.device = args.device or ("mixed" if torch.cuda.is_available() else "cpu")
    args.codec = args.codec or ("h264" if args.device == "mixed" else "vp9")
    if args.device == "cpu" and args.codec == "h264":
        p.error("DALI's CPU video decoder does not decode H.264: --codec vp9, or --device mixed on a GPU")
    clips, outputs = ensure_clips(args), {}
    with clock() as build:
        decode("dali", clips[: args.batch], args)  # builds the pipeline, as a worker's first batch does

    def run(tool: str, _rnd: int) -> dict:
        with clock() as lap:
            outputs[tool] = decode(tool, clips, args)
        return {"tool": tool, "wall": lap.wall, "cpu": lap.cpu}

    wall, cpu = (medians(rounds(("pyav", "dali"), args.repeats, run), lambda r, k=k: r[k]) for k in ("wall", "cpu"))
    diffs = np.concatenate(
        [
            (x.cpu().int() - y.cpu().int()).abs().float().mean(dim=(1, 2, 3)).numpy()
            for x, y in zip(outputs["dali"], outputs["pyav"], strict=True)
        ]
    )
    fig = {t: (len(clips) / wall[t], len(clips) * args.frames / wall[t], 1000 * cpu[t] / len(clips)) for t in wall}
    rows = [(t, f"{a:.1f}", f"{b:.0f}", f"{c:.1f}") for t, (a, b, c) in fig.items()]
    rows.append(("**dali / pyav**", *(f"**{d / q:.2f}**" for d, q in zip(fig["dali"], fig["pyav"]))))
    return [
        f"{len(clips)} {args.codec} clips of {args.videos} corpus videos (1..{args.max_s:g} s), {args.frames} frames at {args.fps} fps "
        f"fitted to {args.size} px; DALI {args.device}, batches of {args.batch}; medians of {args.repeats} rounds",
        "",
        *table(("tool", "clips/s", "frames/s", "CPU ms / clip"), rows),
        "",
        f"- DALI's first batch, pipeline build included: {build.wall:.2f} s wall, {build.cpu:.2f} s CPU",
        f"- DALI's frames from PyAV's: mean absolute difference per frame {diffs.mean():.2f} levels (largest {diffs.max():.2f})",
    ]


def clips_stage(args) -> list[str]:
    pool, sizes = ensure_corpus(args.videos, args.seed)
    names, warm = sorted(sizes)[: args.videos], None
    if any(t.startswith("v2d") for t in args.tools):
        ensure_video2dataset()
    with Session("video", args.keep) as s:
        loop = serve(s, pool, prefect=False)  # each shardsmith command starts its own Prefect server
        manifest, small = s.work / "manifest.parquet", s.work / "warmup.parquet"
        for path, urls in (
            (manifest, [f"{loop.base_url}/img/{x}" for x in names]),
            (small, [f"{loop.base_url}/img/{x}" for x in names[:4]]),
        ):
            write_manifest(path, urls, caption=[f"synthetic video number {i}" for i in range(len(urls))])
        firsts = [next((t for t in args.tools if t.startswith(x)), None) for x in ("ss-", "v2d-")]
        for tool in [t for t in firsts if t and not args.no_warmup] + (["ss-warm"] if "ss-warm" in args.tools else []):
            env = prefect_env(
                s.work / "prefect-home", loop.api, SHARDSMITH_WARM="1", SHARDSMITH_WARM_DIR=str(s.work / "warm")
            )
            print(
                f"untimed: {tool} on 4 videos" + (", starting the warm service" if tool == "ss-warm" else ""),
                flush=True,
            )
            run_tool(s, args, loop, tool, 0, small, {"env": env, "pid": None})
            shutil.rmtree(s.work / f"{tool}-0", ignore_errors=True)
            warm = {"env": env, "pid": wait_warm(s.work / "warm")} if tool == "ss-warm" else warm

        def run(tool: str, rnd: int) -> Run:
            r = run_tool(s, args, loop, tool, rnd, manifest, warm)
            if not args.keep:
                shutil.rmtree(s.work / f"{tool}-{rnd}", ignore_errors=True)
            return r

        try:
            runs = rounds(args.tools, args.repeats, run, args.quiet_wait)
        finally:
            if warm:
                stop_warm(warm["env"], warm["pid"])
    return render(runs, args.tools, args)


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, repeats=3, quiet_wait=30.0, keep="video")
    p.add_argument("--stage", choices=("clips", "decode"), default="clips", help="what is measured (default clips)")
    p.add_argument("--videos", type=int, help="videos of the corpus, 6..12 s each (default: clips 40, decode 8)")
    p.add_argument("--seed", type=int, default=0, help="seed of the corpus")
    p.add_argument(
        "--fps",
        type=float,
        help="clips: their rate at equal settings (default 10); decode: the rate frames are taken at (default 4); 0: the source's",
    )
    p.add_argument("--side", type=int, default=256, help="clips: their long side at equal settings (default 256)")
    add_tool_flags(p, rows_per_shard=5, baseline="video2dataset", threads=32)  # its default thread_count
    p.add_argument(
        "--no-warmup", action="store_true", help="clips: skip the untimed first run of each program on 4 videos"
    )
    p.add_argument("--run-timeout", type=float, default=1800, help="clips: stop a command after this many seconds")
    p.add_argument("--max-s", type=float, default=4.0, help="decode: a clip's longest length in seconds (default 4)")
    p.add_argument(
        "--codec", choices=["h264", "vp9"], help="decode: the clips' codec (default: h264 with a GPU, else vp9)"
    )
    p.add_argument(
        "--device",
        choices=["cpu", "mixed"],
        help="decode: DALI's decoder, mixed is NVDEC (default: mixed with a GPU, else cpu)",
    )
    p.add_argument(
        "--frames", type=int, default=8, help="decode: frames per clip (precache.clip_latents.frames; default 8)"
    )
    p.add_argument("--size", type=int, default=128, help="decode: the square frames are fitted to (default 128)")
    p.add_argument(
        "--batch", type=int, default=16, help="decode: clips per DALI batch (precache.batch_size; default 16)"
    )
    args = parse(p, argv, tools=TOOLS)
    decoding = args.stage == "decode"
    args.videos, args.fps = (
        args.videos or (8 if decoding else 40),
        (4.0 if decoding else 10.0) if args.fps is None else args.fps or None,
    )
    if decoding:
        emit("Clip decode (`bench_video.py --stage decode`)", decode_stage(args, p), argv, args.markdown)
        return 0
    import av

    planned = [plan(args.seed, i) for i in range(args.videos)]
    note = f"{args.videos} videos, {sum(p[0] for p in planned) / FPS:.0f} s, {sum(len(expected_spans(*p)) for p in planned)} clips planned; PyAV {av.__version__}; {V2D_REQUIREMENT}"
    emit("Video clips (`bench_video.py --stage clips`)", clips_stage(args), argv, args.markdown, note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
