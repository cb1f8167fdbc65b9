"""The dual encoder of the curation phase: a CLIP-family model from a local folder, loaded once per worker."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# CLIP's normalisation, for folders that do not say theirs.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
OPEN_CLIP_CONFIG = "open_clip_config.json"
TRANSFORMERS_MODELS = {"clip": "CLIPModel", "siglip": "SiglipModel"}


class CurateError(RuntimeError):
    """A curation that cannot run: a missing or unknown model, a head that does not fit it."""


@dataclass(frozen=True)
class Preprocess:
    """How the encoder wants its pixels: resized (and cropped) to ``size``, then normalised.

    Args:
        size: the square side the vision tower takes.
        center_crop: resize the shorter side to ``size`` and crop the centre (CLIP's); else the
            whole image is resized to ``size`` x ``size`` (SigLIP's "squash").
        mean, std: per channel, of pixels in [0, 1].
    """

    size: int
    center_crop: bool
    mean: tuple[float, float, float]
    std: tuple[float, float, float]


def need_model_dir(path: str | None, what: str = "curate.model") -> Path:
    if not path or not Path(path).is_dir():
        raise CurateError(
            f"{what}: no model directory at {path!r}; models are never downloaded at run time, point the "
            "recipe at a local folder (transformers save_pretrained layout, or an open_clip checkpoint)"
        )
    return Path(path)


_DIGESTS: dict[tuple, str] = {}
_DIGESTS_LOCK = threading.Lock()


def folder_digest(*paths: str | None) -> str:
    """SHA-256 over every file of the given folders or files (relative name and content).

    Names embeddings: the same weights give the same name wherever the folder lies, and any
    change of weights, config or tokenizer gives another. Remembered per process by the files'
    sizes and modification times, so a run hashes a large checkpoint once.
    """
    files: list[tuple[str, str, int, int]] = []
    for n, path in enumerate(p for p in paths if p):
        root = Path(path)
        found = [root] if root.is_file() else sorted(f for f in root.rglob("*") if f.is_file())
        for f in found:
            rel = f.name if f == root else f.relative_to(root).as_posix()
            if any(part.startswith(".") for part in Path(rel).parts):
                continue
            st = f.stat()
            files.append((f"{n}/{rel}", str(f), st.st_size, st.st_mtime_ns))
    key = tuple(files)
    with _DIGESTS_LOCK:
        if key in _DIGESTS:
            return _DIGESTS[key]
    sha = hashlib.sha256()
    for rel, full, size, _ in files:
        sha.update(f"{rel}\0{size}\0".encode())
        with open(full, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                sha.update(block)
    digest = sha.hexdigest()
    with _DIGESTS_LOCK:
        _DIGESTS[key] = digest
    return digest


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CurateError(f"{path}: not readable JSON ({err})") from None
    if not isinstance(data, dict):
        raise CurateError(f"{path}: expected a JSON object")
    return data


def _side(value: Any, default: int) -> int:
    """A transformers image-processor size: an int, or a dict with shortest_edge / height."""
    if isinstance(value, int):
        return value
    if isinstance(value, dict):
        for k in ("shortest_edge", "height", "width"):
            if isinstance(value.get(k), int):
                return int(value[k])
    return default


def transformers_preprocess(path: Path, image_size: int) -> Preprocess:
    """From ``preprocessor_config.json`` (transformers' image-processor keys), CLIP's otherwise."""
    pre = path / "preprocessor_config.json"
    data = _read_json(pre) if pre.exists() else {}
    crop = bool(data.get("do_center_crop", not pre.exists()))
    size = _side(data.get("crop_size"), image_size) if crop else _side(data.get("size"), image_size)
    mean = tuple(float(x) for x in data.get("image_mean", CLIP_MEAN))
    std = tuple(float(x) for x in data.get("image_std", CLIP_STD))
    if len(mean) != 3 or len(std) != 3:
        raise CurateError(f"{pre}: image_mean and image_std need three values each")
    return Preprocess(size, crop, (mean[0], mean[1], mean[2]), (std[0], std[1], std[2]))


class DualEncoder:
    """Image and text towers of one CLIP-family model, frozen, on one device.

    Args:
        path: the model folder (transformers CLIP or SigLIP, or an open_clip checkpoint).
        tokenizer: folder of the tokenizer (default: ``path``).
        max_length: caption tokens (default: the text tower's context length).
        device: ``cpu`` or ``cuda``; fp32 on the CPU, fp16 on the GPU.

    ``images`` and ``texts`` return L2-normalised float32 embeddings, one row per input.
    """

    def __init__(self, path: str, tokenizer: str | None = None, max_length: int | None = None, device: str = "cpu"):
        import torch
        from transformers import AutoTokenizer
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()  # see precache_models.quiet_model_loading
        root = need_model_dir(path)
        self.device = device
        self.dtype = torch.float32 if device == "cpu" else torch.float16
        with quiet_transformers():
            if (root / OPEN_CLIP_CONFIG).exists():
                from tasks.curate.openclip import load_open_clip

                self.model, self.preprocess = load_open_clip(root)
                self.kind = "open_clip"
            else:
                self.model, self.preprocess, self.kind = _load_transformers(root)
        tok_dir = tokenizer or path
        need_model_dir(tok_dir, "curate.tokenizer")
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
        except (OSError, ValueError) as err:
            raise CurateError(
                f"curate.tokenizer {tok_dir}: no tokenizer there ({type(err).__name__}: {err}); put its files "
                "(tokenizer.json, or vocab.json and merges.txt) beside the model or set curate.tokenizer"
            ) from None
        context = int(self.model.config.text_config.max_position_embeddings)
        self.max_length = min(max_length or context, context)
        self.model.to(device=device, dtype=self.dtype).eval().requires_grad_(False)

    @property
    def dim(self) -> int:
        """Width of the shared embedding space."""
        return int(self.texts(["a"]).shape[1])

    def images(self, pixels: Any) -> np.ndarray:
        """``pixels``: (B, 3, S, S) normalised as ``preprocess`` says, on any device."""
        import torch

        with torch.inference_mode():
            out = self.model.get_image_features(pixel_values=pixels.to(self.device, self.dtype))
        return _normalised(out)

    def texts(self, captions: list[str]) -> np.ndarray:
        import torch

        # SigLIP was trained on captions padded to its full length, and pools the last token.
        padding = "max_length" if self.kind == "siglip" else True
        tok = self.tokenizer(
            captions, padding=padding, truncation=True, max_length=self.max_length, return_tensors="pt"
        )
        kwargs = {"input_ids": tok["input_ids"].to(self.device)}
        if self.kind != "siglip" and "attention_mask" in tok:
            kwargs["attention_mask"] = tok["attention_mask"].to(self.device)
        with torch.inference_mode():
            out = self.model.get_text_features(**kwargs)
        return _normalised(out)


def _normalised(out: Any) -> np.ndarray:
    """The projected embeddings (transformers 5 returns them as ``pooler_output``), L2-normalised."""
    t = getattr(out, "pooler_output", out)
    a = t.float().cpu().numpy()
    norm = np.linalg.norm(a, axis=1, keepdims=True)
    return a / np.maximum(norm, 1e-12)


class quiet_transformers:
    """transformers' warnings off while a model is built (a config it fills in warns about token
    ids outside a tiny vocabulary, once per worker and model, in every run's terminal)."""

    def __enter__(self) -> None:
        from transformers.utils import logging as transformers_logging

        self.level = transformers_logging.get_verbosity()
        transformers_logging.set_verbosity_error()

    def __exit__(self, *exc: object) -> None:
        from transformers.utils import logging as transformers_logging

        transformers_logging.set_verbosity(self.level)


def _load_transformers(root: Path) -> tuple[Any, Preprocess, str]:
    import transformers

    config = _read_json(root / "config.json") if (root / "config.json").exists() else {}
    kind = config.get("model_type")
    if kind not in TRANSFORMERS_MODELS:
        raise CurateError(
            f"curate.model {root}: model_type {kind!r} is not a dual encoder shardsmith loads "
            f"(transformers: {', '.join(sorted(TRANSFORMERS_MODELS))}; or an open_clip checkpoint with {OPEN_CLIP_CONFIG})"
        )
    model = getattr(transformers, TRANSFORMERS_MODELS[kind]).from_pretrained(root, local_files_only=True)
    size = int(model.config.vision_config.image_size)
    return model, transformers_preprocess(root, size), kind


_ENCODERS: dict[tuple, DualEncoder] = {}
_ENCODERS_LOCK = threading.Lock()


def resolve_device(device: str) -> str:
    """``cuda`` when asked for, or on ``auto`` when this worker sees a GPU; ``cpu`` otherwise."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise CurateError("curate.device is cuda but this worker sees no CUDA GPU")
    if device == "cpu":
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_encoder(path: str, tokenizer: str | None, max_length: int | None, device: str) -> tuple[DualEncoder, bool]:
    """The worker's encoder, loaded on first use and kept for its next shards; and whether it was loaded now."""
    key = (os.path.abspath(path), tokenizer, max_length, device)
    with _ENCODERS_LOCK:
        if key in _ENCODERS:
            return _ENCODERS[key], False
        enc = DualEncoder(path, tokenizer, max_length, device)
        _ENCODERS[key] = enc
        return enc, True
