"""Curation's dual encoders and heads: open_clip weights against open_clip's own math, transformers folders, LAION heads."""

from __future__ import annotations

import json

import numpy as np
import pytest
from curate_fixtures import (
    make_clip,
    make_linear_head,
    make_mlp_head,
    make_open_clip,
    make_siglip,
    open_clip_state_dict,
)

torch = pytest.importorskip("torch")


def _open_clip_reference(sd: dict, pixels, tokens, heads_v: int, heads_t: int, quick_gelu: bool):
    """open_clip's ViT CLIP forward written from its definition (OpenAI's layout): pre-LN residual
    blocks with ``nn.MultiheadAttention`` over the packed in-projection, class token pooled after
    ``ln_post`` then ``@ proj``; text with a causal mask, pooled at the largest token id."""
    import torch.nn.functional as F

    def act(x):
        return x * torch.sigmoid(1.702 * x) if quick_gelu else F.gelu(x)

    def blocks(x, prefix, heads, mask=None):
        i = 0
        while f"{prefix}.{i}.ln_1.weight" in sd:
            p = f"{prefix}.{i}"
            h = F.layer_norm(x, x.shape[-1:], sd[f"{p}.ln_1.weight"], sd[f"{p}.ln_1.bias"])
            mha = torch.nn.MultiheadAttention(x.shape[-1], heads, batch_first=True)
            mha.load_state_dict(
                {
                    "in_proj_weight": sd[f"{p}.attn.in_proj_weight"],
                    "in_proj_bias": sd[f"{p}.attn.in_proj_bias"],
                    "out_proj.weight": sd[f"{p}.attn.out_proj.weight"],
                    "out_proj.bias": sd[f"{p}.attn.out_proj.bias"],
                }
            )
            x = x + mha(h, h, h, need_weights=False, attn_mask=mask)[0]
            h = F.layer_norm(x, x.shape[-1:], sd[f"{p}.ln_2.weight"], sd[f"{p}.ln_2.bias"])
            h = F.linear(
                act(F.linear(h, sd[f"{p}.mlp.c_fc.weight"], sd[f"{p}.mlp.c_fc.bias"])),
                sd[f"{p}.mlp.c_proj.weight"],
                sd[f"{p}.mlp.c_proj.bias"],
            )
            x = x + h
            i += 1
        return x

    with torch.no_grad():
        x = F.conv2d(pixels, sd["visual.conv1.weight"], stride=sd["visual.conv1.weight"].shape[-1])
        x = x.flatten(2).transpose(1, 2)
        cls = sd["visual.class_embedding"].expand(x.shape[0], 1, -1)
        x = torch.cat([cls, x], dim=1) + sd["visual.positional_embedding"]
        x = F.layer_norm(x, x.shape[-1:], sd["visual.ln_pre.weight"], sd["visual.ln_pre.bias"])
        x = blocks(x, "visual.transformer.resblocks", heads_v)
        x = F.layer_norm(x[:, 0], x.shape[-1:], sd["visual.ln_post.weight"], sd["visual.ln_post.bias"])
        image = x @ sd["visual.proj"]

        n = tokens.shape[1]
        t = sd["token_embedding.weight"][tokens] + sd["positional_embedding"][:n]
        causal = torch.full((n, n), float("-inf")).triu(1)
        t = blocks(t, "transformer.resblocks", heads_t, causal)
        t = F.layer_norm(t, t.shape[-1:], sd["ln_final.weight"], sd["ln_final.bias"])
        text = t[torch.arange(t.shape[0]), tokens.argmax(dim=-1)] @ sd["text_projection"]
    return F.normalize(image, dim=-1).numpy(), F.normalize(text, dim=-1).numpy()


@pytest.mark.parametrize("quick_gelu", [True, False])
def test_open_clip_weights_compute_what_open_clip_computes(tmp_path, quick_gelu):
    from tasks.models.dual_encoder import DualEncoder

    path = make_open_clip(tmp_path / "oc", seed=3, quick_gelu=quick_gelu)
    enc = DualEncoder(str(path))
    sd = open_clip_state_dict(3, vocab=len(enc.tokenizer))
    pixels = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    captions = ["a red circle above the sea", "two blue stars at night", "a green square"]
    tok = enc.tokenizer(captions, padding=True, return_tensors="pt")["input_ids"]
    # open_clip pads with 0 after the end token; the end token is the largest id in each row.
    eos = enc.tokenizer.eos_token_id
    ids = tok.clone()
    for row in ids:
        end = int((row == eos).nonzero()[0])
        row[end + 1 :] = 0
    # The reference pools at the largest id, as open_clip does; transformers' converted model
    # (eos_token_id 2) does the same, so make the end token the largest id of the vocabulary.
    biggest = len(enc.tokenizer) - 1
    ids[ids == eos] = biggest
    ref_image, ref_text = _open_clip_reference(sd, pixels, ids, heads_v=2, heads_t=2, quick_gelu=quick_gelu)
    got_image = enc.images(pixels)
    with torch.inference_mode():
        got_text = enc.model.get_text_features(input_ids=ids)
    got_text = getattr(got_text, "pooler_output", got_text)
    got_text = torch.nn.functional.normalize(got_text, dim=-1).numpy()
    np.testing.assert_allclose(got_image, ref_image, atol=2e-5)
    np.testing.assert_allclose(got_text, ref_text, atol=2e-5)
    assert enc.preprocess.center_crop and enc.preprocess.mean == (0.5, 0.5, 0.5)


