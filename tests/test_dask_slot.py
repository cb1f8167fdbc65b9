"""A shard left waiting on its slowest rows gives its Dask thread back, so the worker goes on with the next shard."""

from __future__ import annotations

import csv
import time

import pytest
from distributed import Client, LocalCluster

from flows.download import _fetched
from flows.runtime import leave_dask_slot
from tasks.demo.webserver import ImageWeb
from tasks.formats.ledger import read_ledger
from tasks.formats.manifests import plan_source
from tasks.formats.recipe_download import (
    DownloadConfig,
    ImageRules,
    LicensePolicy,
    NetworkConfig,
    SourceConfig,
    ValidateConfig,
)
from tasks.formats.storage import Storage
from tasks.stages.download import shard_paths
from tasks.stages.onepass import download_and_validate
from tasks.stages.validate import candidate_paths

# A timeout far longer than the test: the hanging row ends only when its server stops.
DL = DownloadConfig(timeout_s=600, retries=0, network=NetworkConfig(allowed_networks=("127.0.0.1/32",), any_port=True))
CFG = ValidateConfig(
    license=LicensePolicy(allow=("CC0-1.0",)), image=ImageRules(min_side=32, resize_mode="border", image_size=64)
)


def test_outside_a_dask_task_it_does_nothing():
    assert leave_dask_slot() is False


def _wait_for(check, seconds: float = 60.0) -> None:
    end = time.monotonic() + seconds
    while not check():
        if time.monotonic() > end:
            pytest.fail("timed out waiting")
        time.sleep(0.05)


@pytest.mark.timeout(600)  # a cluster of its own: slow to start on a busy 2-core machine
def test_a_shard_waiting_on_a_hanging_row_lets_its_worker_run_the_next_shard(tmp_path, web, image_dir):
    stuck = ImageWeb(root=image_dir).start()
    stopped = False
    try:
        manifest = tmp_path / "m.csv"
        with open(manifest, "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["url", "caption", "license"])
            for i in range(8):
                url = stuck.url("/hang") if i == 2 else web.url(f"/img/photo.jpg?i={i}")
                w.writerow([url, f"photo {i}", "CC0-1.0"])
        storage = Storage(str(tmp_path / "store"))
        first, second = plan_source(
            SourceConfig(name="web", manifest=str(manifest), rows_per_shard=4), storage, "ds"
        ).chunks

        def run(ref):
            down = shard_paths("ds", ref, "t")
            return download_and_validate(
                ref, storage, DL, CFG, down, candidate_paths("ds", "web", ref.index, down[0], "t"), None, _fetched
            )

        # One worker with one thread: the second shard can only start once the first gives its slot back.
        with (
            LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None) as cluster,
            Client(cluster) as client,
        ):
            hanging = client.submit(run, first, pure=False)
            _wait_for(lambda: stuck.hits["/hang"] >= 1)  # the first shard holds the thread, waiting
            nxt = client.submit(run, second, pure=False)
            got_next, _ = nxt.result(timeout=90)
            assert not hanging.done()
            stuck.stop()
            stopped = True
            got_hanging, _ = hanging.result(timeout=90)
    finally:
        if not stopped:
            stuck.stop()
    assert (got_next.counts.rows, got_next.counts.ok) == (4, 4)
    # Nothing is lost: the first shard still records every row, the hanging one as an error.
    rows = read_ledger(storage, got_hanging.ledger).to_pylist()
    assert sorted(r["row"] for r in rows) == [0, 1, 2, 3]
    hung = next(r for r in rows if r["row"] == 2)
    assert hung["status"] == "error" and hung["url"].endswith("/hang"), hung
