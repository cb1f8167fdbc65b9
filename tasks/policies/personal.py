"""Finding personal data in a caption or a conversation turn: where it is and what kind, never what it says.

What each kind matches:

- ``email``: ``local@domain.tld`` with a practical local part (letters, digits, ``._%+-'``; at
  most 64 characters a dotted part) and a domain of up to 16 dotted labels ending in a
  letters-only TLD of 2-63 characters or a punycode one (``xn--p1ai``). ``user@localhost``
  (no dot), ``@handle`` (no local part) and retina file names such as ``logo@2x.png`` (a TLD that
  is an image or media file extension) are not addresses. ASCII letters only (full-width ones
  are read as ASCII).
- ``phone``: runs of digits and phone punctuation with enough digits for the region, handed to
  ``phonenumbers.PhoneNumberMatcher`` at ``Leniency.STRICT_GROUPING``: the number must be valid
  for its region *and* grouped as that region writes it, so "1 2 3 4 5 6 7 8 9 10" is not a
  phone. National formats are read for ``rules.phone_region``; ``+``-international numbers for
  every region; a run where none is found is tried again without its last token ("+44 20 7946
  0958 2024-05-01"), and after a number is found its rest is tried, up to ``_CALLS_PER_RUN``. A run right after a product-code label (ISBN, SKU, model, order, ...) is
  skipped, unless it starts with ``+``. A number written as bare digits ("2345678901") is an
  id (stock photos, catalogues), unless a phone word or sign comes in the 32 characters
  before it ("call me at", "tel:", "phone number:", "my number is", a telephone emoji). An extension (``ext. 12``, ``x12`` written on) is not part of the span; vanity numbers (``1-800-FLOWERS``)
  are not found. Digits in a URL's host and path (file names, ids) are not phones; in its
  query they may be.
- ``card``: 14-19 digits, contiguous or in groups as cards are printed (4-4-4-4 and an optional
  1-3, 4-4-4-1..4, 4-6-4, 4-6-5; one separator, space or dash; the leading groups of a grouped
  run too long for a card, so a card followed by a year is found; a last group of 1-2 digits
  followed by ``/`` and a digit is an expiry month, not part of the number), not inside a
  longer number (a digit, letter, dot or slash before, a grouped run not right after a 4-digit
  group, a letter, dash or decimal after; a comma before or after is a list's), Luhn-valid, and with a length and
  prefix that a card network issues (``_ISSUERS``): a random Luhn-valid digit run is mostly not
  a card. A number right after a product-code label (serial, IMEI, SKU, ...; not order or
  invoice) is skipped.
  13-digit Visa and 13-digit Maestro are left out (no longer issued; they collide with EAN-13
  barcodes), as is UATP (prefix 1).
- ``iban``: an upper-case country code, two check digits and 11-30 letters or digits, in groups
  of four with single spaces or contiguous, accepted only when ``stdnum.iban.is_valid`` passes
  (registered country, BBAN format, mod-97, national checks) and the check digits are 02-98
  (00, 01 and 99 pass mod-97 only by congruence and are never issued). Lower-case IBANs are
  not found.
- ``ip``: IPv4 dotted quads and IPv6 addresses that ``ipaddress`` parses and calls global,
  IPv4 not multicast, IPv6 in global unicast (2000::/3: "Bible 3::16" and "Bad::Cafe" parse,
  and Python calls them global): private, loopback, link-local, unspecified, multicast,
  reserved and documentation ranges identify no one on the internet and are skipped, as is a
  quad after a version or numbering word ("version 1.2.3.4", "v 10.0.0.1", "Figure 2.3.1.4").
- ``url_secret``: an ``http(s)``/``ftp(s)``/``ws(s)``/``sftp`` URL or one starting ``www.`` that
  carries a user name (``user@host``, ``user:pass@host``), a query or fragment parameter named
  like a secret (``_STRONG_NAMES``, ``_STRONG_SUFFIXES``) with a value of 4+ characters, a
  parameter with a weaker name (``key``, ``session``, ``sid``, ``auth``, ``code``) whose value
  looks random (16+ characters, letters and digits, some entropy), or any query value that looks
  like a token (32+ characters mixing upper case, lower case and digits, 4+ bits of entropy a
  character), and one carrying a person's address or number: a parameter named ``email``,
  ``mail``, ``phone``, ``tel`` or ``mobile``, or any value holding an e-mail address once
  percent-decoded. Paths are not inspected: content hashes in CDN paths are not secrets. The whole
  URL is the span; its end is the prose's (trailing punctuation, an unopened ``)`` or ``]``,
  Markdown's ``](``).

What is read through, for every kind (``_fold``): spaces that print as one (no-break, thin,
figure, ideographic), every Unicode decimal digit (Arabic-Indic, Devanagari, full-width,
mathematical bold, ...; ``str.isdecimal``), full-width ASCII letters and signs, the small at
sign and the full stops used as dots (ideographic ``\u3002``, halfwidth ``\uff61``, full-width,
small, one dot leader) are read as their ASCII selves, a character for a character, so
"4111\u00a01111 ...", "\u0664\u0661\u0661\u0661 ..." and "jane@example\u3002com" are found
and offsets hold. A dash-like character between two digits (en and em dash, minus, hyphen,
non-breaking hyphen, figure dash, full-width and small hyphen-minus) is read as ``-``
("4111\u20131111 ..."); elsewhere it stays prose ("card\u20144111 ..."). Invisible format
characters (Unicode category Cf: zero-width space, non-joiner and joiner, word joiner, soft
hyphen, BOM, bidi marks) do not split a value: a text holding them is read as it is and once
more without them ("jane\u200b.doe@example.com"), and a span found that way is given in the
text's own offsets and covers the invisible characters inside the value, so ``redact`` removes
them with it.

Overlaps: when two findings overlap, the longer span wins; at equal length the more specific
kind wins, in the order url_secret, email, iban, card, phone, ip. So an IBAN is not also a phone
number, and a URL's ``user@host.com`` is the URL, not an e-mail address.

Bounds: every pattern is linear in the text (quantifiers are bounded, or delimited so that a
text splits one way only), phonenumbers sees at most ``MAX_PHONE_WINDOWS`` windows of a few
hundred characters, each other kind checks at most ``MAX_CHECKS`` candidates, a URL is read up
to ``MAX_URL_CHARS``, and at most ``MAX_SPANS`` spans are returned. When a bound stops the
scan, the result is complete up to where it stopped and ``truncated`` is set.
"""

