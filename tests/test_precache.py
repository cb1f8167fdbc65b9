"""Precaching one shard with tiny real encoders: alignment, layout, values, dtypes, reruns, the gate."""

from __future__ import annotations

import hashlib
import io
import json

import numpy as np
import pytest
from PIL import Image

from tasks.formats.recipe_outputs import PrecacheConfig, PrecacheGate
from tasks.formats.shards import ShardWriter, iter_samples
from tasks.formats.storage import Storage

# Distinct R, G and B so a channel swap (BGR) changes the latents.
COLOURS = [(230, 40, 90), (20, 160, 240), (250, 220, 10), (90, 90, 90), (10, 200, 60)]
FORMATS = ["JPEG", "PNG", "WEBP"]
N = 19  # not a multiple of the batch size: the last batch is partial


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    from tasks.demo.models import make_all

    return make_all(tmp_path_factory.mktemp("models"))


def _image(i: int) -> tuple[str, bytes]:
    fmt = FORMATS[i % len(FORMATS)]
    # Solid colours: any resize and crop of them is the same colour, so the expected input of
    # the VAE is known exactly whatever the resampling filter.
    img = Image.new("RGB", (90 + 7 * i, 70 + 3 * i), COLOURS[i % len(COLOURS)])
    buf = io.BytesIO()
    img.save(buf, fmt, **({"quality": 100} if fmt == "JPEG" else {"lossless": True} if fmt == "WEBP" else {}))
    return {"JPEG": "jpg", "PNG": "png", "WEBP": "webp"}[fmt], buf.getvalue()


def _caption(i: int) -> str:
    return [
        "a red circle",
        "a blue square above the sea",
        "yellow stripes",
        "a grey field",
        "green dots on a white plain",
    ][i % 5]


def write_shard(storage: Storage, rel: str, n: int = N):
    from tasks.stages.precache import PrecacheInput

    with storage.atomic_writer(rel) as fh:
        w = ShardWriter(fh)
        for i in range(n):
            ext, data = _image(i)
            w.write_sample(
                f"src-{i:09d}", {ext: data, "txt": _caption(i).encode(), "json": json.dumps({"i": i}).encode()}
            )
        w.close()
    sha = hashlib.sha256(storage.read_bytes(rel)).hexdigest()
    return PrecacheInput(rel, sha, tuple(w.records))


def read_latents(storage: Storage, rel: str) -> list[tuple[str, dict[str, np.ndarray]]]:
    out = []
    with storage.open(rel, "rb") as fh:
        for s in iter_samples(fh, path=rel):
            out.append((s.key, {ext: np.load(io.BytesIO(data), allow_pickle=False) for ext, data in s.members.items()}))
    return out


def cfg(tiny, **kw) -> PrecacheConfig:
    base = dict(
        image_latents={"model": str(tiny["vae"]), "resolution": 64},
        text={"model": str(tiny["clip-text"]), "max_length": 16},
        batch_size=8,
    )
    base.update(kw)
    return PrecacheConfig.model_validate(base)


def test_latent_shard_mirrors_the_image_shard(tmp_path, tiny):
    from tasks.stages.precache import precache_shard, read_ledgers

    st = Storage(str(tmp_path))
    shard = write_shard(st, "reshard/shard-000000.tar")
    r = precache_shard(st, cfg(tiny), shard, "precache")
    got = read_latents(st, r.tar)
    assert [k for k, _ in got] == [rec.key for rec in shard.records]
    for _, members in got:
        assert set(members) == {"latent_mean.npy", "latent_logvar.npy", "text_emb.npy", "text_mask.npy"}
        assert members["latent_mean.npy"].shape == (4, 8, 8) and members["latent_mean.npy"].dtype == np.float16
        assert members["text_emb.npy"].shape == (16, 32) and members["text_mask.npy"].dtype == np.uint8
    assert r.encodings["image_latents"]["shape"] == [4, 8, 8]
    assert r.encodings["image_latents"]["scaling_factor"] > 0
    assert r.encodings["text"]["shape"] == [16, 32]
    # The records are where the bytes are: what the release's DALI index is built from.
    raw = st.read_bytes(r.tar)
    for rec in r.records:
        for m in rec.members:
            assert np.load(io.BytesIO(raw[m.offset : m.offset + m.size])).size > 0
    ledger = read_ledgers(st, [r])
    assert ledger.column("status").to_pylist() == ["ok"] * N
    assert all(ledger.column("aligned").to_pylist()) and all(ledger.column("finite").to_pylist())
    assert ledger.column("source").to_pylist() == ["src"] * N


