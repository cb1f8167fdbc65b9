"""What `shardsmith run` prints when a run ends: each phase's counts, reasons and outputs, or JSON."""

from __future__ import annotations

import json

import typer

from tasks.audit.runrecord import RunRecord, row_text, summary_rows
from tasks.audit.tallies import by_family


def json_value(value: object) -> object:
    """What ``--json`` prints for values JSON has no type for: an Arrow table (reshard's rows not
    carried, an output's layout) as its size (its rows are in the phase's ledgers), bytes as hex,
    anything else as its string."""
    import pyarrow as pa

    if isinstance(value, (pa.Table, pa.RecordBatch)):
        return {"rows": value.num_rows, "columns": value.schema.names}
    if isinstance(value, bytes):
        return value.hex()
    return str(value)


def print_json(result: dict) -> None:
    """The run's result as JSON: each phase's summary (a dataclass) as its fields, the run
    record as run.json holds it."""
    from dataclasses import asdict, is_dataclass

    def plain(v: object) -> object:
        if isinstance(v, RunRecord):
            return v.to_json()
        return asdict(v) if is_dataclass(v) and not isinstance(v, type) else v

    typer.echo(json.dumps({k: plain(v) for k, v in result.items()}, indent=2, default=json_value))


def print_summary(result: dict) -> None:
    last = result.get("up_to_date")
    if last is not None:
        release = f"; release {last['release']} is still the latest" if last.get("release") else ""
        typer.secho(
            f"{result['dataset']}: up to date, nothing to do (run {last['run']} covered {', '.join(last['phases'])} over the same inputs{release})",
            bold=True,
            fg="green",
        )
        typer.echo(
            f"  report: {result['storage']}/{result['dataset']}/reports/{last['run']}/report.html   (--force runs every phase again)"
        )
        return
    record = result.get("record")
    if record is None:
        return
    dl = result.get("download")
    root = f"{dl.storage}/{dl.dataset}" if dl is not None else f"{record.storage}/{record.dataset}"
    typer.echo("")
    for row in summary_rows(record):
        typer.secho(row_text(row), bold=True)
        for line in _details(row.phase, result, root):
            typer.echo(f"  {line}")
    if "precache" in result and result["precache"] is None:
        typer.echo("precache: no encoders configured")
    rel = result.get("release")
    if rel is not None:
        state = "released" if rel.created else "unchanged, still"
        typer.secho(f"release: {state} {rel.version}: {rel.path}", bold=True, fg="green")
        changes = getattr(record, "changes", None)
        if rel.created and changes:
            from tasks.audit.changes import changes_text

            typer.echo(f"  {changes_text(dict(changes))}")
    typer.echo(f"  report:             {root}/reports/{record.run}/report.html")


def _when(value: object) -> str:
    return value.strftime("%Y-%m-%d %H:%M UTC") if hasattr(value, "strftime") else str(value)


def _upkeep_lines(result: dict) -> list[str]:
    """Under the download row: rows fetched again after a passing failure, and the recheck of
    released rows (download.retry_failed, download.recheck)."""
    lines = []
    dl = result["download"]
    if dl.rows_retried or dl.next_retry_at is not None:
        due = f"; next retry due {_when(dl.next_retry_at)}" if dl.next_retry_at is not None else ""
        lines.append(
            f"retried {dl.rows_retried} rows that failed for a passing reason, {dl.rows_recovered} recovered{due}"
        )
    rc = result.get("recheck")
    if rc is not None and rc.enabled:
        seen = ", ".join(f"{k} {v}" for k, v in sorted(rc.counts.items()) if v) or "nothing due"
        due = f"; next due {_when(rc.next_recheck_at)}" if rc.next_recheck_at is not None else ""
        lines.append(f"rechecked {rc.checked} of {rc.released} released rows: {seen}{due}")
    return lines


def _bounds(cut: dict) -> str:
    low, high = cut.get("low"), cut.get("high")
    if low is not None and high is not None:
        return f"{low:.4f}..{high:.4f}"
    return f">= {low:.4f}" if low is not None else f"<= {high:.4f}"


def _details(phase: str, result: dict, root: str) -> list[str]:
    """What a phase's own summary adds under its summary row: reasons, where its shards are
    (under ``root``, the dataset's folder), what it made."""
    summary = result.get(phase)
    if summary is None:
        return []
    counts = getattr(summary, "counts", None)
    lines = [f"{reason:<24} {n}" for reason, n in by_family(counts.by_reason if counts else {}).items()]
    if phase == "download":
        lines.append(f"{summary.shards_skipped} shards already done, {summary.mb_per_s} MB/s")
        lines += _upkeep_lines(result)
    if phase == "validate":
        lines.append(f"{summary.duplicates} duplicates")
        p = getattr(summary, "privacy", None) or {}
        if any(p.values()):
            lines.append(
                f"privacy: {p['with_faces']} with faces ({p['blurred']} released blurred), {p['with_personal_data']} with "
                f"personal data ({p['redacted']} released redacted), {p['metadata_removed']} with metadata removed"
            )
    if phase == "curate":
        lines.append(
            f"embedded {summary.embedded} samples now, {summary.reused} from stored embeddings (model {summary.model[:16]})"
        )
        lines += [f"cut {c['name']}: {c['rule']} -> keep {_bounds(c)}" for c in summary.cuts]
    if phase in ("download", "validate", "curate"):
        lines.append(f"shards and ledgers: {root}/{phase}/")
    if phase == "finetune":
        st = summary.stats
        fill = (
            f", fill {st['fill_ratio']:.3f} (padding to the longest: {st['pad_to_longest_ratio']:.3f})"
            if st.get("fill_ratio") is not None
            else ""
        )
        lines.append(f"{st['samples']} samples in {st['packs']} packs, cut-off {st['cutoff']} tokens{fill}")
        p = getattr(summary, "privacy", None) or {}
        if any(p.values()):
            lines.append(
                f"privacy: {p['with_personal_data']} records with personal data in their turns "
                f"({p['redacted']} released redacted, {p['refused']} refused)"
            )
    if phase == "reshard":
        lines.append(f"{summary.samples} samples in shards of {summary.samples_per_shard} (last holds {summary.tail})")
        upkeep = getattr(summary, "upkeep", None)
        if upkeep is not None and upkeep.digest:
            shown = ", ".join(f"{k} {v}" for k, v in sorted(upkeep.counts().items()))
            lines.append(f"upkeep (takedowns, rechecks): {shown}")
        if summary.incomplete:
            lines.append(f"{'incomplete_sample':<24} {summary.incomplete}")
    if phase == "precache":
        skipped = sum(1 for r in summary.results if getattr(r, "skipped", False))
        lines.append(f"{summary.samples} samples encoded ({skipped} shards already done)")
        for name, enc in summary.encodings.items():
            shape = "x".join(str(d) for d in enc.get("shape", ()))
            lines.append(f"{name:<24} {shape} {enc.get('dtype', '')}")
    return lines