from __future__ import annotations

import bisect
import ipaddress
import math
import re
import unicodedata
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from urllib.parse import unquote, urlsplit

from phonenumbers import Leniency, PhoneMetadata, PhoneNumberMatcher
from stdnum import iban as stdnum_iban
from stdnum import luhn

from tasks.formats.recipe_privacy import TextPrivacy

PLACEHOLDERS: dict[str, str] = {
    "email": "<EMAIL>",
    "phone": "<PHONE>",
    "card": "<CARD>",
    "iban": "<IBAN>",
    "ip": "<IP>",
    "url_secret": "<URL>",
}

# Most spans returned for one text; past it the scan stops and the result says ``truncated``.
MAX_SPANS = 256
# Most digit runs handed to phonenumbers per text (each costs tens of microseconds; a 1 MiB
# hostile text stops in about half a second). 256 refused a fine-tuning turn of 400 log lines
# (each date a run) as a truncated scan; 1,024 reads about 1,000 such lines.
MAX_PHONE_WINDOWS = 1024
# Most candidates of any other kind checked per text (Luhn, mod-97, ipaddress, URL parsing).
MAX_CHECKS = 1024
# Most characters of one URL inspected; a longer URL is checked on its first part only.
MAX_URL_CHARS = 16384
# Most spans listed by ``describe``; the rest are counted.
DESCRIBE_MAX = 8

# Tie-break between overlapping spans of equal length: lower wins.
_PRIORITY = {"url_secret": 0, "email": 1, "iban": 2, "card": 3, "phone": 4, "ip": 5}


@dataclass(frozen=True, slots=True)
class Span:
    """One finding: ``text[start:end]`` is personal data of ``kind`` (a key of ``PLACEHOLDERS``)."""

    kind: str
    start: int
    end: int


class Findings(tuple[Span, ...]):
    """The spans found in one text, sorted and non-overlapping; a tuple with one more field.

    ``truncated`` is True when a bound (``MAX_SPANS``, ``MAX_PHONE_WINDOWS``, ``MAX_CHECKS``,
    ``MAX_URL_CHARS``) stopped the scan: the spans are then complete only up to where it stopped.
    """

    truncated: bool

    def __new__(cls, spans: Iterable[Span] = (), truncated: bool = False) -> Findings:
        self = super().__new__(cls, spans)
        self.truncated = truncated
        return self

    def __repr__(self) -> str:
        return f"Findings({tuple.__repr__(self)}, truncated={self.truncated})"


_NOTHING = Findings()

# -- e-mail ---------------------------------------------------------------------------------

# Bounded repeats throughout: an unbounded repeat of a group costs the regex engine memory per
# repetition (100 MiB for "x@" and 1 MiB of "a."), and no address has 17 dotted parts.
_EMAIL = re.compile(
    r"(?<![A-Za-z0-9_%+.'\-])[A-Za-z0-9_%+'\-]{1,64}(?:\.[A-Za-z0-9_%+'\-]{1,64}){0,16}"
    r"@(?:[A-Za-z0-9](?:[A-Za-z0-9\-]{0,61}[A-Za-z0-9])?\.){1,16}([A-Za-z]{2,63}|xn--[A-Za-z0-9\-]{1,59})"
    r"(?![A-Za-z0-9\-]|\.[A-Za-z0-9])"
)
_FILE_TLDS = frozenset("png jpg jpeg gif webp svg bmp tif tiff heic avif ico pdf js css mp4 webm".split())


def _emails(text: str) -> Iterator[Span]:
    for m in _EMAIL.finditer(text):
        if m.group(1).lower() not in _FILE_TLDS:
            yield Span("email", m.start(), m.end())
            continue
        # a file extension is not a TLD ("logo@2x.png"), but the address may end before it
        # ("jane.doe@example.com.jpg", a file named after its owner)
        shorter = _EMAIL.fullmatch(text, m.start(), m.start(1) - 1)
        if shorter is not None and shorter.group(1).lower() not in _FILE_TLDS:
            yield Span("email", m.start(), m.start(1) - 1)


# -- phone ----------------------------------------------------------------------------------

