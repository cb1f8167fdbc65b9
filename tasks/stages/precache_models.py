"""The frozen encoders of the precache phase: checked, loaded once per worker process, run on batches."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from pathlib import Path
from typing import Any

from tasks.formats.recipe_outputs import PrecacheConfig

IMAGE_EXTS = "jpg;jpeg;png;webp"
STORAGE_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


class PrecacheError(RuntimeError):
    """A precache that cannot run: a missing model, an unreadable shard, a model of a kind we do not know."""


# ---------------------------------------------------------------------------------------------
# Models: loaded once per worker process
# ---------------------------------------------------------------------------------------------

_MODELS: dict[str, Encoders] = {}
_MODELS_LOCK = threading.Lock()


def need_dir(path: str | None, what: str) -> Path:
    if not path or not Path(path).is_dir():
        raise PrecacheError(
            f"{what}: no model directory at {path!r}; models are never downloaded at run time, "
            "point the recipe at a local save_pretrained folder"
        )
    return Path(path)


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
        from tasks.video.video_vae import check_video_vae

        check_video_vae(cfg)
    if cfg.vision:
        need_dir(cfg.vision.model, "precache.vision.model")
    if cfg.image_embedding:
        need_dir(cfg.image_embedding.model, "precache.image_embedding.model")


def resolve_device(cfg: PrecacheConfig) -> str:
    """``cuda`` when asked for, or on ``auto`` when this worker sees a GPU; ``cpu`` otherwise."""
    import torch

    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise PrecacheError("precache.device is cuda but this worker sees no CUDA GPU")
    if cfg.device == "cpu":
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def quiet_model_loading(diffusers: bool) -> None:
    """No progress bars from loading or saving models (transformers' "Loading weights", the
    Hub's, and diffusers' when ``diffusers``: importing diffusers only for this would cost a
    text-only load seconds of CPU).

    In a Dask worker they interleave with the CLI's own progress lines, and each bar's tqdm
    creates a multiprocessing lock: a worker that the cluster's close ends before its
    finalizers run leaves those locks registered, and Python's resource tracker warns of
    "leaked semaphore objects" as the run exits. Idempotent; process-wide, as the libraries keep it.
    """
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # the Hub's bars too
    if diffusers:
        from diffusers.utils import logging as diffusers_logging

        diffusers_logging.disable_progress_bar()


def dtype_of(name: str) -> Any:
    import torch

    return {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[name]


class Encoders:
    """The frozen models a precache config names, on one device, in eval mode.

    Args:
        cfg: the recipe's precache config.
        device: ``cpu`` or ``cuda``. Models run in fp32 on the CPU (fp16 kernels there are slow
            or missing) and in the storage dtype on the GPU (bf16 -> bf16, fp16 -> fp16).
    """

    def __init__(self, cfg: PrecacheConfig, device: str) -> None:
        import torch

        check_models(cfg)
        quiet_model_loading(diffusers=cfg.image_latents is not None)
        self.cfg = cfg
        self.device = device
        self.compute_dtype = torch.float32 if device == "cpu" else dtype_of(cfg.dtype)
        self.vae = self.tokenizer = self.text = self.vision = self.video_vae = None
        self.vision_mean = self.vision_std = None
        self.vision_size = None
        if cfg.image_latents:
            from diffusers import AutoencoderKL

            kw = {"subfolder": cfg.image_latents.subfolder} if cfg.image_latents.subfolder else {}
            # low_cpu_mem_usage needs accelerate, which we do not depend on for one load per worker.
            self.vae = AutoencoderKL.from_pretrained(
                cfg.image_latents.model,
                local_files_only=True,
                torch_dtype=self.compute_dtype,
                low_cpu_mem_usage=False,
                **kw,
            )
            self.vae.to(device=device).eval().requires_grad_(False)
        if cfg.clip_latents and cfg.clip_latents.model:
            from tasks.video.video_vae import VideoVae

            self.video_vae = VideoVae(cfg, device, self.compute_dtype)
        if cfg.text:
            from transformers import AutoTokenizer

            kind = _model_type(cfg.text.model, "precache.text.model")
            model_class = _text_model_class(kind, cfg.text.model)
            self.tokenizer = AutoTokenizer.from_pretrained(cfg.text.tokenizer or cfg.text.model, local_files_only=True)
            self.text = model_class.from_pretrained(cfg.text.model, local_files_only=True)
            self.text.to(device=device, dtype=self.compute_dtype).eval().requires_grad_(False)
        if cfg.vision:
            from transformers import AutoConfig

            model_class = _vision_model_class(_model_type(cfg.vision.model, "precache.vision.model"), cfg.vision.model)
            config = AutoConfig.from_pretrained(cfg.vision.model, local_files_only=True)
            self.vision = model_class.from_pretrained(cfg.vision.model, local_files_only=True)
            self.vision.to(device=device, dtype=self.compute_dtype).eval().requires_grad_(False)
            vcfg = getattr(config, "vision_config", config)
            self.vision_size = cfg.vision.resolution or int(vcfg.image_size)
            self.vision_mean, self.vision_std = _normalisation(Path(cfg.vision.model))

    # -- encoders on one batch; inputs are torch tensors on any device ----------------------

    def encode_images(self, pixels: Any, keys: list[str]) -> dict[str, Any]:
        """``pixels``: (B, 3, R, R) in [-1, 1]. Returns the stored arrays' tensors by member name."""
        import torch

        with torch.inference_mode():
            dist = self.vae.encode(pixels.to(self.device, self.compute_dtype)).latent_dist
            return stored_latents(dist, self.cfg.image_latents.store, keys)

    def encode_text(self, captions: list[str]) -> dict[str, Any]:
        import torch

        tok = self.tokenizer(
            captions, padding="max_length", truncation=True, max_length=self.cfg.text.max_length, return_tensors="pt"
        )
        with torch.inference_mode():
            out = self.text(
                input_ids=tok["input_ids"].to(self.device), attention_mask=tok["attention_mask"].to(self.device)
            )
        return {"text_emb.npy": out.last_hidden_state, "text_mask.npy": tok["attention_mask"].to(torch.uint8)}

    def encode_vision(self, pixels: Any) -> dict[str, Any]:
        import torch

        with torch.inference_mode():
            out = self.vision(pixel_values=pixels.to(self.device, self.compute_dtype))
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
            from tasks.video.clip_latents import clip_members

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
        return out


