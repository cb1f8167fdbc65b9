"""Clip latents through a tiny real video VAE: the classes allowed, frame counts, stored shapes and values, store modes, metadata, the loader's scaling."""

from __future__ import annotations

import hashlib
import io
import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from tasks.demo.videos import make_video, scene
from tasks.formats.recipe_outputs import PrecacheConfig
from tasks.formats.shards import ShardWriter, iter_samples
from tasks.formats.storage import Storage
from tasks.models.placement import PrecacheError

KINDS = ("wan", "ltx", "cogvideox", "hunyuan")
CLASSES = {
    "wan": "AutoencoderKLWan",
    "ltx": "AutoencoderKLLTXVideo",
    "cogvideox": "AutoencoderKLCogVideoX",
    "hunyuan": "AutoencoderKLHunyuanVideo",
}
SIZE = (96, 64)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tasks.demo.models import make_all, make_video_vae

    root = tmp_path_factory.mktemp("models")
    out = dict(make_all(root, ("vae", "video-vae")))
    for kind in KINDS[1:]:
        out[kind] = make_video_vae(root / kind, kind=kind)
    out["wan"] = out["video-vae"]
    return out


def cfg(models, kind="wan", frames=5, store="mean_logvar", resolution=64, **clip) -> PrecacheConfig:
    return PrecacheConfig.model_validate(
        {
            "image_latents": {"model": str(models["vae"]), "resolution": resolution, "store": store},
            "clip_latents": {"frames": frames, "fps": 4, "model": str(models[kind]), **clip},
            "dtype": "fp32",
            "compute_dtype": "fp32",
            "batch_size": 3,
        }
    )


def _clip(kind: str, i: int) -> bytes:
    return make_video(seconds=1.5, fps=10, size=SIZE, draw=lambda n, t: scene(kind, n + 3 * i, SIZE))


def write_clip_shard(storage: Storage, rel: str, n: int = 4):
    """A resharded shard of clip samples as the video phases leave them: mp4, keyframe jpg, json, txt."""
    from tasks.stages.precache import PrecacheInput

    with storage.atomic_writer(rel) as fh:
        w = ShardWriter(fh)
        for i in range(n):
            kind = "ab"[i % 2]
            buf = io.BytesIO()
            Image.fromarray(scene(kind, 7 + i, SIZE)).save(buf, "JPEG")
            members = {"mp4": _clip(kind, i), "jpg": buf.getvalue(), "json": b"{}", "txt": f"clip {i}".encode()}
            w.write_sample(f"v-{i:09d}", members)
        w.close()
    return PrecacheInput(rel, hashlib.sha256(storage.read_bytes(rel)).hexdigest(), tuple(w.records))


def read_latents(storage: Storage, rel: str) -> dict[str, dict[str, np.ndarray]]:
    with storage.open(rel, "rb") as fh:
        return {
            s.key: {ext: np.load(io.BytesIO(data), allow_pickle=False) for ext, data in s.members.items()}
            for s in iter_samples(fh, path=rel)
        }


@pytest.mark.parametrize("kind", KINDS)
def test_each_allowed_class_loads_from_its_folder_and_compresses_time(models, kind):
    from tasks.models.placement import folder_digest
    from tasks.models.video_vae import VideoVae

    vae = VideoVae(cfg(models, kind), "cpu", "fp32")
    assert type(vae.model).__name__ == CLASSES[kind]
    pixels = torch.rand(2, 5, 3, 64, 64) * 2 - 1
    out = vae.encode(pixels, ["a", "b"])
    assert set(out) == {"latent_mean.npy", "latent_logvar.npy"}
    # 5 frames -> 2 latent frames, time first: (B, T', C, h, w).
    assert tuple(out["latent_mean.npy"].shape) == (2, 2, 4, 8, 8)
    meta = vae.describe()
    assert meta["model_class"] == CLASSES[kind] and meta["latent_frames"] == 2
    assert meta["temporal_compression"] == 4 and meta["spatial_compression"] == 8
    assert meta["model_digest"] == folder_digest(str(models[kind]))
    if kind in ("wan", "ltx"):  # per-channel statistics, from the config (Wan) or the weights (LTX)
        assert len(meta["latents_mean"]) == len(meta["latents_std"]) == 4 and meta["scaling_factor"] == 1.0
        assert meta["latents_mean"] != [0.0] * 4
    else:
        assert meta["latents_mean"] is None and meta["scaling_factor"] != 1.0


