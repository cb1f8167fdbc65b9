"""Tests for tasks/formats/spooled.py: a video body in an unlinked file, written into shards and read back by the tar reader and the probe."""

from __future__ import annotations

import io
import os

import pytest
from video_fixtures import make_video

from tasks.formats.shards import ShardWriter, iter_samples
from tasks.formats.spooled import CHUNK, SpooledBody
from tasks.formats.tar_reader import ShardError
from tasks.video.probe import VideoLimits, probe


def _spooled(tmp_path, data: bytes) -> SpooledBody:
    path = tmp_path / "body"
    path.write_bytes(data)
    return SpooledBody.adopt(path)


def test_adopting_removes_the_name_and_readers_keep_their_own_place(tmp_path):
    data = os.urandom(3 * CHUNK + 17)
    body = _spooled(tmp_path, data)
    assert not (tmp_path / "body").exists() and len(body) == len(data)
    a, b = body.reader(), body.reader()
    assert a.read(10) == data[:10]
    b.seek(-5, io.SEEK_END)
    assert b.read() == data[-5:]
    assert a.read(5) == data[10:15]
    assert body.read_all() == data and body.head(4) == data[:4]
    body.close()
    with pytest.raises(ValueError, match="closed"):
        body.reader().read(1)


def test_a_needle_across_a_chunk_boundary_is_found(tmp_path):
    data = bytearray(2 * CHUNK)
    data[CHUNK - 2 : CHUNK + 2] = b"moov"
    assert _spooled(tmp_path, bytes(data)).contains(b"moov")
    assert not _spooled(tmp_path, bytes(2 * CHUNK)).contains(b"moov")


def test_a_spooled_member_is_written_byte_for_byte_as_bytes_are_and_read_back_spilled(tmp_path):
    video = os.urandom(CHUNK + 1000)
    by_bytes, by_file = io.BytesIO(), io.BytesIO()
    with ShardWriter(by_bytes) as w:
        w.write_sample("a", {"mp4": video, "json": b"{}"})
    with ShardWriter(by_file) as w:
        rec = w.write_sample("a", {"mp4": _spooled(tmp_path, video), "json": b"{}"})
    assert by_file.getvalue() == by_bytes.getvalue()
    assert [m.size for m in rec.members] == [2, len(video)]

    (sample,) = iter_samples(io.BytesIO(by_file.getvalue()), spill=lambda name: name.endswith(".mp4"))
    spilled = sample.members["mp4"]
    assert isinstance(spilled, SpooledBody) and spilled.read_all() == video
    assert sample.members["json"] == b"{}"  # not spilled: bytes as before


def test_a_tar_cut_inside_a_spilled_member_is_truncated(tmp_path):
    out = io.BytesIO()
    with ShardWriter(out) as w:
        w.write_sample("a", {"mp4": os.urandom(5000)})
    with pytest.raises(ShardError, match="tar_truncated"):
        list(iter_samples(io.BytesIO(out.getvalue()[:3000]), spill=lambda name: True))


def test_the_probe_reads_a_spooled_video_as_it_reads_bytes(tmp_path):
    data = make_video(seconds=1, fps=10, size=(64, 48))
    assert probe(_spooled(tmp_path, data), VideoLimits()) == probe(data, VideoLimits())
    # An mp4 without its index: the search for the moov box reads the file, not memory.
    lost = data.replace(b"moov", b"mooz")
    assert probe(_spooled(tmp_path, lost), VideoLimits()).reason == "video_truncated"
    assert probe(lost, VideoLimits()).reason == "video_truncated"
