"""Crawler opt-outs: robots.txt per RFC 9309 (parsed by protego) and X-Robots-Tag headers."""

from __future__ import annotations

from urllib.parse import urlsplit

from protego import Protego

from tasks.policies.ruling import Ruling

_DIRECTIVES_WITH_ARGS = frozenset({"unavailable_after", "max-snippet", "max-image-preview", "max-video-preview"})


class RobotsRules:
    """One origin's robots.txt, as verdicts on URLs.

    protego implements RFC 9309: the longest matching rule wins (``Allow`` on a tie), ``*``
    matches any characters and a trailing ``$`` anchors the end of the path and query.
    urllib.robotparser, which this replaces, took the first matching rule and knew neither.

    Args:
        parser: the parsed file; None when the whole origin is allowed or disallowed.
        allow: with no parser, whether every path is allowed.
        why: with no parser, the detail a refused row carries; with one, where the file came from.
        reason: with no parser, the reason a refused row carries: ``robots_disallowed``, or,
            where robots.txt could not be read (a 5xx, a timeout, a connection error), that
            failure's own reason (``http_503``, ``timeout``, ...). RFC 9309 disallows every fetch
            meanwhile, but the row failed for a passing reason: a later run fetches it again
            (``download.retry_failed``), and a recheck counts the host unreachable instead of
            taking an outage for an opt-out.
    """

    def __init__(self, parser: Protego | None, allow: bool, why: str, reason: str = "robots_disallowed"):
        self.parser, self.allow, self.why, self.reason = parser, allow, why, reason

    @classmethod
    def allow_all(cls, why: str) -> RobotsRules:
        return cls(None, True, why)

    @classmethod
    def disallow_all(cls, why: str, reason: str = "robots_disallowed") -> RobotsRules:
        return cls(None, False, why, reason)

    @classmethod
    def parse(cls, body: bytes, where: str) -> RobotsRules:
        return cls(Protego.parse(body.decode("utf-8", "replace")), True, where)

    def verdict(self, url: str, ua_token: str) -> Ruling[str]:
        """Whether robots.txt lets the user agent ``ua_token`` fetch ``url`` (the verdict's value);
        refused as ``robots_disallowed``, the detail naming the file and the path."""
        if self.parser is None:
            return Ruling(url) if self.allow else Ruling(url, self.reason, self.why)
        if self.parser.can_fetch(url, ua_token):
            return Ruling(url)
        parts = urlsplit(url)
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
        return Ruling(url, "robots_disallowed", f"{self.why} disallows {path} for {ua_token}")


def x_robots_verdict(values: list[str], directives: frozenset[str], ua_token: str) -> Ruling[str]:
    """Whether ``X-Robots-Tag`` header values carry an opt-out directive that applies to us.

    Refused as ``opted_out``, the value being the first directive that applies and the detail
    the header values. A value may be scoped to a user agent (``otherbot: noai, noml``); the
    scope holds for the directives after it in that value. Unscoped, ``*`` and our own token
    apply to us.
    """
    for value in values:
        scope: str | None = None
        for part in value.split(","):
            part = part.strip().lower()
            if not part:
                continue
            head, sep, rest = part.partition(":")
            if sep and head.strip() not in _DIRECTIVES_WITH_ARGS:
                scope, part = head.strip(), rest.strip()
            if scope not in (None, "*", ua_token):
                continue
            if part in directives:
                return Ruling(part, "opted_out", "X-Robots-Tag: " + "; ".join(values))
    return Ruling()
