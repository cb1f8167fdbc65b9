"""The precache GPU path: DALI ``mixed`` decode, encoders on CUDA, a dask-cuda cluster (skipped without a GPU)."""

from __future__ import annotations

import numpy as np
import pytest

from tasks.formats.recipe_outputs import PrecacheConfig
from tasks.formats.storage import Storage
from tests.test_precache import read_latents, write_shard

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tasks.demo.models import make_all

    return make_all(tmp_path_factory.mktemp("models"))


def test_gpu_decode_and_encode_match_the_cpu_path(tmp_path, tiny):
    from tasks.models.frozen import precache_device as resolve_device
    from tasks.models.placement import decode_device
    from tasks.stages.precache import precache_shard

    st = Storage(str(tmp_path))
    shard = write_shard(st, "reshard/shard-000000.tar")
    base = dict(
        image_latents={"model": str(tiny["vae"]), "resolution": 64},
        text={"model": str(tiny["clip-text"]), "max_length": 16},
        batch_size=8,
        dtype="fp32",
        compute_dtype="fp32",  # the devices compared, not the precisions
    )
    gpu_cfg = PrecacheConfig(**base, decode="gpu", device="cuda")
    assert decode_device(gpu_cfg) == "mixed" and resolve_device(gpu_cfg) == "cuda"
    gpu = precache_shard(st, gpu_cfg, shard, "gpu")
    cpu = precache_shard(st, PrecacheConfig(**base, decode="cpu", device="cpu"), shard, "cpu")
    g, c = read_latents(st, gpu.tar), read_latents(st, cpu.tar)
    assert [k for k, _ in g] == [k for k, _ in c] == [r.key for r in shard.records]
    for (_, a), (_, b) in zip(g, c):
        # nvJPEG and libjpeg-turbo may differ by a level; solid colours keep that small.
        np.testing.assert_allclose(a["latent_mean.npy"], b["latent_mean.npy"], atol=0.05)
        np.testing.assert_allclose(a["text_emb.npy"], b["text_emb.npy"], atol=1e-3)


def test_auto_computes_in_bf16_on_a_gpu_that_has_it(tmp_path, tiny):
    import torch

    from tasks.models.placement import compute_dtype
    from tasks.stages.precache import precache_shard

    want = "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    assert compute_dtype("auto", "cuda") == want
    st = Storage(str(tmp_path))
    shard = write_shard(st, "reshard/shard-000000.tar", n=4)
    cfg = PrecacheConfig(image_latents={"model": str(tiny["vae"]), "resolution": 64}, batch_size=4, device="cuda")
    result = precache_shard(st, cfg, shard, "p")
    assert result.encodings["image_latents"]["compute_dtype"] == want


def test_cuda_cluster_runs_precache_tasks_on_gpu_workers(tmp_path, tiny):
    import dask
    from distributed import Client

    from flows.runtime import dask_cluster
    from tasks.stages.precache import precache_shard

    st = Storage(str(tmp_path))
    shard = write_shard(st, "reshard/shard-000000.tar", n=6)
    cfg = PrecacheConfig(image_latents={"model": str(tiny["vae"]), "resolution": 64}, batch_size=4)
    with dask_cluster("cuda") as address, Client(address) as client:
        assert all(w["resources"].get("GPU") == 1 for w in client.scheduler_info()["workers"].values())
        with dask.annotate(resources={"GPU": 1}):
            result = client.submit(precache_shard, st, cfg, shard, "p").result()
    assert result.samples == 6 and result.nonfinite == 0
