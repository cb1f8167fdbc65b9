"""The warm service's Dask cluster, in a process of its own: ``python -m flows.warm_cluster FILE PARENT``.

It starts a local cluster as a run would (flows.runtime.start_cluster: one worker per core, our
worker settings and preload), writes the scheduler's address to ``FILE`` (written whole, then
renamed: a reader sees it complete or not at all) and keeps the cluster until SIGTERM or until
the process ``PARENT`` (the warm service, ``cli/warm_service.py``) is gone.

Also what a run forked by the warm service reads to find the service's server and cluster
(flows/session.py): the variables the service sets in its children, and the scheduler's address
once this process has written it.
"""

from __future__ import annotations

import os
import signal
import sys
import time

POLL_S = 0.5
# Set by the warm service in each command it forks: its Prefect API, and the file that holds
# its cluster's scheduler address.
API_ENV = "SHARDSMITH_WARM_API"
CLUSTER_ENV = "SHARDSMITH_WARM_CLUSTER"


def scheduler_address(path: str, timeout: float) -> str:
    """The warm cluster's scheduler address, once :func:`main` has written it (whole, then
    renamed into place)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(path) as f:
                return f.read().strip()
        except FileNotFoundError:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the warm service's Dask cluster did not start within {timeout:.0f} s ({path})"
                ) from None
            time.sleep(0.05)


def main(argv: list[str]) -> None:
    target, parent = argv[0], int(argv[1])
    from flows.runtime import close_cluster, start_cluster, worker_env

    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    cluster = start_cluster("local", None, 1, worker_env())
    tmp = f"{target}.tmp"
    with open(tmp, "w") as out:
        out.write(cluster.scheduler_address)
    os.replace(tmp, target)
    try:
        while not stop["now"] and os.getppid() == parent:
            time.sleep(POLL_S)
    finally:
        close_cluster(cluster)


if __name__ == "__main__":
    main(sys.argv[1:])
