"""Shared fixtures: isolated Prefect settings, a session-wide test harness, tiny images, servers."""

from __future__ import annotations

import os
import tempfile

# Before Prefect is imported anywhere: no analytics (no network), a cold server may start
# slowly here, and results, logs and the profile go to a temp dir that dies with the session.
_PREFECT_TMP = tempfile.mkdtemp(prefix="shardsmith-prefect-")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ["PREFECT_HOME"] = _PREFECT_TMP
os.environ["PREFECT_RESULTS_LOCAL_STORAGE_PATH"] = os.path.join(_PREFECT_TMP, "results")
os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
# Each command in its own process, as before the warm service (cli/warm.py): tests that start
# `shardsmith run` would each leave one behind. tests/test_warm.py turns it on for its own.
os.environ["SHARDSMITH_WARM"] = "0"

import io  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def prefect_harness():
    """One Prefect test server for every flow test in the session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def prefect_api_url(prefect_harness) -> str:
    """The session's Prefect server, for CLI runs in subprocesses: with ``PREFECT_API_URL`` set,
    ``shardsmith run`` starts no server of its own (tests/test_cli.py covers the one it starts)."""
    from prefect.settings import get_current_settings

    return str(get_current_settings().api.url)


@pytest.fixture(scope="session")
def dask_address(prefect_harness) -> Iterator[str]:
    """One Dask LocalCluster of two workers for the in-process flow tests that do not test the
    cluster itself; yields its scheduler address.

    A cluster of their own costs each run seconds of worker start, and a run with the precache
    phase another import of diffusers in every new worker. The workers get the session's
    Prefect API (``worker_env``) and, being started once, none of a test's ``SHARDSMITH_FAULT``:
    tests that inject faults, kill workers or test a cluster's start and stop keep their own.
    """
    from flows.runtime import close_cluster, start_cluster, worker_env
    from tasks.formats.faults import FAULT_ENV

    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(FAULT_ENV, raising=False)  # the spawned workers inherit this process's environment
        cluster = start_cluster("local", 2, 1, worker_env())
    yield cluster.scheduler_address
    close_cluster(cluster)


@pytest.fixture
def shared_cluster(dask_address) -> Iterator[str]:
    """The session's cluster for this test's flow runs (see ``dask_address``): ``SHARDSMITH_CLUSTER``
    names it, as the docker-compose stack names its scheduler to deployed runs."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SHARDSMITH_CLUSTER", dask_address)
        yield dask_address


def make_image(fmt: str, size=(64, 48), color=(200, 40, 40), mode="RGB") -> bytes:
    from PIL import Image

    img = Image.new(mode, size, color if mode == "RGB" else 128)
    for x in range(0, size[0], 8):  # some structure, so encoders do real work
        for y in range(size[1]):
            img.putpixel((x, y), (0, 0, 0) if mode == "RGB" else 0)
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


@pytest.fixture(scope="session")
def image_dir(tmp_path_factory) -> Path:
    """A folder with one small image per common format."""
    root = tmp_path_factory.mktemp("images")
    (root / "a.jpg").write_bytes(make_image("JPEG"))
    (root / "b.png").write_bytes(make_image("PNG", color=(10, 200, 10)))
    (root / "c.webp").write_bytes(make_image("WEBP", color=(10, 10, 200)))
    (root / "d.gif").write_bytes(make_image("GIF"))
    (root / "e.bmp").write_bytes(make_image("BMP"))
    big = make_image("PNG", size=(512, 512))
    (root / "big.png").write_bytes(big)
    # A photo-like picture and its near duplicate: half the size, re-encoded.
    from PIL import Image

    from tasks.demo.images import render_image

    _, photo, _ = render_image(0, 0)
    (root / "photo.jpg").write_bytes(photo)
    im = Image.open(io.BytesIO(photo)).convert("RGB")
    half = io.BytesIO()
    im.resize((im.width // 2, im.height // 2)).save(half, format="JPEG", quality=80)
    (root / "photo_half.jpg").write_bytes(half.getvalue())
    (root / "tiny.png").write_bytes(make_image("PNG", size=(10, 10)))
    return root


@pytest.fixture(scope="session")
def web(image_dir):
    """The loopback image web (good, missing, flaky, slow, hostile routes) for the session."""
    from tasks.demo.webserver import ImageWeb

    server = ImageWeb(root=image_dir)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """A demo corpus of 40 images served on loopback for one test module: (folder, server, expected outcomes)."""
    from tasks.demo.corpus import prepare_demo

    root = tmp_path_factory.mktemp("demo")
    server, expected = prepare_demo(root, n=40, port=0)
    yield root, server, expected
    server.stop()


@pytest.fixture(scope="session")
def s3_endpoint():
    """A real S3 API on loopback (moto's server); yields its endpoint URL."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server._server.server_address[:2]
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_bucket(s3_endpoint, request):
    """A fresh bucket on the moto server; yields (bucket name, fsspec storage options)."""
    import s3fs

    name = "b-" + "".join(c if c.isalnum() else "-" for c in request.node.name.lower())[:40].strip("-")
    options = {"client_kwargs": {"endpoint_url": s3_endpoint}, "key": "testing", "secret": "testing"}
    s3fs.S3FileSystem(**options).mkdir(name)
    return name, options


# The longest test files (minutes each, from `pytest --durations`), longest first. They are
# collected first, so pytest-xdist (`--dist loadfile` hands files out in collection order)
# starts them at once instead of leaving one worker alone on a long file at the end.
LONG_FIRST = (
    "test_resilience_kill.py",
    "test_stack.py",
    "test_cli.py",
    "test_video_pipeline.py",
    "test_flow_release.py",
    "test_flow_finetuning.py",
    "test_cli_uptodate.py",
    "test_resilience_release.py",
    "test_resilience_workers.py",
    "test_deployments.py",
    "test_cli_signals.py",
    "test_flow_inputs.py",
)


def pytest_collection_modifyitems(config, items):
    """Long files first (LONG_FIRST); skip ``gpu``-marked tests where torch sees no CUDA GPU
    (the CPU path is the default run)."""
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files stay whole
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU visible to torch")
    for item in gpu_items:
        item.add_marker(skip)
