"""The report's privacy section: what the privacy checks found and did, and a few blurred samples.

Read from the per-sample table of the validation phase (``report_samples``), whose rows carry
the ledger's privacy columns (tasks/formats/ledger.py ``PRIVACY_FACTS``): ``faces`` (found in
the image; null where not looked for), ``personal_data`` (kinds found in the text, "" for none,
null where not looked for) and ``privacy`` (what was done: blurred, redacted, metadata).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pyarrow as pa

from tasks.audit.report_views import image_uri
from tasks.formats.reasons import OK


def privacy_counts(ledger: pa.Table | None) -> dict[str, int]:
    """Samples with faces found and released blurred, with personal data found and released
    redacted, and released with metadata removed from bytes kept as fetched (the run summary's
    line); empty where the ledger has no privacy columns."""
    if ledger is None or not {"faces", "personal_data", "privacy"} <= set(ledger.column_names):
        return {}
    rows = ledger.select(["status", "faces", "personal_data", "privacy"]).to_pylist()
    done = Counter(d for r in rows if r["status"] == OK for d in (r["privacy"] or "").split(",") if d)
    return {
        "with_faces": sum(1 for r in rows if r["faces"]),
        "blurred": done["blurred"],
        "with_personal_data": sum(1 for r in rows if r["personal_data"]),
        "redacted": done["redacted"],
        "metadata_removed": done["metadata"],
    }


def privacy_view(samples: pa.Table | None, cap: int) -> dict[str, Any] | None:
    """Counts per outcome and kind, and up to ``cap`` thumbnails of blurred samples; None where
    no privacy check ran (a table without the columns, or one where nothing was looked at)."""
    if samples is None or not {"faces", "personal_data", "privacy"} <= set(samples.column_names):
        return None
    rows = samples.select(
        [
            c
            for c in ("key", "status", "reason", "faces", "personal_data", "privacy", "thumbnail")
            if c in samples.column_names
        ]
    ).to_pylist()
    looked_faces = [r for r in rows if r["faces"] is not None]
    looked_text = [r for r in rows if r["personal_data"] is not None]
    if not looked_faces and not looked_text and not any(r["privacy"] for r in rows):
        return None
    counts = privacy_counts(samples)
    kinds = Counter(k for r in looked_text for k in r["personal_data"].split(",") if k)
    refused = Counter(str(r["reason"]) for r in rows if r["reason"] in ("face_present", "personal_data"))
    outcomes = [
        ("images looked at for faces", len(looked_faces)),
        ("with a face", counts["with_faces"]),
        ("faces found", sum(r["faces"] for r in looked_faces)),
        ("released blurred", counts["blurred"]),
        ("refused: face_present", refused["face_present"]),
        ("texts scanned for personal data", len(looked_text)),
        ("with personal data", counts["with_personal_data"]),
        ("released redacted", counts["redacted"]),
        ("refused: personal_data", refused["personal_data"]),
        ("released with metadata removed from bytes kept as fetched", counts["metadata_removed"]),
    ]
    figs: list[dict[str, Any]] = []
    for r in sorted(rows, key=lambda r: str(r["key"])):
        uri = image_uri(r.get("thumbnail")) if r["status"] == OK and "blurred" in (r["privacy"] or "") else None
        if uri is not None and len(figs) < cap:
            figs.append({"key": r["key"], "faces": r["faces"], "uri": uri})
    return {"outcomes": outcomes, "kinds": sorted(kinds.items()), "blurred": figs, "cap": cap}