# phonenumbers' own punctuation, less the letter x (so "1920x1080" stays two numbers).
_PHONE_SEP = r"[\s\-\u2010-\u2015\u2212\u30fc\uff0d\uff0e\uff0f./~()\[\]\uff08\uff09\uff3b\uff3d\u2053\u223c\uff5e]"
# Each digit block is whole (no digit on either side) and at most 17 digits, at most 17 blocks:
# a candidate is at most a few hundred characters, and a 1 MiB digit run yields none. The
# lookaheads only let a run start where a lead character or digit is (a fast scan for the regex
# engine) and where six digits follow, so the years and sizes of most captions cost no Python.
_PHONE_LEAD_CHARS = "+\uff0b([\uff08\uff3b"
_PHONE_LEAD = r"[+\uff0b(\[\uff08\uff3b]"
_PHONE = re.compile(
    rf"(?=[+\uff0b(\[\uff08\uff3b\d])(?:{_PHONE_LEAD}\s?){{0,2}}(?<!\d)(?=\d(?:{_PHONE_SEP}{{0,4}}\d){{5}})"
    rf"\d{{1,17}}(?!\d)(?:{_PHONE_SEP}{{1,4}}\d{{1,17}}(?!\d)){{0,16}}"
)
# A number right after one of these labels is a product, device or publication code, not a phone
# or card number.
_CODE_WORDS = r"isbn(?:-1[03])?|issn|ean|upc|gtin|asin|sku|mpn|imei|model|part|serial|item|lot|patent|doi"
_LABEL_END = r"\s*(?:no\.?|nr\.?|number)?\s*[:#.]?\s*$"
_CODE_LABEL = re.compile(rf"(?i)\b(?:{_CODE_WORDS}|order|invoice){_LABEL_END}")
# Cards are checked harder (issuer, length, Luhn): an order or invoice label does not hide one.
_CARD_CODE_LABEL = re.compile(rf"(?i)\b(?:{_CODE_WORDS}){_LABEL_END}")
# An extension written onto the number ("0132x12", "0132ext12"): phonenumbers reads it, and a
# letter right after a number otherwise refuses it.
_EXTENSION = re.compile(r"(?i)(?:x|ext\.?|extn\.?)\s?\d{1,6}(?!\w)")
# Words and signs in the few words before bare digits that make them a phone number ("call me
# at 4155550132", "my number is ...", "tel:"); "photo", "text" or "ring size" do not.
_PHONE_CUE = re.compile(
    r"(?i)(?:\b(?:call|tel|telephone|phone|ph|mobile|mob|cell|fax|whatsapp|sms|contact|reach|hotline|dial"
    r"|telefon|téléphone|tél|teléfono|móvil|handy)\b|\bmy\s+(?:number|no)\b|[\u260e\u2706\U0001f4de\U0001f4f1])"
)
_CUE_BEFORE = 32  # characters before bare digits searched for a cue
_INTERNATIONAL_MIN_DIGITS = 6  # the shortest "+CC NSN" of any region (Austria, Germany, Iran)
_CALLS_PER_RUN = 6  # phonenumbers calls on one run of digits and punctuation, its retries included


@lru_cache(maxsize=64)
def _min_national_digits(region: str) -> int:
    """Fewest digits a nationally written number of the region has (at least 6)."""
    meta = PhoneMetadata.metadata_for_region(region)
    desc = meta.general_desc if meta is not None else None
    lengths = desc.possible_length if desc is not None else ()
    return max(_INTERNATIONAL_MIN_DIGITS, min(lengths, default=_INTERNATIONAL_MIN_DIGITS))


def _phones(text: str, region: str, state: _Budget, phone_field: bool = False) -> Iterator[Span]:
    national_min = _min_national_digits(region)
    for m in _PHONE.finditer(text):
        s, e = m.start(), m.end()
        if _count_digits(text, s, e) < _needed_digits(text, s, national_min):
            continue
        if text[s] not in "+\uff0b" and _CODE_LABEL.search(text, max(0, s - 24), s):
            continue  # a "+" number is never a product's code
        # A run may hold a number and then more digits ("... 0958 2024-05-01") or several numbers;
        # phonenumbers finds a number after leading junk but not before trailing junk, so the run
        # is offered again without its last token, and after each number found, its rest.
        calls = 0
        while s < e and calls < _CALLS_PER_RUN:
            need = _needed_digits(text, s, national_min)
            end, spans = e, []
            while calls < _CALLS_PER_RUN and _count_digits(text, s, end) >= need:
                if not state.spend_phone(s):
                    return
                calls += 1
                spans = list(_match_phones(text, s, end, region))
                if spans:
                    break
                end = _drop_last_token(text, s, end)
            if not spans:
                break
            yield from (span for span in spans if phone_field or not _bare_id(text, span))
            s = spans[-1].end
            while s < e and not (text[s].isdecimal() or text[s] in _PHONE_LEAD_CHARS):
                s += 1


def _bare_id(text: str, span: Span) -> bool:
    """A number written as bare digits ("Stock Photo - 2345678901", "ID: 2345678901"): an id,
    unless a phone word or sign comes in the ``_CUE_BEFORE`` characters before it ("call me at
    4155550132", "tel:4155550132")."""
    before = max(0, span.start - _CUE_BEFORE)
    return text[span.start : span.end].isdigit() and not _PHONE_CUE.search(text, before, span.start)


def _needed_digits(text: str, start: int, national_min: int) -> int:
    """Fewest digits a number starting at ``start`` has: fewer when it starts with a plus."""
    lead = text[start : start + 3]
    return _INTERNATIONAL_MIN_DIGITS if "+" in lead or "\uff0b" in lead else national_min


def _count_digits(text: str, start: int, end: int) -> int:
    return sum(1 for ch in text[start:end] if ch.isdecimal())


def _drop_last_token(text: str, start: int, end: int) -> int:
    """End of the run without its last space-separated token, or without its last digit block
    when it is one token: "+44 20 7946 0958 2024-05-01" loses " 2024-05-01"."""
    i = end
    while i > start and not text[i - 1].isspace():
        i -= 1
    if i <= start:
        i = end
        while i > start and text[i - 1].isdecimal():
            i -= 1
    while i > start and not text[i - 1].isdecimal():
        i -= 1
    return i


