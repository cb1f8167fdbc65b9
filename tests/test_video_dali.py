"""Clip frames through DALI's video decoder (its CPU build on VP9 clips here, NVDEC on H.264 behind ``gpu``) against PyAV's."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import av
import numpy as np
import pytest
from video_fixtures import find_box, make_video

from tasks.formats.recipe_outputs import PrecacheConfig
from tasks.formats.storage import Storage
from tasks.models.placement import PrecacheError
from tasks.video.clips import Clip, ClipConfig, transcode
from tasks.video.dali_frames import clip_decoder, dali_decode, decode_clips
from tasks.video.frames import decode_clip
from tasks.video.probe import VideoLimits, probe

W, H, FPS = 128, 72, 10
BASE, STEP = 12, 8  # frame i is grey at BASE + STEP * i below the square: its index, read back
# Mean absolute difference per frame, in levels of 255, that DALI's frames may have from PyAV's:
# measured at most 2.1 on these scenes. PyAV's YUV->RGB (FFmpeg's unscaled path) rounds about a
# level lower than DALI's and upsamples chroma differently, so single pixels at sharp colour
# edges differ by up to ~80; the resizers (DALI's antialiased linear, PIL's BILINEAR) add about
# half a level. A frame off by one is STEP levels away everywhere.
TOLERANCE = 3.0


def _ramp(i: int, t: float, size: tuple[int, int] = (W, H)) -> np.ndarray:
    w, h = size
    img = np.full((h, w, 3), BASE + STEP * i, np.uint8)
    x = (i * 5) % (w - 16)
    img[h // 4 : h // 4 + 16, x : x + 16] = (240, 40, 40)  # a colour edge that moves
    return img


def _clip(frames: int, codec: str = "vp9") -> bytes:
    """A clip of the ramp's first ``frames`` frames, transcoded as shardsmith cuts clips."""
    source = make_video(seconds=3.0, fps=FPS, size=(W, H), draw=_ramp)
    info = probe(source, VideoLimits()).value
    clip = Clip(0, 0, frames, 0.0, frames / FPS, 0, 0.0, 0.5, ())
    return transcode(source, info, clip, ClipConfig(codec=codec))


@pytest.fixture(scope="module")
def clips() -> dict[str, bytes]:
    return {"long": _clip(30), "short": _clip(5)}


def _indexes(stack) -> list[int]:
    """Each frame's index, from its grey level under the square (the bottom rows; any size)."""
    pixels = stack.cpu().numpy()[:, :, -2:, :].astype(np.float64)
    return [round((float(np.median(f)) - BASE) / STEP) for f in pixels]


def _expected(n: int, frames: int, fps: float | None) -> tuple[list[int], int]:
    """The frames taken from a clip of ``n`` frames at FPS: the latest one shown at each
    ``k / fps`` seconds that the clip reaches (all of them, ``fps`` None), then its last pick."""
    if fps is None:
        picks = list(range(min(n, frames)))
    else:
        picks = [int(k * FPS / fps + 1e-6) for k in range(frames) if k / fps <= (n - 1) / FPS + 1e-6]
    return picks + [picks[-1]] * (frames - len(picks)), len(picks)


def _mean_diff(a, b) -> np.ndarray:
    return (a.cpu().int() - b.cpu().int()).abs().float().mean(dim=(1, 2, 3)).numpy()


@pytest.mark.parametrize(("frames", "fps", "size"), [(8, 4.0, 32), (12, 7.0, 48), (10, None, 32), (6, 3.0, None)])
def test_dali_takes_pyavs_frames_from_vp9_clips(clips, frames, fps, size):
    data = clips["long"]
    with av.open(io.BytesIO(data)) as box:
        assert box.streams.video[0].codec_context.name == "vp9"
    (got, real), (got2, _) = dali_decode([data, clips["short"]], frames, fps, size, device="cpu")
    want, want_real = decode_clip(data, frames, fps, size)
    side = (size, size) if size else (H, W)
    assert tuple(got.shape) == tuple(want.shape) == (frames, 3, *side) and str(got.dtype) == "torch.uint8"
    assert _indexes(got) == _indexes(want) == _expected(30, frames, fps)[0]
    assert real == want_real == _expected(30, frames, fps)[1]
    assert _mean_diff(got, want).max() <= TOLERANCE
    # The second clip of the batch is its own, not the first's.
    assert _indexes(got2) == _expected(5, frames, fps)[0]


