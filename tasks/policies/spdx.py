"""SPDX license expressions (``MIT OR Apache-2.0``): parsed by license-expression, judged against an allowlist."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

from license_expression import (
    OR,
    ExpressionError,
    LicenseSymbol,
    LicenseWithExceptionSymbol,
    Licensing,
    get_spdx_licensing,
)

# A part of an expression, or a whole value, that is present but not recognised.
UNKNOWN = "LicenseRef-Unknown"
# An exception after WITH that is not on the SPDX exceptions list. SPDX 3 names additions outside
# the list AdditionRef-*, as it names licenses outside it LicenseRef-*.
UNKNOWN_EXCEPTION = "AdditionRef-Unknown"

# A parser with no known symbols keeps every part as written ("CC BY 4.0", "public domain"), so
# the parts go through the same alias normalisation as a single value. SPDX asks for upper-case
# operators, but manifests write "MIT or Apache-2.0" too; the parser takes both.
_PARSER = Licensing()
_OPERATOR = re.compile(r"(?:^|[\s()])(?:and|or|with)(?=[\s()]|$)", re.IGNORECASE)
_NORMALISED_OPERATOR = re.compile(r" (?:AND|OR|WITH) ")

Normalizer = Callable[[str], "str | None"]


@functools.cache
def _spdx_lists() -> tuple[dict[str, str], dict[str, str]]:
    """Lower-case id -> id, for the SPDX licenses and for the SPDX exceptions, as license-expression ships them."""
    licenses: dict[str, str] = {}
    exceptions: dict[str, str] = {}
    for key, symbol in get_spdx_licensing().known_symbols.items():
        if key == symbol.key:  # ids only: the library's aliases include other tools' LicenseRefs
            (exceptions if symbol.is_exception else licenses)[key.lower()] = key
    return licenses, exceptions


def listed_license(text: str) -> str | None:
    """The SPDX License List id written as ``text`` (any case), or None."""
    return _spdx_lists()[0].get(text.strip().lower())


def listed_exception(text: str) -> str | None:
    """The SPDX exceptions list id written as ``text`` (any case), or None."""
    return _spdx_lists()[1].get(text.strip().lower())


def looks_like_expression(text: str) -> bool:
    """Whether ``text`` has an AND, OR or WITH operator (in any case) between its words."""
    return _OPERATOR.search(text) is not None


def is_expression(value: str) -> bool:
    """Whether a normalised value is a compound expression rather than one id."""
    return _NORMALISED_OPERATOR.search(value) is not None


def is_choice_or_combination(value: str) -> bool:
    """Whether a normalised value joins licenses with AND or OR (``L WITH E`` is one term)."""
    return " AND " in value or " OR " in value


def normalize_expression(text: str, normalize_license: Normalizer) -> str | None:
    """``text`` as a normalised SPDX expression, or None when it is not one.

    Every license part goes through ``normalize_license`` (aliases, URLs and ids in any case;
    None or ``LicenseRef-Unknown`` when it does not know the part), every exception through the
    SPDX exceptions list; parts not recognised become ``LicenseRef-Unknown`` and
    ``AdditionRef-Unknown``. None when the text does not parse (a part with characters other
    than letters, digits, ``.-_:+`` and spaces, an operator without operands, unbalanced
    parentheses) or when none of its licenses is recognised: that is free text with an "and"
    or "or" in it, not an expression.
    """
    try:
        parsed = _PARSER.parse(text)
    except ExpressionError:
        return None
    if parsed is None:
        return None
    recognised = [False]

    def lic(symbol: LicenseSymbol) -> LicenseSymbol:
        found = normalize_license(symbol.key)
        if found is None or found == UNKNOWN:
            return LicenseSymbol(UNKNOWN)
        recognised[0] = True
        return LicenseSymbol(found)

    def rebuild(node):
        if isinstance(node, LicenseWithExceptionSymbol):
            exception = listed_exception(node.exception_symbol.key) or UNKNOWN_EXCEPTION
            return LicenseWithExceptionSymbol(lic(node.license_symbol), LicenseSymbol(exception, is_exception=True))
        if isinstance(node, LicenseSymbol):
            return lic(node)
        return type(node)(*(rebuild(arg) for arg in node.args))

    rebuilt = rebuild(parsed)
    return rebuilt.render() if recognised[0] else None


@functools.lru_cache(maxsize=1024)
def blockers(expression: str, allowed: frozenset[str], unknown_ok: bool) -> tuple[str, ...]:
    """What keeps a normalised expression from being allowed; empty when it is allowed.

    ``A OR B`` is allowed when one alternative is, ``A AND B`` when every part is. A part is
    allowed when its id is in ``allowed``, or when it is unrecognised and ``unknown_ok``.
    ``L WITH E`` is allowed when that whole term is in ``allowed``, or when ``L`` is allowed and
    ``E`` is a listed exception (or an unrecognised one and ``unknown_ok``): an SPDX exception
    only grants permissions beyond its license's, never takes any away.
    """

    def walk(node) -> set[str]:
        if isinstance(node, LicenseWithExceptionSymbol):
            if f"{node.license_symbol.key} WITH {node.exception_symbol.key}" in allowed:
                return set()
            out = walk(node.license_symbol)
            if node.exception_symbol.key == UNKNOWN_EXCEPTION and not unknown_ok:
                out.add("an unrecognised exception")
            return out
        if isinstance(node, LicenseSymbol):
            if node.key in allowed or (node.key == UNKNOWN and unknown_ok):
                return set()
            return {"an unrecognised license" if node.key == UNKNOWN else node.key}
        parts = [walk(arg) for arg in node.args]
        if isinstance(node, OR) and any(not p for p in parts):
            return set()
        return set().union(*parts)

    return tuple(sorted(walk(_PARSER.parse(expression))))
