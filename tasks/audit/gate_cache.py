"""Passed gates (and dedup decisions) remembered by their inputs, so a rerun over unchanged outputs does not judge them again.

A gate is a deterministic function of the files it reads (ledgers, shard records) and of its
thresholds. When a phase's gate passed on exactly these files (same names, sizes and
modification stamps) and these settings, a rerun reuses that verdict: it is copied into the
new run's report with the run that evaluated it, whose Great Expectations Data Docs stay
where they are. A file rewritten in place (a ledger deleted and committed again) changes its
stamp, and the gate runs again. Failed gates are never reused.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from typing import Any

from pydantic import BaseModel

from tasks.formats.storage import Storage

VERSION = 1  # bump when a gate's checks change, so no older verdict is reused


def stamps(storage: Storage, rels: list[str]) -> list[tuple[str, int, str]]:
    """(path, size, modification stamp) of each file, from one listing per folder.

    Raises FileNotFoundError when one is missing: a gate over missing files cannot be reused.
    """
    by_folder: dict[str, list[str]] = {}
    for rel in rels:
        by_folder.setdefault(posixpath.dirname(rel), []).append(rel)
    found: dict[str, tuple[int, str]] = {}
    for folder, wanted in by_folder.items():
        try:
            entries = storage.fs.ls(storage.path(folder), detail=True)
        except FileNotFoundError:
            entries = []
        listed = {posixpath.basename(e["name"].rstrip("/")): e for e in entries}
        for rel in wanted:
            entry = listed.get(posixpath.basename(rel))
            if entry is None:
                raise FileNotFoundError(storage.url(rel))
            stamp = entry.get("ETag") or entry.get("LastModified") or entry.get("mtime") or entry.get("created") or ""
            found[rel] = (int(entry.get("size") or 0), str(stamp))
    return [(rel, *found[rel]) for rel in rels]


def gate_key(phase: str, files: list[tuple[str, int, str]], *settings: Any) -> str:
    """Digest of a gate's inputs: the phase, its files' stamps and its settings."""
    plain = [s.model_dump(mode="json") if isinstance(s, BaseModel) else s for s in settings]
    blob = json.dumps([VERSION, phase, files, plain], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def _path(dataset: str, phase: str, key: str) -> str:
    return f"{dataset}/gates/{phase}-{key}.json"


def recall_value(storage: Storage, dataset: str, kind: str, key: str) -> Any | None:
    """A JSON value remembered for ``kind`` (e.g. ``dedup``) under ``key``, or None."""
    try:
        return json.loads(storage.read_bytes(f"{dataset}/state/{kind}-{key}.json"))["value"]
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None


def remember_value(storage: Storage, dataset: str, kind: str, key: str, value: Any) -> None:
    """Keep a JSON value that is a function of the files and settings ``key`` digests."""
    storage.write_bytes(
        f"{dataset}/state/{kind}-{key}.json", json.dumps({"value": value}, sort_keys=True).encode(), fsync=False
    )


def recall(storage: Storage, dataset: str, phase: str, key: str) -> tuple[Any, str] | None:
    """(GateResult, run that evaluated it) of a passed gate with these inputs, or None."""
    from tasks.audit.gate_results import GateResult

    try:
        data = json.loads(storage.read_bytes(_path(dataset, phase, key)))
        return GateResult.from_json(data["gate"]), str(data["run"])
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None


def remember(storage: Storage, dataset: str, phase: str, key: str, gate: Any, run: str) -> None:
    """Keep a passed gate's verdict for later runs over the same inputs."""
    if not gate.success:
        return
    payload = {"run": run, "gate": gate.to_json()}
    storage.write_bytes(
        _path(dataset, phase, key), json.dumps(payload, sort_keys=True, default=str).encode(), fsync=False
    )
