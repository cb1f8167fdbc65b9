"""Per-sample tables of the validation phase: what its gate judges and what its report shows."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from tasks.audit.video_views import KEYFRAME, STRIP, strip_keyframes, with_video_columns
from tasks.formats.ledger import PRIVACY_FACTS, committed, read_ledgers
from tasks.formats.storage import Storage
from tasks.stages.validate import CandidateResult, thumbs_path

REPORT_COLUMNS = ["key", "source", "status", "reason", "license", "width", "height", "caption_chars", "bytes"]


def gate_samples(accepted: pa.Table | None) -> pa.Table:
    """The accepted samples' columns the validation gate judges, with their aspect ratio and
    whether each is released with a face that was not blurred, or with personal data in its
    text that was not redacted (``faces_shown``, ``personal_data_shown``; False where a ledger
    predates the privacy checks)."""
    if accepted is None or accepted.num_rows == 0:
        return pa.table({"key": pa.array([], pa.string())})
    table = _with_aspect(
        accepted.select(["key", "license", "width", "height", "caption_chars", "pixel_sha256", "phash", "bytes"])
    )
    return table.append_column("faces_shown", pa.array(_shown(accepted, "faces", "blurred"), pa.bool_())).append_column(
        "personal_data_shown", pa.array(_shown(accepted, "personal_data", "redacted"), pa.bool_())
    )


def _shown(accepted: pa.Table, found: str, done: str) -> list[bool]:
    """Per row: the ``found`` privacy column says something was found, and ``privacy`` does not say ``done``."""
    if found not in accepted.column_names:
        return [False] * accepted.num_rows
    did = accepted.column("privacy").to_pylist() if "privacy" in accepted.column_names else [None] * accepted.num_rows
    return [bool(f) and done not in (d or "").split(",") for f, d in zip(accepted.column(found).to_pylist(), did)]


def _with_aspect(table: pa.Table) -> pa.Table:
    """Append ``aspect`` = long side / short side (null where a side is unknown)."""
    w = table.column("width").to_pylist()
    h = table.column("height").to_pylist()
    aspect = [max(a, b) / min(a, b) if a and b else None for a, b in zip(w, h)]
    return table.append_column("aspect", pa.array(aspect, pa.float64()))


def report_samples(
    storage: Storage, ledger: pa.Table | None, cands: list[CandidateResult], video_sources: set[str] | None = None
) -> pa.Table | None:
    """Per-sample rows for the report: final verdicts, plus the few thumbnails pass 1 kept (of
    rejected samples, and of accepted ones whose faces were blurred); what the privacy checks
    found and did, where the ledger has it.

    Where there are videos (clips, or rows of ``video_sources``), also each row's video, the
    clip's span and the video's probed facts, for the report's video section, and the small
    keyframes of the clips its strips show (tasks/audit/video_views.py).
    """
    if ledger is None:
        return None
    thumbs: dict[str, bytes] = {}
    files = [thumbs_path(c.table) for c in cands]
    for table in read_ledgers(storage, sorted(committed(storage, files))).values():
        if table is not None:  # committed: always there
            thumbs.update(zip(table.column("key").to_pylist(), table.column("thumbnail").to_pylist()))
    base = _with_aspect(ledger.select(REPORT_COLUMNS + [c for c in PRIVACY_FACTS if c in ledger.column_names]))
    base, shown = with_video_columns(base, ledger, video_sources or set(), thumbs)
    keys = base.column("key").to_pylist()
    base = base.append_column("thumbnail", pa.array([thumbs.get(k) for k in keys], pa.binary()))
    if STRIP not in base.column_names:
        return base
    candidates = [c.table for c in cands if not video_sources or c.source in video_sources]
    frames = strip_keyframes(storage, ledger, candidates, shown, thumbs)
    return base.append_column(KEYFRAME, pa.array([frames.get(k) for k in keys], pa.binary()))


def without_pictures(samples: pa.Table, keys: pa.Array | pa.ChunkedArray) -> pa.Table:
    """``samples`` with no thumbnail or keyframe for ``keys``: what the takedown lists and the
    rechecks removed before the reshard is not shown in the report the release ships."""
    hidden = pc.is_in(samples.column("key"), value_set=pa.array(keys.to_pylist(), pa.string()))
    for name in ("thumbnail", KEYFRAME):
        if name in samples.column_names:
            at = samples.column_names.index(name)
            column = pc.if_else(hidden, pa.scalar(None, samples.schema.field(name).type), samples.column(name))
            samples = samples.set_column(at, name, column)
    return samples