@pytest.mark.parametrize(
    ("frames", "fps", "picks", "real"), [(8, None, [0, 1, 2, 3, 4, 4, 4, 4], 5), (6, 4.0, [0, 2, 2, 2, 2, 2], 2)]
)
def test_a_short_clip_repeats_its_last_frame(clips, frames, fps, picks, real):
    ((got, got_real),) = dali_decode([clips["short"]], frames, fps, 32, device="cpu")
    want, want_real = decode_clip(clips["short"], frames, fps, 32)
    assert _indexes(got) == _indexes(want) == picks and got_real == want_real == real
    assert (got[real:] == got[real - 1]).all()


def test_the_decoder_is_dali_on_a_gpu_worker_and_pyav_on_others_unless_named(tmp_path):
    import torch

    def choice(decode: str = "auto", **clip) -> tuple[str, str]:
        latents = {"model": str(tmp_path), "resolution": 32}
        return clip_decoder(PrecacheConfig(image_latents=latents, clip_latents=clip, decode=decode))

    assert choice() == (("dali", "mixed") if torch.cuda.is_available() else ("pyav", "cpu"))
    assert choice("cpu") == choice("cpu", decoder="pyav") == choice(decoder="pyav") == ("pyav", "cpu")
    assert choice("cpu", decoder="dali") == ("dali", "cpu")
    if not torch.cuda.is_available():
        assert choice(decoder="dali") == ("dali", "cpu")
        with pytest.raises(PrecacheError, match="no CUDA GPU"):
            choice("gpu")


def _garbled(data: bytes) -> bytes:
    """The clip with its frames' bytes replaced by noise: the container reads, the frames do not."""
    off, size = find_box(data, ["mdat"])
    noise = np.random.default_rng(0).integers(0, 256, size - 8, dtype=np.uint8).tobytes()
    return data[: off + 8] + noise + data[off + size :]


def test_a_clip_dali_cannot_decode_names_its_shard_and_sample(clips, tmp_path):
    cfg = PrecacheConfig(
        image_latents={"model": str(tmp_path), "resolution": 32}, clip_latents={"frames": 4, "decoder": "dali"}
    )
    batch = [("k0", clips["long"]), ("k1", _garbled(clips["short"])), ("k2", clips["short"])]
    with pytest.raises(PrecacheError, match=r"shard-9\.tar: sample k1: DALI's video decoder failed: .*decoder"):
        decode_clips(batch, cfg, 32, "shard-9.tar")
    # The pipeline a failed batch left is replaced: the next batch decodes.
    assert len(decode_clips([batch[0], batch[2]], cfg, 32, "shard-9.tar")) == 2


@pytest.fixture(scope="module")
def vae(tmp_path_factory) -> Path:
    from tasks.demo.models import make_vae

    return make_vae(tmp_path_factory.mktemp("models") / "vae")


def _shard(st: Storage, clip: bytes):
    import hashlib

    from tasks.formats.shards import ShardWriter
    from tasks.stages.precache import PrecacheInput

    rel = "reshard/shard-000000.tar"
    with st.atomic_writer(rel) as fh:
        w = ShardWriter(fh)
        for i in range(2):
            jpg = io.BytesIO()
            with av.open(io.BytesIO(clip)) as box:
                next(box.decode(video=0)).to_image().save(jpg, "JPEG")
            w.write_sample(f"v-{i:09d}_c000", {"mp4": clip, "jpg": jpg.getvalue(), "txt": b"a square"})
        w.close()
    return PrecacheInput(rel, hashlib.sha256(st.read_bytes(rel)).hexdigest(), tuple(w.records))


def test_h264_clips_through_decoder_dali_on_a_cpu_worker_fail_the_shard_clearly(tmp_path, vae):
    from tasks.stages.precache import precache_shard

    st = Storage(str(tmp_path))
    shard = _shard(st, _clip(10, codec="h264"))
    # decode: cpu, so that a GPU worker tests the CPU build too.
    base = {"image_latents": {"model": str(vae), "resolution": 32, "store": "mean"}, "batch_size": 2, "decode": "cpu"}
    dali = PrecacheConfig(**base, clip_latents={"frames": 4, "fps": 2, "decoder": "dali"})
    with pytest.raises(PrecacheError) as err:
        precache_shard(st, dali, shard, "dali")
    assert "shard-000000.tar: sample v-000000000_c000: DALI's CPU video decoder does not decode h264" in str(err.value)
    # auto decodes them with PyAV on this worker.
    done = precache_shard(st, PrecacheConfig(**base, clip_latents={"frames": 4, "fps": 2}), shard, "auto")
    assert done.encodings["clip_latents"]["shape"][0] == 4


