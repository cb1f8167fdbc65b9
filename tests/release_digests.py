"""Digests of a demo release's files with each run's own facts (times, ids, port, paths) normalised out (no tests here)."""

from __future__ import annotations

import hashlib
import io
import json
import re
from collections.abc import Iterator
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
# Release shards are named by a digest of their content (shard-{digest8}-NNNNNN.tar), which
# holds the samples' .json, so the port too.
_SHARD_DIGEST = re.compile(r"shard-[0-9a-f]{8}-(?=\d{6}|\{)")


def _name(rel: str) -> str:
    """A release file's path with its shard digest normalised out."""
    return _SHARD_DIGEST.sub("shard-<digest>-", rel)


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


# Floats a CPU's kernels decide in their last bits (the precache gate's channel statistics,
# computed from the latents): compared apart, with a tolerance (release_floats).
FLOAT_STATS = frozenset({"mean", "std"})


def _scrub(value: Any, parent: str = "", where: str = "", floats: dict[str, float] | None = None) -> Any:
    """``value`` with volatile values and float statistics replaced; the float statistics go
    into ``floats`` (when given) by their path, ``where`` being the path of ``value``."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if k in VOLATILE_KEYS:
                out[k] = "<volatile>"
            elif parent == "channels" and k in FLOAT_STATS:
                out[k] = "<float>"
                if floats is not None and isinstance(v, float):
                    floats[f"{where}.{k}"] = v
            else:
                out[k] = _scrub(v, k, f"{where}.{k}", floats)
        return out
    if isinstance(value, list):
        return [_scrub(v, parent, f"{where}[{i}]", floats) for i, v in enumerate(value)]
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
    elif path.suffix == ".tar" and path.parent.name == "latents":
        data = _latents_layout(path)
    else:
        data = path.read_bytes()
    if path.suffix == ".html":
        for pattern in _REPORT_VOLATILE:
            data = pattern.sub(rb"\1<volatile>", data)
    for name, digest in raw_digests.items():
        data = data.replace(digest.encode(), f"<sha256 of {name}>".encode())
    data = _LOOPBACK.sub(b"http://127.0.0.1:PORT", data)
    data = _WORK_KEY.sub(b"/<work key>/", data)
    data = re.compile(_SHARD_DIGEST.pattern.encode()).sub(b"shard-<digest>-", data)
    return data.replace(str(root).encode(), b"<root>")


def release_digests(release: Path, root: Path) -> dict[str, str]:
    """sha256 of every file of ``release`` (demo folder ``root``), normalised, by path relative to it."""
    files = sorted(p for p in release.rglob("*") if p.is_file())
    raw = {str(p.relative_to(release)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}
    raw.update(
        {f"manifests/{p.name}": hashlib.sha256(p.read_bytes()).hexdigest() for p in (root / "manifests").iterdir()}
    )
    return {_name(str(p.relative_to(release))): hashlib.sha256(normalised(p, root, raw)).hexdigest() for p in files}


# Torch does not promise the same float bits on every CPU: its kernels (oneDNN's convolutions,
# MKL's matrix products) pick their vector width and blocking by the CPU's instructions and
# caches, so the tiny encoders' outputs differ in their last bits from one machine to another
# (an AMD EPYC and an Intel Xeon with AVX-512 both did, against digests written on an AVX2
# machine, with oneDNN and ATen pinned to AVX2). The latents are compared in two parts: their
# layout byte for byte (members, sizes, dtypes, shapes, and every array that is not floats),
# their values within a tolerance.
FLOAT_REL_TOL = 1e-3
FLOAT_ABS_TOL = 1e-4


def _latent_members(path: Path) -> Iterator[tuple[str, bytes, Any]]:
    """(name, bytes, the array when it holds floats, else None) of each member of a latents tar."""
    import tarfile

    import numpy as np

    with tarfile.open(path) as tar:  # our own test output
        for member in tar:
            data = tar.extractfile(member).read() if member.isfile() else b""
            array = np.load(io.BytesIO(data)) if member.name.endswith(".npy") else None
            yield member.name, data, array if array is not None and array.dtype.kind == "f" else None


def _latents_layout(path: Path) -> bytes:
    out = []
    for name, data, array in _latent_members(path):
        if array is None:
            out.append(name.encode() + b" " + hashlib.sha256(data).hexdigest().encode())
        else:
            out.append(f"{name} {array.dtype.str} {array.shape} <floats>".encode())
    return b"\n".join(out)


def release_floats(release: Path) -> dict[str, float]:
    """The values the digests leave out (see above), by name: each float array's mean and root
    mean square, and the channel statistics of the JSON files."""
    import numpy as np

    out: dict[str, float] = {}
    for tar in sorted((release / "latents").glob("*.tar")):
        for name, _, array in _latent_members(tar):
            if array is not None:
                values = array.astype(np.float64)
                out[_name(f"latents/{tar.name}/{name}:mean")] = float(values.mean())
                out[_name(f"latents/{tar.name}/{name}:rms")] = float(np.sqrt((values**2).mean()))
    for path in sorted(release.rglob("*.json")):
        _scrub(json.loads(path.read_bytes()), where=str(path.relative_to(release)), floats=out)
    return out


def floats_differ(golden: dict[str, float], got: dict[str, float]) -> list[str]:
    """Names whose values differ beyond the tolerance, or that one side lacks."""
    import math

    names = sorted(golden.keys() | got.keys())
    return [
        n
        for n in names
        if n not in golden
        or n not in got
        or not math.isclose(golden[n], got[n], rel_tol=FLOAT_REL_TOL, abs_tol=FLOAT_ABS_TOL)
    ]
