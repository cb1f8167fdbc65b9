"""The recipe's text privacy check as validation and fine-tuning apply it to one text.

Text (captions, and every turn of a fine-tuning record): tasks/policies/personal.py finds the
spans; ``record`` keeps the text, ``redact`` puts a typed placeholder in each span, ``reject``
refuses the sample (``personal_data``). A text the scanner could not read to its end (a cap on
spans or candidates stopped it; hostile input) is refused under ``redact`` and ``reject`` too:
what it did not read it cannot vouch for. Offsets are into the
text as cleaned, before redaction; values are never written anywhere.

A sample's json carries third parties' text besides its caption: a manifest's extra columns, an
ingested shard's own json (``upstream``) and side-file row (``upstream_row``), where a copy of
the caption may sit unredacted. ``check_fields`` scans every string there under the same rules,
and numbers of six digits or more (as their digits; a field named as a phone makes bare digits a
phone number), and keys (a map keyed by e-mail address: such a key is named ``<key>`` in paths,
so no detail carries it); only ``OWN_FIELDS``, whose values shardsmith sets, are left as they
are. It removes copies of image metadata (``METADATA_FIELDS``: img2dataset's ``exif`` column,
say) wherever they are.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Any

from tasks.formats.recipe_privacy import TextPrivacy
from tasks.policies.personal import Span, describe, find_personal, may_hold_personal, redact

PERSONAL_DATA = "personal_data"
# What a sample's ``privacy`` ledger column lists, in this order: what was done to what is released.
PRIVACY_DONE = ("blurred", "redacted", "metadata")
# Fields of a sample's json whose values shardsmith sets itself, never scanned: the caption is
# checked on its own, the URL is what the sample is known by (recheck and takedown match it).
# Everything else is scanned, shardsmith's provenance included, since third parties name it:
# ``origin`` (file names, tar keys, a column named so), ``id`` (an id column), ``license`` (as
# the source wrote it: released as ``license_raw``), ``side_file``, ``json_unread``.
OWN_FIELDS = frozenset({"key", "source", "row", "url", "caption", "format", "bytes", "sha256"})
# Image metadata copied into a json (img2dataset's ``exif`` column, a tool's ``xmp``): removed
# wherever it is, by its field's name (any case), as the image's own metadata is.
METADATA_FIELDS = frozenset({"exif", "xmp", "iptc", "gps", "gpsinfo", "icc_profile"})
MAX_FIELD_TEXTS = 256  # strings of one json scanned; a json with more is a truncated scan
MAX_FIELD_DEPTH = 8  # nesting of one json scanned; deeper values are a truncated scan


@dataclass(frozen=True)
class FieldsOutcome:
    """A sample's json after the check of its third parties' fields (``check_fields``).

    Args:
        meta: the json to release: redacted where the rules redact, metadata fields removed.
        spans: (field path, span) of each finding, offsets into that field's text.
        removed: paths of the metadata fields removed.
        reason, detail: a refusal (``personal_data``), or None.
        redacted: a field's text was redacted.
        checked: its fields were scanned (a mode other than off).
    """

    meta: dict[str, Any]
    spans: tuple[tuple[str, Span], ...] = ()
    removed: tuple[str, ...] = ()
    reason: str | None = None
    detail: str | None = None
    redacted: bool = False
    checked: bool = False


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
    fields: FieldsOutcome | None = field(default=None, compare=False)  # the json's other fields, where checked

    @property
    def kinds(self) -> str:
        """The ledger's ``personal_data``: kinds found in the caption and the json's fields."""
        found = [*self.spans, *(s for _, s in (self.fields.spans if self.fields else ()))]
        return kinds_of(tuple(found))

    @property
    def scanned(self) -> bool:
        return self.checked or (self.fields is not None and self.fields.checked)


def check_text(
    text: str | None, rules: TextPrivacy, field: str | None = None, phone_field: bool = False
) -> TextOutcome:
    """The privacy check of one text (a caption, a turn, a json field: ``phone_field`` when its
    name says it holds a phone number) under ``rules``."""
    if not text or rules.mode == "off":
        return TextOutcome(text)
    spans = find_personal(text, rules, phone_field)
    truncated = spans.truncated  # a cap stopped the scan: what it did not read it cannot vouch for
    if not spans and not truncated:
        return TextOutcome(text, checked=True)
    if (rules.mode == "reject" and spans) or (rules.mode in ("redact", "reject") and truncated):
        why = describe(spans, field)
        return TextOutcome(text, tuple(spans), PERSONAL_DATA, why, truncated=truncated, checked=True)
    if rules.mode == "redact":
        return TextOutcome(redact(text, spans), tuple(spans), redacted=True, checked=True)
    return TextOutcome(text, tuple(spans), truncated=truncated, checked=True)


def check_fields(meta: dict[str, Any], rules: TextPrivacy) -> FieldsOutcome:
    """``meta`` (a sample's json) with the strings of its third parties' fields checked under
    ``rules`` and its metadata fields removed; the first refusal stops the scan."""
    spans: list[tuple[str, Span]] = []
    removed: list[str] = []
    state = {"texts": 0, "truncated": False, "redacted": False}
    refusal: list[tuple[str, TextOutcome]] = []

    def walk(value: Any, path: str, depth: int, name: str = "") -> Any:
        """``value`` as released; the json itself is at depth 0, its fields at 1."""
        if refusal:
            return value
        if isinstance(value, (dict, list)) and depth > MAX_FIELD_DEPTH:
            state["truncated"] = True
            return value
        if isinstance(value, dict):
            out = {}
            for key, item in value.items():
                if depth == 0 and key in OWN_FIELDS:
                    out[key] = item
                    continue
                key, shown = released_key(key, path)
                if refusal:
                    return value
                here = f"{path}.{shown}" if path else shown
                if key in out:  # two keys redacted alike: the later one numbered
                    key = next(f"{key}#{n}" for n in range(2, len(value) + 2) if f"{key}#{n}" not in out)
                if str(key).lower() in METADATA_FIELDS:
                    if item not in (None, "", [], {}):  # dropped either way; recorded when it held something
                        removed.append(here)
                else:
                    out[key] = walk(item, here, depth + 1, str(key))
            return out
        if isinstance(value, list):
            return [walk(item, f"{path}[{i}]", depth + 1, name) for i, item in enumerate(value)]
        # A number of six digits or more is read as its digits ({"card": 4111111111111111}):
        # under redact its placeholder, a string, takes its place.
        number = isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 100_000
        if not (number or (isinstance(value, str) and value)) or rules.mode == "off":
            return value
        checked = scan(str(value), path, _phone_name(name))
        return checked.text if checked is not None and checked.redacted else value

    def scan(text: str, path: str, phone_field: bool = False) -> TextOutcome | None:
        """``text`` (at ``path``) checked within the json's budget, its findings recorded; None
        when the budget is spent (the scan is truncated) or it refuses the sample."""
        if state["texts"] >= MAX_FIELD_TEXTS:
            state["truncated"] = True
            return None
        state["texts"] += 1
        checked = check_text(text, rules, path, phone_field=phone_field)
        if checked.reason is not None:
            refusal.append((path, checked))
            return None
        spans.extend((path, s) for s in checked.spans)
        state["redacted"] = state["redacted"] or checked.redacted
        return checked

    def released_key(key: Any, path: str) -> tuple[Any, str]:
        """A key as released and as paths name it. Keys are third parties' text too (a
        contacts map keyed by address): one holding personal data is named in paths with its
        spans replaced (so no detail carries it), released so under ``redact``, refuses the
        sample under ``reject``. Only keys with a digit, ``@`` or a URL's start are scanned."""
        if not isinstance(key, str) or rules.mode == "off" or not may_hold_personal(key):
            return key, str(key)
        checked = scan(key, f"{path}.<key>" if path else "<key>")
        if checked is None:
            return key, "<key>"
        if not checked.spans:
            return key, key
        return checked.text, redact(key, checked.spans)

    out = walk(meta, "", 0)
    checked = rules.mode != "off"
    if refusal:  # what it found is recorded (the row's personal_data), as an accepted sample's is
        where, refused = refusal[0]
        found = (*spans, *((where, s) for s in refused.spans))
        return FieldsOutcome(meta, found, reason=refused.reason, detail=refused.detail, checked=checked)
    if state["truncated"] and rules.mode in ("redact", "reject"):
        detail = (
            f"json fields: more than {MAX_FIELD_TEXTS} texts or nested deeper than {MAX_FIELD_DEPTH}: scan truncated"
        )
        return FieldsOutcome(meta, reason=PERSONAL_DATA, detail=detail, checked=checked)
    return FieldsOutcome(out, tuple(spans), tuple(removed), redacted=bool(state["redacted"]), checked=checked)


