"""bench_video.py's corpus, its two tools' settings and outputs, and the checks that their clips are what was asked for."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from harness.procs import BENCH_DIR

FPS = 25
SIZE = (320, 180)
SECONDS = (6, 7, 8, 9, 10, 12)  # no 11: a 1 s remainder after a 10 s clip is a clip for one tool only
MIN_SCENE_S = 2
LICENSE = "CC-BY-4.0"

# Scenes alternate a dark and a bright palette (background, square, bar) whose hues differ too,
# so that both tools' detectors see every cut (grey levels for shardsmith, HSV for PySceneDetect).
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

V2D_VENV = BENCH_DIR / "video2dataset-venv"
V2D_REQUIREMENT = "video2dataset==1.3.0"
# video2dataset 1.3.0's own pins (torch 2.1.2, torchaudio 2.1.2, torchdata 0.7.1) would pull a
# CUDA torch of several GB; its download stage never runs torch, it only imports it. So the
# venv gets the CPU torch this project uses and the rest of its requirements without those pins
# (numpy < 2 as it asks; pyarrow < 20 and opencv < 4.12 are the last that take numpy 1).
V2D_DEPS = (
    "numpy<2", "fire>=0.4,<0.6", "requests", "ffmpeg-python", "yt-dlp", "pyarrow<20", "fsspec", "webdataset",
    "webvtt-py", "wandb", "pandas", "tqdm", "timeout-decorator", "scenedetect==0.6.2",
    "opencv-python-headless<4.12", "decord", "langdetect", "soundfile", "omegaconf", "einops",
    "transformers==4.37.1", "Pillow", "accelerate", "scipy", "torchdata==0.9.0",
)  # fmt: skip
TORCH_WHEEL = Path("/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl")
# Its open bugs in the download stage (upstream issues 263 and 311): the writer asks the first
# video subsampler for ``encode_formats``, which neither ResolutionSubsampler nor FrameSubsampler
# has, and FrameSubsampler pops the stream dict the worker is iterating. The fixes below are
# FrameSubsampler's on video2dataset's main branch (after 1.3.0); no ffmpeg call changes.
V2D_PATCHES = {
    "subsamplers/resolution_subsampler.py": [
        ("        self.encode_format = encode_format\n",
         "        self.encode_format = encode_format\n        self.encode_formats = {\"video\": encode_format}  # bench patch\n"),
    ],
    "subsamplers/frame_subsampler.py": [
        ("        self.encode_format = encode_format\n",
         "        self.encode_format = encode_format\n        self.encode_formats = {\"video\": encode_format}  # bench patch\n"),
        ('video_bytes = streams.pop("video")', 'video_bytes = streams["video"]  # bench patch'),
    ],
}  # fmt: skip


# ------------------------------------------------------------------------------------ corpus


@dataclass(frozen=True)
class Scene:
    """One scene of a corpus video: its first frame and how it is drawn."""

    start: int
    palette: tuple
    side: int
    speed: int
    bar_speed: int
    phase: int


def plan(seed: int, index: int) -> tuple[int, list[Scene]]:
    """Video ``index``'s frame count and scenes: 6..12 s, 0..3 cuts at any frame, every scene at
    least 2 s and, when there is a cut, at most 10 s (so each tool's clips are the scenes, a
    lone 12 s scene giving 10 + 2 s)."""
    rng = np.random.default_rng([seed, index])
    seconds = int(rng.choice(SECONDS))
    frames = seconds * FPS
    cuts = int(rng.integers(0, 4))
    cuts = min(cuts, seconds // MIN_SCENE_S - 1)
    lengths = [frames]
    for _ in range(100):
        k = cuts + 1
        spare = frames - k * MIN_SCENE_S * FPS
        lengths = [MIN_SCENE_S * FPS + int(x) for x in rng.multinomial(spare, [1 / k] * k)]
        if k == 1 or max(lengths) <= 10 * FPS:
            break
    dark_first = bool(rng.integers(0, 2))
    first = int(rng.integers(0, 4))
    scenes, start = [], 0
    for k, length in enumerate(lengths):
        bank = DARK if (k % 2 == 0) == dark_first else BRIGHT
        scenes.append(
            Scene(
                start=start,
                palette=bank[(first + k // 2 + index) % len(bank)],
                side=int(rng.integers(40, 70)),
                speed=int(rng.integers(4, 10)),
                bar_speed=int(rng.integers(3, 7)),
                phase=int(rng.integers(0, 400)),
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
    background, square, bar = sc.palette
    w, h = SIZE
    img = np.empty((h, w, 3), np.uint8)
    img[:] = background
    x = _bounce(sc.phase + i * sc.speed, w - sc.side)
    y = (h - sc.side) // 3
    img[y : y + sc.side, x : x + sc.side] = square
    yb = _bounce(sc.phase + i * sc.bar_speed, h - 12)
    img[yb : yb + 12, 10:80] = bar
    return img


def expected_spans(frames: int, scenes: list[Scene], max_s: float = 10.0, min_s: float = 1.0) -> list[tuple[int, int]]:
    """The clips both tools should cut, as frame spans: every scene in windows of ``max_s``,
    a remainder kept when at least ``min_s`` long."""
    out = []
    bounds = [s.start for s in scenes] + [frames]
    step = int(round(max_s * FPS))
    for a, b in zip(bounds, bounds[1:]):
        for lo in range(a, b, step):
            hi = min(lo + step, b)
            if (hi - lo) / FPS >= min_s:
                out.append((lo, hi))
    return out


def ensure_corpus(videos: int, seed: int) -> tuple[Path, dict[str, int]]:
    """``videos`` H.264 mp4s (320x180, 25 fps, a keyframe a second) under
    ``.bench/video/pool-v1-sSEED/``, made once each; their names and sizes."""
    from tasks.demo.videos import make_video

    folder = BENCH_DIR / "video" / f"pool-v1-s{seed}"
    folder.mkdir(parents=True, exist_ok=True)
    sizes = {}
    made = 0
    for index in range(videos):
        path = folder / f"v{index:04d}.mp4"
        if not path.exists():
            frames, scenes = plan(seed, index)
            data = make_video(seconds=frames / FPS, fps=FPS, size=SIZE, draw=lambda i, t, s=scenes: frame(s, i))
            tmp = path.with_suffix(".part")
            tmp.write_bytes(data)
            tmp.rename(path)
            made += 1
        sizes[path.name] = path.stat().st_size
    if made:
        print(f"made {made} videos in {folder}", flush=True)
    return folder, sizes


def write_manifest(path: Path, urls: list[str]) -> None:
    """One parquet both tools read: url, caption, license."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = len(urls)
    captions = [f"synthetic video number {i}" for i in range(n)]
    pq.write_table(pa.table({"url": urls, "caption": captions, "license": [LICENSE] * n}), path)


