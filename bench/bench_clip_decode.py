"""Clip decode: precache's frames of video clips through DALI's video decoder beside PyAV's, at equal settings.

One invocation cuts (or reuses) clips of the video benchmark's corpus (``--videos`` synthetic
videos of bench/video_tools.py, 320x180 at 25 fps; clips as ``validate.video.clips`` cuts them:
scenes, 1..``--max-s`` s, in the codec asked for) and runs, alternating (the order flips every
round), for ``--repeats`` rounds, each tool over every clip:

- ``pyav``: ``tasks.video.frames.decode_clip`` clip after clip, as precache decodes on a CPU
  worker (PyAV's decode on the CPU, PIL's BILINEAR resize and crop);
- ``dali``: ``tasks.video.dali_frames.dali_decode`` in batches of ``--batch`` clips, as precache
  with ``clip_latents.decoder: dali`` (or ``auto`` on a GPU worker): DALI's video decoder on
  ``--device`` (``cpu``: its libavcodec build, which decodes VP9 but not H.264; ``mixed``:
  NVDEC), its resize and crop on the same device.

Both take ``--frames`` frames every ``1 / --fps`` s and fit them to ``--size`` square. The
default codec is H.264 where torch sees a GPU (``mixed``) and VP9 otherwise, so that both tools
decode the same clips. Printed: clips/s and output frames/s (wall), CPU ms per clip (this
process, every thread: DALI's workers included), their ratios DALI / PyAV (medians), and how far
DALI's frames are from PyAV's (mean absolute difference per frame, levels of 255). DALI's
pipeline is built once before the rounds (a worker builds it once); its build time is shown.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.procs import BENCH_DIR, REPO, clock  # noqa: E402
from harness.report import alternated, command, emit, machine, med, now, revision, table  # noqa: E402
from video_tools import ensure_corpus  # noqa: E402

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

TOOLS = ("pyav", "dali")


def ensure_clips(args) -> list[bytes]:
    """The corpus's clips in ``args.codec``, cut as validate cuts them, under
    ``.bench/clip_decode/`` (made once per corpus, codec and length)."""
    from tasks.video.clips import ClipConfig, cut, render, signals
    from tasks.video.probe import VideoLimits, probe

    corpus, sizes = ensure_corpus(args.videos, args.seed)
    folder = BENCH_DIR / "clip_decode" / f"clips-v1-s{args.seed}-n{args.videos}-{args.codec}-max{args.max_s:g}"
    done = folder / ".complete"
    if not done.exists():
        folder.mkdir(parents=True, exist_ok=True)
        cfg = ClipConfig(split="scenes", min_s=1, max_s=args.max_s, codec=args.codec)
        for name in sorted(sizes):
            data = (corpus / name).read_bytes()
            info = probe(data, VideoLimits()).value
            kept = [c for c in cut(signals(data, info), info, cfg) if c.reason is None]
            for index, (mp4, _) in render(data, info, kept, cfg).items():
                (folder / f"{Path(name).stem}_c{index:03d}.mp4").write_bytes(mp4 or b"")
        done.touch()
        print(f"cut {len(list(folder.glob('*.mp4')))} {args.codec} clips into {folder}", flush=True)
    return [p.read_bytes() for p in sorted(folder.glob("*.mp4"))]


def run_pyav(clips: list[bytes], args) -> list:
    from tasks.video.frames import decode_clip

    return [decode_clip(c, args.frames, args.fps, args.size)[0] for c in clips]


def run_dali(clips: list[bytes], args) -> list:
    from tasks.video.dali_frames import dali_decode

    out = []
    for i in range(0, len(clips), args.batch):
        batch = dali_decode(clips[i : i + args.batch], args.frames, args.fps, args.size, args.device, args.batch)
        out += [t for t, _ in batch]
    if args.device == "mixed":
        import torch

        torch.cuda.synchronize()
    return out


def agreement(a: list, b: list) -> tuple[float, float]:
    """The mean and the largest per-frame mean absolute difference between two tools' frames."""
    import numpy as np

    diffs = np.concatenate(
        [(x.cpu().int() - y.cpu().int()).abs().float().mean(dim=(1, 2, 3)).numpy() for x, y in zip(a, b, strict=True)]
    )
    return float(diffs.mean()), float(diffs.max())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--videos", type=int, default=8, help="videos of the corpus to cut clips from (default 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-s", type=float, default=4.0, help="a clip's longest length in seconds (default 4)")
    p.add_argument("--codec", choices=["h264", "vp9"], help="the clips' codec (default: h264 with a GPU, else vp9)")
    p.add_argument("--device", choices=["cpu", "mixed"], help="DALI's decoder (default: mixed with a GPU, else cpu)")
    p.add_argument("--frames", type=int, default=8, help="frames per clip (precache.clip_latents.frames; default 8)")
    p.add_argument("--fps", type=float, default=4.0, help="the rate they are taken at (default 4; 0: consecutive)")
    p.add_argument("--size", type=int, default=128, help="the square they are fitted to (default 128)")
    p.add_argument("--batch", type=int, default=16, help="clips per DALI batch (precache.batch_size; default 16)")
    p.add_argument("--repeats", type=int, default=3, help="rounds; each runs both tools over every clip (default 3)")
    p.add_argument("--markdown", type=Path, help="also write the report (markdown) to this file")
    args = p.parse_args(argv)
    import torch

    gpu = torch.cuda.is_available()
    args.device = args.device or ("mixed" if gpu else "cpu")
    args.codec = args.codec or ("h264" if args.device == "mixed" else "vp9")
    args.fps = args.fps or None
    if args.device == "cpu" and args.codec == "h264":
        p.error("DALI's CPU video decoder does not decode H.264: --codec vp9, or --device mixed on a GPU")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    clips = ensure_clips(args)
    frames_out = len(clips) * args.frames
    mb = sum(len(c) for c in clips) / 2**20
    print(
        f"{len(clips)} {args.codec} clips ({mb:.1f} MiB), {args.frames} frames at {args.fps} fps to {args.size} px; "
        f"DALI {args.device}, batches of {args.batch}; {args.repeats} rounds, load {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    with clock() as build:
        first = run_dali(clips[: args.batch], args)  # builds the pipeline, as a worker's first batch does
    runs = {"pyav": run_pyav, "dali": run_dali}
    wall: dict[str, list[float]] = {t: [] for t in TOOLS}
    cpu: dict[str, list[float]] = {t: [] for t in TOOLS}
    outputs: dict[str, list] = {}
    for rnd, tool in alternated(TOOLS, args.repeats):
        with clock() as lap:
            got = runs[tool](clips, args)
        wall[tool].append(lap.wall)
        cpu[tool].append(lap.cpu)
        outputs.setdefault(tool, got)
        print(f"round {rnd} {tool}: {lap.wall:.2f} s wall, {lap.cpu:.2f} s CPU", flush=True)
    del first
    mean_diff, max_diff = agreement(outputs["dali"], outputs["pyav"])
    rows, figures = [], {}
    for tool in TOOLS:
        w, c = med(wall[tool]), med(cpu[tool])
        figures[tool] = (len(clips) / w, frames_out / w, 1000 * c / len(clips))
        rows.append([tool, f"{figures[tool][0]:.1f}", f"{figures[tool][1]:.0f}", f"{figures[tool][2]:.1f}"])
    rows.append(
        [
            "dali / pyav",
            f"{figures['dali'][0] / figures['pyav'][0]:.2f}",
            f"{figures['dali'][1] / figures['pyav'][1]:.2f}",
            f"{figures['dali'][2] / figures['pyav'][2]:.2f}",
        ]
    )
    lines = [
        f"Clip decode: {len(clips)} {args.codec} clips of the video corpus ({args.videos} videos, 320x180, 25 fps, "
        f"1..{args.max_s:g} s), {args.frames} frames at {args.fps} fps fitted to {args.size} px; "
        f"DALI {args.device} in batches of {args.batch}; medians of {args.repeats} rounds",
        "",
        *table(["tool", "clips/s", "frames/s", "CPU ms / clip"], rows),
        "",
        f"DALI's first batch (pipeline build included): {build.wall:.2f} s wall, {build.cpu:.2f} s CPU",
        f"DALI's frames from PyAV's: mean absolute difference per frame {mean_diff:.2f} levels (largest {max_diff:.2f})",
        "",
        f"{now()}; {revision()}; {machine()}",
        f"`{command('bench_clip_decode.py', argv)}`",
    ]
    emit("\n".join(lines), args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
