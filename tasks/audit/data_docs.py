"""Great Expectations Data Docs of a run's gates, rendered to open offline."""

from __future__ import annotations

import ast
import html
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from tasks.audit.gate_results import GateResult
from tasks.audit.ge_runner import GE_LOCK, ge_context, import_gx, json_default
from tasks.formats.storage import Storage

# GE's pages load Bootstrap, jQuery, bootstrap-table, Font Awesome and Vega from CDNs. Offline
# (or behind a strict proxy) that leaves them unstyled, and the index's tables empty: they are
# filled by bootstrap-table from data in an inline script. We render those tables into the
# HTML, drop every script and remote asset, and add a small stylesheet of our own for the
# Bootstrap classes GE uses. Our checks draw no charts, so nothing needs Vega.
OFFLINE_CSS = Path(__file__).resolve().parent / "templates" / "data_docs_offline.css"
# The phases whose pages a run's site already holds (beside its index.html).
RENDERED = "rendered.json"
# The pages run no script at all, and a browser that honours the policy fetches nothing remote.
CSP = "default-src 'self' data:; script-src 'none'; object-src 'none'; style-src 'self' 'unsafe-inline'"

_SCRIPT = re.compile(r"<script\b[^>]*>.*?</script\s*>", re.S | re.I)
_REMOTE_LINK = re.compile(r"<link\b[^>]*\bhref=[\"']?(?:https?:)?//[^>]*>", re.I)
_REMOTE_IMG = re.compile(r"<img\b[^>]*\bsrc=[\"']?(?:https?:)?//[^>]*>", re.I | re.S)
_FOOTER = re.compile(r"<footer\b.*?</footer\s*>", re.S | re.I)  # GE's newsletter and call-to-action banners
_REMOTE_URL = re.compile(r"url\(\s*['\"]?(?:https?:)?//[^)]*\)", re.I)
_HANDLER = re.compile(r"\son(?:click|load|change)=\"[^\"]*\"", re.I)
_TABLE_SCRIPT = re.compile(
    r"\$\('#(?P<id>[\w-]+)'\)\.bootstrapTable\(\s*Object\.assign\(\s*\{\s*columns:\s*(?P<columns>\[.*?\]),\s*data:\s*(?P<data>\[.*?\]),\s*toolbar:",
    re.S,
)


def _table_rows(columns: list[dict[str, Any]], data: list[dict[str, Any]]) -> str:
    """The rows bootstrap-table would have drawn. Cell values are GE's own HTML snippets (GE
    inserts them unescaped as well); a row's link covers the cells that hold no link."""
    head = "".join(f"<th>{html.escape(str(c.get('title', c.get('field', ''))))}</th>" for c in columns)
    rows = []
    for row in data:
        link = row.get("_table_row_link_path")
        cells = []
        for c in columns:
            value = str(row.get(c.get("field"), ""))
            if link and "<a " not in value:
                value = f'<a class="row-link" href="{html.escape(str(link), quote=True)}">{value}</a>'
            cells.append(f"<td>{value}</td>")
        rows.append(f"<tr>{''.join(cells)}</tr>")
    return f"<thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody>"


def offline_page(page: str, css: str) -> str:
    """One Data Docs page made to render without a network: tables filled, no script, no
    remote stylesheet, font or image, and our stylesheet inline."""
    for m in _TABLE_SCRIPT.finditer(page):
        try:
            columns, data = ast.literal_eval(m.group("columns")), ast.literal_eval(m.group("data"))
        except (ValueError, SyntaxError):
            continue  # left empty: the test of this module notices a GE version that changed it
        empty = re.compile(rf"(<table\s+id=\"{re.escape(m.group('id'))}\"[^>]*>)\s*</table>")
        rows = _table_rows(columns, data)
        page = empty.sub(lambda t, rows=rows: t.group(1) + rows + "</table>", page, count=1)
    for pattern in (_SCRIPT, _REMOTE_LINK, _REMOTE_IMG, _FOOTER, _HANDLER):
        page = pattern.sub("", page)
    page = _REMOTE_URL.sub("none", page)
    head = f'<meta http-equiv="Content-Security-Policy" content="{CSP}">\n<style>{css}</style>\n'
    return page.replace("</head>", head + "</head>", 1)


def offline_site(site_dir: str) -> None:
    """Rewrite every page of a Data Docs site in place (see ``offline_page``)."""
    css = OFFLINE_CSS.read_text(encoding="utf-8")
    for folder, _dirs, files in os.walk(site_dir):
        for name in files:
            if name.endswith(".html"):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as fh:
                    page = fh.read()
                with open(path, "w", encoding="utf-8") as fh:
                    fh.write(offline_page(page, css))


