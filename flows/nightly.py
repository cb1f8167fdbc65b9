"""The nightly rebuild: every recipe in a folder, one subflow per dataset, and a summary of the night."""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path
from typing import Any

import yaml
from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.states import Failed

from flows.audit import GateFailed, report_dir
from flows.params import ClusterChoice, RecipeOverrides, recipe_overrides
from tasks.audit.runrecord import RunRecord, SummaryRow, summary_rows
from tasks.formats.recipe import load_recipe
from tasks.formats.recipe_base import RecipeError
from tasks.formats.storage import Storage

SUMMARY_KEY = "nightly-rebuild-summary"


def dataset_flow(kind: str):
    """The end-to-end flow of a recipe kind; fine-tuning only where its flow exists."""
    if kind == "pretraining":
        from flows.pretraining import pretraining_flow

        return pretraining_flow
    # Imported lazily: the fine-tuning flow is optional, and costly imports stay out of the
    # nightly's own start.
    if kind == "finetuning" and importlib.util.find_spec("flows.finetuning") is not None:
        from flows import finetuning

        return finetuning.finetuning_flow
    raise RecipeError(f"no flow for recipes of kind {kind!r} in this version of shardsmith")


@flow(name="nightly-rebuild")
def nightly_rebuild(
    recipes_dir: str = "recipes",
    pattern: str = "*.yaml",
    phases: list[str] | None = None,
    cluster: ClusterChoice | None = None,
    overrides: RecipeOverrides | None = None,
) -> Any:
    """Rebuild every recipe in a folder; a failing dataset does not stop the others.

    Args:
        recipes_dir: folder of recipe YAMLs; relative to the project folder.
        pattern: which files in it are recipes (glob).
        phases: phases to run for every dataset; empty runs each kind's full pipeline.
        cluster: local, cuda or a Dask scheduler address, for every dataset.
        overrides: recipe values applied to every dataset (use sparingly: gates are per dataset).
    """
    logger = get_run_logger()
    paths = sorted(Path(recipes_dir).glob(pattern))
    if not paths:
        raise RecipeError(f"no recipes matching {pattern!r} in {Path(recipes_dir).resolve()}")
    done = [rebuild_one(path, phases, cluster, overrides) for path in paths]
    rows = [row for row, _ in done]
    for row in rows:
        logger.info("%s: %s %s", row["dataset"], row["status"], row["why"] or row["version"] or "")
    publish_summary(rows, [(row["dataset"], p) for row, phase_rows in done for p in phase_rows])
    bad = [r for r in rows if r["status"] in ("blocked", "failed")]
    if bad:
        # Failed, so the night shows red in the UI and the alert automation fires; every
        # dataset has still been attempted and the summary is posted.
        return Failed(
            message=f"{len(bad)} of {len(rows)} datasets not rebuilt: "
            + "; ".join(f"{r['dataset']} {r['status']}" for r in bad),
            data=rows,
        )
    return rows


def rebuild_one(
    path: Path, phases: list[str] | None, cluster: str | None, overrides: RecipeOverrides | None
) -> tuple[dict[str, Any], list[SummaryRow]]:
    """Run one recipe as a subflow and describe the outcome: one row for the dataset, and the
    summary rows of the phases it ran (a blocked run's too)."""
    row: dict[str, Any] = {
        "dataset": _declared_name(path),
        "recipe": str(path),
        "kind": "",
        "status": "failed",
        "version": "",
        "why": "",
        "report": "",
    }
    dotted = recipe_overrides(overrides, cluster)
    try:
        recipe = load_recipe(path, dotted)
        run_flow = dataset_flow(recipe.kind)
    except RecipeError as err:
        row["why"] = _first_line(str(err))
        return row, []
    row.update(dataset=recipe.dataset, kind=recipe.kind)
    # Dotted overrides (cluster included) are what every dataset flow takes.
    params: dict[str, Any] = {"recipe_path": str(path), "phases": phases, "overrides": dotted or None}
    accepted = inspect.signature(run_flow.fn).parameters
    params = {k: v for k, v in params.items() if k in accepted and (v is not None or k == "recipe_path")}
    state = run_flow.with_options(flow_run_name=f"{recipe.dataset}-nightly")(**params, return_state=True)
    result = state.result(raise_on_failure=False)
    if isinstance(result, BaseException) or not state.is_completed():
        row["status"] = "blocked" if isinstance(result, GateFailed) else "failed"
        text = str(result) if isinstance(result, BaseException) else (state.message or state.name)
        row["why"] = _first_line(text)
        row["report"] = next((line[len("report: ") :] for line in text.splitlines() if line.startswith("report: ")), "")
        blocked = getattr(result, "run", None)  # GateFailed carries the record its report shows
        return row, summary_rows(blocked) if isinstance(blocked, RunRecord) else []
    release = result.get("release") if isinstance(result, dict) else None
    if release is not None:
        row["status"] = "released" if release.created else "unchanged"
        row["version"] = release.version
    else:
        row["status"] = "done"  # ran the phases asked for, none of them a release
    record = result.get("record") if isinstance(result, dict) else None
    if not isinstance(record, RunRecord):
        return row, []
    row["report"] = Storage(recipe.storage, recipe.storage_options).url(f"{report_dir(recipe, record.run)}/report.html")
    return row, summary_rows(record)


def publish_summary(rows: list[dict[str, Any]], phases: list[tuple[str, SummaryRow]] | None = None) -> None:
    """A markdown and a table artifact under stable keys, so the Artifacts page keeps each night;
    the markdown ends with every dataset's phases (``phases``: dataset and summary row)."""
    create_markdown_artifact(
        summary_markdown(rows, phases),
        key=SUMMARY_KEY,
        description="What the nightly rebuild released, what it blocked and why",
    )
    create_table_artifact(rows, key=f"{SUMMARY_KEY}-table", description="Nightly rebuild, one row per dataset")


def summary_markdown(rows: list[dict[str, Any]], phases: list[tuple[str, SummaryRow]] | None = None) -> str:
    """The night's markdown: counts, one escaped row per dataset, then every dataset's phases."""
    from tasks.audit.report_markdown import md, summary_table

    counts = {
        s: sum(1 for r in rows if r["status"] == s) for s in ("released", "unchanged", "done", "blocked", "failed")
    }
    lines = [
        "# Nightly rebuild",
        "",
        ", ".join(f"{n} {s}" for s, n in counts.items() if n) or "nothing to do",
        "",
        "| dataset | kind | status | version | why | report |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        report = f"[report]({r['report']})" if r["report"] else ""
        # the why can quote third parties' text (a manifest's column names): escaped, as every cell
        cells = [md(r[k]) for k in ("dataset", "kind", "status", "version", "why")]
        lines.append("| {} | {} | **{}** | {} | {} | ".format(*cells) + f"{report} |")
    if phases:
        lines += ["", "## Phases", "", *summary_table([p for _, p in phases], [d for d, _ in phases])]
    return "\n".join(lines) + "\n"


def _declared_name(path: Path) -> str:
    """The dataset a recipe names, even when the recipe does not validate; else its file name."""
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return path.stem
    name = data.get("dataset") if isinstance(data, dict) else None
    return name if isinstance(name, str) and name else path.stem


def _first_line(text: str) -> str:
    # The full message is in the flow run's logs and the report; the summary keeps it short.
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line[:300]
