"""Tests for a release of video clips read by Megatron-Energon: each clip's video and caption, not its keyframe."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
from pathlib import Path

import pytest
from energon_venv import NOT_INSTALLED, energon_command, missing, readers_python, run_reader

from tasks.demo.videos import make_video
from tasks.formats.indexes import ShardIndexInput, all_indexes, energon_indexes
from tasks.formats.shards import ShardWriter
from tasks.formats.storage import Storage

# (seconds, fps, (width, height)) of each clip, by shard: lengths, rates and sizes all differ,
# so a reader that returns the wrong clip, or a keyframe, or drops frames shows.
CLIPS = (
    ((1.0, 10, (64, 48)), (1.5, 10, (48, 32))),
    ((2.0, 8, (32, 32)),),
)
KEYFRAME_SIZE = (20, 12)  # unlike every clip's size


def _key(shard: int, i: int) -> str:
    return f"vid{shard}_c{i:03d}"


def _caption(shard: int, i: int) -> str:
    return f"clip {i} of video {shard}: a red square crosses the blue, café 猫"


def _keyframe(i: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", KEYFRAME_SIZE, (200, 30 * i, 40)).save(buf, format="JPEG")
    return buf.getvalue()


def _members(shard: int, i: int, seconds: float, fps: int, size: tuple[int, int]) -> dict[str, bytes]:
    """A clip sample as the video pipeline writes one: mp4, keyframe jpg, json, txt."""
    meta = {"key": _key(shard, i), "duration_s": seconds, "fps": fps, "width": size[0], "height": size[1]}
    return {
        "mp4": make_video(seconds=seconds, fps=fps, size=size),
        "jpg": _keyframe(i),
        "json": json.dumps(meta).encode(),
        "txt": _caption(shard, i).encode("utf-8"),
    }


def _write_shard(path: Path, shard: int) -> ShardIndexInput:
    with open(path, "wb") as fh:
        writer = ShardWriter(fh)
        for i, spec in enumerate(CLIPS[shard]):
            writer.write_sample(_key(shard, i), _members(shard, i, *spec))
        writer.close()
    return ShardIndexInput(name=path.name, size=path.stat().st_size, samples=writer.records)


@pytest.fixture(scope="module")
def clip_release(tmp_path_factory):
    """A release of real H.264 clips with every index, written as the release step writes them."""
    root = tmp_path_factory.mktemp("clips")
    shards = [_write_shard(root / f"shard-{s:06d}.tar", s) for s in range(len(CLIPS))]
    files = all_indexes(shards, name="clips")
    storage = Storage(str(root))
    for rel, data in files.items():
        storage.write_bytes(rel, data)
    # What each clip decodes to: (frames, channels, height, width), and its caption.
    expected = [
        [_key(s, i), _caption(s, i), [round(seconds * fps), 3, size[1], size[0]]]
        for s, clips in enumerate(CLIPS)
        for i, (seconds, fps, size) in enumerate(clips)
    ]
    return {"root": root, "shards": shards, "files": files, "expected": expected}


def test_a_release_of_clips_maps_the_video_and_caption(clip_release):
    files = clip_release["files"]
    assert files[".nv-meta/dataset.yaml"] == (
        b"sample_type:\n"
        b"  __module__: megatron.energon\n"
        b"  __class__: VidQASample\n"
        b"field_map:\n"
        b"  video: mp4\n"
        b"  context: txt\n"
    )
    # The crude view beside it, for a cooker of the trainer's own video sample.
    assert files[".nv-meta/crude.yaml"] == b"__module__: megatron.energon\n__class__: CrudeWebdataset\n"
    energon = {k: v for k, v in files.items() if k.startswith(".nv-meta/") or k.endswith(".tar.idx")}
    assert energon_indexes(clip_release["shards"]) == energon


def test_a_mixed_or_explicit_release_keeps_captioning(clip_release, tmp_path):
    shards = clip_release["shards"]
    # An explicit sample type wins, and the crude view stays (the release is still all clips).
    keyframes = energon_indexes(shards, sample_type="CaptioningSample")
    assert b"__class__: CaptioningSample\n" in keyframes[".nv-meta/dataset.yaml"]
    assert ".nv-meta/crude.yaml" in keyframes
    # A release that mixes clips and images: every sample has a jpg, only clips an mp4.
    path = tmp_path / "images.tar"
    with open(path, "wb") as fh:
        writer = ShardWriter(fh)
        writer.write_sample("img-000000", {"jpg": _keyframe(0), "txt": b"an image", "json": b"{}"})
        writer.close()
    image = ShardIndexInput(name="images.tar", size=path.stat().st_size, samples=writer.records)
    mixed = energon_indexes([*shards, image])
    assert mixed[".nv-meta/dataset.yaml"] == (
        b"sample_type:\n  __module__: megatron.energon\n  __class__: CaptioningSample\n"
        b"field_map:\n  image: jpg\n  caption: txt\n"
    )
    assert ".nv-meta/crude.yaml" not in mixed
    with pytest.raises(ValueError, match="no member for field 'video'"):
        energon_indexes([image], sample_type="VidQASample")


# ---------------------------------------------------------------------------------------------
# Energon's own loader, its decoders and its tools, in the energon venv
# ---------------------------------------------------------------------------------------------

_VIDEO_SCRIPT = r"""
import contextlib, json, sys, traceback
release, reference, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
out = {}


def clip(s, video, text):
    # A sample as [key, class, caption, decoded shape (T, C, H, W)]; None where it has no video.
    video = getattr(s, video, None)
    frames = video.get_video() if hasattr(video, "get_video") else video
    clips = getattr(frames, "video_clips", None)
    return [s.__key__, type(s).__name__, getattr(s, text, None), list(clips[0].shape) if clips else None]


