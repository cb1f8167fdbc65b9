"""The frozen encoders of the precache phase (VAE, text and vision encoders, and the video VAE through video_vae.py): checked, loaded once per worker process, run on batches."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from tasks.formats.recipe_outputs import PrecacheConfig
from tasks.models.latents import maybe_float, stored_latents
from tasks.models.placement import (
    STORAGE_DTYPES,
    PrecacheError,
    compute_dtype,
    frozen,
    need_dir,
    quiet_model_loading,
    resolve_device,
    running,
)
from tasks.models.preprocess import normalisation

# The members the image VAE's outputs become for clips (``latent.npy`` -> ``clip_latent.npy``).
CLIP_PREFIX = "clip_"
_MODELS: dict[str, Encoders] = {}
_MODELS_LOCK = threading.Lock()
# The model blocks of a precache config that name a model, and so a compute dtype.
BLOCKS = ("image_latents", "clip_latents", "text", "vision", "image_embedding")


def clip_members(image_members: list[str]) -> list[str]:
    return [CLIP_PREFIX + m for m in image_members]


def compute_dtypes(cfg: PrecacheConfig, device: str) -> dict[str, str]:
    """Per configured model block, the dtype it computes in on ``device``: its own
    ``compute_dtype`` when it sets one, else ``precache.compute_dtype`` (``auto`` resolved)."""
    out = {}
    for name in BLOCKS:
        block = getattr(cfg, name)
        if block is not None:
            out[name] = compute_dtype(getattr(block, "compute_dtype", None) or cfg.compute_dtype, device)
    return out


def check_models(cfg: PrecacheConfig) -> None:
    """Fail before any work when a configured model or tokenizer folder is missing."""
    if cfg.image_latents:
        base = need_dir(cfg.image_latents.model, "precache.image_latents.model")
        if cfg.image_latents.subfolder:
            need_dir(str(base / cfg.image_latents.subfolder), "precache.image_latents.subfolder")
    if cfg.text:
        need_dir(cfg.text.model, "precache.text.model")
        need_dir(cfg.text.tokenizer or cfg.text.model, "precache.text.tokenizer")
    if cfg.clip_latents and cfg.clip_latents.model:
        from tasks.models.video_vae import check_video_vae

        check_video_vae(cfg)
    if cfg.vision:
        need_dir(cfg.vision.model, "precache.vision.model")
    if cfg.image_embedding:
        need_dir(cfg.image_embedding.model, "precache.image_embedding.model")


def precache_device(cfg: PrecacheConfig) -> str:
    """``cuda`` when asked for, or on ``auto`` when this worker sees a GPU; ``cpu`` otherwise."""
    return resolve_device(cfg.device, "precache.device")


class Encoders:
    """The frozen models a precache config names, on one device, in eval mode.

    Args:
        cfg: the recipe's precache config.
        device: ``cpu`` or ``cuda``. Weights stay fp32; each model computes in its block's
            compute dtype (``compute_dtypes``), under autocast.
    """

    def __init__(self, cfg: PrecacheConfig, device: str) -> None:

        check_models(cfg)
        quiet_model_loading(diffusers=cfg.image_latents is not None)
        self.cfg = cfg
        self.device = device
        self.dtypes = compute_dtypes(cfg, device)
        self.vae = self.tokenizer = self.text = self.vision = self.video_vae = None
        self.vision_mean = self.vision_std = None
        self.vision_size = None
        if cfg.image_latents:
            from diffusers import AutoencoderKL

            kw = {"subfolder": cfg.image_latents.subfolder} if cfg.image_latents.subfolder else {}
            # low_cpu_mem_usage needs accelerate, which we do not depend on for one load per worker.
            self.vae = AutoencoderKL.from_pretrained(
                cfg.image_latents.model, local_files_only=True, low_cpu_mem_usage=False, **kw
            )
            # The VAE also encodes clip frames unless a video VAE does: its weights stay fp32
            # when the two blocks compute in different dtypes.
            clip = cfg.clip_latents
            shared = clip is not None and clip.model is None
            same = not shared or self.dtypes["clip_latents"] == self.dtypes["image_latents"]
            frozen(self.vae, device, self.dtypes["image_latents"] if same else "fp32")
        if cfg.clip_latents and cfg.clip_latents.model:
            from tasks.models.video_vae import VideoVae

            self.video_vae = VideoVae(cfg, device, self.dtypes["clip_latents"])
        if cfg.text:
            from tasks.models.tokenizers import local_tokenizer

            kind = _model_type(cfg.text.model, "precache.text.model")
            model_class = _text_model_class(kind, cfg.text.model)
            what = "precache.text.tokenizer" if cfg.text.tokenizer else "precache.text.model"
            self.tokenizer = local_tokenizer(cfg.text.tokenizer or cfg.text.model, what, PrecacheError)
            self.text = model_class.from_pretrained(cfg.text.model, local_files_only=True)
            frozen(self.text, device, self.dtypes["text"])
            self.text_kind = kind
        if cfg.vision:
            from transformers import AutoConfig

            model_class = _vision_model_class(_model_type(cfg.vision.model, "precache.vision.model"), cfg.vision.model)
            config = AutoConfig.from_pretrained(cfg.vision.model, local_files_only=True)
            self.vision = model_class.from_pretrained(cfg.vision.model, local_files_only=True)
            frozen(self.vision, device, self.dtypes["vision"])
            vcfg = getattr(config, "vision_config", config)
            self.vision_size = cfg.vision.resolution or int(vcfg.image_size)
            self.vision_mean, self.vision_std = normalisation(Path(cfg.vision.model))

    # -- encoders on one batch; inputs are torch tensors on any device ----------------------

    def encode_images(self, pixels: Any, keys: list[str], block: str = "image_latents") -> dict[str, Any]:
        """``pixels``: (B, 3, R, R) in [-1, 1]. Returns the stored arrays' tensors by member name;
        ``block``: whose compute dtype (``clip_latents`` for clip frames through this VAE)."""
        import torch

        with running(self.device, self.dtypes.get(block, self.dtypes["image_latents"])):
            dist = self.vae.encode(pixels.to(self.device, torch.float32)).latent_dist
            return stored_latents(dist, self.cfg.image_latents.store, keys)

    def encode_text(self, captions: list[str]) -> dict[str, Any]:
        """Hidden states ``(B, max_length, D)`` and the mask. Each batch is run at its longest
        caption's length (SigLIP's at ``max_length``, as it was trained), then padded with zeros
        to ``max_length``: the mask keeps padding out of every real token's state, so this is
        what running every caption at ``max_length`` gives, less the cost of the padding."""
        import torch

        length = self.cfg.text.max_length
        siglip = self.text_kind == "siglip_text_model"
        tok = self.tokenizer(
            captions,
            padding="max_length" if siglip else "longest",
            truncation=True,
            max_length=length,
            return_tensors="pt",
        )
        with running(self.device, self.dtypes["text"]):
            out = self.text(
                input_ids=tok["input_ids"].to(self.device), attention_mask=tok["attention_mask"].to(self.device)
            )
        states, mask = out.last_hidden_state.float(), tok["attention_mask"].to(torch.uint8)
        states = states * mask.to(states.device, states.dtype)[:, :, None]
        pad = length - states.shape[1]
        if pad > 0:
            states = torch.nn.functional.pad(states, (0, 0, 0, pad))
            mask = torch.nn.functional.pad(mask, (0, pad))
        return {"text_emb.npy": states, "text_mask.npy": mask}

    def encode_vision(self, pixels: Any) -> dict[str, Any]:
        import torch

        with running(self.device, self.dtypes["vision"]):
            out = self.vision(pixel_values=pixels.to(self.device, torch.float32))
        return {"vision_emb.npy": out.last_hidden_state}

    def describe(self) -> dict[str, dict[str, Any]]:
        """index.json's ``encodings`` entries, less the shapes (known after the first batch)."""
        out: dict[str, dict[str, Any]] = {}
        dtype = STORAGE_DTYPES[self.cfg.dtype]
        if self.vae is not None:
            il = self.cfg.image_latents
            members = ["latent_mean.npy", "latent_logvar.npy"] if il.store == "mean_logvar" else ["latent.npy"]
            out["image_latents"] = {
                "members": members,
                "dtype": dtype,
                "scaling_factor": float(self.vae.config.scaling_factor),
                "shift_factor": maybe_float(getattr(self.vae.config, "shift_factor", None)),
                "resolution": il.resolution,
                "store": il.store,
                "model": Path(il.model).name + (f"/{il.subfolder}" if il.subfolder else ""),
            }
        if self.vae is not None and self.cfg.clip_latents is not None:
            out["clip_latents"] = {
                **out["image_latents"],
                "members": clip_members(out["image_latents"]["members"]),
                "frames": self.cfg.clip_latents.frames,
                "fps": self.cfg.clip_latents.fps,
                "latent_frames": self.cfg.clip_latents.frames,
            }
            if self.video_vae is not None:  # its class, digest, latent frames and factors instead
                out["clip_latents"].update(self.video_vae.describe())
        if self.text is not None:
            out["text"] = {
                "members": ["text_emb.npy", "text_mask.npy"],
                "dtype": dtype,
                "mask_dtype": "uint8",
                "max_length": self.cfg.text.max_length,
                "model": Path(self.cfg.text.model).name,
            }
        if self.cfg.image_embedding is not None:
            out["image_embedding"] = {
                "members": ["image_emb.npy"],
                "dtype": dtype,
                "normalized": True,
                "model": Path(self.cfg.image_embedding.model).name,
            }
        if self.vision is not None:
            out["vision"] = {
                "members": ["vision_emb.npy"],
                "dtype": dtype,
                "resolution": self.vision_size,
                "model": Path(self.cfg.vision.model).name,
            }
        for name, info in out.items():
            info["compute_dtype"] = self.dtypes.get(name, self.dtypes.get("image_latents"))
        return out