def test_values_are_the_encoders_outputs(tmp_path, tiny):
    import torch
    from diffusers import AutoencoderKL
    from transformers import AutoTokenizer, CLIPTextModel

    from tasks.stages.precache import precache_shard

    st = Storage(str(tmp_path))
    shard = write_shard(st, "reshard/shard-000000.tar")
    r = precache_shard(st, cfg(tiny, dtype="fp32", compute_dtype="fp32"), shard, "precache")
    got = read_latents(st, r.tar)
    vae = AutoencoderKL.from_pretrained(tiny["vae"]).eval()
    tok = AutoTokenizer.from_pretrained(tiny["clip-text"])
    text = CLIPTextModel.from_pretrained(tiny["clip-text"]).eval()
    for i in (0, 1, 5):  # jpeg, png, webp
        colour = torch.tensor(COLOURS[i % len(COLOURS)], dtype=torch.float32) / 127.5 - 1.0
        pixels = colour.view(1, 3, 1, 1).expand(1, 3, 64, 64)
        with torch.no_grad():
            dist = vae.encode(pixels).latent_dist
        _, members = got[i]
        # JPEG at quality 100 moves a solid colour by a level or two; png/webp are exact.
        np.testing.assert_allclose(members["latent_mean.npy"], dist.mean[0].numpy(), atol=0.02)
        np.testing.assert_allclose(members["latent_logvar.npy"], dist.logvar[0].numpy(), atol=0.02)
        ids = tok([_caption(i)], padding="max_length", truncation=True, max_length=16, return_tensors="pt")
        with torch.no_grad():
            emb = text(**ids).last_hidden_state[0].numpy()
        # Run at the batch's longest caption, not at max_length: the same states where the mask
        # is 1 (what padding to max_length gives), zeros where it is 0.
        mask = ids["attention_mask"][0].numpy().astype(bool)
        np.testing.assert_allclose(members["text_emb.npy"][mask], emb[mask], atol=1e-5)
        assert not members["text_emb.npy"][~mask].any()
        assert members["text_mask.npy"].tolist() == ids["attention_mask"][0].tolist()


def test_bf16_compute_stays_within_the_tolerance_of_fp32(tmp_path, tiny):
    """compute_dtype bf16 (autocast; the weights stay fp32) against fp32 on the same shard: the
    same keys, latents within the tolerance the fp32 check above allows for JPEG, caption states
    close, and the dtype named in index.json's encodings and in the shard's name."""
    from tasks.stages.precache import precache_shard

    st = Storage(str(tmp_path))
    shard = write_shard(st, "reshard/shard-000000.tar")
    a = precache_shard(st, cfg(tiny, dtype="fp32", compute_dtype="fp32"), shard, "precache")
    b = precache_shard(st, cfg(tiny, dtype="fp32", compute_dtype="bf16"), shard, "precache")
    assert a.tar != b.tar  # another dtype, another latent shard: never mixed
    assert a.encodings["image_latents"]["compute_dtype"] == "fp32"
    assert b.encodings["image_latents"]["compute_dtype"] == "bf16" and b.encodings["text"]["compute_dtype"] == "bf16"
    for (ka, ma), (kb, mb) in zip(read_latents(st, a.tar), read_latents(st, b.tar)):
        assert ka == kb
        np.testing.assert_allclose(mb["latent_mean.npy"], ma["latent_mean.npy"], atol=0.02)
        np.testing.assert_allclose(mb["text_emb.npy"], ma["text_emb.npy"], atol=0.05)
        assert mb["text_mask.npy"].tolist() == ma["text_mask.npy"].tolist()
    # A block's own compute_dtype wins over precache's.
    c = precache_shard(
        st,
        cfg(
            tiny,
            dtype="fp32",
            compute_dtype="bf16",
            text={"model": str(tiny["clip-text"]), "max_length": 16, "compute_dtype": "fp32"},
        ),
        shard,
        "precache",
    )
    assert c.encodings["text"]["compute_dtype"] == "fp32" and c.encodings["image_latents"]["compute_dtype"] == "bf16"


