"""bench_video.py's report: settings, per-run figures, medians, the clip checks and the ratios, as markdown."""

from __future__ import annotations

from harness.report import fmt, med, ratio, table
from video_tools import FPS, SIZE, scaled


def settings(meta: dict) -> list[str]:
    """What each tool was asked to do, in words."""
    a = meta["args"]
    w, h = scaled(a.side)
    fps = f"{a.fps:g} fps" if a.fps else "the source's fps"
    return [
        f"- equal settings: scene cuts, clips of 1..10 s (a longer scene in 10 s windows), {w}x{h} (long side {a.side}), "
        f"{fps}, H.264 crf 23, mp4; {a.workers} processes, {a.rows_per_shard} videos per shard (of {meta['videos']}).",
        f"  - shardsmith: `validate.video.clips: {{split: scenes, min_s: 1, max_s: 10, max_side: {a.side}"
        f"{f', fps: {a.fps:g}' if a.fps else ''}, crf: 23}}`, `rows_per_shard: {a.rows_per_shard}`, `execution.workers: {a.workers}`; "
        "one decode pass to find cuts (64x36 grey frame differences), one to encode every clip (x264 preset veryfast) "
        "and its keyframe JPEG.",
        f"  - video2dataset: CutDetectionSubsampler (PySceneDetect ContentDetector, threshold 27, min_scene_len 15, "
        f"cuts_are_clips), ClippingSubsampler (min_length 1, max_length 10, max_length_strategy all, precision exact or "
        f"keyframe_adjusted), ResolutionSubsampler (scale, height {h}){f', FrameSubsampler (frame_rate {a.fps:g})' if a.fps else ''}; "
        f"processes_count {a.workers}, thread_count {a.threads}, number_sample_per_shard {a.rows_per_shard}. Each subsampler is "
        "an `ffmpeg` run with FFmpeg's libx264 defaults (preset medium, crf 23): `exact` encodes the whole video once at "
        "the cuts, then each clip again to resize" + (" and again to change its rate" if a.fps else "") + "; "
        "`keyframe_adjusted` (after an ffprobe of the keyframes) copies the clips at the keyframes inside each scene instead.",
        "- defaults: shardsmith's recipe with `media: video` and nothing else (scenes, 1..10 s, long side 640 so "
        f"{SIZE[0]}x{SIZE[1]} stays, the source's fps, crf 23; 1,000 rows per shard, so one shard and one busy worker); "
        "video2dataset's default config (no subsampling: every video stored as fetched; 16 processes, 32 threads, 1,000 per shard).",
        "- Prefect: " + ("each shardsmith command starts its own server (in its CPU)" if a.prefect == "own"
                         else "one server started beforehand, its CPU during a run shown apart"),
    ]  # fmt: skip