# -------------------------------------------------------------------------------- the tools


def scaled(side: int) -> tuple[int, int]:
    """The corpus's frame size with its long side at most ``side`` (never larger), both even: what
    shardsmith's ``max_side`` gives (tasks.video.clips.clip_size)."""
    w, h = SIZE
    scale = min(1.0, side / max(w, h))
    return max(2, int(w * scale) // 2 * 2), max(2, int(h * scale) // 2 * 2)


def shardsmith_recipe(
    path: Path, store: Path, manifest: Path, clips: dict | None, per_shard: int | None, workers: int | None
) -> None:
    """A recipe over the manifest (``media: video``): ``clips`` is ``validate.video.clips`` (None:
    its defaults), ``per_shard`` and ``workers`` None leave shardsmith's defaults."""
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
        "  license:",
        f"    allow: [{LICENSE}]",
        "    review: {reviewed_by: bench/bench_video.py, reviewed_on: 2026-12-04, notes: videos rendered locally}",
        *([f"  video: {{clips: {json.dumps(clips)}}}"] if clips else []),
        *([f"execution: {{cluster: local, workers: {workers}}}"] if workers else []),
    ]
    path.write_text("\n".join(lines) + "\n")


def v2d_config(
    path: Path, side: int, fps: float | None, precision: str, per_shard: int, workers: int, threads: int
) -> None:
    """video2dataset's config for the settings shardsmith's recipe gets: cuts (PySceneDetect's
    content detector, its default threshold) as clips, 1..10 s, ``precision`` (``exact``
    re-encodes at the cuts), the height that gives ``side`` on the long side, ``fps``. JSON is YAML."""
    _, height = scaled(side)
    sub: dict = {
        "CutDetectionSubsampler": {
            "cuts_are_clips": True,
            "args": {"cut_detection_mode": "all", "framerates": None, "threshold": 27, "min_scene_len": 15},
        },
        "ClippingSubsampler": {
            "args": {"min_length": 1.0, "max_length": 10.0, "max_length_strategy": "all", "precision": precision}
        },
        "ResolutionSubsampler": {"args": {"height": height, "resize_mode": "scale"}},
    }
    if fps:
        sub["FrameSubsampler"] = {"args": {"frame_rate": fps}}
    config = {
        "subsampling": sub,
        "reading": {"yt_args": {"download_size": 360, "download_audio_rate": 44100, "yt_metadata_args": None},
                    "timeout": 60, "sampler": None},
        "storage": {"number_sample_per_shard": per_shard, "oom_shard_count": 5, "captions_are_subtitles": False},
        "distribution": {"processes_count": workers, "thread_count": threads, "subjob_size": 1000,
                         "distributor": "multiprocessing"},
    }  # fmt: skip
    path.write_text(json.dumps(config, indent=1) + "\n")


