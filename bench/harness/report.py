"""Rounds that alternate the tools, medians and ratios, markdown tables, and where the figures came from."""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

from harness.procs import REPO

T = TypeVar("T")


def in_turn(items: Sequence[T], rnd: int, first: int = 1) -> list[T]:
    """The items in the order round ``rnd`` runs them: as given in round ``first``, reversed in
    the next, and so on, so that load from other work falls on every tool alike."""
    return list(items) if (rnd - first) % 2 == 0 else list(items)[::-1]


def alternated(items: Sequence[T], repeats: int, first: int = 1) -> Iterator[tuple[int, T]]:
    """(round, item) for ``repeats`` rounds numbered from ``first``, the order flipping every round."""
    for rnd in range(first, first + repeats):
        for item in in_turn(items, rnd, first):
            yield rnd, item


def med(xs: Iterable[float | None]) -> float | None:
    """The median of the values that are not None (None when there are none)."""
    kept = [x for x in xs if x is not None]
    return statistics.median(kept) if kept else None


def fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def per_1k(cpu: float | None, n: int) -> float | None:
    """CPU seconds per 1,000 samples (None stays None)."""
    return None if cpu is None else 1000 * cpu / max(n, 1)


def table(head: Sequence[str], rows: Iterable[Sequence[object]], align: str | None = None) -> list[str]:
    """A markdown table's lines. ``align``: one letter per column, ``l`` or ``r``; default the
    first column left, the others right."""
    align = align or "l" + "r" * (len(head) - 1)
    lines = ["| " + " | ".join(head) + " |", "|" + "".join("---|" if a == "l" else "---:|" for a in align)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def add_round_flags(p: argparse.ArgumentParser, name: str, repeats: int, quiet_wait: float = 90.0) -> None:
    """The flags every benchmark that runs tools in rounds takes: --repeats, --quiet-wait,
    --markdown and --keep (its run folders under ``.bench/NAME/runs/``)."""
    p.add_argument(
        "--repeats",
        type=int,
        default=repeats,
        help="rounds; each runs every tool once, in turn (reversed in even rounds)",
    )
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=quiet_wait,
        help="before each run, wait up to this many seconds for other work on the machine to drop under 0.3 cores (0: don't wait)",
    )
    p.add_argument("--markdown", type=Path, help="also write the report (markdown) to this file")
    p.add_argument("--keep", action="store_true", help=f"keep each run's folder under .bench/{name}/runs/")


def pick_tools(p: argparse.ArgumentParser, text: str, choices: Sequence[str]) -> list[str]:
    """The tools ``--tools`` names (comma-separated, a subset of ``choices``), in its order."""
    tools = [t.strip() for t in text.split(",") if t.strip()]
    unknown = set(tools) - set(choices)
    if unknown or not tools:
        p.error(f"--tools: unknown {sorted(unknown)}; choose from {','.join(choices)}")
    return tools


# ----------------------------------------------------------------------------------- provenance


def revision() -> str:
    """The commit measured, with ``-dirty`` when the working tree has uncommitted changes."""
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() or "unknown"


def machine(memory: bool = False) -> str:
    """Cores, memory (when asked), architecture and Python version."""
    mem = ""
    if memory:
        import psutil

        mem = f"{psutil.virtual_memory().total / 2**30:.0f} GiB, "
    return f"{os.cpu_count()} cores, {mem}{platform.machine()}, Python {platform.python_version()}"


def command(script: str, argv: list[str] | None) -> str:
    """The command line that made the figures, for the report."""
    return f"python bench/{script} " + " ".join(sys.argv[1:] if argv is None else argv)


def now() -> str:
    return dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")


def emit(text: str, markdown: Path | None) -> None:
    """Print the report, and write it to ``markdown`` when given."""
    print("\n" + text)
    if markdown:
        markdown.write_text(text)
