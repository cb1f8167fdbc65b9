"""License strings normalised to SPDX ids and judged against the recipe's policy."""

from __future__ import annotations

import datetime as dt
import functools
import re
import unicodedata
from urllib.parse import urlsplit

from tasks.formats.recipe_download import LicensePolicy
from tasks.policies.license_names import (  # noqa: F401 - re-exported: the names are part of this module's API
    ALL_RIGHTS_RESERVED,
    DEPRECATED_IDS,
    LICENSE_ALIASES,
    LICENSE_REFS,
    MISSING_VALUES,
    PUBLIC_DOMAIN,
    SPDX_KNOWN,
    SPDX_LISTED,
)
from tasks.policies.ruling import Ruling
from tasks.policies.spdx import (
    UNKNOWN,
    UNKNOWN_EXCEPTION,
    blockers,
    is_choice_or_combination,
    is_expression,
    listed_license,
    looks_like_expression,
    normalize_expression,
)

_BY_LOWER = {i.lower(): i for i in SPDX_KNOWN}


def _rewrites(*pairs: tuple[str, str]) -> tuple[tuple[re.Pattern[str], str], ...]:
    """(compiled pattern, replacement) pairs, applied in order."""
    return tuple((re.compile(p), r) for p, r in pairs)


# Rewrites applied before compaction, in order: long names to the short forms the alias
# table uses, "or later" to "+", and words that never change which license is meant.
_PHRASES = _rewrites(
    (r"\bgnu\s+free\s+documentation\b|\bfree\s+documentation\b|\bgnu\s+fdl\b", " gfdl "),
    (r"\bgnu\s+lesser\s+general\s+public\b|\blesser\s+general\s+public\b", " lgpl "),
    (r"\bgnu\s+affero\s+general\s+public\b|\baffero\s+general\s+public\b", " agpl "),
    (r"\bgnu\s+general\s+public\b|\bgeneral\s+public\b", " gpl "),
    (r"\bgnu\s+(?=[al]?gpl)", " "),
    (r"\bcreative\s+commons\b", " cc "),
    (r"\bor\s+(?:any\s+)?(?:later|newer)(?:\s+version)?\b|\bor-later\b", "+"),
    (r"\b(?:the|licen[cs]e[ds]?|version|only|software|universal|international|generic|unported)\b", " "),
    (r"(\d)\.0(?![\d.])", r"\1"),
)


def _compact(text: str) -> str:
    """Lowercased key with separators, filler words and trailing ``.0`` versions removed."""
    t = text.lower()
    for pattern, repl in _PHRASES:
        t = pattern.sub(repl, t)
    t = re.sub(r"[^a-z0-9.+]", "", t)
    # "gplv3", "apachev2": a "v" glued between a name and its version says nothing more
    return re.sub(r"(?<=[a-z])v(?=\d)", "", t)


_ALIASES: dict[str, str] = {_compact(k): v for k, v in LICENSE_ALIASES.items()}
# Every listed id also answers to its own compacted form ("apache-2", "cc-by-sa-4").
_ALIASES.update({_compact(i): i for i in SPDX_LISTED if _compact(i) not in _ALIASES})

_LICENSE_REF = re.compile(r"^licenseref-[a-z0-9.-]+$", re.IGNORECASE)
_WIKIMEDIA_PD = re.compile(r"^pd[-_ ][a-z0-9 _.-]+$", re.IGNORECASE)  # PD-old, PD-US, PD-self
_ARR_MARK = re.compile(r"all\s+rights\s+reserved|©|\(c\)|\bcopyright(?:ed)?\b", re.IGNORECASE)
# Words that say a license is being granted; with them a copyright notice is not "all rights
# reserved" but a license we failed to parse, so it stays unknown.
_GRANT_WORDS = re.compile(
    r"licen[cs]|creative\s*commons|\bcc\b|\bcc[-_ ]?by|\bcc0\b|gpl|\bmit\b|apache|\bbsd\b|public\s+domain",
    re.IGNORECASE,
)

# Creative Commons element words, long forms first so "non commercial" is not read as two words.
_CC_WORDS = _rewrites(
    (r"creative\s*commons", " cc "),
    (r"share[\s_-]*alike", " sa "),
    (r"\bnon[\s_-]*commercial", " nc "),
    (r"\bno[\s_-]*deriv(?:ative)?s?(?:[\s_-]*works)?", " nd "),
    (r"attribution", " by "),
)
_CC_FILLER = frozenset(
    {
        "cc",
        "license",
        "licence",
        "licensed",
        "international",
        "generic",
        "unported",
        "version",
        "v",
        "ver",
        "the",
        "under",
        "a",
        "deed",
        "legalcode",
        "public",
    }
)
_CC_ELEMENTS = ("by", "nc", "nd", "sa")
_CC_GLUED = re.compile(r"^(?:cc)?((?:by|nc|nd|sa)+)$")
_CC_VERSION = re.compile(r"^\d(?:\.\d)?$")
_CC_PORT = re.compile(r"^(?:[a-z]{2}|igo)$")


