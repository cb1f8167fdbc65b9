"""Untrusted video bytes probed from their container's headers, under limits, before any frame is decoded.

Decisions (tests/test_video_probe.py pins each, on files PyAV writes and on their hostile edits):

- The container is sniffed from the bytes (ISO BMFF ``ftyp``, Matroska/WebM's EBML magic, RIFF
  AVI), never from the URL's extension or the Content-Type: a video named ``.jpg`` is probed as
  a video, an image named ``.mp4`` is ``not_a_video`` with what it is in the detail.
- FFmpeg's demuxer (through PyAV) reads the headers only: how many bytes it may read to find
  the streams is capped (``probe_bytes``), and it is told the container, so it never guesses.
- Every limit is checked on what the headers declare: stream count, the video stream's codec,
  width x height, duration and frame count. A file that declares 100,000 x 100,000 pixels, a
  billion frames or ten thousand streams is refused here, with no frame decoded.
- Truncation: an mp4 without its index (``moov``) cannot be opened at all; one whose index
  is whole but whose media data is cut holds fewer packets than the index declares. Packets
  are counted by demuxing (no decoding), which costs a read of the bytes already in memory.
  An index at the end of the file (no "faststart") is a valid file and passes.
- Orientation (a display matrix: every portrait phone video has one) is reported, not applied:
  the clip cutter turns the frames when it decodes, so clips and keyframes come out as a player
  shows them. This PyAV exposes the matrix on decoded frames only, not on the stream, so once
  every limit has passed the probe decodes the first packet for it.
"""

from __future__ import annotations

from dataclasses import dataclass

from tasks.formats.recipe_video import VideoLimits
from tasks.formats.spooled import Payload, SpooledBody, media_source
from tasks.policies.ruling import Ruling
from tasks.policies.sniff import SNIFF_BYTES, container_verdict

# Container names as FFmpeg's demuxers call them, and the sniffed families they read.
CONTAINERS = {"mp4": "mov", "webm": "matroska", "mkv": "matroska", "avi": "avi"}


@dataclass(frozen=True, slots=True)
class VideoInfo:
    """What a video's headers say, once they passed the limits (the ledger and report show it)."""

    container: str
    codec: str
    width: int
    height: int
    fps: float
    duration_s: float
    frames: int
    rotation: int  # degrees a player turns the frames clockwise: 0, 90, 180 or 270
    audio: bool
    streams: int
    mirrored: bool = False  # a player then flips them left to right


# A display matrix's (a, b, c, d), as signs, to (clockwise degrees, mirrored): frame pixel (x, y)
# is shown at (a x + c y, b x + d y). Matrices that are not quarter turns are ignored.
_TURNS: dict[tuple[int, ...], tuple[int, bool]] = {
    (1, 0, 0, 1): (0, False),
    (0, 1, -1, 0): (90, False),
    (-1, 0, 0, -1): (180, False),
    (0, -1, 1, 0): (270, False),
    (-1, 0, 0, 1): (0, True),
    (0, 1, 1, 0): (90, True),
    (1, 0, 0, -1): (180, True),
    (0, -1, -1, 0): (270, True),
}


def probe(data: Payload, limits: VideoLimits) -> Ruling[VideoInfo]:
    """The video's header facts, or the first limit it breaks (a stable reason and a detail).
    ``data``: the bytes, or a spooled file (read through, never whole)."""
    if not len(data):
        return Ruling(reason="not_a_video", detail="no bytes")
    head = data.head(SNIFF_BYTES) if isinstance(data, SpooledBody) else data
    sniffed = container_verdict(head, limits.containers)
    if sniffed.reason is not None or sniffed.value is None:
        return Ruling(reason=sniffed.reason, detail=sniffed.detail)
    container = sniffed.value
    import av

    try:
        with av.open(
            media_source(data),
            format=CONTAINERS[container],
            options={"probesize": str(limits.probe_bytes), "analyzeduration": "0"},
        ) as box:
            return _check(box, container, limits)
    except av.error.InvalidDataError as err:
        if container == "mp4" and not (data.contains(b"moov") if isinstance(data, SpooledBody) else b"moov" in data):
            return Ruling(reason="video_truncated", detail="no moov box: the index of an mp4 is missing")
        return Ruling(reason="undecodable_video", detail=f"{container}: {err.strerror or err}")
    except (av.error.FFmpegError, OSError, ValueError) as err:
        return Ruling(reason="undecodable_video", detail=f"{container}: {type(err).__name__}: {err}")


