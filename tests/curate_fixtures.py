"""Tiny random-weight dual encoders (transformers CLIP and SigLIP, an open_clip checkpoint) and heads, for curation tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

WIDTH = 32


def _tower(**extra: Any) -> dict[str, Any]:
    """One tower's config: two layers of width WIDTH, two heads."""
    return dict(hidden_size=WIDTH, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, **extra)


def _tokenizer(path: Path, max_length: int) -> int:
    """The demo's word-level tokenizer saved at ``path``; its vocabulary size."""
    from transformers import AutoTokenizer

    from tasks.demo.models import make_tokenizer

    make_tokenizer(path, max_length)
    return len(AutoTokenizer.from_pretrained(path))


def make_clip(path: Path, seed: int = 0, image_size: int = 32, max_length: int = 24) -> Path:
    """A transformers CLIPModel (two layers, width 32, patch 16) with the word-level tokenizer."""
    import torch
    from transformers import AutoTokenizer, CLIPConfig, CLIPModel

    path = Path(path)
    vocab = _tokenizer(path, max_length)
    tok = AutoTokenizer.from_pretrained(path)
    torch.manual_seed(seed)
    cfg = CLIPConfig(
        projection_dim=16,
        text_config=_tower(
            vocab_size=vocab,
            max_position_embeddings=max_length,
            pad_token_id=tok.pad_token_id,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
        ),
        vision_config=_tower(
            image_size=image_size,
            patch_size=16,
        ),
    )
    CLIPModel(cfg).save_pretrained(path)
    return path


def make_siglip(path: Path, seed: int = 0, image_size: int = 32, max_length: int = 16) -> Path:
    """A transformers SiglipModel (two layers, width 32, patch 16) with the word-level tokenizer."""
    import torch
    from transformers import SiglipConfig, SiglipModel

    path = Path(path)
    vocab = _tokenizer(path, max_length)
    torch.manual_seed(seed)
    cfg = SiglipConfig(
        text_config=_tower(
            vocab_size=vocab,
            max_position_embeddings=max_length,
        ),
        vision_config=_tower(
            image_size=image_size,
            patch_size=16,
        ),
    )
    SiglipModel(cfg).save_pretrained(path)
    (path / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "do_resize": True,
                "size": {"height": image_size, "width": image_size},
                "image_mean": [0.5] * 3,
                "image_std": [0.5] * 3,
            }
        )
    )
    return path


def open_clip_state_dict(
    seed: int = 0,
    width: int = WIDTH,
    layers: int = 2,
    embed: int = 16,
    image: int = 32,
    patch: int = 16,
    context: int = 24,
    vocab: int = 64,
) -> dict:
    """A random state dict in open_clip's ViT CLIP layout (OpenAI's names)."""
    import torch

    g = torch.Generator().manual_seed(seed)

    def r(*shape: int, scale: float = 0.1) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    sd = {
        "logit_scale": torch.tensor(2.6592),
        "token_embedding.weight": r(vocab, width),
        "positional_embedding": r(context, width),
        "ln_final.weight": 1 + r(width),
        "ln_final.bias": r(width),
        "text_projection": r(width, embed),
        "visual.class_embedding": r(width),
        "visual.conv1.weight": r(width, 3, patch, patch),
        "visual.positional_embedding": r((image // patch) ** 2 + 1, width),
        "visual.ln_pre.weight": 1 + r(width),
        "visual.ln_pre.bias": r(width),
        "visual.ln_post.weight": 1 + r(width),
        "visual.ln_post.bias": r(width),
        "visual.proj": r(width, embed),
    }
    for tower in ("transformer", "visual.transformer"):
        for i in range(layers):
            p = f"{tower}.resblocks.{i}"
            sd.update(
                {
                    f"{p}.ln_1.weight": 1 + r(width),
                    f"{p}.ln_1.bias": r(width),
                    f"{p}.attn.in_proj_weight": r(3 * width, width),
                    f"{p}.attn.in_proj_bias": r(3 * width),
                    f"{p}.attn.out_proj.weight": r(width, width),
                    f"{p}.attn.out_proj.bias": r(width),
                    f"{p}.ln_2.weight": 1 + r(width),
                    f"{p}.ln_2.bias": r(width),
                    f"{p}.mlp.c_fc.weight": r(4 * width, width),
                    f"{p}.mlp.c_fc.bias": r(4 * width),
                    f"{p}.mlp.c_proj.weight": r(width, 4 * width),
                    f"{p}.mlp.c_proj.bias": r(width),
                }
            )
    return sd


def make_open_clip(path: Path, seed: int = 0, quick_gelu: bool = True) -> Path:
    """An open_clip checkpoint folder (config, weights, and a word-level tokenizer beside them)."""
    import torch

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab = _tokenizer(path, 24)
    sd = open_clip_state_dict(seed, vocab=vocab)
    torch.save(sd, path / "open_clip_pytorch_model.bin")
    cfg = {
        "model_cfg": {
            "embed_dim": 16,
            "quick_gelu": quick_gelu,
            "vision_cfg": {"image_size": 32, "layers": 2, "width": WIDTH, "patch_size": 16, "head_width": 16},
            "text_cfg": {"context_length": 24, "vocab_size": vocab, "width": WIDTH, "heads": 2, "layers": 2},
        },
        "preprocess_cfg": {"mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5]},
    }
    (path / "open_clip_config.json").write_text(json.dumps(cfg))
    return path


def make_linear_head(path: Path, dim: int, seed: int = 0) -> Path:
    """A head in LAION-aesthetics' linear format: ``{"weight": (1, dim), "bias": (1,)}``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    torch.save({"weight": torch.randn(1, dim, generator=g), "bias": torch.zeros(1)}, path)
    return Path(path)


def make_mlp_head(path: Path, dim: int, seed: int = 0) -> Path:
    """A head in LAION-aesthetics' MLP layout (``layers.0`` ... ``layers.7``, no activations)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    sizes = [(dim, 64), (64, 16), (16, 8), (8, 1)]
    names = ["layers.0", "layers.2", "layers.4", "layers.6"]
    sd = {}
    for name, (i, o) in zip(names, sizes):
        sd[f"{name}.weight"] = torch.randn(o, i, generator=g) * 0.2
        sd[f"{name}.bias"] = torch.randn(o, generator=g) * 0.1
    torch.save(sd, path)
    return Path(path)
