"""License strings normalised to SPDX ids and judged against the recipe's policy."""

from __future__ import annotations

import datetime as dt
import functools
import re
import unicodedata
from urllib.parse import urlsplit

from tasks.recipe import LicensePolicy

# Ids on the SPDX License List (https://spdx.org/licenses/) that normalisation can produce.
# Every Creative Commons id on the list is here, ports included, so "CC BY-SA 3.0 DE" finds
# its port; the rest are the licenses that image, text and data manifests actually carry.
_CC_IDS = (
    "CC-BY-1.0", "CC-BY-2.0", "CC-BY-2.5", "CC-BY-2.5-AU", "CC-BY-3.0", "CC-BY-3.0-AT",
    "CC-BY-3.0-AU", "CC-BY-3.0-DE", "CC-BY-3.0-IGO", "CC-BY-3.0-NL", "CC-BY-3.0-US", "CC-BY-4.0",
    "CC-BY-NC-1.0", "CC-BY-NC-2.0", "CC-BY-NC-2.5", "CC-BY-NC-3.0", "CC-BY-NC-3.0-DE",
    "CC-BY-NC-4.0", "CC-BY-NC-ND-1.0", "CC-BY-NC-ND-2.0", "CC-BY-NC-ND-2.5", "CC-BY-NC-ND-3.0",
    "CC-BY-NC-ND-3.0-DE", "CC-BY-NC-ND-3.0-IGO", "CC-BY-NC-ND-4.0", "CC-BY-NC-SA-1.0",
    "CC-BY-NC-SA-2.0", "CC-BY-NC-SA-2.0-DE", "CC-BY-NC-SA-2.0-FR", "CC-BY-NC-SA-2.0-UK",
    "CC-BY-NC-SA-2.5", "CC-BY-NC-SA-3.0", "CC-BY-NC-SA-3.0-DE", "CC-BY-NC-SA-3.0-IGO",
    "CC-BY-NC-SA-4.0", "CC-BY-ND-1.0", "CC-BY-ND-2.0", "CC-BY-ND-2.5", "CC-BY-ND-3.0",
    "CC-BY-ND-3.0-DE", "CC-BY-ND-4.0", "CC-BY-SA-1.0", "CC-BY-SA-2.0", "CC-BY-SA-2.0-UK",
    "CC-BY-SA-2.1-JP", "CC-BY-SA-2.5", "CC-BY-SA-3.0", "CC-BY-SA-3.0-AT", "CC-BY-SA-3.0-DE",
    "CC-BY-SA-3.0-IGO", "CC-BY-SA-4.0", "CC-SA-1.0", "CC-PDDC", "CC-PDM-1.0", "CC0-1.0",
)
_OTHER_IDS = (
    "0BSD", "AGPL-3.0-only", "AGPL-3.0-or-later", "Apache-1.0", "Apache-1.1", "Apache-2.0",
    "Artistic-2.0", "BSD-2-Clause", "BSD-3-Clause", "BSD-4-Clause", "BSL-1.0",
    "CDLA-Permissive-1.0", "CDLA-Permissive-2.0", "CDLA-Sharing-1.0", "DL-DE-BY-2.0",
    "DL-DE-ZERO-2.0", "EPL-1.0", "EPL-2.0", "etalab-2.0", "GFDL-1.2-only", "GFDL-1.2-or-later",
    "GFDL-1.3-only", "GFDL-1.3-or-later", "GPL-2.0-only", "GPL-2.0-or-later", "GPL-3.0-only",
    "GPL-3.0-or-later", "ISC", "LGPL-2.1-only", "LGPL-2.1-or-later", "LGPL-3.0-only",
    "LGPL-3.0-or-later", "MIT", "MIT-0", "MPL-1.1", "MPL-2.0", "NLOD-2.0", "ODbL-1.0",
    "ODC-By-1.0", "OFL-1.1", "OGL-Canada-2.0", "OGL-UK-2.0", "OGL-UK-3.0", "PDDL-1.0",
    "Unlicense", "WTFPL", "Zlib",
)
SPDX_LISTED: frozenset[str] = frozenset(_CC_IDS + _OTHER_IDS)

