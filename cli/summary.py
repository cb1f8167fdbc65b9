"""What `shardsmith run` prints when a run ends: each phase's counts, reasons and outputs, or JSON."""

from __future__ import annotations

import json

import typer

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
    """The run's result as JSON: each phase's summary (a dataclass) as its fields."""
    from dataclasses import asdict

    typer.echo(
        json.dumps(
            {k: asdict(v) if hasattr(v, "__dataclass_fields__") else v for k, v in result.items()},
            indent=2,
            default=json_value,
        )
    )


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
    dl = result.get("download")
    if dl is None:
        return
    c = dl.counts
    typer.echo("")
    typer.secho(f"download: {c.rows} rows -> {c.ok} ok, {c.rejected} rejected, {c.error} error", bold=True)
    for reason, n in c.by_reason.items():
        typer.echo(f"  {reason:<24} {n}")
    typer.echo(
        f"  shards: {dl.shards} ({dl.shards_skipped} already done), {dl.samples_per_s} samples/s, {dl.mb_per_s} MB/s"
    )
    typer.echo(f"  shards and ledgers: {dl.storage}/{dl.dataset}/download/")
    val = result.get("validate")
    if val is not None:
        c = val.counts
        typer.secho(
            f"validate: {c.rows} samples -> {c.ok} ok, {c.rejected} rejected ({val.duplicates} duplicates)", bold=True
        )
        for reason, n in by_family(c.by_reason).items():
            typer.echo(f"  {reason:<24} {n}")
        typer.echo(f"  shards and ledgers: {dl.storage}/{dl.dataset}/validate/")
    ft = result.get("finetune")
    if ft is not None:
        c, st = ft.counts, ft.stats
        typer.secho(f"finetune: {c.rows} records -> {c.ok} ok, {c.rejected} rejected, {c.error} error", bold=True)
        for reason, n in by_family(c.by_reason).items():
            typer.echo(f"  {reason:<24} {n}")
        fill = (
            f", fill {st['fill_ratio']:.3f} (padding to the longest: {st['pad_to_longest_ratio']:.3f})"
            if st.get("fill_ratio") is not None
            else ""
        )
        typer.echo(f"  {st['samples']} samples in {st['packs']} packs, cut-off {st['cutoff']} tokens{fill}")
    rs = result.get("reshard")
    if rs is not None:
        typer.secho(
            f"reshard: {rs.samples} samples -> {len(rs.outputs)} shards of {rs.samples_per_shard} (last holds {rs.tail})",
            bold=True,
        )
        if rs.incomplete:
            typer.echo(f"  {'incomplete_sample':<24} {rs.incomplete}")
    pc = result.get("precache")
    if pc is not None:
        skipped = sum(1 for r in pc.results if getattr(r, "skipped", False))
        typer.secho(
            f"precache: {pc.samples} samples encoded in {len(pc.results)} latent shards ({skipped} already done)",
            bold=True,
        )
        for name, enc in pc.encodings.items():
            shape = "x".join(str(d) for d in enc.get("shape", ()))
            typer.echo(f"  {name:<24} {shape} {enc.get('dtype', '')}")
    elif "precache" in result:
        typer.echo("precache: no encoders configured")
    rel = result.get("release")
    if rel is not None:
        state = "released" if rel.created else "unchanged, still"
        typer.secho(f"release: {state} {rel.version}: {rel.path}", bold=True, fg="green")
    record = result.get("record") or {}
    report_dir = f"{dl.storage}/{dl.dataset}/reports/{record.get('run', dl.run)}"
    typer.echo(f"  report:             {report_dir}/report.html")