def test_open_clip_variants_are_refused_by_name(tmp_path):
    from tasks.models.dual_encoder import DualEncoder
    from tasks.models.placement import CurateError

    path = make_open_clip(tmp_path / "oc")
    cfg = json.loads((path / "open_clip_config.json").read_text())
    cfg["model_cfg"]["text_cfg"]["hf_model_name"] = "roberta-base"
    (path / "open_clip_config.json").write_text(json.dumps(cfg))
    with pytest.raises(CurateError, match="text_cfg.hf_model_name"):
        DualEncoder(str(path))


def test_transformers_clip_and_siglip_give_unit_embeddings_and_their_preprocessing(tmp_path):
    from tasks.models.dual_encoder import DualEncoder

    clip = DualEncoder(str(make_clip(tmp_path / "clip")))
    assert clip.kind == "clip" and clip.preprocess.center_crop and clip.preprocess.size == 32
    sig = DualEncoder(str(make_siglip(tmp_path / "siglip")))
    assert sig.kind == "siglip" and not sig.preprocess.center_crop and sig.preprocess.mean == (0.5, 0.5, 0.5)
    for enc in (clip, sig):
        img = enc.images(torch.randn(2, 3, 32, 32))
        txt = enc.texts(["a red circle", "a blue square above the sea"])
        assert img.shape == txt.shape == (2, enc.dim)
        np.testing.assert_allclose(np.linalg.norm(img, axis=1), 1.0, atol=1e-5)
        np.testing.assert_allclose(np.linalg.norm(txt, axis=1), 1.0, atol=1e-5)
        # The same caption alone or in a batch with a longer one embeds the same.
        np.testing.assert_allclose(enc.texts(["a red circle"])[0], txt[0], atol=1e-5)


def test_a_missing_or_unknown_model_says_what_to_do(tmp_path):
    from tasks.models.dual_encoder import DualEncoder
    from tasks.models.placement import CurateError

    with pytest.raises(CurateError, match="curate.model: no model directory.*never downloaded"):
        DualEncoder(str(tmp_path / "nowhere"))
    (tmp_path / "vae").mkdir()
    (tmp_path / "vae" / "config.json").write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(CurateError, match="model_type 't5' is not a dual encoder"):
        DualEncoder(str(tmp_path / "vae"))


TOKENIZER_NAMES = ("tokenizer.json", "tokenizer_config.json")


def test_a_model_folder_without_a_tokenizer_is_refused_not_loaded_empty(tmp_path):
    """transformers 5 builds a tokenizer of two special tokens from a CLIP config alone (every
    word one id): each loader refuses the folder in one line instead, and finds a tokenizer/
    subfolder."""
    import shutil

    from tasks.finetune.tokens import TokenizerError, load_counter
    from tasks.formats.recipe_finetune import TokensConfig
    from tasks.formats.recipe_outputs import PrecacheConfig
    from tasks.models.dual_encoder import DualEncoder, check_model
    from tasks.models.frozen import Encoders
    from tasks.models.placement import CurateError, PrecacheError

    model = make_clip(tmp_path / "clip")
    bare = tmp_path / "notok"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(model / name, bare / name)
    with pytest.raises(CurateError, match=f"curate.model {bare}: no tokenizer there") as err:
        DualEncoder(str(bare))
    assert "\n" not in str(err.value)
    for load in (True, False):  # False: a preflight's check, the files looked for
        with pytest.raises(CurateError, match="no tokenizer there"):
            check_model(str(bare), load_tokenizer=load)
    with pytest.raises(CurateError, match=f"curate.tokenizer {bare}: no tokenizer there"):
        DualEncoder(str(model), tokenizer=str(bare))
    with pytest.raises(TokenizerError, match=f"finetune.tokens.tokenizer {bare}: no tokenizer there"):
        load_counter(TokensConfig(tokenizer=str(bare)))
    with pytest.raises(PrecacheError, match=f"precache.text.model {bare}: no tokenizer there"):
        Encoders(PrecacheConfig(text={"model": str(bare), "max_length": 16}), "cpu")
    # Tokenizer files that load as nothing but special tokens are refused too.
    hollow = tmp_path / "hollow"
    from transformers import CLIPTokenizer

    (hollow).mkdir()
    (hollow / "vocab.json").write_text(json.dumps({"<|startoftext|>": 0, "<|endoftext|>": 1}))
    (hollow / "merges.txt").write_text("#version: 0.2\n")
    assert len(CLIPTokenizer(str(hollow / "vocab.json"), str(hollow / "merges.txt"))) <= 3
    shutil.copy(model / "config.json", hollow / "config.json")
    with pytest.raises(CurateError, match="no vocabulary besides its"):
        DualEncoder(str(model), tokenizer=str(hollow))
    # A tokenizer in the folder's tokenizer/ subfolder is found.
    (bare / "tokenizer").mkdir()
    for name in TOKENIZER_NAMES:
        shutil.copy(model / name, bare / "tokenizer" / name)
    check_model(str(bare))
    enc = DualEncoder(str(bare))
    assert len(enc.tokenizer) == len(DualEncoder(str(model)).tokenizer) > 10
    assert load_counter(TokensConfig(tokenizer=str(bare))).count("a red circle") == 3


