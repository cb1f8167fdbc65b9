"""Names of content-addressed outputs: a short stable digest of what an output is made from."""

from __future__ import annotations

import hashlib
import json
from typing import Any

DIGEST_CHARS = 16  # hex characters of SHA-256 kept in a name: 64 bits, no collision in practice


def short_digest(text: str) -> str:
    """The first ``DIGEST_CHARS`` hex characters of the SHA-256 of ``text`` (UTF-8)."""
    return hashlib.sha256(text.encode()).hexdigest()[:DIGEST_CHARS]


def digest_of(*parts: Any) -> str:
    """A short stable digest of JSON-able parts (keys sorted; other values as ``str``)."""
    return short_digest(json.dumps(parts, sort_keys=True, default=str))