@pytest.mark.parametrize("kind", KINDS)
def test_each_class_computes_in_bf16_close_to_fp32(models, kind):
    """compute_dtype bf16 (linear and convolution weights kept in it, autocast around) runs
    every allowed class and stays near fp32's latents."""
    from tasks.models.video_vae import VideoVae

    pixels = torch.rand(2, 5, 3, 64, 64) * 2 - 1
    want = VideoVae(cfg(models, kind), "cpu", "fp32").encode(pixels, ["a", "b"])["latent_mean.npy"]
    got = VideoVae(cfg(models, kind), "cpu", "bf16").encode(pixels, ["a", "b"])["latent_mean.npy"]
    assert got.dtype == torch.float32 and got.shape == want.shape
    rel = float((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt())
    assert 0 < rel < 0.05, rel


def test_frames_and_resolution_the_model_cannot_take_are_refused_before_any_work(models, tmp_path):
    from tasks.models.frozen import check_models

    with pytest.raises(PrecacheError, match=r"precache\.clip_latents\.frames is 8.*1 \+ k \* 4 frames: 1, 5, 9"):
        check_models(cfg(models, frames=8))
    # A model whose config says 16x in space (as Wan 2.2's does) takes no 72 px clips.
    coarse = tmp_path / "wan16"
    shutil.copytree(models["wan"], coarse)
    config = json.loads((coarse / "config.json").read_text())
    (coarse / "config.json").write_text(json.dumps({**config, "scale_factor_spatial": 16}))
    with pytest.raises(PrecacheError, match=r"precache\.image_latents\.resolution is 72.*multiple of 16"):
        check_models(cfg({**models, "wan16": coarse}, "wan16", resolution=72))
    with pytest.raises(PrecacheError, match=r"class 'AutoencoderKL' is not a video VAE"):
        check_models(cfg(models).model_copy(update={"clip_latents": _clip_cfg(str(models["vae"]))}))
    with pytest.raises(PrecacheError, match=r"precache\.clip_latents\.model: no model directory"):
        check_models(cfg(models).model_copy(update={"clip_latents": _clip_cfg(str(tmp_path / "none"))}))
    with pytest.raises(PrecacheError, match=r"precache\.clip_latents\.subfolder"):
        check_models(cfg(models, subfolder="vae"))
    check_models(cfg(models, frames=9))  # 1 + 2 * 4


def _clip_cfg(model):
    from tasks.formats.recipe_outputs import ClipLatentsConfig

    return ClipLatentsConfig(frames=5, fps=4, model=model)


def test_a_pipeline_folder_is_read_through_its_subfolder(models, tmp_path):
    from tasks.models.video_vae import VideoVae

    shutil.copytree(models["ltx"], tmp_path / "pipe" / "vae")
    vae = VideoVae(cfg(models, "ltx").model_copy(update={"clip_latents": _sub(tmp_path / "pipe")}), "cpu", "fp32")
    assert vae.describe()["model"] == "pipe/vae" and type(vae.model).__name__ == "AutoencoderKLLTXVideo"


def _sub(path):
    from tasks.formats.recipe_outputs import ClipLatentsConfig

    return ClipLatentsConfig(frames=5, fps=4, model=str(path), subfolder="vae")


def test_a_shard_of_clips_stores_the_video_vaes_latents_and_records_it(tmp_path, models):
    from tasks.models.video_vae import VideoVae
    from tasks.stages.precache import precache_shard
    from tasks.video.frames import decode_clip

    st = Storage(str(tmp_path))
    shard = write_clip_shard(st, "reshard/shard-000000.tar")
    c = cfg(models)
    r = precache_shard(st, c, shard, "precache")
    got = read_latents(st, r.tar)
    assert list(got) == [rec.key for rec in shard.records]
    vae = VideoVae(c, "cpu", "fp32")
    for i, (key, members) in enumerate(got.items()):
        assert set(members) >= {"clip_latent_mean.npy", "clip_latent_logvar.npy", "latent_mean.npy"}
        mean = members["clip_latent_mean.npy"]
        # Temporal compression shows: 5 frames stored as 2 latent frames, time first.
        assert mean.shape == (2, 4, 8, 8) and mean.dtype == np.float32
        assert members["latent_mean.npy"].shape == (4, 8, 8)  # the keyframe, through the image VAE
        frames, _ = decode_clip(_clip("ab"[i % 2], i), 5, 4, 64)
        pixels = frames.float().div(127.5).sub(1.0)[None]
        want = vae.encode(pixels, [key])["latent_mean.npy"][0].numpy()
        np.testing.assert_allclose(mean, want, atol=1e-4)
    assert not np.allclose(got["v-000000000"]["clip_latent_mean.npy"], got["v-000000001"]["clip_latent_mean.npy"])
    meta = r.encodings["clip_latents"]
    assert meta["shape"] == [2, 4, 8, 8] and meta["members"] == ["clip_latent_mean.npy", "clip_latent_logvar.npy"]
    assert meta["model_class"] == "AutoencoderKLWan" and meta["latent_frames"] == 2 and meta["frames"] == 5
    assert meta["model"] == "video-vae" and len(meta["model_digest"]) == 64
    wan = json.loads((models["wan"] / "config.json").read_text())
    assert meta["latents_mean"] == pytest.approx(wan["latents_mean"]) and meta["scaling_factor"] == 1.0
    # The keyframe's latents keep the image VAE's factors.
    assert r.encodings["image_latents"]["scaling_factor"] != 1.0 and "model_class" not in r.encodings["image_latents"]


def test_store_modes_as_the_image_latents_say(tmp_path, models):
    from tasks.stages.precache import precache_shard

    st = Storage(str(tmp_path))
    shard = write_clip_shard(st, "reshard/shard-000000.tar", n=2)
    mean = read_latents(st, precache_shard(st, cfg(models, store="mean"), shard, "p-mean").tar)
    assert {m for v in mean.values() for m in v if m.startswith("clip_")} == {"clip_latent.npy"}
    sampled = read_latents(st, precache_shard(st, cfg(models, store="sample"), shard, "p-sample").tar)
    again = read_latents(st, precache_shard(st, cfg(models, store="sample"), shard, "p-again").tar)
    for key in mean:
        m, s = mean[key]["clip_latent.npy"], sampled[key]["clip_latent.npy"]
        assert s.shape == m.shape == (2, 4, 8, 8)
        assert not np.allclose(s, m)  # a draw, not the mean
        np.testing.assert_array_equal(s, again[key]["clip_latent.npy"])  # seeded by the key
    a, b = (sampled[k]["clip_latent.npy"] - mean[k]["clip_latent.npy"] for k in sampled)
    assert not np.allclose(a, b)  # each clip its own draw


def test_the_loader_scales_clip_latents_with_the_video_vaes_factors(tmp_path, models):
    from loaders.latents import decode_latent_block
    from tasks.stages.precache import precache_shard

    class Sample:
        def __init__(self, key, members):
            self.key, self.members = key, members

    st = Storage(str(tmp_path))
    shard = write_clip_shard(st, "reshard/shard-000000.tar", n=2)
    r = precache_shard(st, cfg(models, store="mean"), shard, "precache")
    with st.open(r.tar, "rb") as fh:
        samples = [Sample(s.key, dict(s.members)) for s in iter_samples(fh, path=r.tar)]
    raw = read_latents(st, r.tar)
    kw = dict(latent_sample=False, noise_seed=[0])
    scaled = decode_latent_block(samples, r.encodings, scale_latents=True, **kw)
    plain = decode_latent_block(samples, r.encodings, scale_latents=False, **kw)
    meta = r.encodings["clip_latents"]
    mean = np.asarray(meta["latents_mean"], np.float32).reshape(-1, 1, 1)
    std = np.asarray(meta["latents_std"], np.float32).reshape(-1, 1, 1)
    for s, p in zip(scaled, plain):
        stored = raw[s["key"]]["clip_latent.npy"]
        np.testing.assert_array_equal(p["clip_latent"].numpy(), stored)
        np.testing.assert_allclose(s["clip_latent"].numpy(), (stored - mean) / std, rtol=1e-5, atol=1e-5)
        # The keyframe's latent is scaled by the image VAE's own factor, not the video VAE's.
        il = r.encodings["image_latents"]
        np.testing.assert_allclose(
            s["latent"].numpy(), raw[s["key"]]["latent.npy"] * il["scaling_factor"], rtol=1e-5, atol=1e-6
        )
    # Normalised as the model's statistics say: near unit scale on these smooth clips.
    values = np.stack([s["clip_latent"].numpy() for s in scaled])
    assert 0.2 < values.std() < 5
