"""The warm service's Dask cluster, in a process of its own: ``python -m flows.warm_cluster FILE PARENT``.

It starts a local cluster as a run would (flows.runtime.start_cluster: one worker per core, our
worker settings and preload), writes the scheduler's address to ``FILE`` (written whole, then
renamed: a reader sees it complete or not at all) and keeps the cluster until SIGTERM or until
the process ``PARENT`` (the warm service) is gone.
"""

from __future__ import annotations

import os
import signal
import sys
import time

POLL_S = 0.5


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
