"""Fault injection for the resilience tests: a kill, exit or full disk at a chosen write, off unless SHARDSMITH_FAULT is set."""

from __future__ import annotations

import errno
import fnmatch
import os
import signal
from dataclasses import dataclass
from typing import IO, Any

# Fault injection for the resilience tests; off (one dictionary lookup) unless this is set.
FAULT_ENV = "SHARDSMITH_FAULT"
_FAULT_ACTIONS = ("killgroup", "sigkill", "exit", "enospc")
_FAULT_POINTS = ("before", "write", "commit")


@dataclass(frozen=True)
class Fault:
    """One fault that the atomic writer injects where its point is reached for a matching path.

    Args:
        action: ``killgroup`` (SIGKILL to the whole process group: the flow, its workers, as
            when the machine dies), ``sigkill`` (this process only, as the OOM killer does),
            ``exit`` (``os._exit(1)``) or ``enospc`` (the write raises ``OSError(ENOSPC)``).
        point: ``before`` the file is opened, during its first ``write``, or after its
            ``commit`` (renamed or uploaded, before anything else happens).
        pattern: an fnmatch glob over the path relative to the storage root.
        marker: a file path; when set, the fault fires only where it can create that file
            exclusively, so once across every process of the run. Default: every time.

    ``SHARDSMITH_FAULT`` holds one or more ``ACTION:POINT:GLOB[:MARKER]``, separated by ``;``.
    """

    action: str
    point: str
    pattern: str
    marker: str | None = None

    def fire(self) -> None:
        if self.marker:
            try:
                os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return
        if self.action == "enospc":
            raise OSError(errno.ENOSPC, "No space left on device (injected by SHARDSMITH_FAULT)")
        if self.action == "exit":
            os._exit(1)
        if self.action == "killgroup":
            os.killpg(os.getpgrp(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)


def faults_for(rel: str) -> list[Fault]:
    """The faults ``SHARDSMITH_FAULT`` asks for at ``rel``; empty (and cheap) when it is unset."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return []
    out = []
    for item in filter(None, (s.strip() for s in spec.split(";"))):
        parts = item.split(":", 3)
        if len(parts) < 3 or parts[0] not in _FAULT_ACTIONS or parts[1] not in _FAULT_POINTS:
            raise ValueError(
                f"{FAULT_ENV}: {item!r} is not ACTION:POINT:GLOB[:MARKER] with ACTION in {_FAULT_ACTIONS}, POINT in {_FAULT_POINTS}"
            )
        fault = Fault(*parts)
        if fnmatch.fnmatchcase(rel, fault.pattern):
            out.append(fault)
    return out


def inject(faults: list[Fault], point: str) -> None:
    for fault in faults:
        if fault.point == point:
            fault.fire()


def fault_point(rel: str, point: str) -> None:
    """Fire the faults asked for at ``rel`` and ``point``, for writers that bypass ``atomic_writer``."""
    inject(faults_for(rel), point)


class FaultyFile:
    """A file object whose first write fires the ``write`` faults; everything else passes through."""

    def __init__(self, fh: IO[bytes], faults: list[Fault]):
        self._fh = fh
        self._faults = faults

    def write(self, data: Any) -> int:
        if self._faults:
            n = self._fh.write(bytes(data)[: len(data) // 2])  # a torn write: half is on disk
            faults, self._faults = self._faults, []
            inject(faults, "write")
            return n + self._fh.write(bytes(data)[n:])
        return self._fh.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fh, name)