_PHONE_NAMES = frozenset("phone tel telephone mobile cell fax whatsapp msisdn telefon phonenumber".split())


@functools.lru_cache(maxsize=4096)  # field names repeat from sample to sample
def _phone_name(name: str) -> bool:
    """A json field named as a phone number (``phone``, ``mobileNumber``, ``tel_2``)."""
    words = re.findall(r"[a-z]+", re.sub(r"([a-z])([A-Z])", r"\1 \2", name).lower())
    return any(word in _PHONE_NAMES for word in words)


def span_facts(spans: tuple[Span, ...], field: str | None = None) -> list[dict[str, Any]]:
    """The json record of spans: kind and offsets, never the value."""
    return [{"kind": s.kind, "start": s.start, "end": s.end, **({"field": field} if field else {})} for s in spans]


def record_text(row: dict[str, Any], meta: dict[str, Any], text: TextOutcome) -> None:
    """An accepted sample's record of its text's check (image and video samples alike): the
    ledger row's ``personal_data`` kinds (None where nothing was scanned), the kinds and offsets
    in its json and its row's detail, ``redacted`` and ``metadata`` in its row's ``privacy``.
    ``meta`` is the json to release, its other fields already as ``check_fields`` left them."""
    fields = text.fields
    redacted = text.redacted or (fields is not None and fields.redacted)
    row["personal_data"] = text.kinds if text.scanned else None
    done = set((row["privacy"] or "").split(",")) | ({"redacted"} if redacted else set())
    facts, notes = span_facts(text.spans, "caption"), [describe(text.spans)] if text.spans else []
    if fields is not None:
        by_field: dict[str, list[Span]] = {}
        for path, span in fields.spans:
            by_field.setdefault(path, []).append(span)
        for path, found in by_field.items():
            facts += span_facts(tuple(found), path)
            notes.append(describe(found, path))
        if fields.removed:
            gone = [*meta.get("metadata_removed", []), *(f"json:{p}" for p in fields.removed)]
            meta["metadata_removed"] = list(dict.fromkeys(gone))
            done.add("metadata")
    if facts:
        note = ("redacted: " if redacted else "personal data kept: ") + "; ".join(notes)
        row["detail"] = note if row["detail"] is None else f"{row['detail']}; {note}"
        meta["personal_data"] = facts
    row["privacy"] = ",".join(d for d in PRIVACY_DONE if d in done) or None


def kinds_of(spans: tuple[Span, ...]) -> str:
    """The ledger's ``personal_data`` value: the kinds found, sorted, comma-joined ("" for none)."""
    return ",".join(sorted({s.kind for s in spans}))