@pytest.mark.parametrize("damage", ["bad_config", "truncated_weights", "empty_folder", "no_weights", "bad_index"])
def test_a_corrupt_model_folder_is_one_line_naming_the_folder_and_what_failed(tmp_path, damage):
    import shutil

    from tasks.models.dual_encoder import DualEncoder, check_model
    from tasks.models.placement import CurateError

    model = make_clip(tmp_path / "clip")
    broken = tmp_path / damage
    shutil.copytree(model, broken)
    weights = broken / "model.safetensors"
    if damage == "bad_config":
        (broken / "config.json").write_text("{not json")
        want = "config.json: not readable JSON"
    elif damage == "truncated_weights":
        for size in (3000, weights.stat().st_size - 100):  # in the header, in the tensors
            weights.write_bytes((model / "model.safetensors").read_bytes()[:size])
            with pytest.raises(
                CurateError, match=f"curate.model {broken}: weight file model.safetensors does not read"
            ):
                check_model(str(broken))
        want = "does not load|does not read"
    elif damage == "empty_folder":
        for f in broken.iterdir():
            f.unlink()
        want = "no config.json there"
    elif damage == "no_weights":
        weights.unlink()
        want = "no weights there"
    else:
        weights.rename(broken / "model-00001-of-00002.safetensors")
        index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
        (broken / "model.safetensors.index.json").write_text(json.dumps(index))
        want = "weight file model-00002-of-00002.safetensors is missing"
    for load in (True, False):
        with pytest.raises(CurateError, match=f"curate.model {broken}: .*({want})") as err:
            check_model(str(broken), load_tokenizer=load)
        assert "\n" not in str(err.value)
    with pytest.raises(CurateError, match=f"curate.model {broken}: ") as err:
        DualEncoder(str(broken))
    assert "\n" not in str(err.value) and len(str(err.value)) < 700
    check_model(str(model))  # the whole folder passes
    check_model(str(model), load_tokenizer=False)


def test_the_curation_phase_checks_its_model_before_any_shard(tmp_path):
    """The phase's first task (the model's digest, on a worker) stops a folder that cannot load,
    before any shard is embedded (where N failed shards would each print the error)."""
    from flows.curate import digests_task
    from tasks.formats.recipe_curate import CurateConfig
    from tasks.models.placement import CurateError

    model = make_clip(tmp_path / "clip")
    weights = model / "model.safetensors"
    assert digests_task.fn(CurateConfig(model=str(model)))[0]
    weights.write_bytes(weights.read_bytes()[:3000])
    with pytest.raises(CurateError, match=f"curate.model {model}: weight file model.safetensors does not read"):
        digests_task.fn(CurateConfig(model=str(model)))


def test_folder_digest_follows_content_not_place(tmp_path):
    import shutil

    from tasks.models.placement import folder_digest

    a = make_clip(tmp_path / "a")
    b = tmp_path / "b"
    shutil.copytree(a, b)
    assert folder_digest(str(a)) == folder_digest(str(b))
    (b / "config.json").write_text((b / "config.json").read_text() + " ")
    assert folder_digest(str(a)) != folder_digest(str(b))


