"""Precached encodings decoded a block at a time: .npy members stacked, latents drawn and scaled together."""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["load_npy", "stack_npy", "decode_latent_block"]

_MAGIC = b"\x93NUMPY"
_HEADERS: dict[bytes, tuple[np.dtype, tuple[int, ...], int, int]] = {}
_MAX_HEADERS = 256  # a release has a handful (one per member); more is not worth keeping
# Purpose tag in the noise seed: the block permutation is seeded by (seed, epoch, slot, block)
# alone, so the draws come from another stream than the shuffle.
_NOISE_STREAM = 1


def npy_header(data: bytes) -> tuple[np.dtype, tuple[int, ...], int]:
    """(dtype, shape, payload offset) of a ``numpy.save`` blob; each distinct header is parsed
    once, by numpy's own reader, then found by its bytes.

    Raises ValueError for what ``np.load(allow_pickle=False)`` refuses or would need to
    reorder (object dtypes, Fortran order) and for a payload shorter or longer than its header says.
    """
    if data[:6] != _MAGIC or len(data) < 10:
        raise ValueError("not a .npy member (no NUMPY magic)")
    size = int.from_bytes(data[8:10], "little") + 10 if data[6] == 1 else int.from_bytes(data[8:12], "little") + 12
    head = data[:size]
    found = _HEADERS.get(head)
    if found is None:
        fh = io.BytesIO(head)
        version = np.lib.format.read_magic(fh)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read(fh)
        if dtype.hasobject or fortran:
            raise ValueError(
                f".npy member with {'an object dtype' if dtype.hasobject else 'Fortran order'} is not supported"
            )
        found = (dtype, tuple(shape), size, dtype.itemsize * int(np.prod(shape)))
        if len(_HEADERS) < _MAX_HEADERS:
            _HEADERS[head] = found
    dtype, shape, offset, nbytes = found
    if len(data) - offset != nbytes:
        raise ValueError(f".npy member of {len(data) - offset} payload bytes, its header says {shape} {dtype}")
    return dtype, shape, offset


def _tensor(arr: np.ndarray):
    """numpy -> torch; ``'<u2'`` arrays are bf16 bits, viewed as bfloat16."""
    import torch

    if arr.dtype == np.dtype("<u2"):
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def _float32(arr: np.ndarray) -> np.ndarray:
    if arr.dtype == np.dtype("<u2"):  # bf16 bits: the high half of a float32
        return (arr.astype(np.uint32) << 16).view(np.float32)
    return arr.astype(np.float32)


def load_npy(data: bytes):
    """A ``numpy.save`` member -> torch tensor; ``'<u2'`` arrays are bf16 bits, viewed as bfloat16."""
    dtype, shape, offset = npy_header(data)
    return _tensor(np.frombuffer(bytearray(memoryview(data)[offset:]), dtype).reshape(shape))


def stack_npy(blobs: Sequence[bytes]) -> np.ndarray:
    """Equal-shaped ``numpy.save`` members -> one array ``(n, *shape)``: the payloads are joined
    in one copy and viewed, with no per-member ``np.load``."""
    heads = [npy_header(b) for b in blobs]
    dtype, shape, _ = heads[0]
    if any(h[:2] != (dtype, shape) for h in heads):
        raise ValueError(f"members of one block differ in shape or dtype: {sorted({(str(h[0]), h[1]) for h in heads})}")
    joined = bytearray().join(memoryview(b)[h[2] :] for b, h in zip(blobs, heads))
    return np.frombuffer(joined, dtype).reshape((len(blobs), *shape))


def decode_latent_block(
    samples: Sequence[Any],
    encodings: dict[str, Any],
    *,
    latent_sample: bool,
    scale_latents: bool,
    noise_seed: Sequence[int],
) -> list[dict[str, Any]]:
    """A block of latent-shard samples -> one dict per sample, in the block's order.

    Each member is decoded for the whole block at once. With ``latent_sample``, latents stored
    as mean and logvar are drawn as ``mean + exp(logvar / 2) * noise``, the noise for the whole
    block from one generator seeded by ``noise_seed`` (the block's place in the epoch), so a
    block read again, as on resumption, draws the same values.
    """
    import torch

    n = len(samples)
    if not n:
        return []
    members = [s.members for s in samples]

    def stacked(name: str) -> np.ndarray:
        try:
            return stack_npy([m[name] for m in members])
        except KeyError:
            missing = next(s.key for s, m in zip(samples, members) if name not in m)
            raise KeyError(f"latent sample {missing!r} has no {name} member") from None

    out: list[dict[str, Any]] = [{"key": s.key} for s in samples]
    columns: dict[str, Any] = {}
    # Image latents, and a clip's per-frame latents ((T, C, h, w) each), drawn and scaled alike.
    for encoding, prefix, column in (("image_latents", "", "latent"), ("clip_latents", "clip_", "clip_latent")):
        if encoding not in encodings:
            continue
        spec = encodings[encoding]
        if f"{prefix}latent_mean.npy" in members[0]:
            latent = _float32(stacked(f"{prefix}latent_mean.npy"))
            if latent_sample:
                stream = _NOISE_STREAM if not prefix else _NOISE_STREAM + 1
                noise = np.random.default_rng([*noise_seed, stream]).standard_normal(latent.shape, dtype=np.float32)
                std = _float32(stacked(f"{prefix}latent_logvar.npy"))
                np.multiply(std, 0.5, out=std)
                np.exp(std, out=std)
                np.multiply(std, noise, out=std)
                latent += std
        else:
            latent = _float32(stacked(f"{prefix}latent.npy"))
        if scale_latents:
            if spec.get("shift_factor") is not None:
                latent -= np.float32(spec["shift_factor"])
            if spec.get("latents_mean") is not None:
                # A video VAE's per-channel statistics (Wan, LTX-Video), on the C axis of (B, [T,] C, h, w).
                latent -= np.asarray(spec["latents_mean"], np.float32).reshape(-1, 1, 1)
                latent /= np.asarray(spec["latents_std"], np.float32).reshape(-1, 1, 1)
            latent *= np.float32(spec.get("scaling_factor") or 1.0)
        columns[column] = torch.from_numpy(latent)
    if "text" in encodings:
        columns["text_emb"] = _tensor(stacked("text_emb.npy"))
        columns["text_mask"] = torch.from_numpy(stacked("text_mask.npy").astype(bool))
    if "vision" in encodings:
        columns["vision_emb"] = _tensor(stacked("vision_emb.npy"))
    for name, column in columns.items():
        for i, view in enumerate(column.unbind(0)):
            out[i][name] = view
    return out
