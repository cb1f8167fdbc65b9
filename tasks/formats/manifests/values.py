"""Manifest values judged a column at a time: URL verdicts, text of the mapped columns, wrong types, the extra-columns JSON."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tasks.formats.manifests.files import ManifestError
from tasks.formats.recipe_download import SourceConfig

URL_SCHEMES = ("http", "https", "file", "s3")

# A URL this pattern matches gets no reason from url_problem (tests/test_manifests.py checks
# that on arbitrary strings): scheme http(s), a host of letters, digits, dots, dashes and
# underscores, a port of at most 4 digits, no control character, and a last character that
# str.strip() keeps. Anything else goes through url_problem one row at a time.
_PLAIN_URL = r"^[hH][tT][tT][pP][sS]?://[A-Za-z0-9._~-]+(?::[0-9]{1,4})?(?:[/?#][^\x00-\x1f\x7f]*[!-~])?$"
# What pyarrow's utf8_trim removes before the pattern: ASCII whitespace, a subset of what
# str.strip() removes, so a match means the same string str.strip() would give.
_ASCII_SPACE = " \t\n\r\x0b\x0c"

# Intermediate batches: what a reader makes of its rows, before row ids and origins.
BATCH_SCHEMA = pa.schema(
    [
        ("line", pa.int64()),
        ("url", pa.string()),
        ("caption", pa.string()),
        ("license", pa.string()),
        ("extra", pa.string()),
        ("reason", pa.string()),
        ("detail", pa.string()),
    ]
)


def url_problem(url: str | None) -> tuple[str, str] | None:
    """(reason, why) for a manifest URL (already stripped), or None when it may be fetched.

    A bare string without a scheme (``images/a.jpg``, ``not a url``) is ``invalid_url``:
    manifest rows carry absolute URLs, and guessing that a string is a local path would
    turn a typo into a file read.
    """
    if not url:
        return "missing_url", "no URL"
    if any(ord(c) < 32 or ord(c) == 127 for c in url):
        return "invalid_url", "control character in the URL"  # header injection, never a real URL
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a bad port
        host = parts.hostname
    except ValueError as err:
        return "invalid_url", f"cannot parse the URL ({err})"
    if not parts.scheme:
        return "invalid_url", f"no scheme in {_short(url)}"
    if parts.scheme not in URL_SCHEMES:
        return "unsupported_scheme", f"scheme {parts.scheme!r} (allowed: {', '.join(URL_SCHEMES)})"
    if parts.scheme in ("http", "https"):
        if not host or any(c.isspace() for c in host):
            return "invalid_url", f"no valid host in {_short(url)}"
    elif parts.scheme == "s3":
        if not parts.netloc or parts.path in ("", "/"):
            return "invalid_url", f"no bucket or key in {_short(url)}"
    elif parts.path in ("", "/"):
        return "invalid_url", f"no path in {_short(url)}"
    return None


def url_reason(url: str | None) -> str | None:
    """Pre-rejection reason for a manifest URL (already stripped), or None when it may be fetched."""
    problem = url_problem(url)
    return problem[0] if problem else None


def _short(text: str, limit: int = 120) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def json_value(value: Any) -> Any:
    """A value JSON can carry: NaN and infinities become null (pandas writes NaN for missing)."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_value(v) for v in value]
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return str(value)


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _text(value: Any) -> str | None:
    """A scalar url / caption / license value as text: numbers and booleans as JSON writes them."""
    if value is None or isinstance(value, str):
        return value
    value = json_value(value)
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


def _kind_of(value: Any) -> str | None:
    """What a value that is no string and no scalar is, for people; None for strings and scalars."""
    if isinstance(value, (list, tuple)):
        return "a JSON array"
    if isinstance(value, dict):
        return "a JSON object"
    return None


class Mapping:
    """Which manifest columns feed url, caption, license and extra."""

    def __init__(self, source: SourceConfig):
        self.url = source.url_column
        self.caption = source.caption_column
        self.license = source.license_column
        self.all_extras = "*" in source.extra_columns
        self.named_extras = tuple(c for c in source.extra_columns if c != "*")
        self.mapped = {c for c in (self.url, self.caption, self.license) if c is not None}

    def check_columns(self, names: Sequence[str], where: str, line: int | None, kind: str) -> None:
        if self.url not in names:
            shown = ", ".join(names[:20]) + (", ..." if len(names) > 20 else "")
            raise ManifestError(where, f"no column {self.url!r} in the {kind} (columns: {shown})", line)
        for name in sorted(self.mapped | set(self.named_extras)):
            if list(names).count(name) > 1:
                raise ManifestError(
                    where, f"column {name!r} appears {list(names).count(name)} times in the {kind}", line
                )

    def extra_names(self, names: Sequence[str]) -> list[str]:
        """Extra columns in output order: the named ones, or with "*" every unmapped one."""
        if not self.all_extras:
            return list(self.named_extras)
        seen: dict[str, None] = {}
        for name in names:
            if name not in self.mapped:
                seen.setdefault(name, None)
        return list(seen)

    def used(self, names: Sequence[str]) -> list[str]:
        """The columns a file's rows are read from (for the schema agreement of multi-file sources)."""
        return sorted({n for n in (*self.mapped, *self.extra_names(names)) if n in names} | {self.url})