def _match_phones(text: str, s: int, e: int, region: str) -> Iterator[Span]:
    # One character before and one after (a letter there rejects the number), three after when
    # they may be a timestamp's ":30": what phonenumbers looks at around a number. No more, so
    # the token dropped by ``_drop_last_token`` stays out.
    ws = max(0, s - 1)
    extension = _EXTENSION.match(text, e)
    window = text[ws : extension.end() if extension else e + (3 if text[e : e + 1] == ":" else 1)]
    for pm in PhoneNumberMatcher(window, region, leniency=Leniency.STRICT_GROUPING, max_tries=16):
        start, end = max(ws + pm.start, s), min(ws + pm.end, e)
        if start < end:
            yield Span("phone", start, end)


# -- payment cards --------------------------------------------------------------------------

# Contiguous 14-19 digits, or groups: 4 digits, then up to five more groups with the same
# separator; which leading groups make a card number is decided in ``_cards``. Neither may sit
# inside a longer number: no digit, letter, slash or "1." before, no letter or ".1" after, and
# no slash or "-1" after a contiguous one (a path, a range) or a further group after a grouped
# one, which also may not follow a 4-digit group ("0132 4111 ...": one long run). A comma
# before or after is a list's ("a,4111...,5500..."): a thousands group has three digits.
_CARD = re.compile(
    r"(?<![\w./+\-])"
    r"(?:\d{14,19}(?![\w/\-]|\.\d)|(?<!\d{4}[ \-])\d{4}([ \-])\d{4,6}(?:\1\d{1,6}){1,4}(?!\w|[.,]\d|\1\d))"
)
_EXPIRY_AFTER = re.compile(r"/\d")  # "4111 1111 1111 1111 12/25": the last group is a month


def _lengths(lo: int, hi: int) -> frozenset[int]:
    return frozenset(range(lo, hi + 1))


# (first prefix, last prefix, lengths issued): a prefix range of equal-length prefixes.
_ISSUERS: tuple[tuple[str, str, frozenset[int]], ...] = (
    ("4", "4", frozenset({16, 19})),  # Visa
    ("51", "55", frozenset({16})),  # Mastercard
    ("2221", "2720", frozenset({16})),  # Mastercard 2-series
    ("34", "34", frozenset({15})),  # American Express
    ("37", "37", frozenset({15})),
    ("6011", "6011", _lengths(16, 19)),  # Discover
    ("644", "649", _lengths(16, 19)),
    ("65", "65", _lengths(16, 19)),  # Discover, RuPay, Troy, Verve
    ("36", "36", _lengths(14, 19)),  # Diners Club International
    ("300", "305", _lengths(16, 19)),
    ("3095", "3095", _lengths(16, 19)),
    ("38", "39", _lengths(16, 19)),
    ("3528", "3589", _lengths(16, 19)),  # JCB
    ("62", "62", _lengths(16, 19)),  # UnionPay
    ("5018", "5018", _lengths(16, 19)),  # Maestro
    ("5020", "5020", _lengths(16, 19)),
    ("5038", "5038", _lengths(16, 19)),
    ("5893", "5893", _lengths(16, 19)),
    ("6304", "6304", _lengths(16, 19)),
    ("6759", "6759", _lengths(16, 19)),
    ("6761", "6763", _lengths(16, 19)),
    ("5019", "5019", frozenset({16})),  # Dankort
    ("2200", "2205", _lengths(16, 19)),  # Mir, BORICA
    ("60", "60", frozenset({16})),  # RuPay
    ("81", "82", frozenset({16})),
    ("508", "508", frozenset({16})),
    ("353", "353", frozenset({16})),
    ("356", "356", frozenset({16})),
    ("506099", "506198", frozenset({16, 18, 19})),  # Verve
    ("507865", "507964", frozenset({16, 18, 19})),
    ("636", "636", _lengths(16, 19)),  # InterPayment
    ("637", "639", frozenset({16})),  # InstaPayment
    ("9792", "9792", frozenset({16})),  # Troy
    ("8600", "8600", frozenset({16})),  # UzCard
    ("9860", "9860", frozenset({16})),  # Humo
)


def is_card_number(digits: str) -> bool:
    """True when ``digits`` (ASCII digits only) has a card network's prefix and length and passes Luhn."""
    n = len(digits)
    for lo, hi, lengths in _ISSUERS:
        if n in lengths and lo <= digits[: len(lo)] <= hi:
            return luhn.is_valid(digits)
    return False


def _card_shape(groups: list[str]) -> bool:
    """Groups as cards are printed: 4-4-4-4 with an optional last 1-3 (up to 19 digits), 4-4-4-1..4,
    or 4-6-4 / 4-6-5 (Diners, Amex)."""
    sizes = [len(g) for g in groups]
    if sizes[1] == 6:
        return len(sizes) == 3 and sizes[2] in (4, 5)
    if sizes[1] != 4 or sizes[2] != 4 or len(sizes) < 4:
        return False
    if len(sizes) == 4:
        return 1 <= sizes[3] <= 4
    return len(sizes) == 5 and sizes[3] == 4 and 1 <= sizes[4] <= 3