def _cc_id(elements: set[str], version: str | None, port: str | None) -> str:
    """SPDX id for a CC BY-family license, the unported id when SPDX lacks the port, else UNKNOWN."""
    if not elements or version is None or {"nd", "sa"} <= elements:
        return UNKNOWN
    if "." not in version:
        version += ".0"
    base = "CC-" + "-".join(e.upper() for e in _CC_ELEMENTS if e in elements) + "-" + version
    if port and f"{base}-{port.upper()}" in SPDX_LISTED:
        return f"{base}-{port.upper()}"
    # SPDX lists only some ports; the others are the same grant translated into a
    # jurisdiction's law, so the unported id is the closest listed license.
    return base if base in SPDX_LISTED else UNKNOWN


def _parse_cc(text: str) -> str | None:
    """A CC BY-family license written in words, or None when the text is not one."""
    t = text.lower()
    for pattern, repl in _CC_WORDS:
        t = pattern.sub(repl, t)
    t = re.sub(r"(?<=[a-z])(?=\d)", " ", t)  # "by4.0" -> "by 4.0"
    tokens = [tok for tok in re.split(r"[\s,;:/()_\-]+", t) if tok]
    elements: set[str] = set()
    version: str | None = None
    port: str | None = None
    for tok in tokens:
        glued = _CC_GLUED.match(tok)
        if glued:
            run = glued.group(1)
            elements.update(run[i : i + 2] for i in range(0, len(run), 2))
        elif tok in _CC_FILLER:
            continue
        elif _CC_VERSION.match(tok) and version in (None, tok):
            version = tok
        elif _CC_PORT.match(tok) and port is None:
            port = tok
        else:
            # Leftover words mean a string we do not fully understand; guessing would let
            # "CC BY 4.0 except commercial use" through as CC-BY-4.0.
            return None
    if not elements:
        return None
    return _cc_id(elements, version, port)


def _from_url(url: str) -> str:
    """The license a URL points at, or UNKNOWN."""
    parts = urlsplit(url if "://" in url else "https://" + url)
    host = (parts.hostname or "").removeprefix("www.")
    segs = [s for s in parts.path.lower().split("/") if s and not s.startswith(("deed", "legalcode"))]
    if host == "creativecommons.org" and segs:
        if segs[0] == "publicdomain" and len(segs) >= 2:
            return {"zero": "CC0-1.0", "mark": "CC-PDM-1.0"}.get(segs[1], UNKNOWN)
        if segs[0] == "licenses" and len(segs) >= 2:
            if segs[1] == "publicdomain":
                return "CC-PDDC"
            elements = set(segs[1].split("-"))
            if not elements <= set(_CC_ELEMENTS):
                return UNKNOWN
            version = segs[2] if len(segs) >= 3 and _CC_VERSION.match(segs[2]) else None
            port = segs[3] if len(segs) >= 4 and _CC_PORT.match(segs[3]) else None
            return _cc_id(elements, version, port)
        return UNKNOWN
    if host in ("spdx.org", "opensource.org") and len(segs) >= 2 and segs[0] in ("licenses", "license"):
        name = re.sub(r"\.(html?|php|txt|json)$", "", segs[-1]).removesuffix("-license")
        found = _normalize_text(name)
        return found if found is not None else UNKNOWN
    if host == "apache.org" and segs[-1:] and segs[-1].startswith("license-2.0"):
        return "Apache-2.0"
    if host == "gnu.org" and len(segs) >= 2 and segs[0] == "licenses":
        name = re.sub(r"(\.en)?\.(html?|txt)$", "", segs[1])
        return DEPRECATED_IDS.get(name.replace("fdl", "gfdl", 1) if name.startswith("fdl") else name, UNKNOWN)
    if host == "opendatacommons.org" and len(segs) >= 2 and segs[0] == "licenses":
        return {"odbl": "ODbL-1.0", "by": "ODC-By-1.0", "pddl": "PDDL-1.0"}.get(segs[1], UNKNOWN)
    if host == "nationalarchives.gov.uk" and "open-government-licence" in segs:
        version = segs[-1] if segs[-1].isdigit() else ""
        return {"3": "OGL-UK-3.0", "2": "OGL-UK-2.0"}.get(version, UNKNOWN)
    if host == "rightsstatements.org" and len(segs) >= 2 and segs[1] == "inc":
        return ALL_RIGHTS_RESERVED
    if host == "unlicense.org":
        return "Unlicense"
    return UNKNOWN


