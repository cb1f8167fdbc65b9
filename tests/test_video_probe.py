"""Video probing: facts from the headers of files PyAV writes, and every hostile edit refused before a frame is decoded."""

from __future__ import annotations

import io

import pytest
from PIL import Image
from video_fixtures import find_box, make_video, patch

from tasks.formats.reasons import REASONS
from tasks.video.probe import VideoLimits, probe

LIMITS = VideoLimits()


@pytest.fixture(scope="module")
def mp4() -> bytes:
    return make_video(seconds=2.0, fps=10)


@pytest.mark.parametrize(
    "kwargs, container, codec",
    [
        ({}, "mp4", "h264"),
        ({"faststart": False}, "mp4", "h264"),  # the index at the end is a valid file
        ({"container": "webm", "codec": "libvpx-vp9"}, "webm", "vp9"),
        ({"container": "mkv"}, "mkv", "h264"),
    ],
)
def test_headers_give_the_facts(kwargs, container, codec):
    info = probe(make_video(seconds=2.0, fps=10, size=(96, 64), **kwargs), LIMITS)
    assert info.reason is None, info.detail
    v = info.value
    assert (v.container, v.codec, v.width, v.height) == (container, codec, 96, 64)
    assert (v.fps, v.duration_s, v.frames, v.audio, v.streams) == (10.0, 2.0, 20, False, 1)


def test_audio_is_reported_and_audio_alone_is_no_video():
    assert probe(make_video(audio=True), LIMITS).value.audio is True
    alone = probe(make_video(audio=True, video=False), LIMITS)
    assert (alone.reason, alone.detail) == ("video_no_video_stream", "streams: audio")


def test_the_bytes_decide_not_the_name():
    jpeg = io.BytesIO()
    Image.new("RGB", (8, 8)).save(jpeg, "JPEG")
    image = probe(jpeg.getvalue(), LIMITS)  # an image named .mp4
    assert (image.reason, image.detail) == ("not_a_video", "a jpeg image")
    page = probe(b"<!DOCTYPE html><html><body>gone</body></html>", LIMITS)
    assert page.reason == "not_a_video" and "HTML" in page.detail


def test_a_cut_download_is_truncated(mp4):
    half = probe(mp4[: len(mp4) // 2], LIMITS)  # index first (faststart), media data cut
    assert half.reason == "video_truncated" and "declared frames present" in half.detail
    late = make_video(faststart=False)
    cut = probe(late[: len(late) // 2], LIMITS)  # index at the end: cut off with it
    assert (cut.reason, cut.detail) == ("video_truncated", "no moov box: the index of an mp4 is missing")


def test_declared_sizes_over_the_limits_are_refused_undecoded():
    big = probe(make_video(size=(4000, 2400), seconds=0.2), LIMITS)
    assert big.reason == "video_too_large" and "4000x2400" in big.detail
    small = VideoLimits(max_pixels=96 * 63)
    assert probe(make_video(size=(96, 64)), small).reason == "video_too_large"


def test_a_billion_declared_frames_are_refused_at_once(mp4):
    off, _ = find_box(mp4, ["moov", "trak", "mdia", "minf", "stbl", "stts"])
    hostile = patch(mp4, off + 16, ">I", 2_000_000_000)  # the one stts entry's sample count
    ruling = probe(hostile, LIMITS)  # from the header: no packet is read, let alone counted
    assert ruling.reason == "video_too_long" and "2,000,000,000 frames" in ruling.detail


@pytest.mark.parametrize("container", ["mkv", "webm"])
def test_frames_over_max_frames_are_counted_where_the_container_declares_none(container):
    codec = "libvpx-vp9" if container == "webm" else "libx264"
    data = make_video(seconds=3.0, fps=40, container=container, codec=codec)  # 120 frames, no count in the header
    assert probe(data, LIMITS).value.frames == 120
    ruling = probe(data, VideoLimits(max_frames=100))
    assert (ruling.reason, ruling.detail) == ("video_too_long", "over 100 frames present (limit 100)")


def test_duration_limits(mp4):
    assert probe(mp4, VideoLimits(max_duration_s=1.5)).reason == "video_too_long"
    assert probe(mp4, VideoLimits(min_duration_s=3)).reason == "video_too_short"
    mdhd, _ = find_box(mp4, ["moov", "trak", "mdia", "mdhd"])
    zero = probe(patch(mp4, mdhd + 24, ">I", 0), LIMITS)  # the track declares a duration of zero
    assert zero.reason == "video_too_short"


def test_too_many_streams_codecs_and_containers():
    many = probe(make_video(container="mkv", extra_streams=40, seconds=0.5), LIMITS)
    assert (many.reason, many.detail) == ("video_too_many_streams", "41 streams (limit 16)")
    codec = probe(make_video(), VideoLimits(codecs=("vp9",)))
    assert (codec.reason, codec.detail) == ("video_unsupported_codec", "h264; allowed: vp9")
    box = probe(make_video(container="mkv"), VideoLimits(containers=("mp4",)))
    assert box.reason == "video_unsupported_container"


@pytest.mark.parametrize("cut", [0, 7, 40, 300])
def test_garbage_after_a_real_start_never_raises(mp4, cut):
    ruling = probe(mp4[:cut] + b"\x00\xff" * 50, LIMITS)
    assert ruling.reason in REASONS and ruling.reason != "ok"


def test_every_reason_is_registered():
    for reason in (
        "not_a_video",
        "video_unsupported_container",
        "video_unsupported_codec",
        "video_no_video_stream",
        "video_too_many_streams",
        "video_too_large",
        "video_too_long",
        "video_too_short",
        "video_truncated",
        "undecodable_video",
    ):
        assert REASONS[reason][0] == "rejected"