def test_bf16_is_stored_as_raw_bits_and_sample_policy_is_seeded_by_key(tmp_path, tiny):
    import torch

    from tasks.stages.precache import precache_shard

    st = Storage(str(tmp_path))
    shard = write_shard(st, "reshard/shard-000000.tar", n=6)
    c = cfg(
        tiny, dtype="bf16", image_latents={"model": str(tiny["vae"]), "resolution": 64, "store": "sample"}, text=None
    )
    r = precache_shard(st, c, shard, "a")
    got = read_latents(st, r.tar)
    assert r.encodings["image_latents"]["dtype"] == "bfloat16" and r.encodings["image_latents"]["members"] == [
        "latent.npy"
    ]
    raw = got[0][1]["latent.npy"]
    assert raw.dtype == np.dtype("<u2")
    values = torch.from_numpy(raw.astype(np.int16)).view(torch.bfloat16).float()
    assert torch.isfinite(values).all() and values.abs().sum() > 0
    # Same key, same draw: another output prefix recomputes and must store the same bytes.
    again = precache_shard(st, c, shard, "b")
    assert again.sha256 == r.sha256 and not again.skipped
    # The models stay loaded in this process (a Dask worker) for the next shard.
    assert again.timings["load_s"] == 0.0
    # Solid images of the same colour (samples 0 and 5) differ only by the per-key noise.
    assert not np.array_equal(got[0][1]["latent.npy"], got[5][1]["latent.npy"])


def test_rerun_returns_the_recorded_result(tmp_path, tiny):
    from tasks.stages.precache import precache_shard

    st = Storage(str(tmp_path))
    shard = write_shard(st, "reshard/shard-000000.tar", n=5)
    first = precache_shard(st, cfg(tiny), shard, "precache")
    mtime = (tmp_path / first.tar).stat().st_mtime_ns
    second = precache_shard(st, cfg(tiny), shard, "precache")
    assert second.skipped and second.sha256 == first.sha256 and second.records == first.records
    assert second.stats["image_latents"].sum == first.stats["image_latents"].sum
    assert (tmp_path / first.tar).stat().st_mtime_ns == mtime
    # A changed config is a new output, not the recorded one.
    other = precache_shard(st, cfg(tiny, text={"model": str(tiny["t5"]), "max_length": 8}), shard, "precache")
    assert other.tar != first.tar and other.encodings["text"]["shape"] == [8, 32]


def test_vision_features_and_text_only(tmp_path, tiny):
    from tasks.stages.precache import precache_shard

    st = Storage(str(tmp_path))
    shard = write_shard(st, "reshard/shard-000000.tar", n=4)
    r = precache_shard(
        st,
        PrecacheConfig(vision={"model": str(tiny["clip-vision"])}, text={"model": str(tiny["t5"])}, batch_size=3),
        shard,
        "p",
    )
    got = read_latents(st, r.tar)
    # 64 px / patch 16 = 16 patches + the class token.
    assert got[0][1]["vision_emb.npy"].shape == (17, 32) and r.encodings["vision"]["resolution"] == 64
    assert set(got[0][1]) == {"vision_emb.npy", "text_emb.npy", "text_mask.npy"}
    assert "image_latents" not in r.encodings


