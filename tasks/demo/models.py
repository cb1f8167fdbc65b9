"""Tiny random-weight encoders built from configs, so the demo and tests precache without downloads."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Words the tiny tokenizer knows; anything else becomes [UNK]. Enough for the demo captions.
_WORDS = (
    "a an the of on in at by with and above below beside near under over over a is are "
    "red green blue yellow white black orange purple grey pink dark light small large big "
    "circle square triangle star line lines stripes dots shape shapes pattern field sky sea "
    "plain snowy desert forest city night dusk dawn morning evening photo painting scan drawing "
    "old new bright pale calm storm cloud clouds sun moon tree trees house road river mountain"
).split()


def make_tokenizer(path: str | Path, max_length: int = 77, words: list[str] | None = None) -> Path:
    """A word-level tokenizer of ``words`` (default: enough for the demo captions) saved in
    transformers' layout (``tokenizer.json`` + config)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[BOS]", "[EOS]"]
    vocab = {tok: i for i, tok in enumerate(specials + sorted(set(_WORDS if words is None else words)))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[BOS] $A [EOS]", special_tokens=[("[BOS]", vocab["[BOS]"]), ("[EOS]", vocab["[EOS]"])]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="[PAD]",
        unk_token="[UNK]",
        bos_token="[BOS]",
        eos_token="[EOS]",
        model_max_length=max_length,
    )
    path = Path(path)
    fast.save_pretrained(path)
    return path


def make_vae(path: str | Path, seed: int = 0) -> Path:
    """An ``AutoencoderKL`` with four down blocks (8x downsampling, as real SD VAEs) and few channels.

    Fewer down blocks would make the mid-block attention span 16k tokens at 512 px: slower than
    a real VAE despite the tiny widths.
    """
    import torch
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 16, 32, 32),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=8,
        sample_size=256,
    )
    # As for Stable Diffusion's 0.18215: the factor that gives the latents unit variance, here
    # measured on smooth random images (random weights give latents far from unit scale).
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        coarse = torch.rand(8, 3, 8, 8, generator=gen) * 2 - 1
        images = torch.nn.functional.interpolate(coarse, size=(128, 128), mode="bilinear")
        std = float(vae.encode(images).latent_dist.mean.std())
    vae.register_to_config(scaling_factor=round(1.0 / std, 5))
    vae.save_pretrained(Path(path))
    return Path(path)


def _tiny_video_vae(kind: str) -> Any:
    """A random-weight diffusers video VAE of ``kind`` with 4 latent channels and 8x8 spatial,
    4x temporal compression (takes 1 + 4k frames)."""
    import diffusers

    if kind == "wan":
        return diffusers.AutoencoderKLWan(
            base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1, temperal_downsample=[False, True, True]
        )
    if kind == "ltx":  # patch 2, then two space-time and one space-only downsampling: 8x space, 4x time
        return diffusers.AutoencoderKLLTXVideo(
            latent_channels=4,
            block_out_channels=(8, 8, 8, 8),
            decoder_block_out_channels=(8, 8, 8, 8),
            layers_per_block=(1, 1, 1, 1, 1),
            decoder_layers_per_block=(1, 1, 1, 1, 1),
            spatio_temporal_scaling=(True, True, False, False),
            decoder_spatio_temporal_scaling=(True, True, False, False),
            patch_size=2,
            spatial_compression_ratio=8,
        )
    if kind == "cogvideox":
        return diffusers.AutoencoderKLCogVideoX(
            block_out_channels=(8, 8, 16, 16), latent_channels=4, layers_per_block=1, norm_num_groups=4
        )
    if kind == "hunyuan":
        return diffusers.AutoencoderKLHunyuanVideo(
            latent_channels=4, block_out_channels=(8, 8, 16, 16), layers_per_block=1, norm_num_groups=4
        )
    raise ValueError(f"unknown tiny video VAE {kind!r}")


def make_video_vae(path: str | Path, seed: int = 0, kind: str = "wan") -> Path:
    """A tiny random-weight video VAE (``kind``: ``wan``, ``ltx``, ``cogvideox``, ``hunyuan``) whose
    normalisation, as its class keeps it, gives unit-variance latents on smooth random videos:
    per-channel ``latents_mean`` / ``latents_std`` for Wan (config) and LTX-Video (buffers), a
    ``scaling_factor`` for the others."""
    import torch

    torch.manual_seed(seed)
    vae = _tiny_video_vae(kind).eval()
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        coarse = torch.rand(4, 3, 5, 8, 8, generator=gen) * 2 - 1
        videos = torch.nn.functional.interpolate(coarse, size=(5, 64, 64), mode="trilinear")
        mean = vae.encode(videos).latent_dist.mean  # (B, C, T', h, w)
        per_channel = mean.transpose(0, 1).flatten(1)
        channel_mean, channel_std = per_channel.mean(1), per_channel.std(1)
    if kind == "wan":
        vae.register_to_config(latents_mean=channel_mean.tolist(), latents_std=channel_std.tolist())
    elif kind == "ltx":
        vae.latents_mean.copy_(channel_mean)
        vae.latents_std.copy_(channel_std)
    else:
        vae.register_to_config(scaling_factor=round(1.0 / float(mean.std()), 5))
    vae.save_pretrained(Path(path))
    return Path(path)


