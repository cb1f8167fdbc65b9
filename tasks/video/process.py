"""One source video to its ledger rows: a row for the video, a row for every clip cut from it, and the kept clips' files.

Nothing is lost between videos and clips: every video ends as exactly one row (``ok`` with its
facts and how many clips it gave, or refused: with the probe's reason, ``video_too_small`` or
``aspect_ratio`` from its declared size, or ``video_no_clips``), and every clip as one row
that names its source video's key and its time span (kept, or ``clip_static``, ``clip_black``,
``duplicate_of:<clip key>``). A decoder failure after the probe passed refuses the video
(``undecodable_video``); it never raises out of here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from tasks.formats.reasons import duplicate_of, original_of, status_of
from tasks.formats.spooled import Payload
from tasks.video.clips import Clip, ClipConfig, clip_size, cut, display_size, no_clips_detail, render, signals
from tasks.video.probe import VideoInfo, VideoLimits, probe


@dataclass(frozen=True, slots=True)
class ClipOut:
    """A clip's ledger row, its keyframe (a JPEG of its middle frame), and for a kept clip its mp4;
    ``stills``: its other frames a check of its pixels looks at, as (label, image), where they
    were asked for (``tasks.video.clips.look_points``)."""

    row: dict[str, Any]
    mp4: bytes | None = None
    jpg: bytes | None = None
    stills: tuple[Any, ...] = ()


def clip_key(video_key: str, index: int) -> str:
    return f"{video_key}_c{index:03d}"


def process_video(
    key: str,
    data: Payload,
    limits: VideoLimits,
    cfg: ClipConfig,
    side: int = 160,
    spans: list[tuple[float, float]] | None = None,
    min_side: int = 1,
    max_aspect: float | None = None,
    stills: int = 0,
) -> tuple[dict[str, Any], list[ClipOut]]:
    """The video's row and its clips (none when the video is refused); each kept clip's
    keyframe (its middle frame) is a JPEG whose long side is ``side``. ``spans``: the captions'
    time spans, for ``split: captions``. ``min_side``, ``max_aspect``: what the validation gate
    expects of every sample (``validate.image``): a video whose clips would be smaller or
    narrower is refused from its declared size, before a frame is decoded. ``stills``: how many
    frames of each kept clip a check of its pixels looks at (0: none; odd): the clip carries
    those besides its keyframe (``ClipOut.stills``)."""
    ruling = probe(data, limits)
    if ruling.reason is not None or ruling.value is None:
        return _video_row(key, len(data), None, ruling.reason, ruling.detail), []
    info = ruling.value
    reason, detail = _size_verdict(info, cfg, min_side, max_aspect)
    if reason is not None:
        return _video_row(key, len(data), info, reason, detail), []
    try:
        sig = signals(data, info)
        clips = cut(sig, info, cfg, spans)
        if not clips:
            return _video_row(key, len(data), info, "video_no_clips", no_clips_detail(sig, info, cfg, spans)), []
        # One more decode pass: every kept clip's mp4, every clip's keyframe (the report shows
        # a refused clip by its keyframe).
        frames: dict[int, list[tuple[str, Any]]] | None = {} if stills else None
        encode = {c.index for c in clips if c.reason is None}
        files = render(data, info, clips, cfg, side, encode=encode, stills=frames, looks=max(stills, 1))
        outs = [_clip(key, clip, files.get(clip.index), (frames or {}).get(clip.index, ())) for clip in clips]
    except Exception as err:  # noqa: BLE001 - FFmpeg's errors, whatever they are: the video's reason
        return _video_row(key, len(data), info, "undecodable_video", f"{type(err).__name__}: {err}"), []
    kept = sum(o.row["status"] == "ok" for o in outs)
    return _video_row(key, len(data), info, None, None, clips=len(outs), kept=kept), outs


def _size_verdict(
    info: VideoInfo, cfg: ClipConfig, min_side: int, max_aspect: float | None
) -> tuple[str | None, str | None]:
    """``video_too_small`` or ``aspect_ratio`` when the clips' size (the declared one, scaled to
    ``clips.max_side``) breaks what the gate expects of a sample; (None, None) otherwise."""
    w, h = clip_size(info, cfg)
    declared = f"{info.width}x{info.height} declared"
    if min(w, h) < min_side:
        scaled = "" if (w, h) == display_size(info) else f", clips {w}x{h} at clips.max_side {cfg.max_side}"
        return "video_too_small", f"{declared}{scaled}: short side below validate.image.min_side {min_side}"
    aspect = max(w, h) / min(w, h)
    if max_aspect is not None and aspect > max_aspect:
        return "aspect_ratio", f"{declared}: aspect {aspect:.2f} above validate.image.max_aspect_ratio {max_aspect:g}"
    return None, None


def _video_row(
    key: str, size: int, info: VideoInfo | None, reason: str | None, detail: str | None, clips: int = 0, kept: int = 0
) -> dict[str, Any]:
    facts = asdict(info) if info is not None else dict.fromkeys(VideoInfo.__slots__)
    return {
        "key": key,
        "status": status_of(reason),
        "reason": reason,
        "detail": detail,
        "bytes": size,
        **facts,
        "clips": clips,
        "clips_kept": kept,
    }


def _clip(key: str, clip: Clip, files: tuple[bytes | None, bytes] | None, stills: Any = ()) -> ClipOut:
    reason = clip.reason
    index = original_of(reason)  # another clip of this video: by its index
    if index is not None:
        reason = duplicate_of(clip_key(key, int(index)))
    row = {
        "key": clip_key(key, clip.index),
        "video": key,
        "status": status_of(reason),
        "reason": reason,
        "detail": clip.detail,
        "start_s": clip.start_s,
        "end_s": clip.end_s,
        "scene": clip.scene,
        "motion": round(clip.motion, 5),
        "luma": round(clip.luma, 4),
        "hashes": [f"{h:064x}" for h in clip.hashes],
    }
    if files is None:
        return ClipOut(row)
    mp4, jpg = files
    if reason is not None:
        return ClipOut(row, None, jpg)  # a refused clip keeps its keyframe
    return ClipOut(row, mp4, jpg, tuple(stills))
