"""Starting a cluster from a fresh interpreter leaves Dask's own settings in place."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_a_cluster_started_before_distributed_is_imported_keeps_distributed_settings():
    # The bench and the Python API import flows.runtime before anything imports distributed;
    # a cluster started then must not drop distributed's defaults when its config block ends
    # (it did: every later client call raised KeyError: 'distributed').
    script = textwrap.dedent(
        """
        import sys
        import dask
        from flows.runtime import close_cluster, start_cluster

        if __name__ == "__main__":
            assert "distributed" not in sys.modules
            cluster = start_cluster("local", 1, 1, {})
            try:
                print(dask.config.get("distributed.comm.timeouts.connect"))
            finally:
                close_cluster(cluster)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "30s"