def stored_latents(dist: Any, store: str, seeds: list[str]) -> dict[str, Any]:
    """What ``image_latents.store`` keeps of a VAE's latent distribution, by member name: mean
    and log-variance, the mean, or one draw per sample seeded by its string in ``seeds`` (so a
    rerun stores the same draw)."""
    import torch

    if store == "mean_logvar":
        return {"latent_mean.npy": dist.mean, "latent_logvar.npy": dist.logvar}
    if store == "mean":
        return {"latent.npy": dist.mean}
    noise = torch.stack([torch.randn(dist.mean.shape[1:], generator=_key_generator(s)) for s in seeds])
    return {"latent.npy": dist.mean + dist.std * noise.to(dist.mean.device, dist.mean.dtype)}


def maybe_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _key_generator(key: str) -> Any:
    import torch

    return torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little"))


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


def _normalisation(path: Path) -> tuple[list[float], list[float]]:
    """The vision encoder's pixel mean and std, from its preprocessor config (CLIP's otherwise)."""
    pre = path / "preprocessor_config.json"
    if pre.exists():
        data = json.loads(pre.read_text())
        if "image_mean" in data and "image_std" in data:
            return [float(x) for x in data["image_mean"]], [float(x) for x in data["image_std"]]
    return [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]


def load_encoders(cfg: PrecacheConfig) -> tuple[Encoders, float]:
    """The worker's encoders for ``cfg``, loaded on first use; and the seconds the load took."""
    device = resolve_device(cfg)
    key = json.dumps([cfg.model_dump(mode="json"), device], sort_keys=True)
    with _MODELS_LOCK:
        if key in _MODELS:
            return _MODELS[key], 0.0
        start = time.perf_counter()
        enc = Encoders(cfg, device)
        _MODELS[key] = enc
        return enc, time.perf_counter() - start
