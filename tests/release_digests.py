"""Digests of a demo release's files with each run's own facts (times, ids, port, paths) normalised out (no tests here)."""

from __future__ import annotations

import hashlib
import io
import json
import re
from pathlib import Path
from typing import Any

# Keys whose values a rerun of the same inputs changes: wall-clock times and durations, run
# and flow-run ids, Great Expectations' own ids, load times and frame fingerprints (GE hashes
# frames that hold port-dependent digests and work paths), and the hashes of the recipe and
# inputs (the recipe names the run's temporary folder, the manifests name the server's port).
VOLATILE_KEYS = frozenset(
    {
        "created",
        "started",
        "finished",
        "seconds",
        "samples_per_s",
        "timings",
        "run",
        "flow_run_id",
        "data_docs",
        "id",
        "validation_id",
        "run_time",
        "validation_time",
        "ge_load_time",
        "pandas_data_fingerprint",
        "recipe_hash",
        "fingerprint",
        # The package version, with the git commit when run from a clone (not from a worktree,
        # whose .git is a file): every commit changes it.
        "code_version",
    }
)
# The loopback image server takes an ephemeral port, and the manifests' URLs (carried into
# every sample's .json) name it.
_LOOPBACK = re.compile(rb"http://127\.0\.0\.1:\d+")
# Work folders are named by a hash of their inputs, which include the manifests (the port).
_WORK_KEY = re.compile(rb"/[0-9a-f]{12}/")
# The report shows the run id, the recipe hash, times and durations; and thumbnails of
# rejected samples, which validation takes for the first few rejects per reason to finish in
# its thread pool (tasks/stages/validate.py), so which ones differs from run to run.
_REPORT_VOLATILE = (
    re.compile(rb'(<div class="thumbs">).*?(?=</div>)', re.DOTALL),
    re.compile(rb'(data-meta="(?:run|recipe-hash|started|finished|duration)">)[^<]*'),
    re.compile(rb'(data-col="(?:seconds|samples_per_s)">)[^<]*'),
    re.compile(rb'(<p class="muted">)[^<]* s, [^<]* samples/s(?=</p>)'),
    re.compile(rb"(<title>shardsmith report: \S+ )[^<]*"),
)


def _scrub(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: "<volatile>" if k in VOLATILE_KEYS else _scrub(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_scrub(v) for v in value]
    return value


def _canonical_json(data: bytes) -> bytes:
    return json.dumps(_scrub(json.loads(data)), sort_keys=True, indent=1).encode()


def _parquet(path: Path) -> bytes:
    """The table's rows (Arrow IPC, no metadata), then its schema metadata with JSON values scrubbed."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema.remove_metadata()) as writer:
        writer.write_table(table.replace_schema_metadata(None))
    meta = {k.decode(): _scrub(json.loads(v)) for k, v in (table.schema.metadata or {}).items()}
    return sink.getvalue() + json.dumps(meta, sort_keys=True).encode()


def normalised(path: Path, root: Path, raw_digests: dict[str, str]) -> bytes:
    """The bytes of ``path`` that must not change between two runs of the demo under ``root``.

    ``raw_digests`` (name -> sha256 of files that hold the port) are replaced by their name
    wherever they are recorded: those files are compared on their own.
    """
    if path.suffix == ".json":
        data = _canonical_json(path.read_bytes())
    elif path.suffix == ".parquet":
        data = _parquet(path)
    else:
        data = path.read_bytes()
    if path.suffix == ".html":
        for pattern in _REPORT_VOLATILE:
            data = pattern.sub(rb"\1<volatile>", data)
    for name, digest in raw_digests.items():
        data = data.replace(digest.encode(), f"<sha256 of {name}>".encode())
    data = _LOOPBACK.sub(b"http://127.0.0.1:PORT", data)
    data = _WORK_KEY.sub(b"/<work key>/", data)
    return data.replace(str(root).encode(), b"<root>")


def release_digests(release: Path, root: Path) -> dict[str, str]:
    """sha256 of every file of ``release`` (demo folder ``root``), normalised, by path relative to it."""
    files = sorted(p for p in release.rglob("*") if p.is_file())
    raw = {str(p.relative_to(release)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}
    raw.update(
        {f"manifests/{p.name}": hashlib.sha256(p.read_bytes()).hexdigest() for p in (root / "manifests").iterdir()}
    )
    return {str(p.relative_to(release)): hashlib.sha256(normalised(p, root, raw)).hexdigest() for p in files}