def _normalize_text(text: str) -> str | None:
    """Exact ids, deprecated ids, CC words and aliases; None when nothing matched."""
    lower = text.lower()
    if lower in _BY_LOWER:
        return _BY_LOWER[lower]
    if lower in DEPRECATED_IDS:
        return DEPRECATED_IDS[lower]
    cc = _parse_cc(text)
    if cc is not None:
        return cc
    # The alias table first ("BSD 3-Clause New or Revised"), then every other id on the SPDX
    # License List, as license-expression ships it.
    return _ALIASES.get(_compact(text)) or listed_license(text)


def normalize_license(raw: str | None) -> str | None:
    """Normalise a manifest's license value to an SPDX id or SPDX expression.

    Args:
        raw: the value as written: an SPDX id in any case, a name ("CC BY-SA 3.0 DE",
            "Apache License, Version 2.0", "Attribution 4.0 International"), a license URL
            (creativecommons.org, spdx.org, opensource.org, gnu.org, apache.org,
            opendatacommons.org), a copyright notice, or an SPDX expression of any of these
            joined by AND, OR and WITH, with parentheses ("MIT OR Apache-2.0",
            "CC BY 4.0 AND ODbL-1.0", "GPL-2.0-or-later WITH Classpath-exception-2.0").

    Returns:
        None when the value is missing: None, blank, or a null spelling in MISSING_VALUES
        ("n/a", "unknown", "nan", ...). Otherwise an id from the SPDX License List,
        ``LicenseRef-Public-Domain``, ``LicenseRef-All-Rights-Reserved``, any other
        ``LicenseRef-*`` passed through as written, or UNKNOWN (``LicenseRef-Unknown``) for a
        value that is present but not recognised. Deprecated SPDX ids become their current
        form (``GPL-3.0`` -> ``GPL-3.0-only``); a CC port SPDX does not list becomes the
        unported id (``CC BY 3.0 FR`` -> ``CC-BY-3.0``); a CC license without a version is
        UNKNOWN, since the versions grant different terms. An expression comes back as
        license-expression renders it, each part normalised (``mit or CC BY 4.0`` ->
        ``MIT OR CC-BY-4.0``), unrecognised parts as ``LicenseRef-Unknown`` (exceptions:
        ``AdditionRef-Unknown``); one with no recognised license at all is UNKNOWN.
        A value that is not a string is never read as text (``str(["MIT"])`` would pass as
        MIT): a float NaN (a dataframe's null) is missing, anything else UNKNOWN.
    """
    if raw is None:
        return None
    if not isinstance(raw, str):
        return None if isinstance(raw, float) and raw != raw else UNKNOWN
    text = raw
    # Long values are free text, not repeated license names: not worth a cache slot.
    return _normalize(text) if len(text) <= 256 else _normalize.__wrapped__(text)


# A manifest repeats a handful of license strings across millions of rows.
@functools.lru_cache(maxsize=4096)
def _normalize(raw: str) -> str | None:
    text = " ".join(unicodedata.normalize("NFKC", raw).split()).strip("\"'` ").rstrip(".")
    if text.lower() in MISSING_VALUES:
        return None
    if _LICENSE_REF.match(text):
        return _BY_LOWER.get(text.lower(), text)
    if re.match(r"^(?:https?://|www\.|[a-z0-9.-]+\.(?:org|com|net|gov\.uk)/)", text, re.IGNORECASE):
        return _from_url(text)
    found = _normalize_text(text)
    if found is not None:
        return found
    if looks_like_expression(text):
        expression = normalize_expression(text, _normalize)
        if expression is not None:
            return expression
    if _WIKIMEDIA_PD.match(text):
        return PUBLIC_DOMAIN
    if _ARR_MARK.search(text) and not _GRANT_WORDS.search(_ARR_MARK.sub(" ", text)):
        return ALL_RIGHTS_RESERVED
    return UNKNOWN


@functools.lru_cache(maxsize=64)
def _allowed(allow: tuple[str, ...]) -> frozenset[str]:
    # Entries that do not normalise are reported by policy_problems; here they match nothing.
    ids = (normalize_license(a) for a in allow)
    return frozenset(i for i in ids if i is not None and i != UNKNOWN)


def _shown(raw: str, limit: int = 80) -> str:
    """The raw value for a detail message, cut so details stay short, its personal data masked
    (a license field is third parties' text: "Photo by jane@example.org")."""
    from tasks.policies.personal import masked

    return repr(masked(raw if len(raw) <= limit else raw[:limit] + "..."))