def _cards(text: str, state: _Budget) -> Iterator[Span]:
    for m in _CARD.finditer(text):
        if not state.spend_check(m.start()):
            return
        if _CARD_CODE_LABEL.search(text, max(0, m.start() - 24), m.start()):
            continue
        number = m.group()
        if not number.isascii():
            continue
        sep = m.group(1)
        if sep is None:
            if is_card_number(number):
                yield Span("card", m.start(), m.end())
            continue
        # A grouped card followed by more digits ("4111 1111 1111 1111 2024"): when the run is too
        # long for a card, the longest leading groups shaped like a card and passing the checks
        # are the card. A run of card length is judged whole, so its checksum decides.
        groups = number.split(sep)
        if len(groups) > 3 and len(groups[-1]) <= 2 and _EXPIRY_AFTER.match(text, m.end()):
            groups = groups[:-1]
        whole = sum(map(len, groups)) <= 19
        for k in [len(groups)] if whole else range(len(groups) - 1, 2, -1):
            if _card_shape(groups[:k]) and is_card_number("".join(groups[:k])):
                yield Span("card", m.start(), m.start() + len(sep.join(groups[:k])))
                break


# -- IBAN -----------------------------------------------------------------------------------

_IBAN = re.compile(r"(?<![A-Za-z0-9])[A-Z]{2}[0-9]{2}(?: ?[A-Z0-9]{4}){2,7}(?: ?[A-Z0-9]{1,4})?(?![A-Za-z0-9])")


def _ibans(text: str, state: _Budget) -> Iterator[Span]:
    for m in _IBAN.finditer(text):
        if not state.spend_check(m.start()):
            return
        found = m.group()
        if found[2:4] in ("00", "01", "99"):
            continue  # ISO 13616 issues 02-98; the others pass mod-97 only by congruence
        # The greedy match may have taken a following upper-case word; try without it.
        ends = [len(found)] + [i for i in range(len(found) - 1, 14, -1) if found[i] == " "]
        for end in ends[:8]:
            if len(found[:end].replace(" ", "")) >= 15 and stdnum_iban.is_valid(found[:end]):
                yield Span("iban", m.start(), m.start() + end)
                break


# -- IP addresses ---------------------------------------------------------------------------

# The first digit, then the look-behind at it: a leading digit lets the regex engine scan fast.
_IPV4 = re.compile(r"[0-9](?<![\w.][0-9])[0-9]{0,2}\.(?:[0-9]{1,3}\.){2}[0-9]{1,3}(?!\w|\.[0-9])")
_IPV6 = re.compile(r"(?<![\w.])(?<![0-9A-Fa-f:]:)[0-9A-Fa-f:]{3,39}(?!\w|:[\w:]|\.\w)")
# Words before a dotted number that make it a version or a section, not an address.
_VERSION_WORD = re.compile(
    r"(?i)(?:\b(?:v|ver|version|build|release|rev|revision|firmware|fw|fig|figure|sec|section|chapter|ch|"
    r"table|step|item|clause|article|art|rule|para|paragraph)|§)\s*[.:]?\s*$"
)
# Global unicast IPv6 (2000::/3): "Bible 3::16", "Bad::Cafe" and "1:2:3:4:5:6:7:8" parse as
# addresses that Python calls global, but no host has them.
_IPV6_UNICAST = ipaddress.IPv6Network("2000::/3")


def _ips(text: str, state: _Budget) -> Iterator[Span]:
    if "." in text:
        for m in _IPV4.finditer(text):
            if not state.spend_check(m.start()):
                return
            if _VERSION_WORD.search(text, max(0, m.start() - 16), m.start()):
                continue
            try:
                addr = ipaddress.IPv4Address(m.group())
            except ValueError:
                continue
            if addr.is_global and not addr.is_multicast:
                yield Span("ip", m.start(), m.end())
    if "::" in text or text.count(":") >= 7:
        for m in _IPV6.finditer(text):
            if m.group().count(":") < 2:
                continue
            if not state.spend_check(m.start()):
                return
            found = m.group()
            if found.endswith(":") and not found.endswith("::"):
                found = found[:-1]  # the sentence's colon ("from 2001:db8::1:")
            try:
                addr6 = ipaddress.IPv6Address(found)
            except ValueError:
                continue
            if addr6.is_global and addr6 in _IPV6_UNICAST:
                yield Span("ip", m.start(), m.start() + len(found))


# -- URLs carrying secrets ------------------------------------------------------------------

_URL = re.compile(r"(?i)(?<![\w@.])(?:(?:https?|ftps?|wss?|sftp)://|www\.)[^\s<>\"'`]+")
_URL_CUE = re.compile(r"://|(?i:www\.)")  # what every match of _URL holds: a scheme's or a www. in any case


def may_hold_personal(text: str) -> bool:
    """Whether any kind could be found in ``text`` as ``find_personal`` reads it (folded: a
    full-width at sign is an ``@``): each needs a digit, an ``@`` or a URL."""
    read = text if text.isascii() else _fold(text, _READ)
    return "@" in read or any(ch.isdigit() for ch in read) or _URL_CUE.search(read) is not None


def may_hold_url(text: str) -> bool:
    """Whether ``_URL`` can match in ``text`` as ``find_personal`` reads it (one linear search; of
    a non-ASCII text, its folded copy without invisible characters: "www\u3002", "ww\u200bw.")."""
    return _URL_CUE.search(text if text.isascii() else _fold(text, _READ)) is not None


_STRONG_NAMES = frozenset(
    "password passwd pwd pw pass secret token apikey accesskey sig signature credential credentials "
    "sessionid sessid phpsessid jsessionid sessiontoken securitytoken clientsecret privatekey authorization "
    "email mail phone tel mobile".split()  # the last: a person's address or number in a link
)
_STRONG_SUFFIXES = (
    "token",
    "secret",
    "password",
    "passwd",
    "signature",
    "apikey",
    "accesskey",
    "sessionid",
    "credential",
    "resetkey",
    "authkey",
    "sessionkey",
)
_WEAK_NAMES = frozenset("key session sid auth code".split())
_NON_VALUES = frozenset("true false null none undefined yes no".split())
_PARAM_NAME_JUNK = re.compile(r"[\s_.\-\[\]]")
_MAX_PARAMS = 256


