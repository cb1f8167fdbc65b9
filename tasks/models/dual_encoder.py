"""The dual encoder of the curation phase (and of precache's image embedding): a CLIP-family model from a local folder, loaded once per worker."""

from __future__ import annotations

import functools
import os
import threading
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from tasks.models.openclip import OPEN_CLIP_CONFIG, WEIGHT_FILES, load_open_clip
from tasks.models.placement import CurateError, length_order, need_dir, quiet_transformers, running
from tasks.models.placement import frozen as frozen_model
from tasks.models.preprocess import Preprocess, read_json, transformers_preprocess
from tasks.models.tokenizers import local_tokenizer, need_tokenizer_folder, one_line

TRANSFORMERS_MODELS = {"clip": "CLIPModel", "siglip": "SiglipModel"}


def need_model_dir(path: str | None, what: str = "curate.model") -> Path:
    return need_dir(path, what, CurateError)


# A transformers folder's weights: one file, or an index naming its shards.
TRANSFORMERS_WEIGHTS = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def check_model(path: str | None, tokenizer: str | None = None, load_tokenizer: bool = True) -> None:
    """Fail (CurateError, one line naming the folder and what is wrong) when the dual encoder at
    ``path`` cannot load, without loading its weights: its config must read and name a dual
    encoder shardsmith loads, its weight files must be whole (safetensors headers cover their
    files, torch zips end in their directory), and its tokenizer must load with a vocabulary.
    What the curation phase checks before it embeds anything, and what a preflight can run
    (``load_tokenizer=False``: the tokenizer's files are looked for, not loaded, and
    transformers is not imported)."""
    root = need_model_dir(path)
    if (root / OPEN_CLIP_CONFIG).exists():
        try:
            meta = read_json(root / OPEN_CLIP_CONFIG)
        except CurateError as err:
            raise CurateError(f"curate.model {root}: {one_line(err)}") from None
        if not isinstance(meta.get("model_cfg"), dict):
            raise CurateError(f"curate.model {root}: {OPEN_CLIP_CONFIG} has no model_cfg")
        names: tuple[str, ...] = WEIGHT_FILES
    else:
        _model_kind(root)
        names = TRANSFORMERS_WEIGHTS
    weights = [root / n for n in names if (root / n).is_file()]
    if not weights:
        raise CurateError(f"curate.model {root}: no weights there (none of {', '.join(names)})")
    for f in _weight_files(weights[0]):
        _check_weights(root, f)
    if load_tokenizer:
        _tokenizer(root, tokenizer)
    else:
        need_tokenizer_folder(*_tokenizer_dir(root, tokenizer), CurateError)


def _tokenizer_dir(root: Path, tokenizer: str | None) -> tuple[str, str]:
    """The dual encoder's tokenizer folder (``curate.tokenizer``, else the model's), and the
    recipe field that names it."""
    if tokenizer is None:
        return str(root), "curate.model"
    need_model_dir(tokenizer, "curate.tokenizer")
    return tokenizer, "curate.tokenizer"


def _tokenizer(root: Path, tokenizer: str | None) -> Any:
    """The dual encoder's tokenizer, loaded (``tokenizers.local_tokenizer``)."""
    return local_tokenizer(*_tokenizer_dir(root, tokenizer), CurateError)


def _weight_files(first: Path) -> list[Path]:
    """The weight files ``first`` stands for: itself, or the shards its index names."""
    if not first.name.endswith(".index.json"):
        return [first]
    try:
        index = read_json(first)
        shards = sorted(set(index["weight_map"].values()))
    except (CurateError, KeyError, AttributeError, TypeError) as err:
        raise CurateError(f"curate.model {first.parent}: {first.name} names no shards ({one_line(err)})") from None
    return [first.parent / s for s in shards]


def _check_weights(root: Path, f: Path) -> None:
    """A weight file that is there and whole (its header, not its tensors, read)."""
    if not f.is_file():
        raise CurateError(f"curate.model {root}: weight file {f.name} is missing")
    try:
        if f.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(f), "np"):
                pass
        elif zipfile.is_zipfile(f):
            with zipfile.ZipFile(f) as z:
                z.namelist()
        elif f.stat().st_size == 0:
            raise ValueError("empty file")
    except Exception as err:  # noqa: BLE001 - a reader's failure, named in one line
        raise CurateError(
            f"curate.model {root}: weight file {f.name} does not read ({type(err).__name__}: {one_line(err)}); "
            "is it truncated or corrupt?"
        ) from None