# What the SPDX list has no id for gets a LicenseRef (SPDX's form for ids outside the list).
PUBLIC_DOMAIN = "LicenseRef-Public-Domain"
ALL_RIGHTS_RESERVED = "LicenseRef-All-Rights-Reserved"
# A license string that was present but could not be recognised. normalize_license returns
# it (never None) so that "the manifest said something we do not understand" stays distinct
# from "the manifest said nothing".
UNKNOWN = "LicenseRef-Unknown"
LICENSE_REFS: frozenset[str] = frozenset({PUBLIC_DOMAIN, ALL_RIGHTS_RESERVED, UNKNOWN})

SPDX_KNOWN: frozenset[str] = SPDX_LISTED | LICENSE_REFS
_BY_LOWER = {i.lower(): i for i in SPDX_KNOWN}

# Values that mean "no license given" rather than "a license we do not know": a source
# default then applies. Spreadsheet and dataframe exports write nulls in all these ways.
MISSING_VALUES = frozenset({"", "none", "null", "nil", "nan", "n/a", "na", "-", "--", "?", "unknown",
                            "not specified", "unspecified"})

# Free-form spellings, compacted by _compact at import, so each entry covers its case,
# spacing, punctuation, "License"/"Version" words and "v2"/"2.0" variants at once. The
# Creative Commons BY family is parsed structurally instead (_parse_cc), since its elements,
# versions and ports combine into too many spellings to list.
LICENSE_ALIASES: dict[str, str] = {
    # Creative Commons public-domain tools
    "CC0": "CC0-1.0", "CC0 1.0": "CC0-1.0", "CC-0": "CC0-1.0", "CC Zero": "CC0-1.0", "CC Zero 1.0": "CC0-1.0",
    "Creative Commons Zero": "CC0-1.0", "Creative Commons CC0": "CC0-1.0",
    "Public Domain Dedication": "CC0-1.0", "CC0 Public Domain Dedication": "CC0-1.0",
    "CC0 1.0 Universal Public Domain Dedication": "CC0-1.0",
    "Public Domain Mark": "CC-PDM-1.0", "Public Domain Mark 1.0": "CC-PDM-1.0",
    "PDM": "CC-PDM-1.0", "PDM 1.0": "CC-PDM-1.0", "CC PDM": "CC-PDM-1.0", "CC PDM 1.0": "CC-PDM-1.0",
    "Creative Commons Public Domain Mark": "CC-PDM-1.0",
    "Public Domain Dedication and Certification": "CC-PDDC",
    "Creative Commons Public Domain Dedication and Certification": "CC-PDDC",
    "Public domain": PUBLIC_DOMAIN, "PD": PUBLIC_DOMAIN,
    # Open Data Commons and government data licenses
    "PDDL": "PDDL-1.0", "ODC PDDL": "PDDL-1.0", "Public Domain Dedication and License": "PDDL-1.0",
    "Open Data Commons Public Domain Dedication and License": "PDDL-1.0",
    "ODbL": "ODbL-1.0", "ODC ODbL": "ODbL-1.0", "Open Database License": "ODbL-1.0",
    "Open Data Commons Open Database License": "ODbL-1.0",
    "ODC-By": "ODC-By-1.0", "Open Data Commons Attribution License": "ODC-By-1.0",
    "OGL-UK 3.0": "OGL-UK-3.0", "OGL 3.0": "OGL-UK-3.0", "Open Government Licence 3.0": "OGL-UK-3.0",
    "Open Government Licence 2.0": "OGL-UK-2.0", "Open Government Licence Canada 2.0": "OGL-Canada-2.0",
    "Etalab 2.0": "etalab-2.0", "Licence Ouverte 2.0": "etalab-2.0",
    "Datenlizenz Deutschland Namensnennung 2.0": "DL-DE-BY-2.0",
    "Datenlizenz Deutschland Zero 2.0": "DL-DE-ZERO-2.0",
    "CDLA Permissive 1.0": "CDLA-Permissive-1.0", "CDLA Permissive 2.0": "CDLA-Permissive-2.0",
    "CDLA Sharing 1.0": "CDLA-Sharing-1.0",
    "Community Data License Agreement Permissive 2.0": "CDLA-Permissive-2.0",
    # permissive software licenses
    "Apache 2.0": "Apache-2.0", "ASL 2.0": "Apache-2.0", "AL 2.0": "Apache-2.0",
    "Apache 1.1": "Apache-1.1", "Apache 1.0": "Apache-1.0",
    "MIT": "MIT", "The MIT License (MIT)": "MIT", "Expat": "MIT", "MIT/Expat": "MIT",
    "MIT No Attribution": "MIT-0",
    "BSD 3-Clause": "BSD-3-Clause", "BSD-3": "BSD-3-Clause", "3-Clause BSD": "BSD-3-Clause",
    "New BSD": "BSD-3-Clause", "Modified BSD": "BSD-3-Clause", "Revised BSD": "BSD-3-Clause",
    'BSD 3-Clause "New" or "Revised" License': "BSD-3-Clause",
    "BSD 2-Clause": "BSD-2-Clause", "BSD-2": "BSD-2-Clause", "2-Clause BSD": "BSD-2-Clause",
    "Simplified BSD": "BSD-2-Clause", "FreeBSD": "BSD-2-Clause",
    'BSD 2-Clause "Simplified" License': "BSD-2-Clause",
    "BSD 4-Clause": "BSD-4-Clause", "Original BSD": "BSD-4-Clause",
    "Zero-Clause BSD": "0BSD", "BSD Zero Clause": "0BSD",
    "ISC": "ISC", "Unlicense": "Unlicense", "WTFPL": "WTFPL", "zlib": "Zlib",
    "Boost Software License 1.0": "BSL-1.0", "Boost 1.0": "BSL-1.0",
    "MPL 2.0": "MPL-2.0", "Mozilla Public License 2.0": "MPL-2.0", "MPL 1.1": "MPL-1.1",
    "EPL 2.0": "EPL-2.0", "Eclipse Public License 2.0": "EPL-2.0", "EPL 1.0": "EPL-1.0",
    "SIL Open Font License 1.1": "OFL-1.1", "OFL 1.1": "OFL-1.1", "Artistic 2.0": "Artistic-2.0",
    # GNU family: a bare version means "only", as SPDX's deprecated GPL-3.0 did
    "GPL 2": "GPL-2.0-only", "GPL 2+": "GPL-2.0-or-later",
    "GPL 3": "GPL-3.0-only", "GPL 3+": "GPL-3.0-or-later",
    "LGPL 2.1": "LGPL-2.1-only", "LGPL 2.1+": "LGPL-2.1-or-later",
    "LGPL 3": "LGPL-3.0-only", "LGPL 3+": "LGPL-3.0-or-later",
    "AGPL 3": "AGPL-3.0-only", "AGPL 3+": "AGPL-3.0-or-later",
    "GFDL 1.2": "GFDL-1.2-only", "GFDL 1.2+": "GFDL-1.2-or-later",
    "GFDL 1.3": "GFDL-1.3-only", "GFDL 1.3+": "GFDL-1.3-or-later",
    # no license granted
    "All rights reserved": ALL_RIGHTS_RESERVED, "Copyright": ALL_RIGHTS_RESERVED,
    "Copyrighted": ALL_RIGHTS_RESERVED, "Proprietary": ALL_RIGHTS_RESERVED,
    "In Copyright": ALL_RIGHTS_RESERVED,
}