@pytest.mark.parametrize("fmt", ["pth", "safetensors"])
def test_laion_linear_head_scores_as_its_formula(tmp_path, fmt):
    from tasks.curate.heads import load_head
    from tasks.formats.recipe_curate import HeadConfig

    pth = make_linear_head(tmp_path / "head.pth", 16, seed=2)
    path = pth
    if fmt == "safetensors":
        from safetensors.torch import save_file

        path = tmp_path / "head.safetensors"
        save_file(torch.load(pth, weights_only=True), str(path))
    w = torch.load(pth, weights_only=True)["weight"].numpy()
    emb = np.random.default_rng(0).normal(size=(5, 16)).astype(np.float32)
    unit = emb / np.linalg.norm(emb, axis=1, keepdims=True)
    raw = load_head("aesthetic", HeadConfig(path=str(path)), 16)(emb)
    np.testing.assert_allclose(raw, unit @ w[0], rtol=1e-5)
    sig = load_head("watermark", HeadConfig(path=str(path), output="sigmoid"), 16)(emb)
    np.testing.assert_allclose(sig, 1 / (1 + np.exp(-(unit @ w[0]))), rtol=1e-5)


def test_laion_mlp_head_applies_its_layers_in_order(tmp_path):
    from tasks.curate.heads import load_head
    from tasks.formats.recipe_curate import HeadConfig

    path = make_mlp_head(tmp_path / "mlp.pth", 16)
    sd = torch.load(path, weights_only=True)
    emb = np.random.default_rng(1).normal(size=(4, 16)).astype(np.float32)
    x = torch.nn.functional.normalize(torch.from_numpy(emb), dim=-1)
    for name in ("layers.0", "layers.2", "layers.4", "layers.6"):
        x = torch.nn.functional.linear(x, sd[f"{name}.weight"], sd[f"{name}.bias"])
    got = load_head("aesthetic", HeadConfig(path=str(path)), 16)(emb)
    np.testing.assert_allclose(got, x[:, 0].numpy(), rtol=1e-4, atol=1e-6)


def test_a_head_that_does_not_fit_the_model_is_named(tmp_path):
    from tasks.curate.heads import load_head
    from tasks.formats.recipe_curate import HeadConfig
    from tasks.models.placement import CurateError

    path = make_linear_head(tmp_path / "h.pth", 768)
    with pytest.raises(CurateError, match="curate.heads.nsfw: the head takes 768-d embeddings, the model gives 16-d"):
        load_head("nsfw", HeadConfig(path=str(path)), 16)
    with pytest.raises(CurateError, match="no file at"):
        load_head("nsfw", HeadConfig(path=str(tmp_path / "missing.pth")), 16)


@pytest.mark.parametrize("name", ["quickgelu", "gelu"])
def test_checkpoints_made_by_open_clip_give_open_clips_outputs(name):
    """tests/data/open_clip_tiny was made by open_clip 3.3.0 itself (tools/make_open_clip_fixture.py)."""
    from pathlib import Path

    from tasks.models.openclip import load_open_clip

    base = Path(__file__).parent / "data" / "open_clip_tiny"
    expected = json.loads((base / "expected.json").read_text())["models"][name]
    model, pre = load_open_clip(base / name)
    model.float().eval()
    pixels = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(expected["pixels_seed"]))
    with torch.no_grad():
        image = model.get_image_features(pixel_values=pixels)
        text = model.get_text_features(input_ids=torch.tensor(expected["ids"]))
    image = torch.nn.functional.normalize(getattr(image, "pooler_output", image), dim=-1).numpy()
    text = torch.nn.functional.normalize(getattr(text, "pooler_output", text), dim=-1).numpy()
    np.testing.assert_allclose(image, np.array(expected["image"]), atol=1e-5)
    np.testing.assert_allclose(text, np.array(expected["text"]), atol=1e-5)
    assert pre.size == 32 and pre.center_crop


def test_a_broken_curation_model_stops_the_run_before_any_download(tmp_path):
    """The run's preflight checks the dual encoder's folder (config, weights, tokenizer files)
    on the machine that runs it, so a broken one costs no download; None where it is sound or
    curation is off."""
    from flows.preflight import phases_problem
    from tasks.formats.recipe import parse_recipe

    (tmp_path / "empty").mkdir()

    def recipe(model: str | None):
        curate = {"model": model} if model else {}
        return parse_recipe(
            {
                "dataset": "d",
                "storage": str(tmp_path / "s"),
                "sources": [{"name": "s", "manifest": "m.csv"}],
                "curate": curate,
            }
        )

    problem = phases_problem(recipe(str(tmp_path / "empty")), ["release"])
    assert problem is not None and str(tmp_path / "empty") in problem and "config.json" in problem
    assert phases_problem(recipe(None), ["release"]) is None
    assert phases_problem(recipe(str(tmp_path / "empty")), ["download"]) is None  # curation not run
