"""Clips: scene cuts, windows, static, black and duplicate clips, and the transcoded clip, on videos PyAV writes."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest
from PIL import Image
from video_fixtures import make_video, scene

from tasks.formats.reasons import status_of
from tasks.video.clips import ClipConfig, cut, render, signals, thumbnail, transcode
from tasks.video.probe import VideoLimits, probe

SIZE = (160, 96)
FPS = 10


def _clips(data: bytes, **cfg):
    info = probe(data, VideoLimits()).value
    return info, cut(signals(data, info), info, ClipConfig(**cfg))


def _video(*parts: tuple[str, float]) -> bytes:
    """Scenes one after another: (kind, seconds) each; each scene starts from its first frame."""
    frames = [(kind, i) for kind, seconds in parts for i in range(int(seconds * FPS))]
    return make_video(seconds=len(frames) / FPS, fps=FPS, size=SIZE, draw=lambda n, t: scene(*frames[n], SIZE))


def test_a_scene_cut_starts_a_clip_and_windows_keep_to_max_s():
    _, clips = _clips(_video(("a", 3.0), ("b", 3.5)), max_s=2.0, min_s=1.0)
    spans = [(c.start_s, c.end_s, c.scene) for c in clips]
    # Scene a: 0-2, 2-3; scene b from the cut at 3 s: 3-5, 5-6.5 (nothing crosses the cut).
    assert spans == [(0.0, 2.0, 0), (2.0, 3.0, 0), (3.0, 5.0, 1), (5.0, 6.5, 1)]
    assert all(c.reason is None for c in clips), [(c.reason, c.detail) for c in clips]


def test_fixed_windows_ignore_scenes_and_drop_a_short_remainder():
    _, clips = _clips(_video(("a", 3.0), ("b", 3.5)), split="fixed", max_s=2.0, min_s=1.0)
    assert [(c.start_s, c.end_s) for c in clips] == [(0.0, 2.0), (2.0, 4.0), (4.0, 6.0)]  # 6-6.5 s is too short


def test_caption_spans_are_cut_into_windows_inside_each_span_and_clamped_to_the_video():
    info, _ = _clips(_video(("a", 3.0), ("b", 3.5)))
    data = _video(("a", 3.0), ("b", 3.5))
    sig = signals(data, info)
    # Spans may overlap, leave gaps, ignore scenes and run past the end (clamped there).
    spans = [(0.5, 2.0), (1.5, 5.2), (6.0, 9.0), (9.5, 12.0)]
    clips = cut(sig, info, ClipConfig(split="captions", max_s=2.0, min_s=0.5), spans)
    got = [(c.start_s, c.end_s, c.scene) for c in clips]
    assert got == [(0.5, 2.0, 0), (1.5, 3.5, 1), (3.5, 5.2, 1), (6.0, 6.5, 2)]
    # Overlapping clips each get all their frames from the one decode pass.
    files = render(data, info, clips, ClipConfig(split="captions", max_s=2.0, min_s=0.5))
    counts = []
    for c in clips:
        with av.open(io.BytesIO(files[c.index][0])) as box:
            counts.append(sum(1 for _ in box.decode(video=0)))
    assert counts == [15, 20, 17, 5]
    with pytest.raises(ValueError, match="time spans"):
        cut(sig, info, ClipConfig(split="captions"))


def test_black_and_static_clips_are_rejected_with_their_measure():
    _, clips = _clips(_video(("a", 2.0), ("black", 2.0), ("still", 2.0)), max_s=2.0)
    assert [c.reason for c in clips] == [None, "clip_black", "clip_static"]
    assert "mean level" in clips[1].detail and "mean frame difference" in clips[2].detail
    assert all(status_of(c.reason) == "rejected" for c in clips[1:])


def test_a_scene_shown_again_is_a_duplicate_of_its_first_clip():
    _, clips = _clips(_video(("a", 2.0), ("b", 2.0), ("a", 2.0)), max_s=2.0)
    assert [c.reason for c in clips] == [None, None, "duplicate_of:0"]
    assert "bits" in clips[2].detail


@pytest.mark.parametrize("fps, frames", [(None, 20), (5.0, 10)])
def test_a_clip_is_transcoded_to_its_span_rate_and_size(fps, frames):
    data = _video(("a", 3.0), ("b", 3.0))
    info, clips = _clips(data, max_s=2.0)
    out = transcode(data, info, clips[2], ClipConfig(fps=fps, max_side=80))
    clip = probe(out, VideoLimits()).value
    assert (clip.container, clip.codec, clip.width, clip.height) == ("mp4", "h264", 80, 48)
    assert (clip.frames, clip.duration_s) == (frames, 2.0)
    assert out[4:8] == b"ftyp" and out.index(b"moov") < out.index(b"mdat")  # index first: streamable
    # It is the second scene's picture: yellow background.
    info2 = probe(out, VideoLimits()).value
    first = cut(signals(out, info2), info2, ClipConfig(min_s=0.1))[0]
    assert first.luma > 0.5


def test_a_thumbnail_is_the_clips_middle_frame():
    data = _video(("a", 2.0), ("b", 2.0))
    info, clips = _clips(data, max_s=2.0)
    image = Image.open(io.BytesIO(thumbnail(data, info, clips[1], side=80)))
    assert image.format == "JPEG" and image.size == (80, 48)
    r, g, b = image.convert("RGB").getpixel((2, 2))
    assert r > 150 and g > 150 and b < 100  # scene b's yellow


def test_every_kept_clip_gets_its_own_file_from_one_pass():
    from tasks.video.process import process_video

    row, outs = process_video("v", _video(("a", 3.0), ("b", 2.0)), VideoLimits(), ClipConfig(max_s=2.0, fps=5.0))
    assert row["clips"] == row["clips_kept"] == 3
    spans = [(o.row["start_s"], o.row["end_s"]) for o in outs]
    assert spans == [(0.0, 2.0), (2.0, 3.0), (3.0, 5.0)]
    for out, (start, end) in zip(outs, spans, strict=True):
        clip = probe(out.mp4, VideoLimits()).value
        assert (clip.frames, clip.duration_s) == (round((end - start) * 5), end - start)
        assert Image.open(io.BytesIO(out.jpg)).format == "JPEG"


def test_a_video_with_no_clip_says_what_its_scenes_were():
    from tasks.video.process import process_video

    flicker = _video(("a", 0.5), ("b", 0.5), ("a", 0.5), ("b", 0.8), ("a", 0.5), ("b", 0.2))
    row, outs = process_video("v", flicker, VideoLimits(), ClipConfig(min_s=1.0))
    assert outs == [] and row["reason"] == "video_no_clips"
    assert row["detail"] == (
        "3.00 s declared, 30 frames decoded, 6 scene(s) at clips.scene_threshold 0.2; "
        "the longest is 0.80 s (1.50-2.30 s), shorter than clips.min_s 1"
    )
    row, _ = process_video("v", _video(("a", 0.5)), VideoLimits(), ClipConfig(split="fixed", min_s=1.0))
    assert row["detail"] == (
        "0.50 s declared, 5 frames decoded, split: fixed (one span); the longest is 0.50 s (0.00-0.50 s), "
        "shorter than clips.min_s 1"
    )


def test_a_video_smaller_or_narrower_than_the_gate_expects_is_refused_before_decoding(monkeypatch):
    import tasks.video.process as process

    def no_decoding(*_):
        raise AssertionError("decoded")

    monkeypatch.setattr(process, "signals", no_decoding)
    tiny = make_video(seconds=1.0, size=(48, 32))
    row, outs = process.process_video("v", tiny, VideoLimits(), ClipConfig(), min_side=64, max_aspect=4.0)
    assert (row["reason"], row["width"], outs) == ("video_too_small", 48, [])
    assert row["detail"] == "48x32 declared: short side below validate.image.min_side 64"
    # Declared large enough, but its clips are scaled below the minimum by clips.max_side.
    row, _ = process.process_video(
        "v", make_video(seconds=1.0, size=(320, 96)), VideoLimits(), ClipConfig(max_side=160), min_side=64
    )
    assert row["reason"] == "video_too_small" and "clips 160x48 at clips.max_side 160" in row["detail"]
    row, _ = process.process_video(
        "v", make_video(seconds=1.0, size=(400, 80)), VideoLimits(), ClipConfig(), min_side=64, max_aspect=4.0
    )
    assert row["reason"] == "aspect_ratio" and row["detail"].startswith("400x80 declared: aspect 5.00")


MARK = (0, 255, 0)


def _marked(i: int, t: float):
    img = scene("a", i, SIZE)
    img[:12, :12] = MARK  # the stored frame's top-left corner, clear of the moving square
    return img


def _corner(img) -> str:
    """Which corner of an RGB image (rows x columns x 3) holds the green mark."""
    h, w = img.shape[:2]
    corners = {
        "top-left": img[:4, :4],
        "top-right": img[:4, -4:],
        "bottom-left": img[-4:, :4],
        "bottom-right": img[-4:, -4:],
    }
    return max(corners, key=lambda k: int(corners[k][..., 1].mean()) - int(corners[k][..., 0].mean()))


@pytest.mark.parametrize(
    ("matrix", "turn", "corner"),
    [
        ((0, 1, -1, 0), (90, False), "top-right"),
        ((-1, 0, 0, -1), (180, False), "bottom-right"),
        ((0, -1, 1, 0), (270, False), "bottom-left"),
        ((-1, 0, 0, 1), (0, True), "top-right"),  # mirrored: flipped left to right
    ],
)
def test_clips_and_keyframes_come_out_as_a_player_shows_a_rotated_video(matrix, turn, corner):
    from video_fixtures import display_matrix

    from tasks.video.process import process_video

    data = display_matrix(make_video(seconds=2.0, fps=FPS, size=SIZE, draw=_marked), *matrix)
    info = probe(data, VideoLimits()).value
    assert (info.rotation, info.mirrored, info.width, info.height) == (*turn, *SIZE)
    shown = SIZE[::-1] if turn[0] in (90, 270) else SIZE
    row, outs = process_video("v", data, VideoLimits(), ClipConfig(max_s=2.0), side=80)
    (out,) = outs
    assert row["clips_kept"] == 1
    with av.open(io.BytesIO(out.mp4)) as box:
        frame = next(box.decode(video=0)).to_ndarray(format="rgb24")
    assert frame.shape[1::-1] == shown
    assert _corner(frame) == corner
    keyframe = Image.open(io.BytesIO(out.jpg)).convert("RGB")
    assert keyframe.size == tuple(round(80 * s / max(SIZE)) for s in shown)
    assert _corner(np.asarray(keyframe)) == corner


def _timed(pts: list[int], rate: int, container: str = "matroska") -> bytes:
    """A video whose frames carry these timestamps (1 / ``rate`` s units): a stream that starts
    late, or a variable frame rate (phones)."""
    import fractions
    import os
    import tempfile

    handle, path = tempfile.mkstemp(suffix=".mkv")
    os.close(handle)
    try:
        with av.open(path, "w", format=container) as box:
            stream = box.add_stream("libx264", rate=rate)
            stream.width, stream.height, stream.pix_fmt = SIZE[0], SIZE[1], "yuv420p"
            stream.codec_context.time_base = stream.time_base = fractions.Fraction(1, rate)
            stream.options = {"preset": "ultrafast", "bf": "0"}
            for n, p in enumerate(pts):
                frame = av.VideoFrame.from_ndarray(scene("a", n, SIZE), format="rgb24")
                frame.pts, frame.time_base = p, fractions.Fraction(1, rate)
                for packet in stream.encode(frame):
                    box.mux(packet)
            for packet in stream.encode():
                box.mux(packet)
        with open(path, "rb") as fh:
            return fh.read()
    finally:
        os.unlink(path)


def _seconds(mp4: bytes) -> tuple[int, float]:
    """An mp4's frames, and where its last one ends (its time and one frame at the stream's rate)."""
    with av.open(io.BytesIO(mp4)) as box:
        rate = float(box.streams.video[0].average_rate)
        frames = list(box.decode(video=0))
    return len(frames), round(float(frames[-1].time) + 1 / rate, 3)


def test_a_stream_that_starts_late_is_timed_from_its_first_frame():
    data = _timed([100 + n for n in range(30)], 10)  # 3 s whose first frame says 10 s
    info = probe(data, VideoLimits()).value
    assert info.duration_s == 3.0  # Matroska's duration ends at the last timestamp: 13 s less its start
    sig = signals(data, info)
    assert sig.times[0] == 0.0 and sig.times[-1] == pytest.approx(2.9)
    spans = [(0.0, 1.5), (1.5, 3.0)]  # seconds from the video's start, as a caption span says
    clips = cut(sig, info, ClipConfig(split="captions", max_s=2.0, min_s=0.5), spans)
    assert [(c.start_s, c.end_s) for c in clips] == [(0.0, 1.5), (1.5, 3.0)]


def test_a_variable_frame_rate_clip_lasts_as_long_as_its_span():
    # 1 s at 30 fps, then 4 frames half a second apart: the clip's frames keep their times
    data = _timed([n for n in range(30)] + [30 + 15 * k for k in range(1, 5)], 30)
    info = probe(data, VideoLimits()).value
    sig = signals(data, info)
    clips = cut(sig, info, ClipConfig(split="fixed", max_s=4.0, min_s=1.0))
    assert len(clips) == 1 and clips[0].start_s == 0.0
    files = render(data, info, clips, ClipConfig(fps=10))
    frames, seconds = _seconds(files[0][0])
    # 3 s of frames at 10 fps (the gaps show the frame before), not the 34 frames run together
    assert frames == 31 and seconds == pytest.approx(3.1, abs=0.01)
