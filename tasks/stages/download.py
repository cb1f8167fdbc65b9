"""The download stage: one manifest chunk in, one WebDataset shard and its ledger out."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

from tasks.formats import clock
from tasks.formats.ledger import DOWNLOAD_LEDGER_SCHEMA, LedgerRow
from tasks.formats.manifests import ChunkRef, read_chunk, sample_key
from tasks.formats.names import short_digest
from tasks.formats.reasons import OK
from tasks.formats.recipe_download import DownloadConfig
from tasks.formats.spooled import SpooledBody
from tasks.formats.storage import Storage
from tasks.policies.sniff import EXTENSIONS
from tasks.stages.fetched import Fetched, take_body
from tasks.stages.fetchrows import iter_completed
from tasks.stages.runner import DECIDE_FAILED, ShardResult, Verdict, failure_detail, run_shard


def download_config_hash(recipe: Any) -> str:
    """Hash of the download settings that change what a shard holds.

    Concurrency, timeouts and retries are left out: changing them must not re-download
    shards that are already committed.
    """
    cfg = recipe.download
    kept = [cfg.max_bytes, cfg.allowed_formats, cfg.opt_out_directives, cfg.respect_robots_txt]
    kept += [cfg.max_redirects, cfg.user_agent]
    if recipe.has_video:  # only where there are videos: a recipe without them keeps its names
        kept += [cfg.video_max_bytes, recipe.validate_.video.containers]
    return recipe.config_hash(cfg.network) + ":" + json.dumps(kept)


def shard_paths(dataset: str, ref: ChunkRef, config_hash: str) -> tuple[str, str]:
    """(tar, ledger) paths of a chunk's download shard; named by chunk content and config."""
    digest = short_digest(f"{ref.content_hash}:{config_hash}")
    stem = f"{dataset}/download/{ref.source}/{ref.name}-{digest}"
    return stem + ".tar", stem + ".ledger.parquet"


def download_shard(
    ref: ChunkRef,
    storage: Storage,
    cfg: DownloadConfig,
    tar_rel: str,
    ledger_rel: str,
    s3_options: dict[str, Any] | None = None,
    rows_from: Callable[..., tuple[list[dict[str, Any]], Iterator[tuple[dict[str, Any], Fetched]]]] | None = None,
    now: datetime | None = None,
) -> ShardResult:
    """Download one chunk into one shard; a shard whose ledger exists is done and skipped.

    ``rows_from`` gives the chunk's rows and their results (default ``fetched_rows``: read the
    chunk, fetch its URLs); an ingest source passes ``tasks.sources.ingest_rows`` bound to it.
    Samples go into the tar as their fetches complete, so a slow row holds back none after it;
    the ledger, in row order, is what later phases read in order. A shard with no accepted
    sample is still committed (an empty tar), so every chunk has the same two outputs. Every
    row records the fetch facts (``fetch_facts``) with ``now``, the run's time (default: the
    clock's now when the shard starts).
    """
    at = now or clock.now()
    rows: list[list[dict[str, Any]]] = []  # the chunk's rows (an ingest source fills them as it goes)

    def results() -> Iterator[tuple[dict[str, Any], Fetched]]:
        chunk_rows, fetched = (rows_from or fetched_rows)(ref, storage, cfg, s3_options)
        rows.append(chunk_rows)
        return fetched

    return run_shard(
        storage,
        tar_rel,
        ledger_rel,
        results,
        lambda got: download_verdict(got[0], got[1], ref.source, at),
        source=ref.source,
        index=ref.index,
        schema=DOWNLOAD_LEDGER_SCHEMA,
        failed=lambda got, err: failed_row(got[0], ref.source, err, at),
        check=lambda ledger: check_every_row_once(rows[0], ledger, tar_rel),
    )


