"""The stable reasons a ledger row can carry, with the status each implies."""

from __future__ import annotations

OK = "ok"
REJECTED = "rejected"
ERROR = "error"
STATUSES = (OK, REJECTED, ERROR)

# reason -> (status, what it means). Reasons are snake_case and never change meaning;
# http_<code> is the only family (bounded by the set of HTTP status codes).
REASONS: dict[str, tuple[str, str]] = {
    # manifest rows
    "unparsable_row": (REJECTED, "the manifest line could not be parsed (bad JSON, wrong field count)"),
    "missing_url": (REJECTED, "the row has no URL"),
    "invalid_url": (REJECTED, "the URL cannot be parsed or has no host"),
    "unsupported_scheme": (REJECTED, "the URL scheme is not http, https, file or s3"),
    # network policy (SSRF guard)
    "blocked_address": (REJECTED, "the host resolves to a loopback, private, link-local or other non-global address"),
    "blocked_scheme": (REJECTED, "file:// or s3:// URL not allowed by the recipe (no file_root, bucket not listed, or outside the root)"),
    "too_many_redirects": (REJECTED, "more redirect hops than download.max_redirects"),
    "robots_disallowed": (REJECTED, "robots.txt disallows our user agent for this path"),
    "opted_out": (REJECTED, "X-Robots-Tag carries an opt-out directive (noai, noimageai, noml, ...)"),
    # payload
    "too_large": (REJECTED, "the body exceeded download.max_bytes"),
    "empty_body": (REJECTED, "the server sent no bytes"),
    "not_an_image": (REJECTED, "the bytes are not a known image format (sniffed, not trusted from headers)"),
    "format_not_allowed": (REJECTED, "an image format not in download.allowed_formats"),
    "truncated_image": (REJECTED, "the image ends before its format's end marker"),
    # fetch failures
    "timeout": (ERROR, "the request did not complete within download.timeout_s"),
    "connection_error": (ERROR, "connection refused, reset or closed early"),
    "dns_error": (ERROR, "the host name does not resolve"),
    "tls_error": (ERROR, "the TLS handshake failed"),
    "rate_limited": (ERROR, "429 with a Retry-After longer than download.max_retry_after_s"),
    "read_error": (ERROR, "a file:// or s3:// source could not be read"),
}


def status_of(reason: str | None) -> str:
    """Status implied by a reason; ``None`` means ok, ``http_<code>`` means error."""
    if reason is None:
        return OK
    if reason.startswith("http_"):
        return ERROR
    try:
        return REASONS[reason][0]
    except KeyError:
        raise ValueError(f"unknown reason {reason!r}; add it to tasks/reasons.py") from None
