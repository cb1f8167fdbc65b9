"""Names of content-addressed outputs: a short stable digest of what an output is made from."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

DIGEST_CHARS = 16  # hex characters of SHA-256 kept in a name: 64 bits, no collision in practice


def short_digest(text: str) -> str:
    """The first ``DIGEST_CHARS`` hex characters of the SHA-256 of ``text`` (UTF-8)."""
    return hashlib.sha256(text.encode()).hexdigest()[:DIGEST_CHARS]


def digest_of(*parts: Any) -> str:
    """A short stable digest of JSON-able parts (keys sorted; other values as ``str``)."""
    return short_digest(json.dumps(parts, sort_keys=True, default=str))


# A retry version of a download chunk (tasks/stages/retry.py): the base stem, then
# ``.r{gen:03d}-{d8}``; the recheck state names a chunk by its base across its versions.
_RETRY_VERSION = re.compile(r"^(?P<base>.+)\.r(?P<gen>\d{3})-(?P<d8>[0-9a-f]{8})$")


def split_version(stem: str) -> tuple[str, int]:
    """(base stem, generation) of a download stem: generation 0 for the base, N for ``.rNNN-xxxxxxxx``."""
    m = _RETRY_VERSION.match(stem)
    return (m["base"], int(m["gen"])) if m else (stem, 0)
