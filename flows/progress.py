"""Progress of a run's phases: a live display in the terminal that runs the CLI, nothing elsewhere.

The flows report shards as they finish (``runtime.gather`` does it for every phase); the
Prefect UI gets the same numbers as progress artifacts. A deployment run has no terminal, so
nothing is displayed there.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Protocol


class Sink(Protocol):
    def start(self, phase: str, shards: int, rows: int | None) -> None: ...
    def advance(self, phase: str, rows: int, shards: int = 1) -> None: ...
    def finish(self, phase: str) -> None: ...


class _Nothing:
    def start(self, phase: str, shards: int, rows: int | None) -> None:
        pass

    def advance(self, phase: str, rows: int, shards: int = 1) -> None:
        pass

    def finish(self, phase: str) -> None:
        pass


_sink: Sink = _Nothing()


def start(phase: str, shards: int, rows: int | None = None) -> None:
    _sink.start(phase, shards, rows)


def advance(phase: str, result: Any = None) -> None:
    """One task of ``phase`` is done: one shard, or a list of the shards it made (a reshard
    build task writes several); rows are read from each ``counts.rows`` when it has them."""
    if isinstance(result, list):
        _sink.advance(phase, sum(_rows(r) for r in result), len(result))
    else:
        _sink.advance(phase, _rows(result))


def _rows(result: Any) -> int:
    retried = getattr(result, "retried", None)  # a retry's new version: the rows it fetched again
    if retried is not None:
        return int(retried)
    checked = getattr(result, "rows", None)  # a shard's rows (ShardResult), a recheck's rows checked
    if isinstance(checked, int):
        return checked
    counts = getattr(result, "counts", None)
    rows = getattr(counts, "rows", None)
    if rows is None:
        rows = getattr(result, "samples", 0) or 0
    return int(rows)


def finish(phase: str) -> None:
    _sink.finish(phase)


class Terminal:
    """A line per phase: shards and rows done, rows/s and time left (rich, on stderr).

    On a terminal the line updates in place; otherwise (CI logs, a pipe) one line is printed
    when the phase ends.
    """

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        self.console = Console(stderr=True)
        self.live = self.console.is_terminal
        self.progress = Progress(
            TextColumn("{task.description:<10}"),
            BarColumn(bar_width=24),
            TextColumn("{task.completed:>5.0f}/{task.total:<5.0f} shards"),
            TextColumn("{task.fields[rows]}"),
            TimeRemainingColumn(),
            console=self.console,
            transient=False,
            disable=not self.live,
        )
        self.tasks: dict[str, Any] = {}
        self.stats: dict[str, dict[str, float]] = {}

    def __enter__(self) -> Terminal:
        global _sink
        self.progress.start()
        self._previous, _sink = _sink, self
        return self

    def __exit__(self, *exc: object) -> None:
        global _sink
        _sink = self._previous
        self.progress.stop()

    def _rows_text(self, phase: str) -> str:
        """Rows done (of the total, when known) and their rate; nothing for a step whose
        results count no rows (a check over finished shards), rather than "0 rows, 0/s"."""
        st = self.stats[phase]
        if not st["rows"] and not st["rows_total"]:
            return ""
        rate = st["rows"] / max(time.monotonic() - st["t0"], 1e-6)
        total = f"/{int(st['rows_total']):,}" if st["rows_total"] else ""
        return f"{int(st['rows']):,}{total} rows, {rate:,.0f}/s"

    def start(self, phase: str, shards: int, rows: int | None) -> None:
        self.stats[phase] = {"t0": time.monotonic(), "rows": 0, "rows_total": rows or 0, "shards": 0, "total": shards}
        if phase in self.tasks:
            self.progress.reset(self.tasks[phase], total=max(shards, 1), rows="")
        else:
            self.tasks[phase] = self.progress.add_task(phase, total=max(shards, 1), rows="")

    def advance(self, phase: str, rows: int, shards: int = 1) -> None:
        if phase not in self.stats:
            self.start(phase, 0, None)
        st = self.stats[phase]
        st["rows"] += rows
        st["shards"] += shards
        self.progress.update(self.tasks[phase], advance=shards, rows=self._rows_text(phase))

    def finish(self, phase: str) -> None:
        if phase not in self.stats:
            return
        st = self.stats[phase]
        self.progress.update(self.tasks[phase], completed=max(st["total"], 1), rows=self._rows_text(phase))
        if not self.live:
            seconds = time.monotonic() - st["t0"]
            rows = self._rows_text(phase)
            print(
                f"{phase}: {int(st['shards'])}/{int(st['total'])} shards{', ' + rows if rows else ''} ({seconds:.1f} s)",
                file=sys.stderr,
                flush=True,
            )