def fetched_rows(
    ref: ChunkRef,
    storage: Storage,
    cfg: DownloadConfig,
    s3_options: dict[str, Any] | None = None,
    on_idle: Callable[[], object] | None = None,
) -> tuple[list[dict[str, Any]], Iterator[tuple[dict[str, Any], Fetched]]]:
    """A manifest chunk's rows, and their fetches as they complete (``on_idle``: see ``iter_completed``)."""
    rows = read_chunk(storage, ref).to_pylist()
    return rows, iter_completed(rows, cfg, s3_options, on_idle)


def _sample_json(row: dict[str, Any], key: str, source: str, entry: LedgerRow) -> bytes:
    meta: dict[str, Any] = {}
    if row.get("extra"):
        meta.update(json.loads(row["extra"]))
    meta.update(
        key=key,
        source=source,
        row=row["row"],
        url=row["url"],
        caption=row["caption"],
        license=row["license"],
        format=entry.format,
        bytes=entry.bytes,
        sha256=entry.sha256,
    )
    return json.dumps(meta, ensure_ascii=False, sort_keys=True).encode("utf-8")


def fetch_facts(fetched: Fetched | None, fetched_at: datetime | None, fetches: int = 1) -> dict[str, Any]:
    """A download ledger row's fetch facts (``tasks.formats.ledger.FETCH_FACTS``): when the row
    was last fetched (the run's time), by how many runs in all, and the validators the server
    sent with its answer (for a recheck's conditional request)."""
    return {
        "fetched_at": fetched_at,
        "fetches": fetches,
        "etag": getattr(fetched, "etag", None),
        "last_modified": getattr(fetched, "last_modified", None),
    }


def download_verdict(
    row: dict[str, Any], fetched: Fetched, source: str, fetched_at: datetime | None = None, fetches: int = 1
) -> Verdict:
    """One row's ledger entry (with its fetch facts), and its sample's members when accepted."""
    key = sample_key(source, row["row"])
    entry = LedgerRow(
        key=key,
        source=source,
        row=row["row"],
        reason=fetched.reason,
        url=row["url"],
        format=fetched.format,
        http_status=fetched.http_status,
        attempts=fetched.attempts,
        detail=fetched.detail,
        origin=row.get("origin"),  # get(): chunks written before it was a column lack it
    )
    facts = fetch_facts(fetched, fetched_at, fetches)
    if entry.status != OK:
        return Verdict(entry.as_dict() | facts)
    data = take_body(fetched) or b""
    entry.bytes = len(data)
    entry.sha256 = data.sha256() if isinstance(data, SpooledBody) else hashlib.sha256(data).hexdigest()
    members = {EXTENSIONS.get(fetched.format, fetched.format): data, "json": _sample_json(row, key, source, entry)}
    if row["caption"] is not None:
        members["txt"] = row["caption"].encode("utf-8")
    return Verdict(entry.as_dict() | facts, members)


def failed_row(
    row: dict[str, Any], source: str, err: Exception, fetched_at: datetime | None = None, fetches: int = 1
) -> dict[str, Any]:
    """The ledger row of a manifest row whose recording raised."""
    entry = LedgerRow(
        key=sample_key(source, row["row"]),
        source=source,
        row=row["row"],
        reason=DECIDE_FAILED,
        url=row.get("url"),
        detail=f"recording the row: {failure_detail(err)}",
        origin=row.get("origin"),
    )
    return entry.as_dict() | fetch_facts(None, fetched_at, fetches)


def check_every_row_once(rows: list[dict[str, Any]], ledger: list[dict[str, Any]], tar_rel: str) -> None:
    """Nothing is lost: a shard whose results do not match its rows one to one is not committed."""
    want = sorted(r["row"] for r in rows)
    got = sorted(entry["row"] for entry in ledger)
    if got != want:
        missing = sorted(set(want) - set(got))[:5]
        raise RuntimeError(f"{tar_rel}: {len(got)} results for {len(want)} rows (missing {missing}); not committed")
