"""The download phase's summary: counts over every shard and where things are, as JSON and markdown."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from datetime import datetime

from tasks.audit.runrecord import SummaryRow
from tasks.formats.ledger import Counts
from tasks.formats.storage import Storage
from tasks.stages.validate import CandidateResult


@dataclass
class DownloadSummary:
    """What the download phase did: counts over every shard, and where things are."""

    dataset: str
    run: str
    storage: str
    shards: int
    shards_skipped: int
    shards_failed: list[str]
    counts: Counts
    seconds: float
    samples_per_s: float
    mb_per_s: float
    manifests: dict[str, str] = field(default_factory=dict)  # source -> sha256
    report: str = ""
    ledgers: list[str] = field(default_factory=list)
    # Each chunk's raw shard; named (the name keys its candidates) but not written where
    # download.keep_raw is false and the chunk was downloaded so.
    tars: list[str] = field(default_factory=list)
    chunks: list[tuple[str, int]] = field(default_factory=list)  # (source, chunk index) of each tar
    candidates: list[CandidateResult] = field(default_factory=list)  # validated in the same pass
    # Rows that failed for a passing reason, fetched again (download.retry_failed), and of
    # those the rows now ok; when the earliest retry of a row of the current versions falls due
    # (None when no row will be retried).
    rows_retried: int = 0
    rows_recovered: int = 0
    next_retry_at: datetime | None = None

    @property
    def skipped(self) -> bool:
        """Every shard was downloaded by an earlier run: nothing was fetched now."""
        return self.shards > 0 and self.shards_skipped == self.shards

    def row(self) -> SummaryRow:
        """The phase's summary row; written before its gate is judged (``gate``: not yet)."""
        c = self.counts
        return SummaryRow(
            "download",
            self.shards,
            c.rows,
            c.ok,
            c.rejected,
            c.error,
            self.samples_per_s,
            "not yet",
            self.seconds,
            self.skipped,
        )


def summary_markdown(s: DownloadSummary) -> str:
    """The phase's summary row, what it skipped, failed and fetched, its reasons and where things are."""
    from tasks.audit.report_markdown import md, summary_table

    c = s.counts
    lines = [
        f"# {s.dataset}: download ({s.run})",
        "",
        *summary_table([s.row()]),
        "",
        "| shards skipped | shards failed | MB/s |",
        "|---:|---:|---:|",
        f"| {s.shards_skipped} | {len(s.shards_failed)} | {s.mb_per_s} |",
        "",
        "| reason | rows |",
        "|---|---:|",
        *[f"| `{r}` | {n} |" for r, n in c.by_reason.items()],
        "",
        f"Storage: `{s.storage}`  ",
        f"Report: `{s.report}`",
    ]
    if s.rows_retried or s.next_retry_at is not None:
        when = s.next_retry_at.strftime("%Y-%m-%d %H:%M UTC") if s.next_retry_at is not None else "none"
        lines += [
            "",
            "| rows retried | recovered | next retry due |",
            "|---:|---:|---|",
            f"| {s.rows_retried} | {s.rows_recovered} | {when} |",
        ]
    if s.shards_failed:
        # a failure's message can quote what a server or a file said: text, never markdown
        lines += ["", "## Failed shards", "", *[f"- {md(f)}" for f in s.shards_failed]]
    return "\n".join(lines) + "\n"


def write_summary(storage: Storage, s: DownloadSummary) -> str:
    """Write the phase summary (JSON and markdown) under ``{dataset}/reports/{run}/``."""
    base = f"{s.dataset}/reports/{s.run}"
    s.report = storage.url(f"{base}/download.md")
    data = asdict(s)
    text = json.dumps(data, indent=2, sort_keys=True, default=_json_time)
    storage.write_bytes(f"{base}/download.json", text.encode())
    storage.write_bytes(f"{base}/download.md", summary_markdown(s).encode())
    return s.report


def _json_time(value: object) -> str:
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")
