"""Caption cleanup and caption rules."""

from __future__ import annotations

import html
import re
import unicodedata

from tasks.formats.recipe_download import CaptionRules
from tasks.policies.ruling import Ruling

# Only a named or numeric reference closed by ";" is decoded. html.unescape alone would also
# decode HTML5's legacy forms without ";", turning "see &notes" into "see ¬es".
_ENTITY = re.compile(r"&(?:#[0-9]{1,7}|#[xX][0-9a-fA-F]{1,6}|[A-Za-z][A-Za-z0-9]{1,31});")

# Tags are stripped only when they name an HTML element and have valid attribute syntax, so
# "<3", "a < b > c" and "<EPS file>" survive. Inline elements vanish ("<b>bo</b>ld" reads
# "bold"); the rest become a space, as a browser would break the line.
_INLINE_TAGS = frozenset(
    "a abbr b bdi bdo big cite code del dfn em font i ins kbd mark q s samp small span strike "
    "strong sub sup tt u var wbr".split()
)
_BLOCK_TAGS = (
    "address article aside blockquote body br caption center dd div dl dt figcaption figure "
    "footer h1 h2 h3 h4 h5 h6 head header hr html img li main nav ol p pre section table tbody "
    "td tfoot th thead title tr ul meta link input button label form iframe video audio source "
    "picture svg noscript"
).split()
_TAG_NAMES = "|".join(sorted(_INLINE_TAGS | set(_BLOCK_TAGS), key=len, reverse=True))
_ATTRS = r"""(?:\s+[A-Za-z_:][-\w:.]*(?:\s*=\s*(?:"[^"]*"|'[^']*'|[^\s"'=<>`]+))?)*"""
_TAG = re.compile(rf"</?({_TAG_NAMES})\b{_ATTRS}\s*/?>", re.IGNORECASE)
_SCRIPT = re.compile(r"<(script|style)\b[^>]*>.*?</\1\s*>", re.IGNORECASE | re.DOTALL)
_COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)

# C0 and C1 controls other than the whitespace ones (\t \n \v \f \r and NEL), and DEL. They are
# junk in a caption and, in bulk, the sign of binary data read as text, so they are counted.
_CONTROLS = re.compile(r"[\x00-\x08\x0e-\x1f\x7f-\x84\x86-\x9f]")
# Invisible format characters with no meaning in a caption: soft hyphen, zero-width space,
# word joiner, BOM, bidi embeddings, overrides and isolates. ZWJ and ZWNJ stay: Indic and
# Persian spelling and emoji sequences need them.
INVISIBLE = re.compile(r"[\u00ad\u200b\u2060\ufeff\u202a-\u202e\u2066-\u2069]")
_SURROGATE = re.compile(r"[\ud800-\udfff]")

# UTF-8 read as Latin-1 or cp1252: a lead byte C2-C5 ("Â", "Ã", "Ä", "Å") then a continuation
# byte 80-BF (U+0080-U+00BF, or the cp1252 letters at 80-9F); "â€" for the 3-byte quotes and
# dashes; "ï»¿" for a BOM. Real text almost never puts these letters before those symbols.
_CP1252_HIGH = "€‚ƒ„…†‡ˆ‰Š‹ŒŽ‘’“”•–—˜™š›œžŸ"
_MOJIBAKE = re.compile(rf"[ÂÃÄÅ][\u0080-\u00bf{_CP1252_HIGH}]|â€[\u0080-\u00bf{_CP1252_HIGH}]?|â„¢|ï»¿")

# Code points unassigned in this Python's Unicode database (14.0) but used by later versions
# for emoji (U+1F000-U+1FAFF) and CJK ideographs (planes 2 and 3); a new emoji is not junk.
_NEWER_RANGES = ((0x1F000, 0x1FAFF), (0x20000, 0x3FFFF))


def _is_cjk(ch: str) -> bool:
    """Scripts written without spaces where one character is counted as one word."""
    cp = ord(ch)
    return (
        0x3040 <= cp <= 0x30FF  # Hiragana, Katakana
        or 0x31F0 <= cp <= 0x31FF
        or 0x3400 <= cp <= 0x4DBF  # CJK Extension A
        or 0x4E00 <= cp <= 0x9FFF  # CJK Unified Ideographs
        or 0xF900 <= cp <= 0xFAFF
        or 0xFF66 <= cp <= 0xFF9F  # halfwidth Katakana
        or 0x20000 <= cp <= 0x3FFFF
    )


def _is_junk(ch: str) -> bool:
    """A character that is no part of any script's text."""
    if ch == "\ufffd":
        return True
    cat = unicodedata.category(ch)
    if cat in ("Co", "Cs"):
        return True
    if cat == "Cn":
        cp = ord(ch)
        return not any(lo <= cp <= hi for lo, hi in _NEWER_RANGES)
    return False


def _unescape(text: str) -> str:
    return _ENTITY.sub(lambda m: html.unescape(m.group(0)), text)