# Rewrites applied before compaction, in order: long names to the short forms the alias
# table uses, "or later" to "+", and words that never change which license is meant.
_PHRASES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(p), r)
    for p, r in (
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
# Deprecated SPDX ids still common in manifests.
_DEPRECATED = {
    "gpl-2.0": "GPL-2.0-only", "gpl-2.0+": "GPL-2.0-or-later", "gpl-3.0": "GPL-3.0-only",
    "gpl-3.0+": "GPL-3.0-or-later", "lgpl-2.1": "LGPL-2.1-only", "lgpl-2.1+": "LGPL-2.1-or-later",
    "lgpl-3.0": "LGPL-3.0-only", "lgpl-3.0+": "LGPL-3.0-or-later", "agpl-3.0": "AGPL-3.0-only",
    "gfdl-1.2": "GFDL-1.2-only", "gfdl-1.3": "GFDL-1.3-only",
}

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
_CC_WORDS: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(p), r)
    for p, r in (
        (r"creative\s*commons", " cc "),
        (r"share[\s_-]*alike", " sa "),
        (r"\bnon[\s_-]*commercial", " nc "),
        (r"\bno[\s_-]*deriv(?:ative)?s?(?:[\s_-]*works)?", " nd "),
        (r"attribution", " by "),
    )
)
_CC_FILLER = frozenset({
    "cc", "license", "licence", "licensed", "international", "generic", "unported", "version",
    "v", "ver", "the", "under", "a", "deed", "legalcode", "public",
})
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
        return _DEPRECATED.get(name.replace("fdl", "gfdl", 1) if name.startswith("fdl") else name, UNKNOWN)
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
    if lower in _DEPRECATED:
        return _DEPRECATED[lower]
    cc = _parse_cc(text)
    if cc is not None:
        return cc
    return _ALIASES.get(_compact(text))


