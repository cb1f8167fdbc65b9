"""Hostile videos through probing and cutting, in a process with capped memory: each ends as one video row with a reason."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

from PIL import Image
from video_fixtures import find_box, make_video, patch

ROOT = Path(__file__).resolve().parent.parent
MEMORY_CAP = 3 << 30  # the child's whole address space: a decoder that allocates for declared sizes fails

CHILD = """
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, ({cap}, {cap}))
from tasks.video.clips import ClipConfig
from tasks.video.probe import VideoLimits
from tasks.video.process import process_video
files = json.load(open(sys.argv[1]))
for name, path in files.items():
    row, clips = process_video(name, open(path, "rb").read(), VideoLimits(), ClipConfig(max_s=1.0))
    print(json.dumps({{"name": name, "row": row, "clips": [c.row for c in clips]}}), flush=True)
"""


def _hostile() -> dict[str, tuple[bytes, str | None]]:
    """name -> (bytes, the video row's reason; None: ok)."""
    good = make_video(seconds=2.0, fps=10)
    late = make_video(seconds=2.0, fps=10, faststart=False)
    stts, _ = find_box(good, ["moov", "trak", "mdia", "minf", "stbl", "stts"])
    mdhd, _ = find_box(good, ["moov", "trak", "mdia", "mdhd"])
    jpeg = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 10, 10)).save(jpeg, "JPEG")
    return {
        "good.mp4": (good, None),
        "index-at-end.mp4": (late, None),
        "video-named.jpg": (good, None),  # the name never decides
        "image-named.mp4": (jpeg.getvalue(), "not_a_video"),
        "cut-media.mp4": (good[: len(good) * 2 // 3], "video_truncated"),
        "no-index.mp4": (late[: len(late) // 2], "video_truncated"),
        "huge-frame.mp4": (make_video(size=(4000, 2400), seconds=0.2), "video_too_large"),
        "billion-frames.mp4": (patch(good, stts + 16, ">I", 2_000_000_000), "video_too_long"),
        "zero-duration.mp4": (patch(good, mdhd + 24, ">I", 0), "video_too_short"),
        "many-streams.mkv": (make_video(container="mkv", extra_streams=200, seconds=0.3), "video_too_many_streams"),
        "audio-only.mp4": (make_video(audio=True, video=False), "video_no_video_stream"),
        "empty.mp4": (b"", "not_a_video"),
        "html.mp4": (b"<html><body>404</body></html>", "not_a_video"),
        "garbage-after-ftyp.mp4": (good[:32] + os.urandom(4096), "video_truncated"),  # its moov is gone
    }


def test_every_hostile_video_ends_as_one_row_with_its_reason(tmp_path):
    cases = _hostile()
    paths = {}
    for name, (data, _) in cases.items():
        (tmp_path / name).write_bytes(data)
        paths[name] = str(tmp_path / name)
    (tmp_path / "files.json").write_text(json.dumps(paths))
    done = subprocess.run(
        [sys.executable, "-c", CHILD.format(cap=MEMORY_CAP), str(tmp_path / "files.json")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = {r["name"]: r for r in map(json.loads, done.stdout.splitlines())}
    assert sorted(results) == sorted(cases)  # one row per video, none lost
    for name, (_, reason) in cases.items():
        row = results[name]["row"]
        assert row["reason"] == reason, (name, row["reason"], row["detail"])
        assert row["key"] == name
        if reason is None:
            assert row["status"] == "ok" and row["clips"] == len(results[name]["clips"]) == 2
            assert {c["video"] for c in results[name]["clips"]} == {name}
        else:
            assert row["status"] == "rejected" and row["detail"] and results[name]["clips"] == []