def _release_clip_latents(release: Path) -> dict[str, np.ndarray]:
    out = {}
    for tar in sorted((release / "latents").glob("*.tar")):
        with tarfile.open(tar) as tf:
            for m in tf.getmembers():
                if m.name.endswith(".clip_latent.npy"):
                    out[m.name.split(".", 1)[0]] = np.load(io.BytesIO(tf.extractfile(m).read())).astype(np.float32)
    return out


@pytest.mark.slow
def test_a_vp9_release_precached_with_dali_stores_pyavs_clip_latents(tmp_path, vae, prefect_api_url):
    from test_video_pipeline import _cli

    def ramp(i: int, size: tuple[int, int]) -> np.ndarray:
        # Each second a ramp of 24 levels a frame and a white bar: the tiny VAE's latents of
        # neighbouring frames differ far more than the decoders' rounding moves them (a red
        # edge's chroma would move them nearly as much as a frame does).
        img = np.full((size[1], size[0], 3), BASE + 24 * (i % FPS), np.uint8)
        img[:, (i * 5) % (size[0] - 8) :][:, :8] = 255
        return img

    videos = tmp_path / "videos"
    videos.mkdir()
    (videos / "a.mp4").write_bytes(make_video(seconds=3, fps=FPS, size=(W, H), draw=lambda i, t: ramp(i, (W, H))))
    (videos / "b.mp4").write_bytes(make_video(seconds=2.2, fps=FPS, size=(96, 64), draw=lambda i, t: ramp(i, (96, 64))))
    (videos / "a.txt").write_text("a white bar on grey\n")
    (videos / "b.txt").write_text("a white bar on grey, smaller\n")
    recipe = tmp_path / "r.yaml"

    def run(decoder: str) -> None:
        recipe.write_text(
            f"""dataset: trips
storage: {tmp_path / "store"}
sources:
  - {{name: cam, manifest: "{videos}", kind: files, media: video}}
validate:
  license: {{review: {{reviewed_by: tests, reviewed_on: 2026-12-01}}, source_defaults: {{cam: CC0-1.0}}}}
  video: {{clips: {{split: fixed, min_s: 1, max_s: 1, codec: vp9}}}}
reshard: {{samples_per_shard: 3}}
precache:
  image_latents: {{model: {vae}, resolution: 32, store: mean}}
  clip_latents: {{frames: 4, fps: 3, decoder: {decoder}}}
  batch_size: 2
  decode: cpu  # DALI's CPU build, a GPU or not
gates:
  download: {{min_success_rate: 0.5}}
execution: {{cluster: local, workers: 1}}
"""
        )
        done = _cli("run", str(recipe), api_url=prefect_api_url)
        assert done.returncode == 0, done.stderr[-3000:]

    run("dali")
    run("pyav")  # only precache is redone: a new release beside the first
    releases = tmp_path / "store" / "trips" / "releases"
    for tar in (releases / "v0001").glob("shard-*.tar"):
        with tarfile.open(tar) as tf:
            for m in tf.getmembers():
                if m.name.endswith(".mp4"):
                    with av.open(tf.extractfile(m)) as box:
                        assert box.streams.video[0].codec_context.name == "vp9"
    dali, pyav = _release_clip_latents(releases / "v0001"), _release_clip_latents(releases / "v0002")
    assert sorted(dali) == sorted(pyav) and len(dali) == 5  # 3 + 2 clips of a second
    for key, want in pyav.items():
        got = dali[key]
        assert got.shape == want.shape and got.shape[0] == 4
        err = np.abs(got - want).mean()
        # Frames a third of a second apart differ far more than the decoders do: a frame taken
        # one early or late would not pass.
        apart = min(np.abs(want[t + 1] - want[t]).mean() for t in range(2))
        assert err <= 0.01 and apart > 4 * err, (key, err, apart)


@pytest.mark.gpu
def test_nvdec_takes_pyavs_frames_from_h264_clips_resized_on_the_gpu():
    import torch

    # x264's veryfast clips have B-frames: frames are stored out of order and DALI must number
    # them in presentation order, as PyAV does.
    data = _clip(30, codec="h264")
    for frames, fps, size in [(8, 4.0, 32), (10, None, 48), (6, 3.0, None)]:
        ((got, real),) = dali_decode([data], frames, fps, size, device="mixed")
        want, want_real = decode_clip(data, frames, fps, size)
        assert got.device.type == "cuda" and got.dtype == torch.uint8 and got.shape == want.shape
        assert _indexes(got) == _indexes(want) == _expected(30, frames, fps)[0] and real == want_real
        # NVDEC's colour conversion is DALI's own: allow a level more than the CPU build.
        assert _mean_diff(got, want).max() <= TOLERANCE + 1.0
