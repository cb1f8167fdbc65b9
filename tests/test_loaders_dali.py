"""DALI pipelines (CPU here, ``mixed`` on a GPU) decode every image of a release with its caption and key."""

from __future__ import annotations

import pytest
from release_fixtures import LATENT_SHAPE, color_of, pretraining_release

COUNTS = [11, 7, 6]
TOTAL = sum(COUNTS)


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    from loaders.release import open_release

    return open_release(pretraining_release(str(tmp_path_factory.mktemp("dali")), COUNTS, latents=True))


def _check_images(batch, size):
    import torch

    n = len(batch["key"])
    assert batch["image"].shape == (n, 3, size, size) and batch["image"].dtype == torch.uint8
    for key, caption, image in zip(batch["key"], batch["caption"], batch["image"]):
        i = int(key.split("-")[1])
        assert caption == f"caption {i}"
        assert torch.allclose(image.float().mean(dim=(1, 2)), torch.tensor(color_of(i), dtype=torch.float32), atol=6)


@pytest.mark.parametrize("num_shards", [1, 2])
def test_dali_cpu_pipeline_decodes_every_image_once_per_epoch(release, num_shards):
    from loaders.dali import DaliLoader

    loaders = [
        DaliLoader(release, 4, image_size=24, shard_id=r, num_shards=num_shards, seed=3, initial_fill=8, device_id=None)
        for r in range(num_shards)
    ]
    assert len({len(dl) for dl in loaders}) == 1  # every rank runs the same number of steps
    for _epoch in range(2):
        seen = []
        for dl in loaders:
            for batch in dl:
                _check_images(batch, 24)
                seen += batch["key"][: batch["valid"]]
        assert sorted(seen) == [f"s-{i:06d}" for i in range(TOTAL)]


def test_dali_latents_path_reads_only_the_latent_shards(release):
    import torch

    from loaders.dali import DaliLoader

    dl = DaliLoader(release, 5, latents=True, shuffle=False, device_id=None)
    assert dl.names == ["latent", "text_emb", "text_mask"]
    seen = []
    for batch in dl:
        n = len(batch["key"])
        assert batch["latent"].shape == (n, *LATENT_SHAPE) and batch["latent"].dtype == torch.float32
        for key, latent, emb, mask in zip(batch["key"], batch["latent"], batch["text_emb"], batch["text_mask"]):
            i = int(key.split("-")[1])
            assert torch.allclose(latent, torch.full(LATENT_SHAPE, i * 0.5), atol=1e-3)
            assert torch.all(emb == i) and int(mask.sum()) == i % 7 + 1
        seen += batch["key"][: batch["valid"]]
    assert seen == [f"s-{i:06d}" for i in range(TOTAL)]


def test_dali_refuses_what_it_cannot_read(tmp_path):
    from loaders.dali import dali_pipeline
    from loaders.release import ReleaseError, open_release

    plain = open_release(pretraining_release(str(tmp_path), [2]))
    with pytest.raises(ReleaseError, match="no precached latents"):
        dali_pipeline(plain, batch_size=2, latents=True, device_id=None)


@pytest.mark.gpu
def test_dali_mixed_decode_on_gpu(release):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from loaders.dali import DaliLoader

    dl = DaliLoader(release, 4, image_size=24, device_id=0, shuffle=False)
    batch = next(iter(dl))
    assert batch["image"].is_cuda
    _check_images({**batch, "image": batch["image"].cpu()}, 24)
