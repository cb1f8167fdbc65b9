"""Latents decoded a block at a time: seeded draws per block, exact resumption, .npy members checked."""

from __future__ import annotations

import io

import numpy as np
import pytest
from release_fixtures import LATENT_SHAPE, npy, pretraining_release

COUNTS = [13, 9, 17, 5]
TOTAL = sum(COUNTS)


@pytest.fixture(scope="module")
def noisy(tmp_path_factory):
    """A release whose latents have logvar 0: every draw is mean + standard normal noise."""
    from loaders.release import open_release

    return open_release(pretraining_release(str(tmp_path_factory.mktemp("noisy")), COUNTS, latents=True, logvar=0.0))


def _draws(release, *, rank=0, world_size=1, workers=1, epoch=0, start=0, **kw) -> dict[str, np.ndarray]:
    """Unscaled noise of every sample this rank reads: ``latent - mean`` by key."""
    from loaders.dataset import ReleaseDataset

    ds = ReleaseDataset(release, mode="latents", rank=rank, world_size=world_size, scale_latents=False, seed=7, **kw)
    ds.set_epoch(epoch, start=start)
    out = {}
    for w in range(workers):
        for sample in ds.iter_worker(w, workers):
            out[sample["key"]] = sample["latent"].numpy() - int(sample["key"].split("-")[1])
    return out


def test_draws_are_real_noise_seeded_by_the_epoch(noisy):
    a = _draws(noisy, shuffle_buffer=8)
    assert len(a) == TOTAL
    values = np.concatenate([v.ravel() for v in a.values()])
    assert abs(values.mean()) < 0.05 and 0.95 < values.std() < 1.05  # logvar 0: std exp(0) = 1
    assert len({v.tobytes() for v in a.values()}) == TOTAL  # no two samples share their noise
    again = _draws(noisy, shuffle_buffer=8)
    assert all(np.array_equal(a[k], again[k]) for k in a)  # same seed and epoch: same draws
    other = _draws(noisy, shuffle_buffer=8, epoch=1)
    assert not any(np.array_equal(a[k], other[k]) for k in a)  # a new epoch draws anew
    mean_only = _draws(noisy, shuffle_buffer=8, latent_sample=False)
    assert all(not v.any() for v in mean_only.values())


@pytest.mark.parametrize("consumed_batches", [1, 3, 6])
def test_resumption_draws_the_same_noise_for_the_rest(noisy, consumed_batches):
    from loaders.dataset import ReleaseDataset

    def stream(start):
        ds = ReleaseDataset(
            noisy, mode="latents", rank=1, world_size=2, seed=5, shuffle_buffer=3, batch_size=2, scale_latents=False
        )
        ds.set_epoch(2, start=start)
        workers = [list(ds.iter_worker(w, 2)) for w in range(2)]
        out = []
        for step in range(max(len(s) for s in workers)):
            out += [s[step] for s in workers if step < len(s)]
        return out

    full, rest = stream(0), stream(consumed_batches * 2)
    assert len(rest) == len(full) - consumed_batches
    for a, b in zip(full[consumed_batches:], rest):
        assert a["key"] == b["key"]
        assert np.array_equal(a["latent"].numpy(), b["latent"].numpy())


def test_stored_dtypes_and_bf16_bits_decode_as_stored():
    import torch

    from loaders.latents import load_npy, stack_npy

    f = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    bf16 = (f.view(np.uint32) >> 16).astype("<u2")  # what precache writes for bfloat16
    assert torch.equal(load_npy(npy(bf16)).float(), torch.from_numpy(f))
    stacked = stack_npy([npy(f), npy(f + 1), npy(f + 2)])
    assert stacked.shape == (3, 2, 3, 4) and np.array_equal(stacked[2], f + 2) and stacked.flags.writeable
    v2 = io.BytesIO()
    np.lib.format.write_array(v2, f, version=(2, 0))
    assert np.array_equal(stack_npy([v2.getvalue()])[0], f)


@pytest.mark.parametrize(
    "blob, message",
    [
        (npy(np.zeros((2, 2), np.float16))[:-3], "payload bytes"),
        (b"not numpy at all", "NUMPY magic"),
        (npy(np.asfortranarray(np.zeros((2, 3), np.float32))), "Fortran order"),
    ],
)
def test_bad_members_are_refused(blob, message):
    from loaders.latents import stack_npy

    with pytest.raises(ValueError, match=message):
        stack_npy([blob])


def test_members_of_one_block_must_agree():
    from loaders.latents import stack_npy

    with pytest.raises(ValueError, match="differ in shape or dtype"):
        stack_npy([npy(np.zeros(LATENT_SHAPE, np.float16)), npy(np.zeros(LATENT_SHAPE, np.float32))])