def test_missing_models_are_named_and_never_downloaded(tmp_path, tiny):
    from tasks.models.frozen import check_models
    from tasks.models.placement import PrecacheError

    with pytest.raises(
        PrecacheError, match=r"precache.image_latents.model: no model directory at '/nowhere/vae'.*never downloaded"
    ):
        check_models(PrecacheConfig(image_latents={"model": "/nowhere/vae"}))
    with pytest.raises(PrecacheError, match="precache.text.tokenizer"):
        check_models(PrecacheConfig(text={"model": str(tiny["t5"]), "tokenizer": str(tmp_path / "missing")}))
    with pytest.raises(PrecacheError, match="not a known text encoder"):
        from tasks.models.frozen import Encoders

        Encoders(PrecacheConfig(text={"model": str(tiny["vae"])}), "cpu")


def test_recipe_resolves_model_paths_against_its_folder(tmp_path):
    from tasks.formats.recipe import parse_recipe

    data = {
        "dataset": "d",
        "storage": "out",
        "sources": [{"name": "s", "manifest": "m.csv"}],
        "precache": {"image_latents": {"model": "models/vae"}, "text": {"model": "models/t5"}},
    }
    r = parse_recipe(data, tmp_path / "r.yaml")
    assert r.precache.image_latents.model == str(tmp_path / "models" / "vae")
    assert r.precache.text.model == str(tmp_path / "models" / "t5") and r.precache.text.tokenizer is None
    assert r.precache.enabled and not parse_recipe({**data, "precache": {}}, tmp_path / "r.yaml").precache.enabled


def test_shard_on_s3(s3_bucket, tiny):
    from tasks.stages.precache import precache_shard

    bucket, options = s3_bucket
    st = Storage(f"s3://{bucket}/ds", options)
    shard = write_shard(st, "reshard/shard-000000.tar", n=5)
    r = precache_shard(st, cfg(tiny), shard, "precache")
    assert [k for k, _ in read_latents(st, r.tar)] == [rec.key for rec in shard.records]


@pytest.fixture(scope="session")
def nan_vae(tiny, tmp_path_factory):
    """The tiny VAE with one NaN planted in its encoder's last convolution: every latent is NaN."""
    import torch
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(tiny["vae"])
    with torch.no_grad():
        vae.encoder.conv_out.bias[0] = float("nan")
    path = tmp_path_factory.mktemp("nan") / "vae"
    vae.save_pretrained(path)
    return path


def test_gate_passes_good_latents_and_blocks_nan_and_bad_scaling(tmp_path, tiny, nan_vae):
    from tasks.audit.gates import precache_gate
    from tasks.stages.precache import channel_table, precache_shard, read_ledgers, shard_table

    st = Storage(str(tmp_path))
    shard = write_shard(st, "reshard/shard-000000.tar", n=10)

    def gate(c: PrecacheConfig, g: PrecacheGate = PrecacheGate(), expected: int = 10):
        r = precache_shard(st, c, shard, "p")
        return r, precache_gate(
            read_ledgers(st, [r]), shard_table([r], {shard.tar: 10}), channel_table([r]), expected, g
        )

    r, good = gate(cfg(tiny))
    assert good.success, [o.describe() for o in good.outcomes if not o.success]

    r, bad = gate(cfg(tiny, image_latents={"model": str(nan_vae), "resolution": 64}))
    failed = {o.name for o in bad.outcomes if not o.success}
    assert "every stored value finite" in failed
    assert r.nonfinite == 10
    assert set(read_ledgers(st, [r]).column("reason").to_pylist()) == {"nonfinite_encoding"}

    # Bounds that the tiny VAE's unit-scaled latents cannot meet stand in for a wrong scaling factor.
    _, scaled = gate(cfg(tiny), PrecacheGate(min_channel_std=10.0, max_channel_std=20.0))
    assert {o.name for o in scaled.outcomes if not o.success} == {"latent channel std within 10..20"}
    # A sample lost between reshard and precache: the count check fails.
    _, lost = gate(cfg(tiny), expected=11)
    assert {o.name for o in lost.outcomes if not o.success} == {"one encoding per released sample"}