def _entropy(value: str) -> float:
    """Shannon entropy in bits per character of the first 256 characters."""
    sample = value[:256]
    n = len(sample)
    return -sum(c / n * math.log2(c / n) for c in Counter(sample).values())


def _looks_random(value: str, min_len: int, min_bits: float, mixed_case: bool) -> bool:
    if len(value) < min_len or not value.isascii():
        return False
    has_digit = any(ch.isdigit() for ch in value)
    has_upper = any(ch.isupper() for ch in value)
    has_lower = any(ch.islower() for ch in value)
    if not (has_digit and (has_upper or has_lower)) or (mixed_case and not (has_upper and has_lower)):
        return False
    return _entropy(value) >= min_bits


def _param_is_secret(name: str, value: str) -> bool:
    key = _PARAM_NAME_JUNK.sub("", unquote(name).lower())
    value = unquote(value)
    if "@" in value and _EMAIL.search(value):  # an address, whatever the parameter's name
        return True
    if key in _STRONG_NAMES or key.endswith(_STRONG_SUFFIXES):
        return len(value) >= 4 and value.lower() not in _NON_VALUES
    if key in _WEAK_NAMES:
        return _looks_random(value, 16, 3.0, mixed_case=False)
    return _looks_random(value, 32, 4.0, mixed_case=True)


def url_has_secret(url: str) -> bool:
    """True when ``url`` carries a user name or a secret-looking query or fragment parameter."""
    try:
        parts = urlsplit(url if "://" in url[:8] else "http://" + url)
    except ValueError:
        return False
    if "@" in parts.netloc:
        return True
    pairs = 0
    for section in (parts.query, parts.fragment):
        if "=" not in section:
            continue
        for pair in re.split(r"[&;]", section):
            pairs += 1
            if pairs > _MAX_PARAMS:
                return False
            name, _, value = pair.partition("=")
            if value and _param_is_secret(name, value):
                return True
    return False


def _url_end(url: str) -> int:
    """Where a URL found in prose ends: trailing punctuation is the sentence's, and so is each
    trailing ``)`` or ``]`` without its opening one in the URL (one pass: counted once), and
    whatever follows a ``](``."""
    link = url.find("](")  # Markdown's [text](https://...) written the other way round
    url = url[:link] if link > 0 else url
    unopened = {")": url.count(")") - url.count("("), "]": url.count("]") - url.count("[")}
    end = len(url)
    while end:
        ch = url[end - 1]
        if ch in ".,;:!?":
            end -= 1
        elif unopened.get(ch, 0) > 0:
            unopened[ch] -= 1
            end -= 1
        else:
            break
    return end


def _urls(text: str, state: _Budget) -> Iterator[Span]:
    for m in _URL.finditer(text):
        if not state.spend_check(m.start()):
            return
        url = m.group()
        if len(url) > MAX_URL_CHARS:
            state.stop_at(m.start() + MAX_URL_CHARS)
            url = url[:MAX_URL_CHARS]
        url = url[: _url_end(url)]
        if url_has_secret(url):
            yield Span("url_secret", m.start(), m.start() + len(url))


# -- the scan -------------------------------------------------------------------------------


class _Budget:
    """Work left for one finder on one text, and where it stopped when the work ran out."""

    __slots__ = ("phone_windows", "checks", "limit")

    def __init__(self, length: int) -> None:
        self.phone_windows = MAX_PHONE_WINDOWS
        self.checks = MAX_CHECKS
        self.limit = length

    def stop_at(self, offset: int) -> None:
        self.limit = min(self.limit, offset)

    def spend_phone(self, offset: int) -> bool:
        if self.phone_windows <= 0:
            self.stop_at(offset)
            return False
        self.phone_windows -= 1
        return True

    def spend_check(self, offset: int) -> bool:
        if self.checks <= 0:
            self.stop_at(offset)
            return False
        self.checks -= 1
        return True


_DIGIT = re.compile(r"\d")


# Text is scanned in a folded form, ASCII where a character has an ASCII reading, a character for
# a character so offsets hold: spaces that print as a space (no-break, thin, figure, ideographic:
# "4111\u00a01111 ..."), every Unicode decimal digit (Arabic-Indic, Devanagari, full-width,
# mathematical bold, ...), full-width ASCII (letters, "\uff20" and the other signs), the small at
# sign, and the full stops used as dots ("\u3002", "\uff61", "\ufe52", "\u2024"); and a dash-like
# character (en and em dash, minus, the hyphens, full-width and small hyphen-minus) between two
# digits is a "-" ("4111\u20131111 ..."; elsewhere it is prose: "a card\u20144111 ...").
# Invisible format characters (category Cf: zero-width space and joiners, word joiner, soft
# hyphen, BOM, bidi marks) stay in that form, where they part words as before; a text holding
# them is read a second time without them, so they do not split a value
# ("jane\u200b.doe@example.com"), and what that reading finds is mapped back to the text as given
# (``_Unfold``): its spans cover the invisible characters inside a value.
_DASHES = "\u2010\u2011\u2012\u2013\u2014\u2015\u2212\ufe58\ufe63\uff0d"
# The dash is found by its character class (a fast scan), then its digits are checked.
_DASH_IN_NUMBER = re.compile(f"[{_DASHES}](?<=[0-9].)(?=[0-9])")
_FOLD_CACHE = 1 << 15  # most characters whose reading a ``_FoldTable`` keeps (a hostile text may hold every one)


