"""The recipe's text privacy check as validation and fine-tuning apply it to one text.

Text (captions, and every turn of a fine-tuning record): tasks/policies/personal.py finds the
spans; ``record`` keeps the text, ``redact`` puts a typed placeholder in each span, ``reject``
refuses the sample (``personal_data``). A text the scanner could not read to its end (a cap on
spans or candidates stopped it; hostile input) is refused under ``redact`` and ``reject`` too:
what it did not read it cannot vouch for. Offsets are into the
text as cleaned, before redaction; values are never written anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tasks.formats.recipe_privacy import TextPrivacy
from tasks.policies.personal import Span, describe, find_personal, redact

PERSONAL_DATA = "personal_data"
# What a sample's ``privacy`` ledger column lists, in this order: what was done to what is released.
PRIVACY_DONE = ("blurred", "redacted", "metadata")


@dataclass(frozen=True)
class TextOutcome:
    """One text after the check: what is released, what was found, a refusal or None."""

    text: str | None
    spans: tuple[Span, ...] = ()
    reason: str | None = None
    detail: str | None = None
    redacted: bool = False
    truncated: bool = False
    checked: bool = False  # the text was scanned (a text, and a mode other than off)


def check_text(text: str | None, rules: TextPrivacy, field: str | None = None) -> TextOutcome:
    """The privacy check of one text (a caption, a turn) under ``rules``."""
    if not text or rules.mode == "off":
        return TextOutcome(text)
    spans = find_personal(text, rules)
    truncated = spans.truncated  # a cap stopped the scan: what it did not read it cannot vouch for
    if not spans and not truncated:
        return TextOutcome(text, checked=True)
    if (rules.mode == "reject" and spans) or (rules.mode in ("redact", "reject") and truncated):
        why = describe(spans, field)
        return TextOutcome(text, tuple(spans), PERSONAL_DATA, why, truncated=truncated, checked=True)
    if rules.mode == "redact":
        return TextOutcome(redact(text, spans), tuple(spans), redacted=True, checked=True)
    return TextOutcome(text, tuple(spans), truncated=truncated, checked=True)


def span_facts(spans: tuple[Span, ...], field: str | None = None) -> list[dict[str, Any]]:
    """The json record of spans: kind and offsets, never the value."""
    return [{"kind": s.kind, "start": s.start, "end": s.end, **({"field": field} if field else {})} for s in spans]


def record_text(row: dict[str, Any], meta: dict[str, Any], text: TextOutcome) -> None:
    """An accepted sample's record of its caption's check (image and video samples alike): the
    ledger row's ``personal_data`` kinds (None where the text was not scanned), the kinds and
    offsets in its json and its row's detail, ``redacted`` in its row's ``privacy``."""
    row["personal_data"] = kinds_of(text.spans) if text.checked else None
    if not text.spans:
        return
    note = ("redacted: " if text.redacted else "personal data kept: ") + describe(text.spans)
    row["detail"] = note if row["detail"] is None else f"{row['detail']}; {note}"
    meta["personal_data"] = span_facts(text.spans, "caption")
    if text.redacted:
        done = {"redacted", *(row["privacy"] or "").split(",")}
        row["privacy"] = ",".join(d for d in PRIVACY_DONE if d in done)


def kinds_of(spans: tuple[Span, ...]) -> str:
    """The ledger's ``personal_data`` value: the kinds found, sorted, comma-joined ("" for none)."""
    return ",".join(sorted({s.kind for s in spans}))
