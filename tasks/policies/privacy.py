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


def kinds_of(spans: tuple[Span, ...]) -> str:
    """The ledger's ``personal_data`` value: the kinds found, sorted, comma-joined ("" for none)."""
    return ",".join(sorted({s.kind for s in spans}))