def v2d_command(manifest: Path, out: Path, tmp: Path, config: str | None) -> list[str]:
    """``video2dataset`` over the parquet manifest into webdataset shards (``config`` None: its default)."""
    return [
        str(V2D_VENV / "bin" / "video2dataset"), "--url_list", str(manifest), "--input_format", "parquet",
        "--url_col", "url", "--caption_col", "caption", "--output_format", "webdataset",
        "--output_folder", str(out), "--tmp_dir", str(tmp), "--enable_wandb", "False",
        *(["--config", config] if config else []),
    ]  # fmt: skip


def ensure_video2dataset() -> Path:
    """video2dataset 1.3.0 in its own venv (made once, never a project dependency), patched for
    its download-stage bugs; FFmpeg's ``ffmpeg`` and ``ffprobe`` must be on PATH."""
    import shutil

    for exe in ("ffmpeg", "ffprobe"):
        if shutil.which(exe) is None:
            raise SystemExit(f"video2dataset runs the {exe} command: install FFmpeg (apt-get install ffmpeg)")
    done = V2D_VENV / ".bench-complete"
    if done.exists():
        return V2D_VENV / "bin" / "video2dataset"
    print(f"installing {V2D_REQUIREMENT} into {V2D_VENV} (once; a few minutes) ...", flush=True)
    python = sys.executable if sys.version_info[:2] == (3, 11) else "python3.11"
    subprocess.run([python, "-m", "venv", str(V2D_VENV)], check=True)
    pip = [str(V2D_VENV / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*pip, str(TORCH_WHEEL) if TORCH_WHEEL.exists() else "torch==2.13.0"], check=True)
    subprocess.run([*pip, "--no-deps", V2D_REQUIREMENT, "torchaudio==2.11.1"], check=True)
    subprocess.run([*pip, *V2D_DEPS], check=True)
    site = next((V2D_VENV / "lib").glob("python3*/site-packages"))
    # torchaudio's compiled ops are built for another torch; without them it imports as Python
    # only (video2dataset's dataloader imports it; the download stage never calls it).
    for lib in (site / "torchaudio" / "lib").glob("*.so"):
        lib.unlink()
    patch_video2dataset(site / "video2dataset")
    subprocess.run(
        [str(V2D_VENV / "bin" / "python"), "-c", "import video2dataset.main"], check=True, capture_output=True
    )
    done.write_text(V2D_REQUIREMENT + "\n")
    return V2D_VENV / "bin" / "video2dataset"


def patch_video2dataset(package: Path) -> None:
    """Apply ``V2D_PATCHES`` (each once; an edit that is not found is an error)."""
    for rel, edits in V2D_PATCHES.items():
        path = package / rel
        text = path.read_text()
        for old, new in edits:
            if new in text:
                continue
            if text.count(old) != 1:
                raise SystemExit(f"cannot patch {path}: {old.strip()!r} found {text.count(old)} times")
            text = text.replace(old, new)
        path.write_text(text)


def v2d_versions() -> str:
    """video2dataset's, FFmpeg's and PySceneDetect's versions as the venv has them."""
    code = "import importlib.metadata as m; print(m.version('video2dataset'), m.version('scenedetect'))"
    try:
        v2d, sd = subprocess.run(
            [str(V2D_VENV / "bin" / "python"), "-c", code], capture_output=True, text=True, check=True
        ).stdout.split()
        ff = subprocess.run(["ffmpeg", "-version"], capture_output=True, text=True, check=True).stdout.split()[2]
    except (OSError, subprocess.CalledProcessError, ValueError):
        return "unknown"
    return f"video2dataset {v2d} (patched, see bench/video_tools.py), PySceneDetect {sd}, FFmpeg {ff}"


def pyav_version() -> str:
    """PyAV's version and the FFmpeg it bundles (shardsmith's decoder and encoder)."""
    import av

    return f"PyAV {av.__version__} (FFmpeg {getattr(av, 'ffmpeg_version_info', '?')})"
