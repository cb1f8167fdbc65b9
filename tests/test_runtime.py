"""Starting a Dask cluster leaves the process's Dask configuration whole."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# In a fresh process, where nothing has imported distributed yet (as a script or a notebook
# that calls start_cluster first): the client and the scheduler read distributed's settings
# afterwards, and a lost key fails their next connection.
SCRIPT = """
import dask
from flows.runtime import close_cluster, start_cluster
cluster = start_cluster("local", 1, 1, {})
try:
    print(dask.config.get("distributed.comm.timeouts.tcp"), dask.config.get("distributed.worker.profile.enabled"))
finally:
    close_cluster(cluster)
"""


def test_start_cluster_keeps_the_distributed_config_and_sets_ours_only_for_the_start():
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    # distributed's default timeout is there; the profiler setting was ours for the start only.
    assert out.stdout.split() == ["30s", "True"]