def license_verdict(raw: str | None, source: str, policy: LicensePolicy) -> Ruling[str]:
    """Judge one sample's license against the policy.

    Args:
        raw: the manifest's license value (None when the column is absent or null).
        source: the sample's source name, for ``policy.source_defaults``.
        policy: the recipe's ``validate.license``.

    Returns:
        A :class:`Ruling` whose value is the SPDX id. Accepted: ``Ruling(id)``. Rejected with
        ``license_missing`` (no value and no source default) or ``license_not_allowed`` (an id
        outside ``policy.allow``, with that id as the value; or an unrecognised value under
        ``unknown: reject``, with no value; or a value that is not a string, such as a
        JSON list, whatever the policy). ``detail`` says which value and why. An
        unrecognised value under ``unknown: allow`` is accepted as ``LicenseRef-Unknown``.
        An expression is judged part by part (``tasks.policies.spdx.blockers``): ``OR`` passes when one
        alternative is allowed, ``AND`` when all are, unrecognised parts follow ``unknown``;
        the value is then the normalised expression, and the detail names the parts that fail.
    """
    if raw is not None and not isinstance(raw, str) and normalize_license(raw) is not None:
        # The manifest readers refuse such values first; a list is never one of its elements.
        return Ruling(
            None, "license_not_allowed", f"license value is a {type(raw).__name__}, not a string: {_shown(repr(raw))}"
        )
    spdx = normalize_license(raw)
    shown_raw = raw
    origin = ""
    if spdx is None:
        default = policy.source_defaults.get(source)
        if default is None:
            return Ruling(
                None, "license_missing", f"no license and no validate.license.source_defaults entry for {source!r}"
            )
        spdx = normalize_license(default)
        shown_raw = default
        origin = f" (source default for {source!r})"
        if spdx is None:
            return Ruling(None, "license_missing", f"source default for {source!r} is empty")
    if spdx == UNKNOWN:
        if policy.unknown == "allow":
            return Ruling(UNKNOWN)
        return Ruling(None, "license_not_allowed", f"unrecognised license: {_shown(str(shown_raw))}{origin}")
    if is_expression(spdx):
        why = blockers(spdx, _allowed(tuple(policy.allow)), policy.unknown == "allow")
        if not why:
            return Ruling(spdx)
        parts = [
            f"{b} (validate.license.unknown: reject)"
            if b.startswith("an unrecognised")
            else f"{b} is not in validate.license.allow"
            for b in why
        ]
        detail = f"{spdx} (from {_shown(str(shown_raw))}): {'; '.join(parts)}{origin}"
        return Ruling(spdx, "license_not_allowed", detail)
    if spdx not in _allowed(tuple(policy.allow)):
        return Ruling(spdx, "license_not_allowed", f"{spdx} is not in validate.license.allow{origin}")
    return Ruling(spdx)


def policy_problems(policy: LicensePolicy) -> list[str]:
    """Allowlist entries and source defaults that do not name a recognised license.

    Such entries silently match nothing, so a recipe check or a flow's preflight should show
    them before any shard runs.
    """
    problems = []
    for entry in policy.allow:
        spdx = normalize_license(entry)
        if spdx in (None, UNKNOWN) or (is_expression(spdx) and (UNKNOWN in spdx or UNKNOWN_EXCEPTION in spdx)):
            problems.append(
                f"validate.license.allow: {entry!r} is not a recognised license; write an SPDX id such as CC-BY-4.0"
            )
        elif is_choice_or_combination(spdx):
            problems.append(
                f"validate.license.allow: {entry!r} joins licenses with AND or OR; list each license on its own "
                "(a sample's OR passes when one alternative is allowed, its AND when every part is)"
            )
    for source, default in sorted(policy.source_defaults.items()):
        if normalize_license(default) in (None, UNKNOWN):
            problems.append(f"validate.license.source_defaults.{source}: {default!r} is not a recognised license")
    return problems


def review_problem(policy: LicensePolicy, today: dt.date | None = None) -> str | None:
    """Why the policy's license review cannot gate a release, or None when it can.

    Args:
        policy: the recipe's ``validate.license``.
        today: the date to compare ``reviewed_on`` against; defaults to today's date.
    """
    review = policy.review
    if review is None:
        return (
            "no license review recorded: add validate.license.review {reviewed_by, reviewed_on} "
            "to the recipe after checking the sources' terms"
        )
    today = today or dt.date.today()
    if review.reviewed_on > today:
        return f"license review date {review.reviewed_on.isoformat()} is in the future; record the day the terms were checked"
    return None