def _scrub(raw: object) -> tuple[str | None, int, int]:
    """Clean a caption and count what was junk in it.

    Returns ``(caption or None, junk, removed)``: ``junk`` counts replacement, private-use,
    unassigned and mojibake characters plus removed controls; ``removed`` the controls, which
    no longer appear in the caption but still count towards the ratio's total.
    """
    if raw is None:
        return None, 0, 0
    if not isinstance(raw, str):
        # pandas writes a missing cell as float NaN, the only value not equal to itself
        if raw != raw:
            return None, 0, 0
        raw = str(raw)
    # Lone surrogates (from "\ud800" in JSON) cannot be written as UTF-8; mark them as lost.
    text = _SURROGATE.sub("\ufffd", raw)
    if "&" in text:
        # Twice at most: "&amp;amp;" (escaped twice by a scraper) reads "&", but a third
        # level would be guessing.
        text = _unescape(_unescape(text))
    if "<" in text:
        text = _COMMENT.sub(" ", text)
        text = _SCRIPT.sub(" ", text)
        text = _TAG.sub(lambda m: "" if m.group(1).lower() in _INLINE_TAGS else " ", text)
    text, removed = _CONTROLS.subn("", text)
    text = INVISIBLE.sub("", text)
    text = unicodedata.normalize("NFC", text)
    junk = removed
    if not text.isascii():
        # Counted before whitespace is collapsed: "Â\xa0" (a mangled no-break space) is
        # mojibake only while the no-break space is still there.
        junk += sum(len(m.group(0)) for m in _MOJIBAKE.finditer(text))
        junk += sum(1 for ch in text if _is_junk(ch))
    text = " ".join(text.split())
    return (text or None), junk, removed


def clean_caption(raw: str | None) -> str | None:
    """Clean a caption for training.

    Args:
        raw: the manifest's caption value; None, NaN and non-strings are accepted.

    Returns:
        The caption with HTML references decoded (``&amp;``, ``&#39;``; a doubly escaped
        ``&amp;amp;`` once more), HTML tags, comments and scripts removed where they are
        real tags, lone surrogates replaced by U+FFFD, control and invisible format
        characters removed, Unicode NFC, and every whitespace run (no-break spaces, tabs,
        newlines, ideographic spaces) one space, stripped. None when nothing is left.
    """
    return _scrub(raw)[0]


def count_words(text: str) -> int:
    """Words in a caption: each space-separated run with a letter or digit counts once, and
    each Chinese or Japanese character counts as a word, since those scripts use no spaces."""
    words = 0
    for token in text.split():
        cjk = sum(1 for ch in token if _is_cjk(ch))
        words += cjk
        if any(ch.isalnum() and not _is_cjk(ch) for ch in token):
            words += 1
    return words


def non_text_ratio(raw: str | None) -> float:
    """Share of a caption's characters that are junk (see ``caption_verdict``); 0.0 when empty."""
    text, junk, removed = _scrub(raw)
    total = len(text or "") + removed
    return min(1.0, junk / total) if total else 0.0


def caption_verdict(raw: str | None, rules: CaptionRules) -> Ruling[str]:
    """Clean a caption and judge it against the recipe's caption rules.

    Args:
        raw: the manifest's caption value.
        rules: the recipe's ``validate.caption``.

    Returns:
        A :class:`Ruling` whose value is the cleaned caption (also when rejected, for the
        report; None when nothing is left), and no reason, or the first failing reason in this
        order, with a detail that sets the caption's length against the bound:

        - ``caption_missing``: nothing left after cleanup and ``rules.required``; without
          ``required`` an empty caption passes as ``Ruling(None)``.
        - ``caption_charset``: the share of junk characters exceeds
          ``rules.max_non_text_ratio``. Junk is U+FFFD, private-use, unassigned (except
          code points later Unicode versions use for emoji and CJK) and surrogate
          characters, removed control characters, and both characters of each UTF-8-as-
          Latin-1 pair such as "Ã©". Any script, emoji and symbols count as text.
        - ``caption_too_short``: fewer than ``rules.min_chars`` characters (code points) or
          fewer than ``rules.min_words`` words (``count_words``).
        - ``caption_too_long``: more than ``rules.max_chars`` characters.
    """
    text, junk, removed = _scrub(raw)
    if text is None:
        if rules.required:
            return Ruling(None, "caption_missing", "no caption after cleanup")
        return Ruling(None)
    n = len(text)
    total = n + removed
    if junk and junk / total > rules.max_non_text_ratio:
        return Ruling(text, "caption_charset", f"{n} characters")
    if n < rules.min_chars or count_words(text) < rules.min_words:
        # The detail's word count is whitespace-split, as ledgers have always shown it.
        detail = f"{n} characters, {len(text.split())} words (min_chars {rules.min_chars}, min_words {rules.min_words})"
        return Ruling(text, "caption_too_short", detail)
    if n > rules.max_chars:
        return Ruling(text, "caption_too_long", f"{n} characters > max_chars {rules.max_chars}")
    return Ruling(text)