def normalize_license(raw: str | None) -> str | None:
    """Normalise a manifest's license value to an SPDX id.

    Args:
        raw: the value as written: an SPDX id in any case, a name ("CC BY-SA 3.0 DE",
            "Apache License, Version 2.0", "Attribution 4.0 International"), a license URL
            (creativecommons.org, spdx.org, opensource.org, gnu.org, apache.org,
            opendatacommons.org), or a copyright notice.

    Returns:
        None when the value is missing: None, blank, or a null spelling in MISSING_VALUES
        ("n/a", "unknown", "nan", ...). Otherwise an id from the SPDX License List,
        ``LicenseRef-Public-Domain``, ``LicenseRef-All-Rights-Reserved``, any other
        ``LicenseRef-*`` passed through as written, or UNKNOWN (``LicenseRef-Unknown``) for a
        value that is present but not recognised. Deprecated SPDX ids become their current
        form (``GPL-3.0`` -> ``GPL-3.0-only``); a CC port SPDX does not list becomes the
        unported id (``CC BY 3.0 FR`` -> ``CC-BY-3.0``); a CC license without a version is
        UNKNOWN, since the versions grant different terms.
    """
    if raw is None:
        return None
    # Numbers, NaN and lists from loosely typed manifests are judged by their text.
    text = raw if isinstance(raw, str) else str(raw)
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
    """The raw value for a detail message, cut so details stay short."""
    return repr(raw if len(raw) <= limit else raw[:limit] + "...")


def license_verdict(raw: str | None, source: str, policy: LicensePolicy) -> tuple[str | None, str | None, str | None]:
    """Judge one sample's license against the policy.

    Args:
        raw: the manifest's license value (None when the column is absent or null).
        source: the sample's source name, for ``policy.source_defaults``.
        policy: the recipe's ``validate.license``.

    Returns:
        ``(spdx, reason, detail)``. Accepted: ``(id, None, None)``. Rejected with
        ``license_missing`` (no value and no source default) or ``license_not_allowed`` (an id
        outside ``policy.allow``, with that id as ``spdx``; or an unrecognised value under
        ``unknown: reject``, with ``spdx`` None). ``detail`` says which value and why. An
        unrecognised value under ``unknown: allow`` is accepted as ``LicenseRef-Unknown``.
    """
    spdx = normalize_license(raw)
    shown_raw = raw
    origin = ""
    if spdx is None:
        default = policy.source_defaults.get(source)
        if default is None:
            return None, "license_missing", f"no license and no validate.license.source_defaults entry for {source!r}"
        spdx = normalize_license(default)
        shown_raw = default
        origin = f" (source default for {source!r})"
        if spdx is None:
            return None, "license_missing", f"source default for {source!r} is empty"
    if spdx == UNKNOWN:
        if policy.unknown == "allow":
            return UNKNOWN, None, None
        return None, "license_not_allowed", f"unrecognised license: {_shown(str(shown_raw))}{origin}"
    if spdx not in _allowed(tuple(policy.allow)):
        return spdx, "license_not_allowed", f"{spdx} is not in validate.license.allow{origin}"
    return spdx, None, None


def policy_problems(policy: LicensePolicy) -> list[str]:
    """Allowlist entries and source defaults that do not name a recognised license.

    Such entries silently match nothing, so a recipe check or a flow's preflight should show
    them before any shard runs.
    """
    problems = []
    for entry in policy.allow:
        if normalize_license(entry) in (None, UNKNOWN):
            problems.append(f"validate.license.allow: {entry!r} is not a recognised license; write an SPDX id such as CC-BY-4.0")
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