def _check(box, container: str, limits: VideoLimits) -> Ruling[VideoInfo]:
    streams = box.streams
    if len(streams) > limits.max_streams:
        return Ruling(reason="video_too_many_streams", detail=f"{len(streams)} streams (limit {limits.max_streams})")
    if not streams.video:
        kinds = sorted({s.type for s in streams}) or ["none"]
        return Ruling(reason="video_no_video_stream", detail=f"streams: {', '.join(kinds)}")
    video = streams.video[0]
    ctx = video.codec_context
    codec = ctx.name or "unknown"
    if codec not in limits.codecs:
        return Ruling(reason="video_unsupported_codec", detail=f"{codec}; allowed: {', '.join(limits.codecs)}")
    w, h = int(ctx.width or 0), int(ctx.height or 0)
    if w > limits.max_width or h > limits.max_height or w * h > limits.max_pixels:
        return Ruling(
            reason="video_too_large",
            detail=f"{w}x{h} declared (limits {limits.max_width}x{limits.max_height}, {limits.max_pixels:,} pixels)",
        )
    if w <= 0 or h <= 0:
        return Ruling(reason="undecodable_video", detail=f"{w}x{h} declared: no frame size")
    duration = _duration(box, video)
    fps = float(video.average_rate or video.guessed_rate or 0)
    declared = int(video.frames or 0)
    if duration > limits.max_duration_s:
        return Ruling(reason="video_too_long", detail=f"{duration:.1f} s declared (limit {limits.max_duration_s:g} s)")
    if declared > limits.max_frames:
        return Ruling(reason="video_too_long", detail=f"{declared:,} frames declared (limit {limits.max_frames:,})")
    if duration < limits.min_duration_s:
        return Ruling(
            reason="video_too_short", detail=f"{duration:.3f} s declared (minimum {limits.min_duration_s:g} s)"
        )
    present, first = 0, None
    for packet in box.demux(video):
        if packet.size:
            present += 1
            if first is None:
                first = packet
            if present > limits.max_frames:  # a container that declares no count (Matroska, WebM), or too few
                return Ruling(
                    reason="video_too_long",
                    detail=f"over {limits.max_frames:,} frames present (limit {limits.max_frames:,})",
                )
    if declared and present < declared:
        return Ruling(reason="video_truncated", detail=f"{present} of {declared} declared frames present")
    frames = declared or present
    rotation, mirrored = _orientation(video, first)
    info = VideoInfo(
        container=container,
        codec=codec,
        width=w,
        height=h,
        fps=round(fps, 3),
        duration_s=round(duration, 3),
        frames=frames,
        rotation=rotation,
        audio=bool(streams.audio),
        streams=len(streams),
        mirrored=mirrored,
    )
    return Ruling(value=info)


def _duration(box, video) -> float:
    """The video stream's declared duration in seconds, else the container's; 0 when none."""
    if video.duration is not None and video.time_base is not None:
        return float(video.duration * video.time_base)
    if box.duration is not None:  # AV_TIME_BASE; Matroska's ends at the last timestamp, so less where they start
        return max(box.duration - max(box.start_time or 0, 0), 0) / 1_000_000
    return 0.0


def _orientation(video, first) -> tuple[int, bool]:
    """How a player turns the frames (clockwise degrees, then mirrored or not): the first
    decoded frame's display matrix, else the old ``rotate`` tag; (0, False) when neither."""
    import numpy as np

    try:
        decoded = video.codec_context.decode(first) + video.codec_context.decode(None) if first else []
    except Exception:  # noqa: BLE001 - FFmpeg's errors: the cutter's decode pass refuses the video
        decoded = []
    for frame in decoded[:1]:
        for side in frame.side_data:
            if "DISPLAYMATRIX" in str(side.type).upper():
                a, b, _, c, d, *_ = np.frombuffer(memoryview(side), "=i4")[:9].tolist()  # FFmpeg's, native order
                return _TURNS.get(tuple(int(np.sign(v)) for v in (a, b, c, d)), (0, False))
    try:
        degrees = int(float((video.metadata or {}).get("rotate", 0))) % 360
    except ValueError:
        return 0, False
    return (degrees, False) if degrees in (0, 90, 180, 270) else (0, False)
