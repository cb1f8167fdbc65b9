"""The video demo's corpus: short videos of moving shapes with captions, a scene cut and a few bad files, served on loopback."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tasks.demo.videos import make_video, scene
from tasks.demo.webserver import ImageWeb

SIZE = (160, 90)


def _bar(i: int, _t: float) -> np.ndarray:
    """A green bar falling through a dark red frame."""
    w, h = SIZE
    img = np.full((h, w, 3), (90, 20, 30), np.uint8)
    y = (i * 5) % (h - 12)
    img[y : y + 12, 20 : w - 20] = (40, 220, 90)
    return img


def _photo() -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", SIZE, (200, 120, 40)).save(out, "JPEG")
    return out.getvalue()


# name -> (how it is made, caption, the row's fate: status and reason). The fates are what the
# demo's release ledger must say; ``shardsmith demo --video`` compares them.
def _videos() -> dict[str, tuple[Callable[[], bytes], str, tuple[str, str | None]]]:
    red = make_video(seconds=4, fps=10, size=SIZE)
    return {
        "red-square.mp4": (lambda: red, "a red square slides across a blue sky", ("ok", None)),
        "blue-square.webm": (
            lambda: make_video(
                seconds=3,
                fps=10,
                size=SIZE,
                container="webm",
                codec="libvpx-vp9",
                draw=lambda i, t: scene("b", i, SIZE),
            ),  # fmt: skip
            "a blue square drifts left over yellow sand",
            ("ok", None),
        ),
        "two-scenes.mp4": (
            lambda: make_video(seconds=5, fps=10, size=SIZE, cut_at=2.5),
            "a red square on blue, then a blue square on yellow",
            ("ok", None),
        ),
        "falling-bar.mkv": (
            lambda: make_video(seconds=3, fps=10, size=SIZE, container="mkv", draw=_bar),
            "a green bar falls through a dark red room",
            ("ok", None),
        ),
        "still.mp4": (
            lambda: make_video(seconds=3, fps=10, size=SIZE, draw=lambda i, t: scene("still", i, SIZE)),
            "a red square that never moves",
            ("rejected", "clip_static"),
        ),
        "night.mp4": (
            lambda: make_video(seconds=3, fps=10, size=SIZE, draw=lambda i, t: scene("black", i, SIZE)),
            "nothing to see at night",
            ("rejected", "clip_black"),
        ),
        "blink.mp4": (
            lambda: make_video(seconds=0.5, fps=10, size=SIZE),
            "over in a blink",
            ("rejected", "video_no_clips"),
        ),
        "cut-download.mp4": (lambda: red[: len(red) // 2], "a download cut short", ("rejected", "video_truncated")),
        "photo.mp4": (_photo, "a photo named like a video", ("rejected", "not_a_video")),
        "radio.mp4": (
            lambda: make_video(seconds=2, audio=True, video=False),
            "a tone and no picture",
            ("rejected", "video_no_video_stream"),
        ),
        "mirror.mp4": (lambda: red, "the red square again, from a mirror site", ("rejected", "duplicate_of")),
    }


MISSING = ("gone.mp4", "a video the server no longer has", ("error", "http_404"))


def prepare_video_demo(out_dir: Path, port: int = 18766) -> tuple[ImageWeb, dict[str, Any]]:
    """Write the videos (once) under ``out_dir/videos``, serve them, write the manifest that points
    there (``out_dir/manifests/videos.csv``); the caller stops the server. Returns it and what
    the release ledger must say of each row (``fates``: name -> [status, reason prefix])."""
    from tasks.demo.models import make_all

    folder = Path(out_dir) / "videos"
    folder.mkdir(parents=True, exist_ok=True)
    # The demo's encoders, shared with the image demo (kept when there): curation's dual encoder
    # sees each clip's keyframe, precache encodes the keyframes and the captions, and the clips'
    # sampled frames through the video VAE.
    make_all(Path(out_dir) / "models", ("vae", "video-vae", "clip-text", "clip"))
    videos = _videos()
    for name, (make, _, _) in videos.items():
        if not (folder / name).exists():
            (folder / name).write_bytes(make())
    server = ImageWeb(folder, port=port).start()
    try:
        manifests = Path(out_dir) / "manifests"
        manifests.mkdir(exist_ok=True)
        rows = [(name, caption, fate) for name, (_, caption, fate) in videos.items()] + [MISSING]
        with open(manifests / "videos.csv", "w", newline="") as f:
            out = csv.writer(f)
            out.writerow(["url", "caption", "license"])
            for name, caption, _ in rows:
                out.writerow([server.url(f"/img/{name}"), caption, "CC0-1.0"])
        expected = {"rows": len(rows), "fates": {name: list(fate) for name, _, fate in rows}}
        (manifests / "VIDEO-EXPECTED.json").write_text(json.dumps(expected, indent=1) + "\n")
    except BaseException:
        server.stop()
        raise
    return server, expected


def fate_problems(expected: dict[str, Any], ledger: list[dict[str, Any]], names: list[str]) -> list[str]:
    """Where the release ledger (one row per manifest row, ``names`` in row order) differs from
    the fates the corpus planted."""
    got = {names[r["row"]]: (r["status"], r["reason"]) for r in ledger}
    problems = [f"{n}: no row in the release ledger" for n in names if n not in got]
    for name, (status, reason) in expected["fates"].items():
        if name not in got:
            continue
        s, r = got[name]
        if s != status or (reason is not None and not (r or "").startswith(reason)) or (reason is None and r):
            problems.append(f"{name}: expected {status} {reason or ''}, got {s} {r or ''}".rstrip())
    return problems