def _model_type(path: str, what: str) -> str | None:
    """``model_type`` from a transformers folder's config.json (read before importing a class)."""
    try:
        return json.loads((Path(path) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError) as err:
        raise PrecacheError(f"{what} {path}: no readable config.json ({err})") from None


# transformers classes of the encoders, by the ``model_type`` of their config.json.
TEXT_MODELS = {
    "clip_text_model": "CLIPTextModel",
    "clip": "CLIPTextModel",
    "t5": "T5EncoderModel",
    "mt5": "MT5EncoderModel",
    "umt5": "UMT5EncoderModel",
    "siglip_text_model": "SiglipTextModel",
}
VISION_MODELS = {
    "clip_vision_model": "CLIPVisionModel",
    "clip": "CLIPVisionModel",
    "siglip_vision_model": "SiglipVisionModel",
    "siglip": "SiglipVisionModel",
}


def _model_class(classes: dict[str, str], kind: str, path: str, what: str) -> Any:
    """The transformers class of a ``what`` ("text", "vision") encoder of model_type ``kind``."""
    import transformers

    if kind not in classes:
        raise PrecacheError(
            f"precache.{what}.model {path}: model_type {kind!r} is not a known {what} encoder ({', '.join(sorted(classes))})"
        )
    return getattr(transformers, classes[kind])


def _text_model_class(kind: str, path: str) -> Any:
    return _model_class(TEXT_MODELS, kind, path, "text")


def _vision_model_class(kind: str, path: str) -> Any:
    return _model_class(VISION_MODELS, kind, path, "vision")


def load_encoders(cfg: PrecacheConfig) -> tuple[Encoders, float]:
    """The worker's encoders for ``cfg``, loaded on first use; and the seconds the load took."""
    device = precache_device(cfg)
    key = json.dumps([cfg.model_dump(mode="json"), device], sort_keys=True)
    with _MODELS_LOCK:
        if key in _MODELS:
            return _MODELS[key], 0.0
        start = time.perf_counter()
        enc = Encoders(cfg, device)
        _MODELS[key] = enc
        return enc, time.perf_counter() - start
