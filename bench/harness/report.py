"""Every script's flags, its rounds (alternated, medians, ratios), its markdown tables and where its figures came from."""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from .procs import REPO, settle

T = TypeVar("T")


def parser(
    doc: str | None, repeats: int = 3, quiet_wait: float | None = None, keep: str | None = None
) -> argparse.ArgumentParser:
    """A script's parser: its docstring as the description, ``--repeats``, ``--markdown`` and a hidden ``--child``;
    ``--quiet-wait`` when ``quiet_wait`` is given, ``--keep`` when ``keep`` names its folder under ``.bench/``."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--repeats",
        type=int,
        default=repeats,
        help=f"rounds; each runs every tool once, in turn, reversed in even rounds (default {repeats})",
    )
    p.add_argument("--markdown", type=Path, help="also write the report (markdown) to this file")
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    if quiet_wait is not None:
        p.add_argument(
            "--quiet-wait",
            type=float,
            default=quiet_wait,
            help=f"before each run, wait up to this many seconds for other work on the machine to drop under 0.3 cores (0: don't; default {quiet_wait:g})",
        )
    if keep:
        p.add_argument("--keep", action="store_true", help=f"keep each run's folder under .bench/{keep}/runs/")
    return p


def parse(p: argparse.ArgumentParser, argv: list[str] | None, tools: Sequence[str] = ()) -> argparse.Namespace:
    """Parse; with ``tools``, a ``--tools`` flag (added here) picks a subset of them, in its order."""
    if tools:
        p.add_argument("--tools", default=",".join(tools), help=f"comma-separated subset of {','.join(tools)}")
    args = p.parse_args(argv)
    if tools:
        args.tools = pick_tools(p, args.tools, tools)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    return args


def pick_tools(p: argparse.ArgumentParser, text: str, choices: Sequence[str]) -> list[str]:
    """The tools ``--tools`` names (comma-separated, a subset of ``choices``), in its order."""
    tools = [t.strip() for t in text.split(",") if t.strip()]
    if (unknown := set(tools) - set(choices)) or not tools:
        p.error(f"--tools: unknown {sorted(unknown)}; choose from {','.join(choices)}")
    return tools


def in_turn(items: Sequence[T], rnd: int, first: int = 1) -> list[T]:
    """The items in the order round ``rnd`` runs them: as given in round ``first``, reversed in
    the next, and so on, so that load from other work falls on every tool alike."""
    return list(items) if (rnd - first) % 2 == 0 else list(items)[::-1]


def alternated(items: Sequence[T], repeats: int, first: int = 1) -> Iterator[tuple[int, T]]:
    """(round, item) for ``repeats`` rounds numbered from ``first``, the order flipping every round."""
    for rnd in range(first, first + repeats):
        for item in in_turn(items, rnd, first):
            yield rnd, item


def rounds(items: Sequence[T], repeats: int, run: Callable[[T, int], Any], quiet_wait: float = 0.0) -> list:
    """``run(item, round)`` for every item of every round (:func:`alternated`), each after :func:`settle`;
    prints what each returned (its ``line()``, or a dict's numbers); the results in the order they ran."""
    out = []
    for rnd, item in alternated(items, repeats):
        settle(quiet_wait)
        out.append(r := run(item, rnd))
        numbers = (
            ", ".join(f"{k} {v:.4g}" for k, v in r.items() if isinstance(v, int | float) and not isinstance(v, bool))
            if isinstance(r, dict)
            else ""
        )
        print(f"  round {rnd} {item}: {r.line() if hasattr(r, 'line') else numbers}", flush=True)
    return out


def med(xs: Iterable[float | None]) -> float | None:
    """The median of the values that are not None (None when there are none)."""
    kept = [x for x in xs if x is not None]
    return statistics.median(kept) if kept else None


def medians(results: Iterable, value: Callable[[Any], float | None], key: str = "tool") -> dict[str, float | None]:
    """The median of ``value(r)`` over each tool's results (``r[key]`` or ``r.key``), in first-seen order."""
    groups: dict[str, list] = {}
    for r in results:
        groups.setdefault(r[key] if isinstance(r, dict) else getattr(r, key), []).append(value(r))
    return {k: med(v) for k, v in groups.items()}


def summary(
    results: Sequence[dict], columns: dict[str, tuple[str | Callable[[dict], Any], str]], key: str = "tool"
) -> list[str]:
    """A markdown table, a row per tool (``r[key]``) in first-seen order: ``columns`` maps a heading to (a
    result's key or ``value(r)``, format spec); numbers show their median over the tool's results, else the first."""
    rows = []
    for name in dict.fromkeys(r[key] for r in results):
        rs, row = [r for r in results if r[key] == name], [name]
        for value, spec in columns.values():
            xs = [value(r) if callable(value) else r.get(value) for r in rs]
            numbers = all(isinstance(x, int | float) and not isinstance(x, bool) for x in xs)
            row.append(fmt(med(xs), spec) if numbers else xs[0] if xs[0] is not None else "-")
        rows.append(row)
    return table([key, *columns], rows)


def fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def per_1k(cpu: float | None, n: int) -> float | None:
    """CPU seconds per 1,000 samples (None stays None)."""
    return None if cpu is None else 1000 * cpu / max(n, 1)


def table(head: Sequence[str], rows: Iterable[Sequence[object]], align: str | None = None) -> list[str]:
    """A markdown table's lines; ``align``: ``l`` or ``r`` per column (default: the first left, the others right)."""
    align = align or "l" + "r" * (len(head) - 1)
    lines = ["| " + " | ".join(head) + " |", "|" + "".join("---|" if a == "l" else "---:|" for a in align)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def revision() -> str:
    """The commit measured, with ``-dirty`` when the working tree has uncommitted changes."""
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() or "unknown"


def emit(title: str, lines: Iterable[str], argv: list[str] | None, markdown: Path | None, note: str = "") -> str:
    """The report: ``## title``, its command, commit, date, machine, load average and ``note``, then ``lines``;
    printed, and written to ``markdown`` when given."""
    import psutil

    command = f"python bench/{Path(sys.argv[0]).name} " + " ".join(sys.argv[1:] if argv is None else argv)
    machine = f"{os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB, {platform.machine()}, Python {platform.python_version()}"
    when, load = (
        dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        " ".join(f"{x:.2f}" for x in os.getloadavg()),
    )
    head = [
        f"## {title}",
        "",
        f"- command: `{command}`",
        f"- commit {revision()}; {when}; {machine}; load average {load}" + (f"; {note}" if note else ""),
        "",
    ]
    text = "\n".join([*head, *lines]) + "\n"
    print("\n" + text)
    if markdown:
        markdown.write_text(text)
    return text
