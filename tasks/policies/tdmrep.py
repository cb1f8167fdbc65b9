"""TDM-Rep (the W3C TDM Reservation Protocol): the ``tdm-reservation`` and ``tdm-policy`` response headers and an origin's ``/.well-known/tdmrep.json``, as verdicts on URLs."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from tasks.policies.ruling import Ruling

TDMREP_PATH = "/.well-known/tdmrep.json"
# The file is read up to this size; a larger one is not read at all (it reserves nothing):
# half a MiB holds thousands of rules, as robots.txt's cap does.
MAX_BYTES = 512 * 1024
# Rules past this many are ignored (each URL is matched against the rules in order).
MAX_RULES = 1000
# A location longer than this is a bad pattern, skipped like any other.
MAX_PATTERN_CHARS = 2048
_SHOWN = 300  # characters of a policy URL or a location in a detail

# RFC 3986 unreserved characters: only their percent-encodings are decoded before matching.
_UNRESERVED_ESCAPE = re.compile(r"%(2[dDeE]|3[0-9]|[46][1-9a-fA-F]|[57][0-9aA]|5[fF]|7[eE])")


def _decode_unreserved(text: str) -> str:
    return _UNRESERVED_ESCAPE.sub(lambda m: chr(int(m[1], 16)), text)


def _shown(text: str) -> str:
    """A value from the web for a detail: printable, and not longer than a line."""
    text = "".join(c if c.isprintable() else "?" for c in text[: _SHOWN + 1])
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."


def reservation(value: Any) -> int | None:
    """A ``tdm-reservation`` value: 1 (reserved), 0 (not reserved) or None (unset: absent, or
    any other value, which the protocol counts as unset). JSON booleans are not numbers here."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value in (0, 1) else None
    if isinstance(value, str) and value.strip() in ("0", "1"):
        return int(value.strip())
    return None


def _policy(value: Any) -> str | None:
    return _shown(value.strip()) if isinstance(value, str) and value.strip() else None


def _reserved(where: str, policy: str | None) -> Ruling[str]:
    """A reservation: ``opted_out``, the policy as the value and in the detail."""
    named = f"tdm-policy {policy}" if policy else "no tdm-policy"
    return Ruling(policy, "opted_out", f"TDM-Rep: {where} reserves TDM rights ({named})")


def path_of(url: str) -> str:
    """The path and query of a URL as TDM-Rep matches them: escapes of unreserved characters decoded."""
    parts = urlsplit(url)
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    return _decode_unreserved(path)


@dataclass(frozen=True)
class TdmRule:
    """One rule of a tdmrep.json: its location pattern (compiled) and what it declares.

    Args:
        location: the pattern as the file gave it (for details).
        reserved: the rule's ``tdm-reservation`` (None: unset, also for an invalid value).
        policy: its ``tdm-policy`` URL, or None.
    """

    location: str
    reserved: int | None
    policy: str | None

    @property
    def pattern(self) -> str:
        """The location as it is matched: escapes of unreserved characters decoded, as in paths."""
        return _decode_unreserved(self.location)


def pattern_matches(pattern: str, path: str) -> bool:
    """Whether a robots.txt-style pattern matches a path from its start: ``*`` is any run of
    characters, a final ``$`` anchors the end; otherwise the pattern is a prefix.

    The literal pieces between ``*`` are found left to right, each at its first place after the
    one before (the first place is always as good as any later one), so a hostile pattern of
    many stars costs string searches, not the backtracking of a regular expression.
    """
    anchored = pattern.endswith("$")
    if anchored:
        pattern = pattern[:-1]
    pieces = pattern.split("*")
    if not path.startswith(pieces[0]):
        return False
    at = len(pieces[0])
    if len(pieces) == 1:
        return at == len(path) if anchored else True
    for piece in pieces[1:-1]:
        found = path.find(piece, at)
        if found < 0:
            return False
        at = found + len(piece)
    last = pieces[-1]
    if anchored:
        return path.endswith(last) and len(path) - len(last) >= at
    return path.find(last, at) >= 0