class _FoldTable(dict[int, "int | None"]):
    """``str.translate``'s table for the folded form: the readings set below, and any other
    character's found when first met (``__missing__``): a decimal digit's ASCII digit, an
    invisible character noted in ``_INVISIBLE`` and kept, or dropped when ``drop``, else the
    character itself."""

    def __init__(self, readings: dict[int, int], drop: bool) -> None:
        super().__init__(readings)
        self.drop = drop

    def __missing__(self, code: int) -> int | None:
        ch = chr(code)
        value: int | None = code
        if ch.isdecimal():
            value = 0x30 + unicodedata.decimal(ch)
        elif unicodedata.category(ch) == "Cf":
            _INVISIBLE.add(ch)
            value = None if self.drop else code
        if len(self) < _FOLD_CACHE:
            self[code] = value
        return value


_INVISIBLE: set[str] = set()  # the invisible characters (category Cf) met so far
_READINGS: dict[int, int] = (
    {i: i for i in range(128)}
    | dict.fromkeys(
        map(ord, "\u00a0\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a\u202f\u205f\u3000"), 0x20
    )
    | {code: code - 0xFEE0 for code in range(0xFF01, 0xFF5F) if code != 0xFF0D}  # full-width ASCII
    | {0xFE6B: ord("@"), 0x3002: ord("."), 0xFF61: ord("."), 0xFE52: ord("."), 0x2024: ord(".")}
)
_FOLD = _FoldTable(_READINGS, drop=False)  # a character for a character
_READ = _FoldTable(_READINGS, drop=True)  # the same, without the invisible characters
_invisible_runs: tuple[int, re.Pattern[str]] = (0, re.compile("(?!)"))


def _fold(text: str, table: _FoldTable = _FOLD) -> str:
    """A non-ASCII ``text`` translated by ``table``, each dash between two digits a "-"."""
    folded = text.translate(table)
    if folded.isascii():
        return folded
    buf = None  # the folded text in UTF-32 when a dash is to change: one copy, not a piece a dash
    for m in _DASH_IN_NUMBER.finditer(folded):
        if buf is None:
            buf = bytearray(folded.encode("utf-32-le", "surrogatepass"))
        buf[4 * m.start() : 4 * m.start() + 4] = b"-\0\0\0"
    return folded if buf is None else buf.decode("utf-32-le", "surrogatepass")


def _invisible() -> re.Pattern[str]:
    """A run of the invisible characters met so far."""
    global _invisible_runs
    if _invisible_runs[0] != len(_INVISIBLE):  # grows to the ~160 characters of category Cf at most
        chars = "".join(re.escape(ch) for ch in sorted(_INVISIBLE))
        _invisible_runs = (len(_INVISIBLE), re.compile(f"[{chars}]+"))
    return _invisible_runs[1]


class _Unfold:
    """Offsets into a text read without its invisible characters, as offsets into the text: asked
    in increasing order, a start counts the invisible characters before it, an end those inside
    the span too (not those after it)."""

    __slots__ = ("runs", "run", "shift")

    def __init__(self, text: str) -> None:
        self.runs = _invisible().finditer(text)
        self.run = next(self.runs, None)
        self.shift = 0  # invisible characters before the offset last asked

    def _skip(self, offset: int, before_end: bool) -> int:
        run = self.run
        while run is not None and (
            run.start() - self.shift < offset or (not before_end and run.start() - self.shift == offset)
        ):
            self.shift += run.end() - run.start()
            run = next(self.runs, None)
        self.run = run
        return offset + self.shift

    def start(self, offset: int) -> int:
        return self._skip(offset, before_end=False)

    def end(self, offset: int) -> int:
        return self._skip(offset, before_end=True)


def _finders(text: str, rules: TextPrivacy) -> Iterator[tuple[str, _Budget]]:
    """The finders worth running on ``text``, each named by kind with a fresh budget."""
    kinds = rules.kinds
    has_digit = _DIGIT.search(text) is not None
    for kind in kinds:
        if kind == "email" and "@" in text:
            yield kind, _Budget(len(text))
        elif kind in ("phone", "card", "iban") and has_digit:
            yield kind, _Budget(len(text))
        elif kind == "ip" and ((has_digit and "." in text) or ":" in text):
            yield kind, _Budget(len(text))
        elif kind == "url_secret" and _URL_CUE.search(text) is not None:
            yield kind, _Budget(len(text))


def _run(kind: str, text: str, rules: TextPrivacy, budget: _Budget, phone_field: bool) -> Iterator[Span]:
    if kind == "email":
        return _emails(text)
    if kind == "phone":
        return _phones(text, rules.phone_region, budget, phone_field)
    if kind == "card":
        return _cards(text, budget)
    if kind == "iban":
        return _ibans(text, budget)
    if kind == "ip":
        return _ips(text, budget)
    return _urls(text, budget)


def find_personal(text: str, rules: TextPrivacy, phone_field: bool = False) -> Findings:
    """Find the personal data in ``text`` that ``rules.kinds`` asks for.

    Args:
        text: a caption or one conversation turn, as it will be released.
        rules: the recipe's ``privacy.text``; with ``mode: off`` nothing is looked for.
        phone_field: the text is a field named as a phone number (a json's ``phone``): bare
            digits there are a number, not an id.

    Returns:
        A :class:`Findings` (a tuple of :class:`Span`) sorted by start, non-overlapping (the
        longer span wins an overlap; at equal length the order url_secret, email, iban, card,
        phone, ip decides), at most ``MAX_SPANS`` long; ``truncated`` when a bound stopped the
        scan, in which case the spans are complete up to where it stopped.
    """
    if rules.mode == "off" or not text:
        return _NOTHING
    folded = text if text.isascii() else _fold(text)
    spans, limit = _scan(folded, rules, phone_field)
    truncated = limit < len(text)
    if not text.isascii() and _INVISIBLE and _invisible().search(folded):
        read = _fold(text, _READ)  # read again without the invisible characters
        more, read_limit = _scan(read, rules, phone_field)
        back = _Unfold(text)
        more = [Span(s.kind, back.start(s.start), back.end(s.end)) for s in more]
        if read_limit < len(read):
            limit, truncated = min(limit, back.end(read_limit)), True
        spans = _resolve(spans + more) if more else spans
        if truncated:
            spans = [s for s in spans if s.end <= limit]
    if not spans:
        return Findings((), truncated=True) if truncated else _NOTHING
    if len(spans) > MAX_SPANS:
        spans, truncated = spans[:MAX_SPANS], True
    return Findings(spans, truncated)


