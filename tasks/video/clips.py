"""A probed video cut into clips: scene cuts from frame differences, windows, static and black checks, frame hashes, transcoding.

One decode pass reads every frame once at a small size (64 x 36 grey, FFmpeg's scaler): the
mean absolute difference between neighbours finds scene cuts (a content detector, as
PySceneDetect's) and motion, the mean level finds black, and a 256-bit difference hash of each
clip's frames at a quarter, half and three quarters finds near duplicates between clips. Spans are then cut at scene changes
(``split: scenes``) or only by time (``fixed``), into windows of at most ``max_s`` seconds;
a remainder shorter than ``min_s`` is not a clip. Each kept span is transcoded on its own
(``codec``: H.264, or VP9 for DALI's CPU decoder, in mp4, its index first, no audio), scaled so
its long side is at most ``max_side``.
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from dataclasses import dataclass
from typing import Any

import numpy as np

from tasks.formats.reasons import duplicate_of
from tasks.formats.recipe_video import ClipConfig
from tasks.formats.spooled import Payload, media_source
from tasks.video.probe import CONTAINERS, VideoInfo

SMALL = (64, 36)  # the analysis size: enough for cuts, motion, luminance and the hashes
HASH_AT = (0.25, 0.5, 0.75)  # where in a clip its frames are hashed


@dataclass(frozen=True, slots=True)
class Signals:
    """Per decoded frame: its time, its difference to the frame before (0..1) and its mean level (0..1)."""

    times: np.ndarray
    diffs: np.ndarray
    luma: np.ndarray
    small: np.ndarray  # frames x 18 x 32, uint8


@dataclass(frozen=True, slots=True)
class Clip:
    """One span of a source video: frames [first, end), seconds [start_s, end_s), and its fate."""

    index: int
    first: int
    end: int
    start_s: float
    end_s: float
    scene: int
    motion: float
    luma: float
    hashes: tuple[int, ...]
    reason: str | None = None
    detail: str | None = None


def signals(data: Payload, info: VideoInfo) -> Signals:
    """Decode every frame once, at the analysis size."""
    import av
    from av.video.reformatter import VideoReformatter

    times: list[float] = []
    frames: list[np.ndarray] = []
    # One scaler for the whole video: frame.reformat() builds FFmpeg's anew for every frame,
    # which cost more than the decoding (bench/RESULTS.md, video clips).
    scaler = VideoReformatter()
    with av.open(media_source(data), format=CONTAINERS[info.container], mode="r") as box:
        stream = box.streams.video[0]
        stream.thread_type = "AUTO"
        for frame in box.decode(stream):
            small = scaler.reformat(frame, width=SMALL[0], height=SMALL[1], format="gray").to_ndarray()
            frames.append(small[:, : SMALL[0]])
            times.append(float(frame.time) if frame.time is not None else len(times) / (info.fps or 1.0))
    if times and times[0] != 0.0:  # a stream whose timestamps start later (or earlier): seconds from its first frame
        times = [t - times[0] for t in times]
    small = np.stack(frames) if frames else np.zeros((0, SMALL[1], SMALL[0]), np.uint8)
    diffs = np.zeros(len(frames), np.float32)
    if len(frames) > 1:
        diffs[1:] = np.abs(np.diff(small.astype(np.int16), axis=0)).mean(axis=(1, 2)) / 255.0
    luma = small.mean(axis=(1, 2)).astype(np.float32) / 255.0 if len(frames) else np.zeros(0, np.float32)
    return Signals(np.asarray(times, np.float64), diffs, luma, small)


def scene_starts(sig: Signals, threshold: float) -> list[int]:
    """Frame indexes that start a scene (always 0 for a non-empty video)."""
    if not len(sig.times):
        return []
    return [0] + [int(i) for i in np.nonzero(sig.diffs > threshold)[0] if i > 0]


def dhash(small: np.ndarray) -> int:
    """A 256-bit difference hash of one analysis frame (17 x 16 samples, left-right gradients)."""
    rows = np.linspace(0, small.shape[0] - 1, 16).astype(int)
    cols = np.linspace(0, small.shape[1] - 1, 17).astype(int)
    grid = small[np.ix_(rows, cols)].astype(np.int16)
    bits = (grid[:, 1:] > grid[:, :-1]).flatten()
    return int(sum(1 << i for i, b in enumerate(bits) if b))


def _hashes(sig: Signals, first: int, end: int) -> tuple[int, ...]:
    return tuple(dhash(sig.small[first + int((end - 1 - first) * at)]) for at in HASH_AT)


def _distance(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """The largest Hamming distance between two clips' hashes, frame by frame."""
    return max(bin(x ^ y).count("1") for x, y in zip(a, b, strict=True))


