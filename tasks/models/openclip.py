"""open_clip checkpoints of the ViT CLIP family, read into transformers' CLIPModel (open_clip itself needs torchvision).

open_clip's ``CLIP`` with a ViT image tower and its own text transformer keeps OpenAI's layout
(``visual.conv1``, ``visual.transformer.resblocks.N.attn.in_proj_weight`` ...); transformers'
``CLIPModel`` computes the same functions with other names and split q/k/v projections. The
weights are renamed and split here, never changed. Towers open_clip builds from timm or Hugging
Face models, attentional pooling, layer scale and other variants are refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tasks.models.placement import CurateError
from tasks.models.preprocess import CLIP_MEAN, CLIP_STD, Preprocess

OPEN_CLIP_CONFIG = "open_clip_config.json"
WEIGHT_FILES = ("open_clip_model.safetensors", "open_clip_pytorch_model.bin", "open_clip_pytorch_model.pt")
# Settings of open_clip's towers that change what they compute, with the value this reader supports.
SUPPORTED_VISION = {
    "timm_model_name": None,
    "attentional_pool": False,
    "no_ln_pre": False,
    "final_ln_after_pool": False,
    "pool_type": "tok",
    "global_average_pool": False,
    "ls_init_value": None,
    "pos_embed_type": "learnable",
    "output_tokens": False,
}
SUPPORTED_TEXT = {
    "hf_model_name": None,
    "embed_cls": False,
    "no_causal_mask": False,
    "final_ln_after_pool": False,
    "pool_type": "argmax",
    "ls_init_value": None,
    "proj_bias": False,
    "proj_type": "linear",
}


def _refuse_variants(root: Path, cfg: dict[str, Any]) -> None:
    problems = []
    for tower, supported in (("vision_cfg", SUPPORTED_VISION), ("text_cfg", SUPPORTED_TEXT)):
        for key, want in supported.items():
            got = cfg.get(tower, {}).get(key, want)
            if got != want:
                problems.append(f"{tower}.{key} = {got!r}")
    if cfg.get("custom_text"):
        problems.append("custom_text = true")
    if problems:
        raise CurateError(
            f"curate.model {root}: an open_clip variant this reader does not convert ({', '.join(problems)}); "
            "save it in transformers' layout (CLIPModel / SiglipModel) instead"
        )


def clip_config(cfg: dict[str, Any]) -> Any:
    """transformers' CLIPConfig for an open_clip ``model_cfg``."""
    from transformers import CLIPConfig

    v, t = cfg["vision_cfg"], cfg["text_cfg"]
    act = "quick_gelu" if cfg.get("quick_gelu") else "gelu"
    vwidth, twidth = int(v["width"]), int(t["width"])
    return CLIPConfig(
        projection_dim=int(cfg["embed_dim"]),
        vision_config={
            "hidden_size": vwidth,
            "intermediate_size": int(vwidth * float(v.get("mlp_ratio", 4.0))),
            "num_hidden_layers": int(v["layers"]),
            "num_attention_heads": vwidth // int(v.get("head_width", 64)),
            "image_size": int(v["image_size"]) if not isinstance(v["image_size"], list) else int(v["image_size"][0]),
            "patch_size": int(v["patch_size"]),
            "hidden_act": act,
            "layer_norm_eps": 1e-5,
        },
        text_config={
            "hidden_size": twidth,
            "intermediate_size": int(twidth * float(t.get("mlp_ratio", 4.0))),
            "num_hidden_layers": int(t["layers"]),
            "num_attention_heads": int(t.get("heads", 8)),
            "vocab_size": int(t.get("vocab_size", 49408)),
            "max_position_embeddings": int(t.get("context_length", 77)),
            "hidden_act": act,
            "layer_norm_eps": 1e-5,
            # 2 selects transformers' legacy pooling: the position of the largest token id, as
            # open_clip's argmax pooling (its end-of-text token has the largest id).
            "eos_token_id": 2,
            "bos_token_id": 0,
            "pad_token_id": 1,
        },
    )