def _text_encoder(path: str | Path, seed: int, max_length: int, build: Callable[[Any], Any]) -> Path:
    """The tiny tokenizer saved at ``path``, then the model ``build(tokenizer)`` makes after seeding, beside it."""
    import torch
    from transformers import AutoTokenizer

    path = Path(path)
    tok = AutoTokenizer.from_pretrained(make_tokenizer(path, max_length))
    torch.manual_seed(seed)
    build(tok).save_pretrained(path)
    return path


def make_clip_text(path: str | Path, seed: int = 0, max_length: int = 77) -> Path:
    """A two-layer CLIP text encoder (hidden 32) with the tiny tokenizer saved beside it."""
    from transformers import CLIPTextConfig, CLIPTextModel

    def build(tok: Any) -> Any:
        return CLIPTextModel(
            CLIPTextConfig(
                vocab_size=len(tok),
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=2,
                max_position_embeddings=max_length,
                pad_token_id=tok.pad_token_id,
                bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id,
            )
        )

    return _text_encoder(path, seed, max_length, build)


def make_t5_encoder(path: str | Path, seed: int = 0, max_length: int = 77) -> Path:
    """A two-layer T5 encoder (d_model 32) with the tiny tokenizer saved beside it."""
    from transformers import T5Config, T5EncoderModel

    def build(tok: Any) -> Any:
        return T5EncoderModel(
            T5Config(
                vocab_size=len(tok),
                d_model=32,
                d_kv=16,
                d_ff=64,
                num_layers=2,
                num_heads=2,
                pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id,
                decoder_start_token_id=tok.pad_token_id,
            )
        )

    return _text_encoder(path, seed, max_length, build)


def make_clip_vision(path: str | Path, seed: int = 0, image_size: int = 64) -> Path:
    """A two-layer CLIP vision encoder (hidden 32, patch 16) and its preprocessor config."""
    import json

    import torch
    from transformers import CLIPVisionConfig, CLIPVisionModel

    path = Path(path)
    torch.manual_seed(seed)
    cfg = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=image_size,
        patch_size=16,
    )
    CLIPVisionModel(cfg).save_pretrained(path)
    # The normalisation the encoder expects, where transformers' image processors keep it.
    (path / "preprocessor_config.json").write_text(
        json.dumps(
            {"image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}
        )
    )
    return path


# The demo's trained dual encoder and its heads (tasks/demo/train_clip.py), committed in the package.
TRAINED = Path(__file__).resolve().parent / "data"


def make_clip(path: str | Path, seed: int = 0) -> Path:
    """The demo's tiny CLIP (trained on the demo's scenes, committed), copied to ``path``, with its
    heads in ``path/heads`` (``watermark.safetensors``: LAION's linear format, ``output: sigmoid``)."""
    path = Path(path)
    shutil.copytree(TRAINED / "tiny-clip", path)
    shutil.copytree(TRAINED / "tiny-clip-heads", path / "heads")
    return path


MAKERS = {
    "vae": make_vae,
    "video-vae": make_video_vae,
    "clip-text": make_clip_text,
    "t5": make_t5_encoder,
    "clip-vision": make_clip_vision,
    "clip": make_clip,
}


def make_all(root: str | Path, names: tuple[str, ...] = tuple(MAKERS)) -> dict[str, Path]:
    """The tiny models ``names`` (default all: ``vae``, ``video-vae`` (Wan), ``clip-text``, ``t5``,
    ``clip-vision``, ``clip``) under ``root``; a model already there is kept."""
    from tasks.models.placement import quiet_model_loading

    root = Path(root)
    todo = [name for name in names if not (root / name / "config.json").exists()]
    if set(todo) - {"clip"}:  # models kept from before (and copied ones) need no library at all
        quiet_model_loading(diffusers=bool({"vae", "video-vae"} & set(todo)))
    out = {}
    for name in names:
        make = MAKERS[name]
        target = root / name
        if name in todo:
            tmp = root / f".{name}.tmp-{os.getpid()}"
            make(tmp)
            try:
                os.replace(tmp, target)
            except OSError:
                # A concurrent maker got there first (rename onto a non-empty folder fails); its
                # model is the same one, built from the same config and seed.
                if not (target / "config.json").exists():
                    raise
                shutil.rmtree(tmp, ignore_errors=True)
        out[name] = target
    return out