def _frames(sig: Signals, first: int, end: int) -> np.ndarray:
    return sig.small[[first + int((end - 1 - first) * at) for at in HASH_AT]].astype(np.int16)


def cut(sig: Signals, info: VideoInfo, cfg: ClipConfig, spans: list[tuple[float, float]] | None = None) -> list[Clip]:
    """The clips of a video, each with its fate: kept (reason None), ``clip_static``,
    ``clip_black`` or ``duplicate_of:<clip index>`` (an earlier clip of the same video).

    With ``split: captions`` the clips are cut from ``spans`` (seconds; a caption's time span
    each, clamped to the video), and a clip's ``scene`` is the index of its span.
    """
    if not len(sig.times):
        return []
    ends = _frame_ends(sig, info)
    bounds = _bounds(sig, cfg, spans)
    clips: list[Clip] = []
    seen: list[tuple[tuple[int, ...], np.ndarray, int]] = []  # (hashes, frames, index) of kept clips
    for scene, (lo, hi) in enumerate(bounds):
        first = lo
        while first < hi:
            limit = sig.times[first] + cfg.max_s
            end = first
            while end < hi and ends[end] <= limit + 1e-9:
                end += 1
            length = float(ends[end - 1] - sig.times[first])
            if length + 1e-9 >= cfg.min_s:
                clips.append(_judge(sig, cfg, len(clips), first, end, scene, float(ends[end - 1]), seen))
            first = end
    return clips


def _frame_ends(sig: Signals, info: VideoInfo) -> np.ndarray:
    """Where each decoded frame ends, in seconds (its start plus one frame)."""
    n = len(sig.times)
    step = 1.0 / info.fps if info.fps else float(np.median(np.diff(sig.times))) if n > 1 else 0.0
    return sig.times + step


def _bounds(sig: Signals, cfg: ClipConfig, spans: list[tuple[float, float]] | None) -> list[tuple[int, int]]:
    """The frames [lo, hi) of every scene (``scenes``), of the whole video (``fixed``) or of every
    caption span (``captions``): what ``cut`` windows into clips."""
    if cfg.split == "captions":
        if spans is None:
            raise ValueError("split: captions needs the captions' time spans")
        # A frame belongs to a span when it starts inside it.
        return [
            (int(np.searchsorted(sig.times, a - 1e-6)), int(np.searchsorted(sig.times, b - 1e-6))) for a, b in spans
        ]
    starts = scene_starts(sig, cfg.scene_threshold) if cfg.split == "scenes" else [0]
    return list(zip(starts, starts[1:] + [len(sig.times)], strict=True))


