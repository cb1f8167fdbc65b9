"""The local Prefect server's process: uvicorn over Prefect's app, for as long as its run lives.

``python -m flows.local_server PARENT_PID UVICORN_ARGS...``. The server runs in a session of
its own (a Ctrl-C in the terminal reaches only the CLI, which stops it last), so nothing would
stop it when the CLI dies without a chance to (SIGKILL, the OOM killer): a thread here watches
the parent and shuts the server down, as uvicorn does on SIGTERM, once it is gone.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

POLL_S = 1.0
# After SIGTERM, how long uvicorn's own shutdown may take before the process just ends.
SHUTDOWN_GRACE_S = 10.0


def watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(POLL_S)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(SHUTDOWN_GRACE_S)
    os._exit(1)


def main(argv: list[str]) -> None:
    parent = int(argv[0])
    threading.Thread(target=watch_parent, args=(parent,), name="watch-parent", daemon=True).start()
    from uvicorn.main import main as uvicorn

    uvicorn.main(args=argv[1:], prog_name="uvicorn")


if __name__ == "__main__":
    main(sys.argv[1:])
