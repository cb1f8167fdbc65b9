"""Small heads over the image embedding (LAION-aesthetics format and the like), evaluated in numpy."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tasks.formats.recipe_curate import HeadConfig
from tasks.models.placement import CurateError

_NATURAL = re.compile(r"(\d+)")


def _natural(key: str) -> list[object]:
    """``layers.10`` after ``layers.2``."""
    return [int(p) if p.isdigit() else p for p in _NATURAL.split(key)]


@dataclass(frozen=True)
class Head:
    """A head's linear layers, in order, and how its output becomes a score.

    Args:
        name: the head's name in the recipe.
        layers: (weight (out, in), bias (out,)) pairs.
        cfg: activation, output transform, output index, normalisation.
        digest: SHA-256 of the file (scores are named by it).
    """

    name: str
    layers: tuple[tuple[np.ndarray, np.ndarray], ...]
    cfg: HeadConfig
    digest: str

    @property
    def input_dim(self) -> int:
        return int(self.layers[0][0].shape[1])

    def __call__(self, emb: np.ndarray) -> np.ndarray:
        """One score per row of ``emb`` (N, D) float32."""
        x = emb.astype(np.float32)
        if self.cfg.normalize:
            x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
        for i, (w, b) in enumerate(self.layers):
            x = x @ w.T + b
            if i < len(self.layers) - 1:
                if self.cfg.activation == "relu":
                    x = np.maximum(x, 0.0)
                elif self.cfg.activation == "gelu":
                    x = 0.5 * x * (1.0 + np.tanh(0.7978845608 * (x + 0.044715 * x**3)))
        if self.cfg.output == "softmax":
            x = np.exp(x - x.max(axis=1, keepdims=True))
            x = x / x.sum(axis=1, keepdims=True)
        if x.shape[1] <= self.cfg.output_index:
            raise CurateError(f"curate.heads.{self.name}: output_index {self.cfg.output_index} of {x.shape[1]} outputs")
        out = x[:, self.cfg.output_index].astype(np.float64)
        if self.cfg.output == "sigmoid":
            out = 1.0 / (1.0 + np.exp(-out))
        return out.astype(np.float32)


def _tensors(path: Path) -> dict[str, np.ndarray]:
    if path.suffix == ".safetensors":
        from safetensors.numpy import load_file

        return dict(load_file(str(path)))
    import torch

    try:
        sd = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unreadable file is the recipe's problem, named
        raise CurateError(f"{path}: not a torch state dict loadable with weights_only ({err})") from None
    if isinstance(sd, dict) and isinstance(sd.get("state_dict"), dict):
        sd = sd["state_dict"]
    if not isinstance(sd, dict):
        raise CurateError(f"{path}: expected a state dict (name -> tensor), got {type(sd).__name__}")
    return {k: v.float().numpy() for k, v in sd.items() if hasattr(v, "numpy")}


def load_head(name: str, cfg: HeadConfig, dim: int | None = None) -> Head:
    """The head ``name`` from its file; ``dim``, the embedding width it must take."""
    path = Path(cfg.path)
    if not path.is_file():
        raise CurateError(f"curate.heads.{name}.path: no file at {cfg.path!r}; heads are never downloaded")
    tensors = _tensors(path)
    weights = sorted((k for k, v in tensors.items() if k.endswith("weight") and v.ndim == 2), key=_natural)
    layers = []
    for wkey in weights:
        w = tensors[wkey].astype(np.float32)
        b = tensors.get(wkey[: -len("weight")] + "bias")
        layers.append((w, (b if b is not None else np.zeros(w.shape[0])).astype(np.float32).reshape(-1)))
    if not layers:
        raise CurateError(f"{path}: no linear layer (a 2-D '*weight' tensor) in the head")
    for (w1, _), (w2, _) in zip(layers, layers[1:]):
        if w2.shape[1] != w1.shape[0]:
            raise CurateError(f"{path}: layer shapes do not chain ({w1.shape} then {w2.shape})")
    if dim is not None and layers[0][0].shape[1] != dim:
        raise CurateError(
            f"curate.heads.{name}: the head takes {layers[0][0].shape[1]}-d embeddings, the model gives {dim}-d"
        )
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return Head(name, tuple(layers), cfg, digest)