def section(name, read):
    # Each way of reading on its own: a failure is that section's answer, and the others still run.
    try:
        out[name] = read()
    except Exception:
        out[name] = "error: " + traceback.format_exc(limit=1).strip().splitlines()[-1]


with contextlib.redirect_stdout(sys.stderr):
    from megatron.energon import (
        Cooker, DefaultTaskEncoder, Sample, SampleDecoder, WorkerConfig, basic_sample_keys, edataclass,
        get_loader, get_savable_loader, get_train_dataset, get_val_dataset, stateless,
    )
    from megatron.energon.av import AVData, AVDecoder
    from megatron.energon.tools.prepare import command

    worker_config = WorkerConfig(rank=0, world_size=1, num_workers=0)

    # dataset.yaml with energon's default decoder: the video as an AVDecoder, decoded on demand.
    def default():
        ds = get_val_dataset(release, split_part="train", worker_config=worker_config, batch_size=None)
        return [clip(s, "video", "context") + [isinstance(getattr(s, "video", None), AVDecoder)]
                for s in get_loader(ds)]

    # The decoder set in the TaskEncoder, as energon's docs say: av_decode="torch" decodes it all.
    class Decoded(DefaultTaskEncoder):
        decoder = SampleDecoder(av_decode="torch")

    def decoded():
        ds = get_val_dataset(release, split_part="train", worker_config=worker_config, batch_size=None,
                             task_encoder=Decoded())
        return [clip(s, "video", "context") + [isinstance(getattr(s, "video", None), AVData)]
                for s in get_loader(ds)]

    # crude.yaml with a cooker that makes the trainer's own sample, as in energon's crude docs.
    @edataclass
    class ClipSample(Sample):
        video: AVDecoder
        caption: str

    @stateless
    def cook(sample):
        return ClipSample(**basic_sample_keys(sample), video=sample["mp4"], caption=sample["txt"])

    class Cooking(DefaultTaskEncoder):
        cookers = [Cooker(cook)]

    def cooked():
        ds = get_train_dataset(release, split_part="train", worker_config=worker_config, batch_size=None,
                               shuffle_buffer_size=None, max_samples_per_sequence=None,
                               dataset_config="crude.yaml", task_encoder=Cooking())
        return [clip(s, "video", "caption") for _, s in zip(range(n), get_savable_loader(ds))]

    section("default", default)
    section("torch", decoded)
    section("cooked", cooked)

    # What `energon prepare` writes for these shards with the one video sample type it offers.
    command.main(
        [reference, "--non-interactive", "--no-progress", "--num-workers", "1", "--split-ratio", "1,0,0",
         "--sample-type", "VidQASample", "--field-map", json.dumps({"video": "mp4", "context": "txt"})],
        standalone_mode=False,
    )
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def energon_python() -> str:
    python = readers_python()
    if python is None:
        missing(NOT_INSTALLED)
    assert python is not None
    return python


@pytest.fixture(scope="module")
def read_back(clip_release, energon_python, tmp_path_factory):
    work = tmp_path_factory.mktemp("energon-video")
    reference = work / "reference"
    reference.mkdir()
    for shard in clip_release["shards"]:
        shutil.copyfile(clip_release["root"] / shard.name, reference / shard.name)
    script = work / "read.py"
    script.write_text(_VIDEO_SCRIPT)
    n = len(clip_release["expected"])
    lines = run_reader(energon_python, script, [str(clip_release["root"]), str(reference), str(n)], work)
    return {"reference": reference, **json.loads(lines[-1])}


def test_energon_yields_each_clips_video_and_caption(clip_release, read_back):
    expected = clip_release["expected"]
    want = [[key, "VidQASample", caption, shape, True] for key, caption, shape in expected]
    assert read_back["default"] == want  # True: an AVDecoder, decoded here by get_video()


def test_energon_decodes_the_clips_with_the_task_encoders_decoder(clip_release, read_back):
    expected = clip_release["expected"]
    want = [[key, "VidQASample", caption, shape, True] for key, caption, shape in expected]
    assert read_back["torch"] == want  # True: AVData, decoded by the loader


def test_energon_cooks_the_crude_view_into_the_trainers_sample(clip_release, read_back):
    # The train loader shuffles shards: one epoch is every clip once, in some order.
    cooked = read_back["cooked"]
    assert isinstance(cooked, list), cooked
    want = [[key, "ClipSample", caption, shape] for key, caption, shape in clip_release["expected"]]
    assert sorted(cooked) == sorted(want)


def test_energon_prepare_writes_the_same_dataset_yaml(clip_release, read_back):
    for rel in (".nv-meta/dataset.yaml", ".nv-meta/split.yaml") + tuple(
        s.name + ".idx" for s in clip_release["shards"]
    ):
        assert clip_release["files"][rel] == (read_back["reference"] / rel).read_bytes(), rel


def test_energon_lint_and_info_accept_the_release(clip_release, energon_python, tmp_path):
    energon = energon_command(energon_python)
    root = str(clip_release["root"])
    lint = subprocess.run([*energon, "lint", root], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert lint.returncode == 0, lint.stdout[-2000:] + lint.stderr[-4000:]
    info = subprocess.run([*energon, "info", root], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert info.returncode == 0, info.stdout[-2000:] + info.stderr[-4000:]
    assert "VidQASample" in info.stdout
    assert f"`train`: 100%, {len(clip_release['expected'])} samples" in info.stdout