def no_clips_detail(
    sig: Signals, info: VideoInfo, cfg: ClipConfig, spans: list[tuple[float, float]] | None = None
) -> str:
    """Why ``cut`` found no clip: the video's length, how many scenes (or caption spans) it
    split into, the longest of them, and ``min_s`` none of them reached."""
    head = f"{info.duration_s:.2f} s declared"
    if not len(sig.times):
        return f"{head}, no frame decoded"
    ends = _frame_ends(sig, info)
    bounds = _bounds(sig, cfg, spans)
    lengths = [float(ends[hi - 1] - sig.times[lo]) if hi > lo else 0.0 for lo, hi in bounds]
    longest = max(range(len(lengths)), key=lengths.__getitem__) if lengths else None
    what = {
        "scenes": f"{len(bounds)} scene(s) at clips.scene_threshold {cfg.scene_threshold:g}",
        "fixed": "split: fixed (one span)",
        "captions": f"{len(bounds)} caption span(s)",
    }[cfg.split]
    decoded = f"{len(sig.times)} frames decoded"
    if longest is None:
        return f"{head}, {decoded}, {what}: nothing to cut"
    lo, hi = bounds[longest]
    at = f"{float(sig.times[lo]):.2f}-{float(ends[hi - 1]):.2f} s" if hi > lo else "no frame inside it"
    return (
        f"{head}, {decoded}, {what}; the longest is {lengths[longest]:.2f} s ({at}), "
        f"shorter than clips.min_s {cfg.min_s:g}"
    )


def _judge(sig: Signals, cfg: ClipConfig, index: int, first: int, end: int, scene: int, end_s: float, seen) -> Clip:
    motion = float(sig.diffs[first + 1 : end].mean()) if end - first > 1 else 0.0
    luma = float(sig.luma[first:end].mean())
    hashes = _hashes(sig, first, end)
    reason = detail = None
    if luma < cfg.min_luma:
        reason, detail = "clip_black", f"mean level {luma:.3f} (minimum {cfg.min_luma:g})"
    elif motion < cfg.min_motion:
        reason, detail = "clip_static", f"mean frame difference {motion:.4f} (minimum {cfg.min_motion:g})"
    else:
        # The hashes see edges only: a square on blue and one on yellow hash alike, so the
        # frames' levels must agree too.
        frames = _frames(sig, first, end)
        near = next(
            (
                (h, i, level)
                for h, f, i in seen
                if _distance(h, hashes) <= cfg.near_bits
                and (level := float(np.abs(f - frames).mean()) / 255.0) <= cfg.near_level
            ),
            None,
        )
        if near is not None:
            bits = _distance(near[0], hashes)
            reason = duplicate_of(str(near[1]))
            detail = f"frame hashes differ in at most {bits} of 256 bits, levels by {near[2]:.3f}"
        else:
            seen.append((hashes, frames, index))
    start_s = round(float(sig.times[first]), 3)
    return Clip(index, first, end, start_s, round(end_s, 3), scene, motion, luma, hashes, reason, detail)


def display_size(info: VideoInfo) -> tuple[int, int]:
    """Width and height as a player shows the video (a quarter turn swaps them)."""
    return (info.height, info.width) if info.rotation in (90, 270) else (info.width, info.height)


