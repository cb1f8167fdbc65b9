"""Curation's GPU path: DALI ``mixed`` decoding and the dual encoder on CUDA (skipped without a GPU)."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
from curate_fixtures import make_clip
from test_curate import _validated_shard

from tasks.curate.embed import embed_shard, embeddings_path
from tasks.formats.recipe_curate import CurateConfig
from tasks.formats.storage import Storage

pytestmark = pytest.mark.gpu


def test_gpu_decode_and_encode_match_the_cpu_path(tmp_path):
    model = make_clip(tmp_path / "clip")
    storage = Storage(str(tmp_path / "store"))
    tar, ledger = _validated_shard(storage)
    sides = {}
    for name, decode, device in (("cpu", "cpu", "cpu"), ("gpu", "gpu", "cuda"), ("auto", "auto", "auto")):
        cfg = CurateConfig(model=str(model), decode=decode, device=device, batch_size=2)
        out = embeddings_path("ds", name * 8, ledger)
        assert embed_shard(storage, cfg, tar, ledger, out, f"run-{name}").embedded == 4
        sides[name] = pq.read_table(tmp_path / "store" / out)
    for name in ("gpu", "auto"):
        assert sides[name].column("key").to_pylist() == sides["cpu"].column("key").to_pylist()
        for tower in ("image", "text"):
            got = np.array(sides[name].column(tower).to_pylist(), dtype=np.float32)
            want = np.array(sides["cpu"].column(tower).to_pylist(), dtype=np.float32)
            # nvJPEG and libjpeg-turbo decode a few pixel values apart; the encoders' kernels differ
            np.testing.assert_allclose(got, want, atol=0.05)