def render(runs: list, tools: list[str], meta: dict, labels: dict, pairs, target: float) -> str:
    a = meta["args"]
    lines = [
        f"- command: `{meta['command']}`",
        f"- date: {meta['date']}; machine: {meta['machine']}; load average before: {meta['load_before']}; code: {meta['revision']}",
        f"- tools: {meta['versions']}",
        f"- corpus: {meta['videos']} videos, {meta['seconds']:.0f} s in all, {meta['corpus_mb']:.1f} MB: 6..12 s each, "
        f"{SIZE[0]}x{SIZE[1]}, {FPS} fps H.264 (a keyframe a second), 0..3 scene cuts at any frame, every scene 2..10 s "
        f"or one 12 s scene (seed {a.seed}); served on loopback by `python -m tasks.demo.webserver`",
        *settings(meta),
        "",
        "Per run (wall = the whole command; phase = shardsmith's JSON `seconds` of download (fused with the cutting) and "
        "validate / video2dataset's first shard start to last shard end; CPU = the command's process tree; peak RSS = "
        "the tree's, summed, sampled every 0.25 s; CPU split: the command's process / its multiprocessing children "
        "(Dask's workers; video2dataset's pool) / the rest (Prefect's server; ffmpeg and ffprobe runs); other load = "
        "cores other work used meanwhile):",
        "",
    ]
    lines += table(
        ["tool", "round", "wall s", "phase s", "clips (videos)", "clips/s (wall)", "clips/s (phase)", "CPU s",
         "CPU split s", "CPU s / clip", "peak RSS MB", "other load"],
        [[r.tool, r.round, f"{r.wall_s:.1f}", fmt(r.phase_s), f"{r.ok} ({r.videos}/{r.rows})", f"{r.rate:.2f}",
          fmt(r.phase_rate, ".2f"), f"{r.cpu_s:.1f}", " / ".join(f"{x:.0f}" for x in r.extra.get("split", ())),
          f"{r.cpu_per_clip:.3f}", f"{r.peak_rss_mb:.0f}", f"{r.other_load:.2f}"] for r in runs],
    )  # fmt: skip
    s = {}
    for tool in tools:
        rs = [r for r in runs if r.tool == tool]
        if rs:
            s[tool] = {
                "n": len(rs),
                "wall": med(r.wall_s for r in rs),
                "rate": med(r.rate for r in rs),
                "rate_best": max(r.rate for r in rs),
                "phase_rate": med(r.phase_rate for r in rs),
                "cpu": med(r.cpu_per_clip for r in rs),
                "rss": med(r.peak_rss_mb for r in rs),
                "videos_s": med(r.video_rate for r in rs),
                "clips": sorted({r.ok for r in rs}),
                "check": next((r.check for r in rs if r.check), {}),
            }
    lines += ["", "Summary (medians over rounds; best clips/s in brackets):", ""]
    lines += table(
        ["tool", "runs", "wall s", "clips/s (wall)", "clips/s (phase)", "videos/s (wall)", "CPU s / clip", "peak RSS MB", "clips"],
        [[labels[t], v["n"], f"{v['wall']:.1f}", f"{v['rate']:.2f} ({v['rate_best']:.2f})", fmt(v["phase_rate"], ".2f"),
          f"{v['videos_s']:.2f}", f"{v['cpu']:.3f}", f"{v['rss']:.0f}", "/".join(map(str, v["clips"]))] for t, v in s.items()],
    )  # fmt: skip
    lines += ["", "Clips read back with PyAV (each tool's first round):", ""]
    lines += table(
        ["tool", "clips (planned)", "asked", "not as asked", "lengths s", "spans as planned", "decoded vs claimed length, s"],
        [[t, f"{c['clips']} ({c['expected']})", c["want"], c["wrong_format"], f"{c['min_s']:.2f}..{c['max_s']:.2f}",
          "-" if c["matched"] is None else f"{c['matched']} of {c['clips']}", fmt(c["length_off_s"], ".2f")]
         for t, v in s.items() if (c := v["check"])],
    )  # fmt: skip
    lines += [
        "",
        "Ratios, shardsmith / video2dataset (medians; > 1: shardsmith faster, or for CPU and memory, cheaper):",
        "",
    ]
    for ss, base in pairs:
        if ss in s and base in s:
            x, b = s[ss], s[base]
            unit = "videos/s" if base.endswith("default") else "clips/s"
            key = "videos_s" if unit == "videos/s" else "rate"
            lines.append(
                f"- {labels[ss]} vs {labels[base]}: {unit} {fmt(ratio(x[key], b[key]), '.2f')}x over the whole command"
                + (
                    ""
                    if unit == "videos/s"
                    else f", {fmt(ratio(x['phase_rate'], b['phase_rate']), '.2f')}x over the phase"
                )
                + f"; CPU per clip {fmt(ratio(b['cpu'], x['cpu']), '.2f')}x ({x['cpu']:.3f} vs {b['cpu']:.3f} s); "
                f"peak RSS {x['rss']:.0f} vs {b['rss']:.0f} MB"
            )
    if "ss-equal" in s and "v2d-equal" in s:
        r = ratio(s["ss-equal"]["rate"], s["v2d-equal"]["rate"])
        verdict = "met" if r is not None and r >= target else "NOT met"
        lines.append(
            f"- issue 34's target, >= {target:g}x video2dataset's clips/s on equal settings: {fmt(r, '.2f')}x, {verdict}"
        )
    if "v2d-default" in s and "ss-default" in s:
        lines.append("- at the defaults the work differs: video2dataset stores each video as fetched (no cuts, no transcode), "
                     "shardsmith cuts and transcodes clips; videos/s compares the rate the manifest goes through.")  # fmt: skip
    return "\n".join(lines) + "\n"