class DualEncoder:
    """Image and text towers of one CLIP-family model, frozen, on one device.

    Args:
        path: the model folder (transformers CLIP or SigLIP, or an open_clip checkpoint).
        tokenizer: folder of the tokenizer (default: ``path``).
        max_length: caption tokens at most (default: the text tower's context length).
        device: ``cpu`` or ``cuda``.
        dtype: the compute dtype (``fp32``, ``bf16``, ``fp16``; placement.compute_dtype resolves
            ``auto``): the weights stay fp32, the towers run under autocast.

    ``images`` and ``texts`` return L2-normalised float32 embeddings, one row per input.
    """

    def __init__(
        self,
        path: str,
        tokenizer: str | None = None,
        max_length: int | None = None,
        device: str = "cpu",
        dtype: str = "fp32",
    ):
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()  # see placement.quiet_model_loading
        root = need_model_dir(path)
        self.device = device
        self.dtype = dtype
        with quiet_transformers():
            if (root / OPEN_CLIP_CONFIG).exists():
                self.model, self.preprocess = _loading(root, lambda: load_open_clip(root))
                self.kind = "open_clip"
            else:
                self.model, self.preprocess, self.kind = _load_transformers(root)
        self.tokenizer = _tokenizer(root, tokenizer)
        context = int(self.model.config.text_config.max_position_embeddings)
        self.max_length = min(max_length or context, context)
        frozen_model(self.model, device, dtype)

    @functools.cached_property
    def dim(self) -> int:
        """Width of the shared embedding space."""
        return int(self._text_batch([self.tokenizer("a")["input_ids"]]).shape[1])

    def images(self, pixels: Any) -> np.ndarray:
        """``pixels``: (B, 3, S, S) normalised as ``preprocess`` says, on any device."""
        import torch

        with running(self.device, self.dtype):
            out = self.model.get_image_features(pixel_values=pixels.to(self.device, torch.float32))
        return _normalised(out)

    def texts(self, captions: list[str], batch_size: int | None = None) -> np.ndarray:
        """One embedding per caption, in their order. The captions are tokenised once, ordered
        by length and run in batches of ``batch_size`` (default: all at once), each padded to
        its longest caption: the attention mask makes that what padding to the context length
        gives, at the cost of the tokens there are. SigLIP was trained on captions padded to its
        full length and pools the last token: its captions are padded to ``max_length``."""
        if not captions:
            return np.zeros((0, self.dim), np.float32)
        ids = self.tokenizer(captions, truncation=True, max_length=self.max_length)["input_ids"]
        order = length_order([len(i) for i in ids])
        step = batch_size or len(captions)
        out: np.ndarray | None = None
        for at in range(0, len(order), step):
            part = order[at : at + step]
            vectors = self._text_batch([ids[i] for i in part])
            if out is None:
                out = np.zeros((len(captions), vectors.shape[1]), np.float32)
            out[part] = vectors
        assert out is not None
        return out

    def _text_batch(self, ids: list[list[int]]) -> np.ndarray:
        siglip = self.kind == "siglip"
        tok = self.tokenizer.pad(
            {"input_ids": ids},
            padding="max_length" if siglip else "longest",
            max_length=self.max_length if siglip else None,
            return_tensors="pt",
        )
        kwargs = {"input_ids": tok["input_ids"].to(self.device)}
        if not siglip:
            kwargs["attention_mask"] = tok["attention_mask"].to(self.device)
        with running(self.device, self.dtype):
            out = self.model.get_text_features(**kwargs)
        return _normalised(out)


def _normalised(out: Any) -> np.ndarray:
    """The projected embeddings (transformers 5 returns them as ``pooler_output``), L2-normalised."""
    t = getattr(out, "pooler_output", out)
    a = t.float().cpu().numpy()
    norm = np.linalg.norm(a, axis=1, keepdims=True)
    return a / np.maximum(norm, 1e-12)


def _model_kind(root: Path) -> str:
    """The ``model_type`` of a transformers folder's config.json, when it is a dual encoder shardsmith loads."""
    try:
        config = read_json(root / "config.json") if (root / "config.json").exists() else {}
    except CurateError as err:
        raise CurateError(
            f"curate.model {root}: {one_line(err).replace(str(root / 'config.json'), 'config.json')}"
        ) from None
    kind = config.get("model_type")
    if kind not in TRANSFORMERS_MODELS:
        what = f"model_type {kind!r} is" if config else "no config.json there: it is"
        raise CurateError(
            f"curate.model {root}: {what} not a dual encoder shardsmith loads "
            f"(transformers: {', '.join(sorted(TRANSFORMERS_MODELS))}; or an open_clip checkpoint with {OPEN_CLIP_CONFIG})"
        )
    return str(kind)


def _load_transformers(root: Path) -> tuple[Any, Preprocess, str]:
    import transformers

    kind = _model_kind(root)
    model_class = getattr(transformers, TRANSFORMERS_MODELS[kind])
    model = _loading(root, lambda: model_class.from_pretrained(root, local_files_only=True))
    size = int(model.config.vision_config.image_size)
    return model, _loading(root, lambda: transformers_preprocess(root, size)), kind


T = TypeVar("T")


def _loading(root: Path, load: Callable[[], T]) -> T:
    """``load()``, its failure (unreadable or truncated weights, a config that does not fit them)
    as one line of CurateError naming the folder and what failed."""
    try:
        return load()
    except CurateError:
        raise
    except Exception as err:  # noqa: BLE001 - any loader's failure, named in one line
        raise CurateError(
            f"curate.model {root}: the model does not load ({type(err).__name__}: {one_line(err)}); "
            "check that its files are complete and unchanged (save_pretrained layout, or an open_clip checkpoint)"
        ) from None


_ENCODERS: dict[tuple, DualEncoder] = {}
_ENCODERS_LOCK = threading.Lock()


def load_encoder(
    path: str, tokenizer: str | None, max_length: int | None, device: str, dtype: str = "fp32"
) -> tuple[DualEncoder, bool]:
    """The worker's encoder, loaded on first use and kept for its next shards; and whether it was loaded now."""
    key = (os.path.abspath(path), tokenizer, max_length, device, dtype)
    with _ENCODERS_LOCK:
        if key in _ENCODERS:
            return _ENCODERS[key], False
        enc = DualEncoder(path, tokenizer, max_length, device, dtype)
        _ENCODERS[key] = enc
        return enc, True
