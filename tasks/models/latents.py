"""What a VAE's latent distribution becomes in storage: mean and log-variance, the mean, or a draw seeded by the sample's key."""

from __future__ import annotations

import hashlib
from typing import Any


def stored_latents(dist: Any, store: str, seeds: list[str]) -> dict[str, Any]:
    """What ``image_latents.store`` keeps of a VAE's latent distribution, by member name: mean
    and log-variance, the mean, or one draw per sample seeded by its string in ``seeds`` (so a
    rerun stores the same draw)."""
    import torch

    mean = dist.mean.float()  # in fp32 whatever the compute dtype (autocast gives bf16 or fp16)
    if store == "mean_logvar":
        return {"latent_mean.npy": mean, "latent_logvar.npy": dist.logvar.float()}
    if store == "mean":
        return {"latent.npy": mean}
    noise = torch.stack([torch.randn(mean.shape[1:], generator=_key_generator(s)) for s in seeds])
    return {"latent.npy": mean + dist.std.float() * noise.to(mean.device)}


def maybe_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _key_generator(key: str) -> Any:
    import torch

    return torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little"))