def build_data_docs(gx: Any, ge_results: list[dict[str, Any]], docs_dir: str, render: list[int] | None = None) -> None:
    """Render one GE Data Docs site for stored validation results (JSON) into ``docs_dir``.

    The results are loaded back into an in-memory context's validation results store, with
    their suites rebuilt from the configurations the results carry, so a report can be
    rendered from the JSON alone (in another process, or after the run). ``render``: the
    positions in ``ge_results`` whose validation and suite pages are rendered (all when None);
    the index always lists every result.
    """
    from great_expectations.core.expectation_validation_result import (
        ExpectationSuiteValidationResultSchema,
    )
    from great_expectations.core.run_identifier import RunIdentifierSchema
    from great_expectations.data_context.types.resource_identifiers import (
        ExpectationSuiteIdentifier,
        ValidationResultIdentifier,
    )
    from great_expectations.expectations.expectation_configuration import ExpectationConfiguration

    with GE_LOCK:
        context = ge_context(gx, docs_dir)
        pages: list[Any] = []
        for position, ge_result in enumerate(ge_results):
            for data in ge_result.get("validations", []):
                result = ExpectationSuiteValidationResultSchema().load(data)
                run_id = result.meta["run_id"]
                if isinstance(run_id, dict):
                    run_id = RunIdentifierSchema().load(run_id)
                batch = result.meta.get("active_batch_definition") or {}
                identifier = ValidationResultIdentifier(
                    expectation_suite_identifier=ExpectationSuiteIdentifier(name=result.suite_name),
                    run_id=run_id,
                    batch_identifier=batch.get("data_asset_name") or result.suite_name,
                )
                context.validation_results_store.set(identifier, result)
                suite = gx.ExpectationSuite(name=result.suite_name)
                for r in data["results"]:
                    cfg = r["expectation_config"]
                    kwargs = {k: v for k, v in cfg.get("kwargs", {}).items() if k != "batch_id"}
                    config = ExpectationConfiguration(
                        type=cfg["type"], kwargs=kwargs, meta=cfg.get("meta"), description=cfg.get("description")
                    )
                    suite.add_expectation(config.to_domain_obj())
                context.suites.add(suite)
                if render is None or position in render:
                    pages += [identifier, identifier.expectation_suite_identifier]
        # GE renders a page for every stored result unless told which: a run's site grows by
        # one phase at a time, so each gate renders its own pages and the index only.
        context.build_data_docs(resource_identifiers=None if render is None else pages)
    offline_site(docs_dir)


def _saved_reports(storage: Storage, rel_dir: str) -> list[dict[str, Any]]:
    """The gate reports already in ``rel_dir`` (other files there are skipped)."""
    reports = []
    for name in storage.listdir(rel_dir):
        if not name.endswith(".json"):
            continue
        try:
            data = json.loads(storage.read_bytes(f"{rel_dir}/{name}"))
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and {"phase", "ge_result", "outcomes"} <= data.keys():
            reports.append(data)
    return reports


def save_gate_report(result: GateResult, storage: Storage, rel_dir: str, docs: bool = True) -> dict[str, str]:
    """Write ``{rel_dir}/{phase}.json`` and the run's GE Data Docs under ``{rel_dir}/data_docs/``.

    The JSON goes first, so a failure while rendering still leaves the verdict behind. The
    Data Docs site covers every gate report in ``rel_dir`` (so one index lists all phases of
    the run); it is built in a local temp dir and copied file by file through ``storage``, which
    works on S3 too. Static assets (fonts, images: most of the site's 4 MB) already there are
    not copied again. Returns the relative paths: ``json`` and ``data_docs`` (index.html);
    ``docs=False`` writes the JSON only (a gate reused from an earlier run, whose Data Docs
    stay with that run).
    """
    rel_dir = rel_dir.strip("/")
    json_rel = f"{rel_dir}/{result.phase}.json"
    payload = json.dumps(result.to_json(), indent=2, sort_keys=True, default=json_default)
    storage.write_bytes(json_rel, payload.encode())
    if not docs:
        return {"json": json_rel}
    docs_rel = f"{rel_dir}/data_docs"
    reports = {r["phase"]: r["ge_result"] for r in _saved_reports(storage, rel_dir)}
    reports[result.phase] = result.ge_result
    phases = sorted(reports)
    # The phases whose pages are already in the site (written after their pages were copied,
    # so an interrupted copy is rendered again); this gate's own pages are always rendered.
    rendered_rel = f"{docs_rel}/{RENDERED}"
    rendered = set(json.loads(storage.read_bytes(rendered_rel))) if storage.exists(rendered_rel) else set()
    fresh = [i for i, p in enumerate(phases) if p not in rendered or p == result.phase]
    gx = import_gx()
    with tempfile.TemporaryDirectory(prefix="shardsmith-docs-") as tmp:
        # GE's index lists the pages its site folder holds: the pages already rendered stand in
        # the temp site as empty files, so the index links them, and are not copied back.
        seeded = _seed_pages(storage, docs_rel, tmp) if rendered else set()
        build_data_docs(gx, [reports[p] for p in phases], tmp, render=fresh)
        for folder, _dirs, files in sorted(os.walk(tmp)):
            for name in sorted(files):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, tmp).replace(os.sep, "/")
                target = f"{docs_rel}/{rel}"
                if rel in seeded and os.path.getsize(path) == 0:
                    continue
                if rel.startswith("static/") and _same_size(storage, target, os.path.getsize(path)):
                    continue
                with open(path, "rb") as fh:
                    storage.write_bytes(target, fh.read())
    storage.write_bytes(rendered_rel, json.dumps(sorted(rendered | {phases[i] for i in fresh})).encode())
    return {"json": json_rel, "data_docs": f"{docs_rel}/index.html"}


def _seed_pages(storage: Storage, docs_rel: str, tmp: str) -> set[str]:
    """Empty stand-ins in ``tmp`` for the validation and suite pages under ``docs_rel``; their paths."""
    seeded: set[str] = set()
    for section in ("validations", "expectations"):
        if not storage.exists(f"{docs_rel}/{section}"):
            continue
        base = storage.path(docs_rel).rstrip("/")
        for found in storage.fs.find(storage.path(f"{docs_rel}/{section}")):
            rel = found[len(base) + 1 :] if found.startswith(base) else None
            if rel is None or not rel.endswith(".html"):
                continue
            os.makedirs(os.path.dirname(os.path.join(tmp, rel)), exist_ok=True)
            open(os.path.join(tmp, rel), "wb").close()
            seeded.add(rel)
    return seeded


def _same_size(storage: Storage, rel: str, size: int) -> bool:
    try:
        return storage.size(rel) == size
    except FileNotFoundError:
        return False