# -- columns ---------------------------------------------------------------------------------

Values = Any  # an arrow array (chunked or not), a python list of values, or None


def _is_nested(t: pa.DataType) -> str | None:
    """What a column of lists, structs or maps holds, for people; None for other types."""
    if (
        pa.types.is_list(t)
        or pa.types.is_large_list(t)
        or pa.types.is_fixed_size_list(t)
        or pa.types.is_list_view(t)
        or pa.types.is_large_list_view(t)
    ):
        return f"a list ({t})"
    if pa.types.is_struct(t):
        return f"a struct ({t})"
    if pa.types.is_map(t):
        return f"a map ({t})"
    return None


def _plain(arr: pa.Array | pa.ChunkedArray) -> pa.Array:
    """One contiguous array; dictionary columns (pandas categoricals) decoded."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks != 1 else arr.chunk(0)
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    return arr


def text_column(values: Values, n: int) -> tuple[pa.Array, dict[int, str]]:
    """(text per row, {row: what it holds} for values of the wrong type, which read as null)."""
    if values is None:
        return pa.nulls(n, pa.string()), {}
    if isinstance(values, list):
        try:
            return pa.array(values, pa.string()), {}
        except (pa.ArrowTypeError, pa.ArrowInvalid):
            pass  # numbers, lists or objects among the strings: one at a time below
        out: list[str | None] = []
        wrong: dict[int, str] = {}
        for i, value in enumerate(values):
            kind = _kind_of(value)
            if kind:
                wrong[i] = kind
                out.append(None)
            else:
                out.append(_text(value))
        return pa.array(out, pa.string()), wrong
    arr = _plain(values)
    t = arr.type
    if pa.types.is_string(t):
        return arr, {}
    if pa.types.is_large_string(t) or pa.types.is_string_view(t) or pa.types.is_null(t) or pa.types.is_integer(t):
        return arr.cast(pa.string()), {}
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_binary_view(t):
        try:
            return arr.cast(pa.string()), {}
        except pa.ArrowInvalid:
            pass  # not UTF-8: decoded with replacement characters below, as bytes always were
    kind = _is_nested(t)
    if kind:
        valid = np.flatnonzero(arr.is_valid().to_numpy(zero_copy_only=False))
        return pa.nulls(n, pa.string()), {int(i): kind for i in valid}
    return pa.array([_text(v) for v in arr.to_pylist()], pa.string()), {}


def _json_texts(values: Values, n: int) -> pa.Array:
    """Each row's value as JSON text (``null`` for none), for the extra-columns object."""
    if values is None:
        return pa.repeat(pa.scalar("null"), n)
    if isinstance(values, list):
        return pa.array([dumps(json_value(v)) for v in values], pa.string())
    arr = _plain(values)
    t = arr.type
    if pa.types.is_large_string(t) or pa.types.is_string_view(t):
        arr, t = arr.cast(pa.string()), pa.string()
    if pa.types.is_string(t):
        if pc.any(pc.match_substring_regex(arr, "[\\x00-\\x1f]")).as_py():
            return pa.array([dumps(v) for v in arr.to_pylist()], pa.string())
        escaped = pc.replace_substring(pc.replace_substring(arr, "\\", "\\\\"), '"', '\\"')
        quoted = pc.binary_join_element_wise('"', escaped, '"', "")
        return pc.fill_null(quoted, "null")
    if pa.types.is_integer(t):
        return pc.fill_null(arr.cast(pa.string()), "null")
    if pa.types.is_boolean(t):
        return pc.fill_null(pc.if_else(arr, "true", "false"), "null")
    if pa.types.is_null(t):
        return _json_texts(None, n)
    return pa.array([dumps(json_value(v)) for v in arr.to_pylist()], pa.string())


def extra_column(names: Sequence[str], columns: dict[str, Values], n: int) -> pa.Array:
    """The extra columns as one JSON object per row, keys in ``names`` order; absent columns are null."""
    if not names:
        return pa.repeat(pa.scalar("{}"), n)
    pieces: list[Any] = []
    for i, name in enumerate(names):
        pieces.append(("{" if i == 0 else ",") + dumps(name) + ":")
        pieces.append(_json_texts(columns.get(name), n))
    pieces.append("}")
    return pc.binary_join_element_wise(*pieces, "")


# -- a batch ----------------------------------------------------------------------------------


@dataclass
class RawBatch:
    """A reader's rows before judging.

    Args:
        lines: 1-based line (parquet: row number) of each row.
        url, caption, license: the mapped columns' values (arrow arrays or python lists);
            None when the column is not mapped or not in the file.
        extra: the extra-columns JSON per row (arrow strings), or None for ``{}``.
        reasons: {row index: (reason, detail)} the reader already decided (unparsable rows,
            whose values must be null).
    """

    lines: np.ndarray
    url: Any = None
    caption: Any = None
    license: Any = None
    extra: pa.Array | None = None
    reasons: dict[int, tuple[str, str]] | None = None


