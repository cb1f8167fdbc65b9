"""The recipe's video settings: what a video may declare before any decoding, and how it becomes clips (tasks/video applies them)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class VideoLimits(BaseModel):
    """What a video may declare before shardsmith decodes any of it.

    Args:
        containers: sniffed families accepted (``mp4`` also covers mov and m4v). Default mp4,
            webm, mkv.
        codecs: FFmpeg codec names accepted for the video stream. Default h264, hevc, vp8, vp9,
            av1, mpeg4.
        max_width, max_height: declared frame size. Default 3840 x 2160.
        max_pixels: declared width x height. Default 3840 * 2160.
        max_duration_s: declared duration. Default 3600.
        min_duration_s: declared duration below this is ``video_too_short``. Default 0.1.
        max_frames: declared frames of the video stream. Default 216,000 (an hour at 60 fps).
        max_streams: streams of every kind. Default 16.
        probe_bytes: how far FFmpeg may read to find the streams. Default 5 MB.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    containers: tuple[str, ...] = ("mp4", "webm", "mkv")
    codecs: tuple[str, ...] = ("h264", "hevc", "vp8", "vp9", "av1", "mpeg4")
    max_width: int = Field(3840, gt=0)
    max_height: int = Field(2160, gt=0)
    max_pixels: int = Field(3840 * 2160, gt=0)
    max_duration_s: float = Field(3600.0, gt=0)
    min_duration_s: float = Field(0.1, ge=0)
    max_frames: int = Field(216_000, gt=0)
    max_streams: int = Field(16, gt=0)
    probe_bytes: int = Field(5_000_000, ge=32)


class ClipConfig(BaseModel):
    """How a video becomes clips.

    Args:
        split: ``scenes`` (windows inside the scenes a content detector finds), ``fixed``
            (windows over the whole video) or ``captions`` (windows inside the time spans of
            the row's captions, ``segments_field``; each clip gets its span's caption).
            Default scenes.
        segments_field: with ``split: captions``, the field of the row (a manifest column
            carried by the source's ``extra_columns``, or the ingested sample's json) that holds
            the spans: a JSON list of ``{"start": s, "end": s, "caption": text}`` (or
            ``[start, end, caption]``), seconds from the video's start. Default ``segments``.
        min_s, max_s: a clip's shortest and longest length in seconds. Default 1 and 10.
        scene_threshold: mean absolute difference of neighbouring frames (0..1 of full scale)
            that starts a new scene. Default 0.2.
        min_motion: a clip whose mean difference between neighbouring frames is below this is
            ``clip_static``. Default 0.002.
        min_luma: a clip whose mean level is below this (0..1) is ``clip_black``. Default 0.06.
        max_side: the transcoded clip's long side in pixels (never upscaled). Default 640.
        fps: the transcoded clip's frame rate; None keeps the source's. Default None.
        codec: the clips' video codec in their mp4: ``h264`` (x264) or ``vp9`` (libvpx-vp9,
            which DALI's CPU video decoder reads: ``precache.clip_latents.decoder``). Default h264.
        crf: the constant rate factor: x264's, or libvpx-vp9's constant quality level with
            ``codec: vp9`` (whose scale runs to 63). Default 23.
        near_bits: clips whose 256-bit difference hashes, of the frames at a quarter, half and
            three quarters of each, differ in at most this many bits each are near duplicates.
            Default 16.
        near_level: and whose frames there differ in level by at most this on average (0..1).
            Default 0.04.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    split: Literal["scenes", "fixed", "captions"] = "scenes"
    segments_field: str = "segments"
    min_s: float = Field(1.0, gt=0)
    max_s: float = Field(10.0, gt=0)
    scene_threshold: float = Field(0.2, gt=0, le=1)
    min_motion: float = Field(0.002, ge=0)
    min_luma: float = Field(0.06, ge=0, le=1)
    max_side: int = Field(640, ge=16)
    fps: float | None = Field(None, gt=0)
    codec: Literal["h264", "vp9"] = "h264"
    crf: int = Field(23, ge=0, le=51)
    near_bits: int = Field(16, ge=0, le=256)
    near_level: float = Field(0.04, ge=0, le=1)