class TdmRules:
    """One origin's ``/.well-known/tdmrep.json``, as verdicts on URLs.

    The file is a JSON array of rules ``{"location", "tdm-reservation", "tdm-policy"}``; the
    first rule whose location matches a URL's path decides (the protocol's "most specific match
    is the first in sequence"); no match is no reservation. A file that cannot be read or
    parsed reserves nothing, and bad rules (not an object, a location that is not a pattern
    starting with ``/`` or ``*``, or longer than ``MAX_PATTERN_CHARS``) are skipped; the first
    ``MAX_RULES`` rules count.

    Args:
        rules: the usable rules, in file order.
        where: the file's URL (or why there is none), for details.
        note: what was wrong with the file, if anything (for logs and tests).
    """

    def __init__(self, rules: list[TdmRule], where: str, note: str | None = None):
        self.rules, self.where, self.note = rules, where, note
        self._patterns = [rule.pattern for rule in rules]

    @classmethod
    def none(cls, why: str) -> TdmRules:
        """No rules: the origin has no usable file (``why`` says what happened)."""
        return cls([], why, why)

    @classmethod
    def parse(cls, body: bytes, where: str) -> TdmRules:
        """The rules of a file's bytes; never raises (a malformed file has no rules)."""
        if len(body) > MAX_BYTES:
            return cls.none(f"{where} is over {MAX_BYTES} bytes: ignored")
        try:
            data = json.loads(body.decode("utf-8-sig"))
        except (ValueError, RecursionError) as err:  # bad UTF-8 or JSON, nesting too deep, huge numbers
            return cls.none(f"{where} is not valid JSON ({type(err).__name__}): ignored")
        if not isinstance(data, list):
            return cls.none(f"{where} is not a JSON array: ignored")
        rules: list[TdmRule] = []
        skipped = 0
        for item in data[:MAX_RULES]:
            location = item.get("location") if isinstance(item, dict) else None
            if (
                not isinstance(location, str)
                or not location.startswith(("/", "*"))
                or len(location) > MAX_PATTERN_CHARS
            ):
                skipped += 1
                continue
            rules.append(TdmRule(location, reservation(item.get("tdm-reservation")), _policy(item.get("tdm-policy"))))
        notes = [f"{skipped} bad rules skipped"] if skipped else []
        if len(data) > MAX_RULES:
            notes.append(f"rules after the first {MAX_RULES} ignored")
        return cls(rules, where, "; ".join(notes) or None)

    def rule_for(self, url: str) -> TdmRule | None:
        """The first rule whose location matches ``url``'s path, or None."""
        path = path_of(url)
        return next((rule for rule, pattern in zip(self.rules, self._patterns) if pattern_matches(pattern, path)), None)

    def verdict(self, url: str) -> Ruling[str]:
        """Whether the file reserves TDM rights on ``url``: ``opted_out`` when the first matching
        rule's ``tdm-reservation`` is 1, the detail naming the file, the rule and the policy."""
        rule = self.rule_for(url)
        if rule is None or rule.reserved != 1:
            return Ruling()
        return _reserved(f"{self.where} (location {_shown(rule.location)!r})", rule.policy)


def header_verdict(reservations: list[str], policies: list[str]) -> Ruling[str] | None:
    """The verdict of a response's ``tdm-reservation`` and ``tdm-policy`` header values, or None
    when they leave it unset (no header, or no valid value), so that tdmrep.json decides.

    A header supersedes the file: ``tdm-reservation: 0`` lifts a reservation the file made. Of
    several values, a 1 wins over a 0.
    """
    values = {reservation(part) for value in reservations for part in value.split(",")} - {None}
    if not values:
        return None
    if 1 not in values:
        return Ruling()
    policy = next((p for value in policies if (p := _policy(value)) is not None), None)
    return _reserved("the tdm-reservation: 1 header", policy)


def tdm_verdict(reservations: list[str], policies: list[str], rules: TdmRules | None, url: str) -> Ruling[str]:
    """TDM-Rep's verdict on one response: its headers where they decide, else the origin's file."""
    header = header_verdict(reservations, policies)
    if header is not None:
        return header
    return rules.verdict(url) if rules is not None else Ruling()