def finish(raw: RawBatch, mapping: Mapping, word: str, cap: int | None) -> pa.Table:
    """A BATCH_SCHEMA table: texts, stripped URLs, empty captions and licenses as null, reasons.

    Precedence of reasons: what the reader decided (``unparsable_row``), then the row cap
    (``cap``: the bytes of url, caption, license and extra together, for formats without
    lines to cap while reading), then ``wrong_type``, then the URL's own reason. ``word`` is
    "line" or "row", for details.
    """
    n = len(raw.lines)
    url, wrong_url = text_column(raw.url, n)
    caption, wrong_caption = text_column(raw.caption, n)
    license_, wrong_license = text_column(raw.license, n)
    caption = _none_if_empty(caption)
    license_ = _none_if_empty(license_)
    extra = _plain(raw.extra) if raw.extra is not None else extra_column((), {}, n)
    decided: dict[int, tuple[str, str]] = dict(raw.reasons or {})
    lines = raw.lines

    if cap is not None and n:
        size = pc.add(pc.add(_bytes(url), _bytes(caption)), pc.add(_bytes(license_), _bytes(extra)))
        for i in np.flatnonzero(pc.greater(size, cap).to_numpy(zero_copy_only=False)):
            decided.setdefault(
                int(i),
                (
                    "unparsable_row",
                    f"{word} {lines[i]}: the row's values take {size[int(i)].as_py()} bytes, over the cap of {cap}",
                ),
            )

    for column, wrong in ((mapping.url, wrong_url), (mapping.caption, wrong_caption), (mapping.license, wrong_license)):
        for i, kind in wrong.items():
            decided.setdefault(i, ("wrong_type", f"{word} {lines[i]}: column {column!r} holds {kind}, not a string"))

    # URLs: the common shape passes a pattern; the rest go through url_problem one by one.
    trimmed = pc.utf8_trim(url, _ASCII_SPACE)
    plain = pc.fill_null(pc.match_substring_regex(trimmed, _PLAIN_URL), False).to_numpy(zero_copy_only=False)
    others = np.flatnonzero(~plain)
    if len(others):
        fixed_at, fixed = [], []
        originals = url.take(pa.array(others)).to_pylist()
        for i, value in zip(others.tolist(), originals):
            stripped = value.strip() or None if value is not None else None
            fixed_at.append(i)
            fixed.append(stripped)
            if i not in decided:
                problem = url_problem(stripped)
                if problem:
                    reason, why = problem
                    if reason == "missing_url":
                        why = f"no URL in column {mapping.url!r}"
                    decided[i] = (reason, f"{word} {lines[i]}: {why}")
        mask = np.zeros(n, bool)
        mask[fixed_at] = True
        trimmed = pc.replace_with_mask(trimmed, pa.array(mask), pa.array(fixed, pa.string()))

    reason = detail = pa.nulls(n, pa.string())
    if decided:
        at = sorted(decided)
        mask = np.zeros(n, bool)
        mask[at] = True
        reason = pc.replace_with_mask(reason, pa.array(mask), pa.array([decided[i][0] for i in at], pa.string()))
        detail = pc.replace_with_mask(detail, pa.array(mask), pa.array([decided[i][1] for i in at], pa.string()))
        unparsable = np.zeros(n, bool)
        unparsable[[i for i in at if decided[i][0] == "unparsable_row"]] = True
        if unparsable.any():  # nothing of an unparsable row is carried
            keep = pa.array(unparsable)
            trimmed, caption, license_, extra = (
                pc.if_else(keep, pa.scalar(None, pa.string()), c) for c in (trimmed, caption, license_, extra)
            )
    return pa.Table.from_arrays(
        [pa.array(lines, pa.int64()), trimmed, caption, license_, extra, reason, detail], schema=BATCH_SCHEMA
    )


def _none_if_empty(arr: pa.Array) -> pa.Array:
    """An empty caption or license is no caption or license: csv cannot write null."""
    empty = pc.equal(arr, "")
    if not pc.any(empty).as_py():
        return arr
    return pc.if_else(empty, pa.scalar(None, pa.string()), arr)


def _bytes(arr: pa.Array) -> pa.Array:
    return pc.fill_null(pc.binary_length(arr), 0).cast(pa.int64())


def unparsable_table(lines: list[int], details: list[str]) -> pa.Table:
    """Rows that are only a reason: unparsable_row at these lines."""
    n = len(lines)
    nulls = pa.nulls(n, pa.string())
    return pa.Table.from_arrays(
        [
            pa.array(lines, pa.int64()),
            nulls,
            nulls,
            nulls,
            nulls,
            pa.array(["unparsable_row"] * n, pa.string()),
            pa.array(details, pa.string()),
        ],
        schema=BATCH_SCHEMA,
    )