def orient(img: np.ndarray, info: VideoInfo) -> np.ndarray:
    """A decoded frame's pixels (rows x columns [x channels]) turned as a player shows them."""
    turned = np.rot90(img, k=(-info.rotation // 90) % 4) if info.rotation % 360 else img
    return np.ascontiguousarray(turned[:, ::-1] if info.mirrored else turned)


def _turned(info: VideoInfo) -> bool:
    return bool(info.rotation % 360 or info.mirrored)


def clip_size(info: VideoInfo, cfg: ClipConfig) -> tuple[int, int]:
    """A transcoded clip's width and height as a player shows it: the long side at most
    ``max_side``, never upscaled, both even (H.264's 4:2:0 needs them so)."""
    width, height = display_size(info)
    scale = min(1.0, cfg.max_side / max(width, height))
    return max(2, int(width * scale) // 2 * 2), max(2, int(height * scale) // 2 * 2)


class _ClipWriter:
    """One clip's H.264 (or VP9) encoder into an mp4 file whose index comes first (readers can stream it)."""

    def __init__(self, info: VideoInfo, clip: Clip, cfg: ClipConfig):
        import av
        import av.video.reformatter

        self.w, self.h = clip_size(info, cfg)
        self.av, self.info, self.turned = av, info, _turned(info)
        self.to_yuv = av.video.reformatter.VideoReformatter()  # a second one: each keeps its own scaler
        self.scaler = av.video.reformatter.VideoReformatter()  # one per clip, not one per frame
        self.rate = cfg.fps or info.fps or 25.0
        self.source_fps = info.fps or self.rate
        self.clip = clip
        self.tick = 1 / _fraction(self.rate)
        handle, self.path = tempfile.mkstemp(suffix=".mp4")
        os.close(handle)
        self.out = av.open(self.path, mode="w", format="mp4", options={"movflags": "+faststart"})
        options: dict[str, object]
        if cfg.codec == "vp9":
            self.stream = self.out.add_stream("libvpx-vp9", rate=_fraction(self.rate))
            # Constant quality (crf with no bit-rate target); "good" at speed 5 is libvpx's
            # usual offline setting, row-mt its threading within a frame.
            options = {"crf": str(cfg.crf), "b": "0", "deadline": "good", "cpu-used": "5", "row-mt": "1"}
        else:
            self.stream = self.out.add_stream("libx264", rate=_fraction(self.rate))
            options = {"crf": str(cfg.crf), "preset": "veryfast"}
        self.stream.width, self.stream.height, self.stream.pix_fmt = self.w, self.h, "yuv420p"
        self.stream.options = options
        self.written = 0
        self.start: float | None = None  # the clip's first frame's time, as the stream gives it
        self.last: Any = None  # the picture written last

    def add(self, i: int, frame, when: float | None) -> None:
        """Frame ``i`` of the video, shown at ``when`` s (its time as decoded: read before any
        writer numbers the frame, which writers of overlapping clips share)."""
        if when is None:
            t = (i - self.clip.first) / self.source_fps
        else:  # the frame's own time: a variable frame rate's frames are not evenly spaced
            self.start = when if self.start is None else self.start
            t = when - self.start
        if t * self.rate + 1e-6 < self.written:  # a lower output rate drops frames evenly
            return
        if self.turned:  # scaled as stored, then turned as a player shows it
            stored = (self.h, self.w) if self.info.rotation in (90, 270) else (self.w, self.h)
            rgb = self.scaler.reformat(frame, width=stored[0], height=stored[1], format="rgb24").to_ndarray()
            upright = self.av.VideoFrame.from_ndarray(orient(rgb, self.info), format="rgb24")
            picture = self.to_yuv.reformat(upright, format="yuv420p")
        else:
            picture = self.scaler.reformat(frame, width=self.w, height=self.h, format="yuv420p")
        # a gap before this frame (a variable frame rate): the picture before it shows until its time
        while self.last is not None and self.written + 1 <= t * self.rate + 1e-6:
            self._write(self.last)
        self._write(picture)
        self.last = picture

    def _write(self, picture: Any) -> None:
        picture.pts, picture.time_base = self.written, self.tick  # numbered at the output rate
        self.written += 1
        for packet in self.stream.encode(picture):
            self.out.mux(packet)

    def finish(self) -> bytes:
        try:
            for packet in self.stream.encode():
                self.out.mux(packet)
            self.out.close()
            with open(self.path, "rb") as f:
                return f.read()
        finally:
            os.unlink(self.path)

    def abandon(self) -> None:
        with contextlib.suppress(Exception):
            self.out.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def look_points(frames: int) -> list[tuple[int, str]]:
    """Where a check of a clip's pixels looks when it looks at ``frames`` (odd) frames: ``(k,
    label)`` for the frames ``k / (frames + 1)`` of the way through, the middle one (the
    keyframe) left out; the label is that share, as ``0.25``."""
    return [(k, share_label(k / (frames + 1))) for k in range(1, frames + 1) if 2 * k != frames + 1]


def share_label(share: float) -> str:
    """``0.25``, ``0.5``, ``0.17``: a share of the way through a clip, as the json names its frames."""
    return f"{share:.2f}".rstrip("0")


def render(
    data: Payload,
    info: VideoInfo,
    clips: list[Clip],
    cfg: ClipConfig,
    side: int = 160,
    encode: bool | set[int] = True,
    stills: dict[int, list[tuple[str, Any]]] | None = None,
    looks: int = 3,
) -> dict[int, tuple[bytes | None, bytes]]:
    """Every clip's mp4 (when ``encode``, or when its index is in it) and a JPEG of its middle
    frame (long side ``side``), by clip index, in one decode pass over the video (clips may
    overlap: caption spans do). With ``stills``, each clip's other frames of the ``looks`` spread
    through it (``look_points``) go into it too, as (label, RGB image of the keyframe's size) by
    clip index: with the middle frame, what a check of a clip's pixels looks at."""
    import av
    from PIL import Image

    todo = sorted(clips, key=lambda c: c.first)
    scale = side / max(info.width, info.height)
    size = (max(1, int(info.width * scale)), max(1, int(info.height * scale)))
    points = look_points(looks)
    looked = {c.index: {c.first + k * (c.end - c.first) // (looks + 1): at for k, at in points} for c in clips}
    mp4s: dict[int, bytes] = {}
    jpgs: dict[int, bytes] = {}

    def still(frame: Any) -> Any:
        image = frame.to_image(width=size[0], height=size[1])
        return Image.fromarray(orient(np.asarray(image), info)) if _turned(info) else image

    k = 0
    active: dict[int, tuple[Clip, _ClipWriter | None]] = {}
    try:
        with av.open(media_source(data), format=CONTAINERS[info.container], mode="r") as src:
            for i, frame in enumerate(src.decode(src.streams.video[0])):
                for index, (clip, writer) in list(active.items()):
                    if i >= clip.end:
                        if writer is not None:
                            mp4s[index] = writer.finish()
                        del active[index]
                while k < len(todo) and todo[k].first <= i:
                    clip = todo[k]
                    if i < clip.end:
                        wanted = encode if isinstance(encode, bool) else clip.index in encode
                        active[clip.index] = (clip, _ClipWriter(info, clip, cfg) if wanted else None)
                    k += 1
                if not active and k == len(todo):
                    break
                when = None if frame.time is None else float(frame.time)
                for clip, writer in active.values():
                    if writer is not None:
                        writer.add(i, frame, when)
                    if i == (clip.first + clip.end) // 2:
                        out = io.BytesIO()
                        still(frame).save(out, "JPEG", quality=85)
                        jpgs[clip.index] = out.getvalue()
                    if stills is not None and i in looked[clip.index]:
                        stills.setdefault(clip.index, []).append((looked[clip.index][i], still(frame)))
        for index, (_, writer) in list(active.items()):
            if writer is not None:
                mp4s[index] = writer.finish()
            del active[index]
    finally:
        for _, writer in active.values():
            if writer is not None:
                writer.abandon()
    missing = [c.index for c in todo if c.index not in jpgs]
    if missing:
        raise ValueError(f"clips {missing} end past the last frame the decoder gave")
    return {c.index: (mp4s.get(c.index), jpgs[c.index]) for c in todo}


def transcode(data: Payload, info: VideoInfo, clip: Clip, cfg: ClipConfig) -> bytes:
    """The clip's frames as H.264 in an mp4 whose index comes first (``render`` for one clip)."""
    mp4, _ = render(data, info, [clip], cfg)[clip.index]
    return mp4 or b""


def thumbnail(data: Payload, info: VideoInfo, clip: Clip, side: int = 160) -> bytes:
    """A JPEG of the clip's middle frame, its long side ``side`` pixels, for the report."""
    return render(data, info, [clip], ClipConfig(), side=side, encode=False)[clip.index][1]


def _fraction(rate: float):
    from fractions import Fraction

    return Fraction(rate).limit_denominator(1001)
