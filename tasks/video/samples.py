"""A video sample judged at validation: its clips as samples (mp4, keyframe, json, txt), or the video's refusal.

What the ledger gets: a video that gave clips is accounted for by its clips' rows, every one
naming the video (``video``) and its span (``start_s``, ``end_s``), kept or refused
(``clip_static``, ``clip_black``, ``duplicate_of:<clip key>``); a video that gave none has one
row of its own with the reason (the probe's, ``video_too_small``, ``video_no_clips``,
``undecodable_video`` ...). So a video is never lost between the download ledger, which has
its row, and the clips. Every row carries what the probe read of its video (``VIDEO_FACTS``: duration, size, frame rate, codec,
container; nulls where the probe refused it), for the report's per-video counts.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

from tasks.formats.ledger import VIDEO_FACTS
from tasks.formats.reasons import status_of
from tasks.formats.recipe_download import VideoRules
from tasks.formats.spooled import Payload
from tasks.policies.privacy import TextOutcome, record_text
from tasks.policies.ruling import Ruling
from tasks.video.clips import clip_size
from tasks.video.probe import VideoInfo
from tasks.video.process import ClipOut, process_video
from tasks.video.segments import Segment, read_segments

# A clip as judged: (ledger row, members or None, keyframe or thumbnail or None).
Judged = tuple[dict[str, Any], dict[str, bytes] | None, bytes | None]
# A check of a kept clip's pixels: (row, members, more of its frames) -> the clip as judged.
Look = Callable[[dict[str, Any], dict[str, bytes], tuple[Any, ...]], Judged]

# What a clip's sample and row say of the video it was cut from (``video_`` + the field).
_SOURCE_FACTS = ("container", "codec", "width", "height", "fps", "duration_s", "frames", "rotation", "audio")


def judge_video(
    key: str,
    data: Payload,
    meta: dict[str, Any],
    row: dict[str, Any],
    cfg: VideoRules,
    caption: str | None,
    clean: Callable[[str | None], Ruling[TextOutcome]],
    *,
    min_side: int,
    max_aspect: float,
    look: Look | None = None,
    look_frames: int = 3,
    spans_from: dict[str, Any] | None = None,
) -> list[tuple[dict[str, Any], dict[str, bytes] | None, bytes | None]]:
    """The (ledger row, members or None, keyframe of a refused clip or None) of every clip of
    the video under ``key``, or of the video alone.

    ``meta`` is the downloaded sample's json and ``row`` the ledger row its license and caption
    checks made (source, row, url, license ...); ``caption`` the cleaned caption, or None;
    ``clean`` the caption rules and privacy check, for the captions of time spans (``split:
    captions``): a clip with its span's own caption records that caption's check in place of
    the video's (a span without one keeps the video's caption and its record);
    ``min_side`` and ``max_aspect`` the image rules' (``validate.image``), which the validation
    gate holds every sample to: a video whose clips would break them is refused unopened;
    ``look`` a check of a kept clip's pixels (the privacy face check): given its row, members
    and its other ``look_frames`` - 1 frames (``ClipOut.stills``), it answers as a clip does;
    ``spans_from`` the json the time spans are read from, where ``meta`` has had its fields
    redacted (so each span's own caption is checked, and recorded, as written).
    """
    segments: list[Segment] | None = None
    if cfg.clips.split == "captions":
        read = read_segments((spans_from if spans_from is not None else meta).get(cfg.clips.segments_field))
        if read.value is None:
            return [(_refused(row, read.reason, read.detail), None, None)]
        segments = read.value
    spans = [(s.start, s.end) for s in segments] if segments is not None else None
    video, clips = process_video(
        key,
        data,
        cfg,
        cfg.clips,
        side=cfg.clips.max_side,
        spans=spans,
        min_side=min_side,
        max_aspect=max_aspect,
        stills=look_frames if look is not None else 0,
    )
    if video["reason"] is not None:
        out = _refused(row, video["reason"], video["detail"])
        out.update(format=video["container"], width=video["width"], height=video["height"], bytes=len(data))
        out.update(_facts(video))
        return [(out, None, None)]
    info = VideoInfo(**{f: video[f] for f in VideoInfo.__slots__})
    width, height = clip_size(info, cfg.clips)
    judged = []
    for c in clips:
        clip_caption, refused, own = caption, None, None
        span = segments[c.row["scene"]] if segments is not None else None
        if span is not None and span.caption is not None:  # the clip's own caption, by the same rules
            checked = clean(span.caption)
            own = checked.value
            clip_caption = own.text if own is not None else None
            if checked.reason is not None:
                refused = (checked.reason, f"span {c.row['scene']}: {checked.detail}")
        judged.append(_clip(c, key, meta, row, info, (width, height), cfg, clip_caption, refused, own, look))
    return judged


def _facts(video: dict[str, Any]) -> dict[str, Any]:
    """The ledger's ``VIDEO_FACTS`` of a probed video (``video_`` + the probe's field)."""
    return {name: video.get(name.removeprefix("video_")) for name in VIDEO_FACTS}


def _refused(row: dict[str, Any], reason: str | None, detail: str | None) -> dict[str, Any]:
    """``row`` refused with ``reason`` (its status follows)."""
    return {**row, "status": status_of(reason), "reason": reason, "detail": detail}


def _clip(
    clip: ClipOut,
    video_key: str,
    meta: dict[str, Any],
    row: dict[str, Any],
    info: VideoInfo,
    size: tuple[int, int],
    cfg: VideoRules,
    caption: str | None,
    refused: tuple[str, str] | None = None,
    own: TextOutcome | None = None,
    look: Look | None = None,
) -> tuple[dict[str, Any], dict[str, bytes] | None, bytes | None]:
    """One clip's (ledger row, members or None, keyframe or None); ``own`` is the check of the
    clip's own caption (its span's), recorded in place of the video's caption's; ``look`` the
    check of a kept clip's pixels."""
    c = clip.row
    if refused is not None and c["reason"] is None:  # its span's caption failed the caption rules
        c = _refused(c, *refused)
        clip = ClipOut(c, None, clip.jpg)
    # Exact duplicates across the dataset (the same video at two URLs): the clip's frame hashes.
    content = hashlib.sha256("".join(c["hashes"]).encode()).hexdigest()
    out = {
        **row,
        "key": c["key"],
        "status": c["status"],
        "reason": c["reason"],
        "detail": c["detail"],
        "video": video_key,
        "start_s": c["start_s"],
        "end_s": c["end_s"],
        **_facts({f: getattr(info, f) for f in _SOURCE_FACTS}),
        "pixel_sha256": content,
        "caption_chars": len(caption) if caption else None,
    }
    if own is not None:  # the video's caption is not this clip's: neither is its privacy record
        out.update(personal_data=own.kinds if own.scanned else None, privacy=None)
    if c["reason"] is not None or clip.mp4 is None or clip.jpg is None:
        return out, None, clip.jpg
    sha = hashlib.sha256(clip.mp4).hexdigest()
    out.update(format="mp4", width=size[0], height=size[1], bytes=len(clip.mp4), sha256=sha)
    sample = {
        **meta,
        "key": c["key"],
        "video": video_key,
        "start_s": c["start_s"],
        "end_s": c["end_s"],
        "duration_s": round(c["end_s"] - c["start_s"], 3),
        "scene": c["scene"],
        "motion": c["motion"],
        "luma": c["luma"],
        "caption": caption,
        "license": row["license"],
        "license_raw": meta.get("license"),
        "width": size[0],
        "height": size[1],
        "fps": cfg.clips.fps or info.fps,
        "format": "mp4",
        "bytes": len(clip.mp4),
        "sha256": sha,
        "src_sha256": meta.get("sha256"),
        "content_sha256": content,
        **{f"video_{f}": getattr(info, f) for f in _SOURCE_FACTS},
    }
    if own is not None:
        sample.pop("personal_data", None)
        record_text(out, sample, own)
    members = {
        "mp4": clip.mp4,
        "jpg": clip.jpg,
        "json": json.dumps(sample, ensure_ascii=False, sort_keys=True).encode(),
    }
    if caption is not None:
        members["txt"] = caption.encode("utf-8")
    return look(out, members, clip.stills) if look is not None else (out, members, None)