def _scan(text: str, rules: TextPrivacy, phone_field: bool) -> tuple[list[Span], int]:
    """The spans found in ``text`` (sorted, disjoint) and where a bound stopped the scan (its
    length when none did); spans end there at the latest."""
    found: list[Span] = []
    limit = len(text)
    for kind, budget in _finders(text, rules):
        count = 0
        for span in _run(kind, text, rules, budget, phone_field):
            found.append(span)
            count += 1
            if count >= MAX_SPANS:
                budget.stop_at(span.end)
                break
        limit = min(limit, budget.limit)
    if not found:
        return found, limit
    if limit < len(text):
        found = [s for s in found if s.end <= limit]
    return _resolve(_outside_url_paths(text, found)), limit


def _outside_url_paths(text: str, found: list[Span]) -> list[Span]:
    """``found`` less the phone numbers inside a URL's host and path: the digit runs there are
    file names and ids ("/photos/2345678901.jpg"), and paths are not inspected (a query's
    values are: ``?phone=...``)."""
    if not any(s.kind == "phone" for s in found) or _URL_CUE.search(text) is None:
        return found
    starts, ends = [], []  # of each URL's host and path, in order, disjoint
    for m in _URL.finditer(text):
        url = m.group()[:MAX_URL_CHARS]
        cut = min((i for i in (url.find("?"), url.find("#")) if i >= 0), default=_url_end(url))
        starts.append(m.start())
        ends.append(m.start() + cut)

    def inside(span: Span) -> bool:
        i = bisect.bisect_right(starts, span.start) - 1
        return i >= 0 and span.end <= ends[i]

    return [s for s in found if s.kind != "phone" or not inside(s)]


def _resolve(found: list[Span]) -> list[Span]:
    """Drop overlapped spans: longest first, then by kind priority, then leftmost."""
    if len(found) == 1:
        return found
    found.sort(key=lambda s: (s.start - s.end, _PRIORITY[s.kind], s.start))
    starts: list[int] = []
    kept: list[Span] = []
    for span in found:
        i = bisect.bisect_left(starts, span.start)
        if i > 0 and kept[i - 1].end > span.start:
            continue
        if i < len(kept) and kept[i].start < span.end:
            continue
        starts.insert(i, span.start)
        kept.insert(i, span)
    return kept


_MASK = TextPrivacy(mode="redact")


def masked(text: str) -> str:
    """``text`` with its personal data of every kind replaced by placeholders, whatever a
    recipe's mode: for third parties' text quoted in a ledger's detail (an unrecognised license,
    a record's role, a server's message), where the values are never written."""
    found = find_personal(text, _MASK)
    return redact(text, found) if found else text


def redact(text: str, spans: Iterable[Span]) -> str:
    """``text`` with each span replaced by its kind's placeholder (``<EMAIL>``, ``<PHONE>``, ...).

    Raises:
        ValueError: a span outside the text, of an unknown kind, or overlapping another.
    """
    pieces: list[str] = []
    pos = 0
    for span in sorted(spans, key=lambda s: s.start):
        if span.start < pos or span.end > len(text) or span.start >= span.end:
            raise ValueError(f"span {span.kind} {span.start}-{span.end} overlaps or is outside the text")
        placeholder = PLACEHOLDERS.get(span.kind)
        if placeholder is None:
            raise ValueError(f"unknown kind of personal data: {span.kind!r}")
        pieces.append(text[pos : span.start])
        pieces.append(placeholder)
        pos = span.end
    pieces.append(text[pos:])
    return "".join(pieces)


def describe(spans: Iterable[Span], field: str | None = None) -> str:
    """A short, stable detail for a ledger row or a sample's json: kinds and offsets, never values.

    ``email 10-27, phone 40-52`` (end exclusive); with ``field``, ``turn 3: email 0-12``. At most
    ``DESCRIBE_MAX`` spans are listed, then ``+N more``; a truncated scan ends ``scan truncated``.
    Empty when there is nothing to say.
    """
    truncated = isinstance(spans, Findings) and spans.truncated
    listed = tuple(spans)
    parts = [f"{s.kind} {s.start}-{s.end}" for s in listed[:DESCRIBE_MAX]]
    if len(listed) > DESCRIBE_MAX:
        parts.append(f"+{len(listed) - DESCRIBE_MAX} more")
    if truncated:
        parts.append("scan truncated")
    if not parts:
        return ""
    body = ", ".join(parts)
    return f"{field}: {body}" if field else body


__all__ = [
    "DESCRIBE_MAX",
    "MAX_CHECKS",
    "MAX_PHONE_WINDOWS",
    "MAX_SPANS",
    "PLACEHOLDERS",
    "Findings",
    "Span",
    "describe",
    "find_personal",
    "is_card_number",
    "redact",
    "url_has_secret",
]