def _blocks(sd: dict[str, Any], src: str, dst: str, layers: int) -> dict[str, Any]:
    out = {}
    for i in range(layers):
        s, d = f"{src}.{i}", f"{dst}.{i}"
        q, k, v = sd[f"{s}.attn.in_proj_weight"].chunk(3, dim=0)
        qb, kb, vb = sd[f"{s}.attn.in_proj_bias"].chunk(3, dim=0)
        out.update(
            {
                f"{d}.self_attn.q_proj.weight": q,
                f"{d}.self_attn.k_proj.weight": k,
                f"{d}.self_attn.v_proj.weight": v,
                f"{d}.self_attn.q_proj.bias": qb,
                f"{d}.self_attn.k_proj.bias": kb,
                f"{d}.self_attn.v_proj.bias": vb,
                f"{d}.self_attn.out_proj.weight": sd[f"{s}.attn.out_proj.weight"],
                f"{d}.self_attn.out_proj.bias": sd[f"{s}.attn.out_proj.bias"],
                f"{d}.layer_norm1.weight": sd[f"{s}.ln_1.weight"],
                f"{d}.layer_norm1.bias": sd[f"{s}.ln_1.bias"],
                f"{d}.layer_norm2.weight": sd[f"{s}.ln_2.weight"],
                f"{d}.layer_norm2.bias": sd[f"{s}.ln_2.bias"],
                f"{d}.mlp.fc1.weight": sd[f"{s}.mlp.c_fc.weight"],
                f"{d}.mlp.fc1.bias": sd[f"{s}.mlp.c_fc.bias"],
                f"{d}.mlp.fc2.weight": sd[f"{s}.mlp.c_proj.weight"],
                f"{d}.mlp.fc2.bias": sd[f"{s}.mlp.c_proj.bias"],
            }
        )
    return out


def convert_state_dict(sd: dict[str, Any], vision_layers: int, text_layers: int) -> dict[str, Any]:
    """open_clip's state dict under transformers' CLIPModel names."""
    out = {
        "logit_scale": sd["logit_scale"].reshape(()),
        "text_model.embeddings.token_embedding.weight": sd["token_embedding.weight"],
        "text_model.embeddings.position_embedding.weight": sd["positional_embedding"],
        "text_model.final_layer_norm.weight": sd["ln_final.weight"],
        "text_model.final_layer_norm.bias": sd["ln_final.bias"],
        "text_projection.weight": sd["text_projection"].T.contiguous(),
        "vision_model.embeddings.class_embedding": sd["visual.class_embedding"],
        "vision_model.embeddings.patch_embedding.weight": sd["visual.conv1.weight"],
        "vision_model.embeddings.position_embedding.weight": sd["visual.positional_embedding"],
        "vision_model.pre_layrnorm.weight": sd["visual.ln_pre.weight"],
        "vision_model.pre_layrnorm.bias": sd["visual.ln_pre.bias"],
        "vision_model.post_layernorm.weight": sd["visual.ln_post.weight"],
        "vision_model.post_layernorm.bias": sd["visual.ln_post.bias"],
        "visual_projection.weight": sd["visual.proj"].T.contiguous(),
    }
    out.update(_blocks(sd, "transformer.resblocks", "text_model.encoder.layers", text_layers))
    out.update(_blocks(sd, "visual.transformer.resblocks", "vision_model.encoder.layers", vision_layers))
    return out


def _state_dict(root: Path) -> dict[str, Any]:
    for name in WEIGHT_FILES:
        path = root / name
        if not path.exists():
            continue
        if name.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(str(path))
        import torch

        sd = torch.load(str(path), map_location="cpu", weights_only=True)
        return sd.get("state_dict", sd) if isinstance(sd, dict) else sd
    raise CurateError(f"curate.model {root}: no open_clip weights ({', '.join(WEIGHT_FILES)})")


def load_open_clip(root: Path) -> tuple[Any, Preprocess]:
    """The checkpoint as a transformers CLIPModel, and open_clip's preprocessing of it."""
    from transformers import CLIPModel

    try:
        meta = json.loads((root / OPEN_CLIP_CONFIG).read_text())
        cfg = meta["model_cfg"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CurateError(f"curate.model {root}: {OPEN_CLIP_CONFIG} has no readable model_cfg ({err})") from None
    _refuse_variants(root, cfg)
    config = clip_config(cfg)
    sd = {k.removeprefix("module."): v for k, v in _state_dict(root).items()}
    try:
        mapped = convert_state_dict(sd, config.vision_config.num_hidden_layers, config.text_config.num_hidden_layers)
    except KeyError as err:
        raise CurateError(f"curate.model {root}: the open_clip weights lack {err}; not a ViT CLIP checkpoint") from None
    model = CLIPModel(config)
    missing, unexpected = model.load_state_dict(mapped, strict=False)
    missing = [k for k in missing if not k.endswith("position_ids")]
    if missing or unexpected:
        raise CurateError(
            f"curate.model {root}: weights do not fit (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    pre = meta.get("preprocess_cfg", {})
    size = config.vision_config.image_size
    mode = pre.get("resize_mode", "shortest")
    return model, Preprocess(
        size=size,
        center_crop=mode != "squash",
        mean=tuple(float(x) for x in pre.get("mean", CLIP_MEAN)),  # type: ignore[arg-type]
        std=tuple(float(x) for x in pre.get("std", CLIP_STD)),  # type: ignore[arg-type]
    )
