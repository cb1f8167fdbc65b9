"""Personal data in captions and turns is found with exact offsets, redacted by kind, and never guessed from look-alikes."""

from __future__ import annotations

import pickle
import random
import string
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tasks.formats.recipe_privacy import TEXT_KINDS, TextPrivacy
from tasks.policies.personal import (
    MAX_SPANS,
    PLACEHOLDERS,
    Findings,
    Span,
    _resolve,
    describe,
    find_personal,
    is_card_number,
    may_hold_url,
    redact,
)

ALL = TextPrivacy()


def spans_of(text: str, rules: TextPrivacy = ALL) -> list[tuple[str, str]]:
    return [(s.kind, text[s.start : s.end]) for s in find_personal(text, rules)]


def luhn_complete(body: str) -> str:
    """``body`` with the Luhn check digit appended."""
    total = 0
    for i, ch in enumerate(reversed(body)):
        d = int(ch) * (1 if i % 2 else 2)
        total += d - 9 if d > 9 else d
    return body + str(-total % 10)


def luhn_ok(digits: str) -> bool:
    return luhn_complete(digits[:-1]) == digits


# -- each kind, exact offsets ---------------------------------------------------------------

FOUND = [
    # e-mail
    ("Write to john.doe@example.com today", "email", 9, 29),
    ("mail: a.b+c@sub.example.co.uk.", "email", 6, 29),
    ("JOHN_DOE%X@EXAMPLE.ORG", "email", 0, 22),
    # phone, region US
    ("Call (650) 253-0000 today", "phone", 5, 19),
    ("650.253.0000", "phone", 0, 12),
    ("+44 20 7946 0958", "phone", 0, 16),
    ("+1 (650) 253-0000 ext. 123", "phone", 0, 17),
    ("tel:+16502530000", "phone", 4, 16),
    ("on set +44 20 7946 0149 1080p collection", "phone", 7, 23),  # last token dropped
    ("call (650) 253-0356 2024-05-01 up", "phone", 5, 19),
    # payment cards
    ("card 4111 1111 1111 1111 exp", "card", 5, 24),
    ("card 4111111111111111.", "card", 5, 21),
    ("amex 3782-822463-10005 ok", "card", 5, 22),
    ("mc 5555555555554444", "card", 3, 19),
    ("card 4111 1111 1111 1111 2024 dress", "card", 5, 24),  # a year after it
    ("card 4111 1111 1111 1111 2024-05-01", "card", 5, 24),
    ("card 4111-1111-1111-1111 12/25", "card", 5, 24),
    ("card 4111 1111 1111 1111/25", "card", 5, 24),
    ("visa 4000 0000 0000 0000 006", "card", 5, 28),  # 19 digits, 4-4-4-4-3
    ("card 4111 1111 1111 1111 12/25", "card", 5, 24),  # its expiry month is not a fifth group
    ("amex 3782 822463 10005 12/25 ok", "card", 5, 22),
    ("John,4111111111111111,12/25", "card", 5, 21),  # a list's commas
    ("cvv 123 4111111111111111", "card", 8, 24),
    ("No. 1 4111 1111 1111 1111", "card", 6, 25),
    # IBAN
    ("IBAN DE89 3704 0044 0532 0130 00 BIC COBADEFFXXX", "iban", 5, 32),
    ("GB82WEST12345698765432", "iban", 0, 22),
    ("pay to GB82 WEST 1234 5698 7654 32.", "iban", 7, 34),
    # IP addresses
    ("server 8.8.8.8:53", "ip", 7, 14),
    ("from 93.184.216.34.", "ip", 5, 18),
    ("ip 2001:4860:4860::8888 ok", "ip", 3, 23),
    ("[https://ex.com/a?token=abc123xyz](link)", "url_secret", 1, 33),  # Markdown's order, reversed
    ("https://x.com/p?call=650-253-0000", "phone", 21, 33),
    ("Phone number: 6502530000", "phone", 14, 24),
    (
        "call me at 6502530000",
        "phone",
        11,
        21,
    ),  # a phone word a few words before bare digits  # a query's values are read, a path's digits not
    ("To order: +44 20 7946 0958", "phone", 10, 26),
    ("paid for order 4111 1111 1111 1111", "card", 15, 34),
    ("call +1 415 555 0132x12", "phone", 5, 20),
    ("mail o'brien@example.com", "email", 5, 24),
    ("mail zelda\uff20example.com", "email", 5, 22),  # a full-width at sign
    ("file jane.doe@example.com.jpg", "email", 5, 25),  # an address as a file's name
    ("ivan@example.xn--p1ai", "email", 0, 21),
    ("IP:2001:4860:4860::8888", "ip", 3, 23),
    ("from 2001:4860:4860::8888: ok", "ip", 5, 25),
    ("card 4111\u00a01111\u00a01111\u00a01111", "card", 5, 24),
    ("+44\u202f20\u202f7946\u202f0958", "phone", 0, 16),
    ("Www.example.com/?token=abcd1234", "url_secret", 0, 31),
    ("wWw.example.com/?token=abcd1234", "url_secret", 0, 31),  # www. in any case, as _URL matches it
    ("https://example.com/x?email=john%40example.com", "url_secret", 0, 46),
    ("https://e.com/?pw=hunter2xx", "url_secret", 0, 27),
    # URLs with secrets
    ("https://user:pw@example.com/x", "url_secret", 0, 29),
    ("ftp://anon@ftp.example.org/pub", "url_secret", 0, 30),
    ("get https://example.com/a?token=abc123xyz now", "url_secret", 4, 41),
    ("see www.example.com/?api_key=AIzaSyA1234567890abcdef", "url_secret", 4, 52),
    ("(https://example.com/a?sig=Zm9vYmFy). Thanks", "url_secret", 1, 35),
    ("https://s3.example.com/o?X-Amz-Signature=9f86d081884c7d65", "url_secret", 0, 57),
    ("https://app.example.com/cb#access_token=ya29.a0AfH6SMB&token_type=bearer", "url_secret", 0, 72),
    ("https://ex.com/p?session=Zk3q9WmX2pLr7TvB", "url_secret", 0, 41),
    ("https://ex.com/p?fbclid=IwAR3xYzAbC9dEfGhIjKlMnOpQrStUvWxYz012345", "url_secret", 0, 65),
]


@pytest.mark.parametrize(("text", "kind", "start", "end"), FOUND)
def test_each_kind_is_found_with_exact_offsets(text, kind, start, end):
    assert find_personal(text, ALL) == (Span(kind, start, end),)


@pytest.mark.parametrize(
    "brand_prefix",
    ["4", "51", "55", "2221", "2720", "34", "37", "6011", "65", "36", "3530", "62", "6759", "2200", "9792"],
)
def test_each_card_network_prefix_is_a_card(brand_prefix):
    length = {"34": 15, "37": 15, "36": 14}.get(brand_prefix, 16)
    digits = luhn_complete(brand_prefix + "1" * (length - len(brand_prefix) - 1))
    assert is_card_number(digits)
    assert spans_of(f"paid with {digits}") == [("card", digits)]


# -- what is not personal data --------------------------------------------------------------

LOOK_ALIKES = [
    "Canon EOS 5D Mark IV body",
    "Wallpaper 1920x1080",
    "3840 x 2160 pixels",
    "taken 2024-05-01",
    "on 2024/05/01",
    "am 01.05.2024",
    "12/05/2024 10:30",
    "2012-01-02 08:00:00 UTC",
    "20240501",
    "ISBN 978-3-16-148410-0",
    "ISBN 0-306-40615-2",
    "ISBN: 9783161484100",
    "EAN 4006381333931",
    "UPC 012345678905",
    "Price $1,299.99",
    "€ 1.299,00 inkl. MwSt",
    "from 1990 to 2020",
    "seasons 2019-2020 2020-2021",
    "sizes 1 2 3 4 5 6 7 8 9 10",
    "1 2 3 4 5 6 7 8 9 0",
    "12 34 56 78 90",
    "Proc. VLDB 12(3): 211-227 (2003)",
    "Samsung Galaxy S23 Ultra 256GB",
    "SKU 2345678901",
    "Item #2345678901",
    "order 20240501123",
    "Serial No. 4111111111111111",
    "IMEI 356938035643809",
    "coordinates 40.7128, -74.0060",
    "population 8 336 817",
    "room 1204-1206",
    "Zip 90210-1234",
    "score 3-2 1-0 2-1 4-4",
    "Nikon D850 + AF-S 24-70mm f/2.8",
    "ratio 16:9 21:9",
    "1234 5678 9012 3456",
    "0000 0000 0000 0000",
    "4111 1111 1111 1112",  # Luhn fails
    "4111 1111 1111 1111 1111 1111 1111",  # seven groups: a table of numbers
    "4111-1111-1111-1111-123",  # 19 digits, judged whole: Luhn fails
    "multicast 224.0.0.1 ff02::1",
    "Scene 2::3, Bible 3::16, Bad::Cafe, 10::20",  # Python calls these global: not unicast
    "Ratio 1:2:3:4:5:6:7:8",
    "https://cdn.example.com/photos/2345678901.jpg",
    "SKU 4111 1111 1111 1111",
    "Stock Photo - 2345678901",  # bare digits are an id, unless a phone word comes before them
    "ID: 6502530000, Photo #6502530000",
    "https://e.com/?mail=true&mode=tel",
    "photo www.example.com/a_6502530000_b.jpg",
    "Figure 2.3.1.4, Section 3.4.5.6, § 8.8.4.4",
    "1234 5678 9012 3456 7890",
    "version 1.2.3.4",
    "router 10.0.0.1",
    "0.0.0.0",
    "localhost 127.0.0.1",
    "docs 192.0.2.1",
    "v2.14.3",
    "12:30:45",
    "std::vector<int>",
    "MAC 00:1A:2B:3C:4D:5E",
    "user@localhost",
    "logo@2x.png",
    "follow @handle",
    "a @ b . com",
    "https://example.com/page?id=12345&lang=en",
    "https://example.com/search?q=tokens&key=summer",
    "https://example.com/login?password=",
    "https://example.com/a?session=2",
    "https://cdn.example.com/ab/cd/0123456789abcdef0123456789abcdef.jpg",
    "https://medium.com/@user/post-123",
    "DE88 3704 0044 0532 0130 00",  # wrong check digits
    "GB82 WEST 1234 5698 7654 33",
    "de89 3704 0044 0532 0130 00",  # lower case
]


@pytest.mark.parametrize("region", ["US", "GB", "DE", "FR", "IN", "JP", "BR"])
def test_look_alikes_are_not_personal_data(region):
    rules = TextPrivacy(phone_region=region)
    assert {text: spans_of(text, rules) for text in LOOK_ALIKES if find_personal(text, rules)} == {}


def test_several_numbers_in_one_run_are_each_found():
    text = "ring 650 253 0000 650 253 0001"
    assert spans_of(text) == [("phone", "650 253 0000"), ("phone", "650 253 0001")]


def test_luhn_valid_numbers_without_an_issuer_prefix_are_not_cards():
    rng = random.Random(7)
    for prefix in ("0", "1", "7", "99", "33", "56", "80", "89"):
        for length in range(13, 20):
            digits = luhn_complete(prefix + "".join(rng.choices(string.digits, k=length - len(prefix) - 1)))
            assert luhn_ok(digits)
            assert not is_card_number(digits), digits
            assert find_personal(digits, TextPrivacy(kinds=("card",))) == ()


def test_issuer_lengths_are_respected():
    assert is_card_number(luhn_complete("4" + "1" * 14))  # Visa, 16
    assert not is_card_number(luhn_complete("4" + "1" * 11))  # 13-digit Visa is left out
    assert not is_card_number(luhn_complete("37" + "1" * 14))  # Amex is 15, not 17


def test_luhn_invalid_card_numbers_are_not_cards():
    for good in ("4111111111111111", "5555555555554444", "378282246310005", "6011111111111117"):
        for last in "0123456789":
            bad = good[:-1] + last
            if bad != good:
                assert find_personal(f"card {bad}", ALL) == ()


def iban_with_check(country: str, bban: str, check: int) -> str:
    return f"{country}{check:02d}{bban}"


def iban_check(country: str, bban: str) -> int:
    return 98 - int("".join(str(int(ch, 36)) for ch in bban + country + "00")) % 97


def test_iban_check_digits_congruent_mod_97_are_not_ibans():
    # A Dutch account whose check digits are 02: 99 is congruent mod 97 and passes the checksum,
    # but ISO 13616 never issues 00, 01 or 99.
    bban = next(b for b in (f"ABNA{n:010d}" for n in range(10_000)) if iban_check("NL", b) == 2)
    assert spans_of(f"to {iban_with_check('NL', bban, 2)}") == [("iban", iban_with_check("NL", bban, 2))]
    assert spans_of(f"to {iban_with_check('NL', bban, 99)}") == []


# -- rules ----------------------------------------------------------------------------------

MIXED = "mail a@example.com, call +1 650-253-0000, card 4111 1111 1111 1111, from 8.8.8.8, https://example.org/?token=abc123xyz"


def test_only_the_kinds_asked_for_are_found():
    assert {s.kind for s in find_personal(MIXED, ALL)} == set(TEXT_KINDS) - {"iban"}
    assert spans_of(MIXED, TextPrivacy(kinds=("email",))) == [("email", "a@example.com")]
    assert spans_of(MIXED, TextPrivacy(kinds=("card", "ip"))) == [("card", "4111 1111 1111 1111"), ("ip", "8.8.8.8")]
    assert find_personal(MIXED, TextPrivacy(kinds=())) == ()
    assert find_personal(MIXED, TextPrivacy(mode="off")) == ()


@pytest.mark.parametrize(
    ("text", "found_in"),
    [
        ("Ruf an: 030 901820.", {"DE"}),
        ("Call (650) 253-0000.", {"US"}),
        ("ring 020 7946 0958", {"GB"}),
        ("tél. 01 42 68 53 00", {"FR"}),
        ("+49 30 901820", {"US", "DE", "GB", "FR"}),
    ],
)
def test_phone_region_decides_national_formats_only(text, found_in):
    found = {r for r in ("US", "DE", "GB", "FR") if find_personal(text, TextPrivacy(phone_region=r))}
    assert found == found_in


# -- overlaps -------------------------------------------------------------------------------


def test_overlaps_keep_the_longer_span():
    # the URL's user@host is an e-mail look-alike inside the URL
    assert spans_of("see ftp://john@example.com/pub") == [("url_secret", "ftp://john@example.com/pub")]
    # the phone-like digits after the country code are part of the IBAN
    assert spans_of("DE89 3704 0044 0532 0130 00", TextPrivacy(phone_region="DE")) == [
        ("iban", "DE89 3704 0044 0532 0130 00")
    ]
    # a public IP in a URL with a token
    assert spans_of("http://93.184.216.34/a?token=abcdefgh") == [
        ("url_secret", "http://93.184.216.34/a?token=abcdefgh")
    ]


def test_equal_length_overlaps_go_to_the_more_specific_kind():
    spans = [
        Span("phone", 0, 16),
        Span("card", 0, 16),
        Span("ip", 20, 27),
        Span("email", 18, 25),
        Span("phone", 30, 40),
    ]
    assert _resolve(spans) == [Span("card", 0, 16), Span("email", 18, 25), Span("phone", 30, 40)]


# -- redact and describe --------------------------------------------------------------------


def test_redact_replaces_each_span_with_its_placeholder():
    found = find_personal(MIXED, ALL)
    assert redact(MIXED, found) == "mail <EMAIL>, call <PHONE>, card <CARD>, from <IP>, <URL>"
    assert redact("nothing here", ()) == "nothing here"
    assert set(PLACEHOLDERS) == set(TEXT_KINDS)


def test_redact_refuses_overlapping_or_outside_spans():
    with pytest.raises(ValueError, match="overlaps"):
        redact("abcdef", [Span("email", 0, 4), Span("phone", 2, 5)])
    with pytest.raises(ValueError, match="outside"):
        redact("abc", [Span("email", 1, 9)])
    with pytest.raises(ValueError, match="unknown kind"):
        redact("abc", [Span("name", 0, 1)])


def test_describe_gives_kinds_and_offsets_never_values():
    found = find_personal(MIXED, ALL)
    detail = describe(found)
    assert detail == "email 5-18, phone 25-40, card 47-66, ip 73-80, url_secret 82-118"
    assert "example" not in detail and "4111" not in detail
    assert describe(found[:1], field="turn 3") == "turn 3: email 5-18"
    assert describe(()) == ""


def test_describe_is_capped_and_says_when_the_scan_stopped():
    text = " ".join(f"u{i}@example.com" for i in range(300))
    found = find_personal(text, ALL)
    assert len(found) == MAX_SPANS and found.truncated
    assert describe(found).endswith(f"+{MAX_SPANS - 8} more, scan truncated")
    assert describe(found, field="caption").startswith("caption: email 0-14, email 15-29,")
    assert describe(Findings((), truncated=True)) == "scan truncated"


def test_findings_survive_pickling_with_their_flag():
    found = find_personal(" ".join(f"u{i}@example.com" for i in range(300)), ALL)
    again = pickle.loads(pickle.dumps(found))
    assert again == found and again.truncated and isinstance(again, Findings)


# -- bounds ---------------------------------------------------------------------------------


def test_max_spans_caps_the_result_and_keeps_it_a_prefix():
    text = " and ".join(["8.8.8.8", "a@example.com"] * 200)
    found = find_personal(text, ALL)
    assert len(found) == MAX_SPANS and found.truncated
    assert [s.start for s in found] == sorted(s.start for s in found)
    # complete up to where it stopped: no gap in the alternation
    assert [s.kind for s in found[:4]] == ["ip", "email", "ip", "email"]
    assert all(found[i].kind != found[i + 1].kind for i in range(len(found) - 1))


MIB = 1 << 20
HOSTILE = {
    "digits and separators": (("1-2 3.4-5 " * (MIB // 10 + 1))[:MIB], True),
    "digit run": (("0123456789" * (MIB // 10 + 1))[:MIB], False),
    "spaced digits": (("1 2 3 4 5 6 7 8 9 0 " * (MIB // 20 + 1))[:MIB], True),
    "groups of four": (("4111 " * (MIB // 5 + 1))[:MIB], True),
    "at signs": ("@" * 100_000, False),
    "a@b.": (("a@b." * (MIB // 4))[:MIB], False),
    "a domain of dots": ("x@" + "a." * (MIB // 2), False),
    "a local part of dots": ("a." * (MIB // 2) + "@example.com", False),
    "open brackets": ("1 (" * (MIB // 3), True),
    "a local part of dashes": ("a-" * (MIB // 2) + "@", False),
    "long url": ("https://example.com/" + "a" * MIB, True),
    "long url query": ("https://example.com/?" + "a=b&" * (MIB // 4), True),
    "colons": ("a:" * (MIB // 2), False),
    "iban look-alikes": ("DE89 3704 " * (MIB // 10), True),
    "pluses": ("+1 " * (MIB // 3), False),
    "dots": ("1." * (MIB // 2), True),
    "www": ("www." * (MIB // 4), True),
    "closing brackets after a url": ("https://e.com/" + ")" * MIB, True),
    "dots and brackets after a url": ("https://e.com/" + ".)" * (MIB // 2), True),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_input_completes_with_a_bounded_result(name):
    text, truncated = HOSTILE[name]
    tracemalloc.start()
    try:
        found = find_personal(text, ALL)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert found == ()
    assert found.truncated is truncated
    # a 1 MiB text costs at most a few MiB more (a URL's match is one copy of it)
    assert peak < 4 * MIB


def test_a_token_in_a_huge_url_is_found_on_its_first_part():
    text = "https://example.com/?token=" + "a" * MIB
    found = find_personal(text, ALL)
    assert found == (Span("url_secret", 0, 16384),) and found.truncated


def test_a_long_log_of_dates_and_numbers_is_read_to_its_end():
    """A fine-tuning turn holding a log: each date and time is a digit run phonenumbers is
    asked about; the scan reads the whole of it, so it is not refused as truncated."""
    log = "".join(f"2023-01-05 12:00:{i % 60:02d} INFO step {i} done\n" for i in range(600))
    found = find_personal(log, ALL)
    assert found == () and not found.truncated


def test_many_phone_numbers_stop_at_the_cap():
    found = find_personal("(650) 253-0000, " * 20_000, ALL)
    assert len(found) == MAX_SPANS and found.truncated
    assert all(s.kind == "phone" for s in found)


# -- properties -----------------------------------------------------------------------------

NOISY = st.text(alphabet="0123456789 -.()+@:/?=&#abcxyzABDEGW", max_size=120)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.text(max_size=200), NOISY))
def test_any_text_gives_sorted_disjoint_spans_within_bounds(text):
    found = find_personal(text, ALL)
    assert isinstance(found, Findings) and len(found) <= MAX_SPANS
    end = 0
    for span in found:
        assert end <= span.start < span.end <= len(text)
        assert span.kind in TEXT_KINDS
        end = span.end
    redacted = redact(text, found)
    assert len(found) == sum(redacted.count(p) for p in PLACEHOLDERS.values()) - sum(
        text.count(p) for p in PLACEHOLDERS.values()
    )


PLANTS = [
    "john.doe@example.com",
    "+1 650-253-0000",
    "+44 20 7946 0958",
    "4111 1111 1111 1111",
    "5555555555554444",
    "DE89 3704 0044 0532 0130 00",
    "8.8.8.8",
    "2001:4860:4860::8888",
    "https://u:p@example.org/x",
    "https://example.com/?token=abc123xyz",
]
FILLER = st.text(alphabet=string.ascii_letters + " ,", max_size=20)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(FILLER, st.sampled_from(PLANTS)), max_size=8), st.sampled_from(["US", "GB", "DE"]))
def test_redacted_text_has_nothing_left_to_find(pieces, region):
    rules = TextPrivacy(phone_region=region)
    text = " and ".join(pieces)
    found = find_personal(text, rules)
    assert sum(text.count(p) for p in PLANTS) == len(found)
    assert find_personal(redact(text, found), rules) == ()


@settings(max_examples=500, deadline=None)
@given(st.text(alphabet=string.digits, min_size=13, max_size=19), st.sampled_from(["", " ", "-"]))
def test_a_digit_run_failing_luhn_is_never_a_card(digits, sep):
    if luhn_ok(digits):
        digits = digits[:-1] + str((int(digits[-1]) + 1) % 10)
    text = sep.join(digits[i : i + 4] for i in range(0, len(digits), 4)) if sep else digits
    assert find_personal(f"pay {text} now", TextPrivacy(kinds=("card",))) == ()


@settings(max_examples=300, deadline=None)
@given(NOISY, st.sampled_from(["US", "GB", "DE"]))
def test_redaction_leaves_nothing_of_a_kind_it_found(text, region):
    rules = TextPrivacy(phone_region=region)
    found = find_personal(text, rules)
    kinds = {s.kind for s in found}
    assert [s for s in find_personal(redact(text, found), rules) if s.kind in kinds] == []


# -- what is read through: other digit scripts, dash-likes, dot-likes, invisible characters --

# The zero of each script's digits: Arabic-Indic, Extended Arabic-Indic, Devanagari, Bengali,
# Thai, full-width, mathematical bold and monospace.
DIGIT_ZEROS = [0x0660, 0x06F0, 0x0966, 0x09E6, 0x0E50, 0xFF10, 0x1D7CE, 0x1D7F6]


def in_script(text: str, zero: int) -> str:
    return "".join(chr(zero + int(ch)) if ch in string.digits else ch for ch in text)


@pytest.mark.parametrize("zero", DIGIT_ZEROS, ids=hex)
@pytest.mark.parametrize(
    ("value", "kind"),
    [
        ("4111 1111 1111 1111", "card"),
        ("4111111111111111", "card"),
        ("+44 20 7946 0958", "phone"),
        ("GB82 WEST 1234 5698 7654 32", "iban"),
        ("8.8.8.8", "ip"),
        ("https://example.com/?token=abc123xyz", "url_secret"),
    ],
)
def test_values_in_any_digit_script_are_found_and_redacted(zero, value, kind):
    disguised = in_script(value, zero)
    text = f"pay {disguised} now"
    assert find_personal(text, ALL) == (Span(kind, 4, 4 + len(disguised)),)
    redacted = redact(text, find_personal(text, ALL))
    assert redacted == f"pay {PLACEHOLDERS[kind]} now"
    assert not any(ch.isdecimal() for ch in redacted)


DASH_LIKES = ["\u2010", "\u2011", "\u2012", "\u2013", "\u2014", "\u2212", "\ufe63", "\uff0d"]


def test_a_lone_surrogate_beside_a_folded_value_is_kept():
    text = "\ud800 card 4111\u20131111\u20131111\u20131111\u200b \udfff"
    found = find_personal(text, ALL)
    assert found == (Span("card", 7, 26),)
    assert redact(text, found) == "\ud800 card <CARD>\u200b \udfff"


@pytest.mark.parametrize("dash", DASH_LIKES, ids=lambda d: f"U+{ord(d):04X}")
def test_dash_like_separators_in_a_number_are_read_as_dashes(dash):
    card = f"4111{dash}1111{dash}1111{dash}1111"
    amex = f"3782{dash}822463{dash}10005"
    phone = f"(650) 253{dash}0000"
    text = f"card {card}, amex {amex}, call {phone}"
    assert spans_of(text) == [("card", card), ("card", amex), ("phone", phone)]
    redacted = redact(text, find_personal(text, ALL))
    assert redacted == "card <CARD>, amex <CARD>, call <PHONE>"
    assert "1111" not in redacted and "0000" not in redacted


@pytest.mark.parametrize("dash", DASH_LIKES, ids=lambda d: f"U+{ord(d):04X}")
def test_a_dash_outside_a_number_stays_prose(dash):
    # read as "-" it would make the card part of a longer code ("card-4111...", "...1111-great")
    assert spans_of(f"card{dash}4111 1111 1111 1111") == [("card", "4111 1111 1111 1111")]
    assert spans_of(f"4111111111111111{dash}great") == [("card", "4111111111111111")]
    assert find_personal(f"seasons 2019{dash}2020 2020{dash}2021", ALL) == ()


INVISIBLES = ["\u200b", "\u200c", "\u200d", "\u2060", "\u00ad", "\ufeff", "\u200e", "\u200f", "\u202a", "\u2066"]
# Each value with a slot, "|", where an invisible character goes.
HIDDEN = [
    ("jane.doe|@example.com", "email"),
    ("jane|.doe@example.com", "email"),
    ("jane.doe@exa|mple.com", "email"),
    ("4111|1111|1111|1111", "card"),
    ("4111 1111 |1111 1111", "card"),
    ("+44|20|7946|0958", "phone"),
    ("+44 20 7946| 0958", "phone"),
    ("GB82|WEST|1234|5698|7654|32", "iban"),
    ("GB82 WEST 12|34 5698 7654 32", "iban"),
    ("8.8|.8.8", "ip"),
    ("https://us|er:pw@example.com/x", "url_secret"),
    ("https://example.com/?to|ken=abcd", "url_secret"),
]


@pytest.mark.parametrize("invisible", INVISIBLES, ids=lambda c: f"U+{ord(c):04X}")
@pytest.mark.parametrize(("value", "kind"), HIDDEN)
def test_invisible_characters_inside_a_value_do_not_hide_it(invisible, value, kind):
    hidden = value.replace("|", invisible)
    text = f"from {hidden} today"
    found = find_personal(text, ALL)
    # the span is in the text's own offsets and covers the invisible characters inside the value
    assert found == (Span(kind, 5, 5 + len(hidden)),)
    redacted = redact(text, found)
    assert redacted == f"from {PLACEHOLDERS[kind]} today"
    assert invisible not in redacted


def test_invisible_characters_around_a_value_stay_outside_its_span():
    text = "\u200bjane.doe\u200c@example.com\u200b and\u2060 4111\u200b1111\u200b1111\u200b1111\u2060."
    assert spans_of(text) == [
        ("email", "jane.doe\u200c@example.com"),
        ("card", "4111\u200b1111\u200b1111\u200b1111"),
    ]
    assert redact(text, find_personal(text, ALL)) == "\u200b<EMAIL>\u200b and\u2060 <CARD>\u2060."


def test_invisible_characters_between_a_word_and_a_value_still_part_them():
    # read without them, "card\u200b4111..." would be one code "card4111..."; it is read as it is too
    assert spans_of("card\u200b4111 1111 1111 1111") == [("card", "4111 1111 1111 1111")]
    assert spans_of("x\u200d4111111111111111\u200dy") == [("card", "4111111111111111")]
    assert spans_of("id\u200b4111111111111111") == [("card", "4111111111111111")]


DOTS = ["\u3002", "\uff61", "\uff0e"]


@pytest.mark.parametrize("dot", DOTS, ids=lambda d: f"U+{ord(d):04X}")
def test_ideographic_and_halfwidth_full_stops_are_dots(dot):
    email = f"jane.doe@mail{dot}example{dot}co{dot}uk"
    url = f"www{dot}example{dot}com/?token=abcd1234"
    ip = f"8{dot}8{dot}8{dot}8"
    text = f"mail {email} or see {url} from {ip}"
    assert spans_of(text) == [("email", email), ("url_secret", url), ("ip", ip)]
    redacted = redact(text, find_personal(text, ALL))
    assert redacted == "mail <EMAIL> or see <URL> from <IP>"
    assert "jane" not in redacted and "example" not in redacted


def test_may_hold_url_reads_the_text_as_find_personal_does():
    assert may_hold_url("www\u3002example\u3002com/?token=abcd")
    assert may_hold_url("ww\u200bw.example.com/?token=abcd")
    assert may_hold_url("https\uff1a\uff0f\uff0fexample.com")
    assert not may_hold_url("w\u3002w\u3002w example")


DISGUISES = {
    "digits": lambda text, draw: in_script(text, draw(st.sampled_from(DIGIT_ZEROS))),
    "dashes": lambda text, draw: "".join(
        draw(st.sampled_from(DASH_LIKES)) if ch == "-" and text[i - 1].isdigit() and text[i + 1].isdigit() else ch
        for i, ch in enumerate(text)
    ),
    "dots": lambda text, draw: text.replace(".", draw(st.sampled_from(DOTS))) if "@" in text else text,
    "invisibles": lambda text, draw: "".join(
        ch + (draw(st.sampled_from(INVISIBLES)) if i < len(text) - 1 and draw(st.booleans()) else "")
        for i, ch in enumerate(text)
    ),
}


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(PLANTS), st.lists(st.sampled_from(list(DISGUISES)), unique=True), st.data())
def test_a_disguised_value_is_found_whole_and_redacted(plant, disguises, data):
    disguised = plant
    for name in disguises:
        disguised = DISGUISES[name](disguised, data.draw)
    text = f"see {disguised} ok"
    (kind,) = {s.kind for s in find_personal(plant, ALL)}
    found = find_personal(text, ALL)
    assert found == (Span(kind, 4, 4 + len(disguised)),)
    assert redact(text, found) == f"see {PLACEHOLDERS[kind]} ok"


UNICODE_HOSTILE = {
    "zero-width spaces": "\u200b" * MIB,
    "digits and zero-width spaces": "1\u200b" * (MIB // 2),
    "groups of four and en dashes": "4111\u2013" * (MIB // 5),
    "at signs and zero-width spaces": "a\u200b@" * (MIB // 3),
}


@pytest.mark.parametrize("name", list(UNICODE_HOSTILE))
def test_hostile_unicode_input_completes_with_a_bounded_result(name):
    text = UNICODE_HOSTILE[name]
    tracemalloc.start()
    try:
        found = find_personal(text, ALL)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert found == () or found.truncated
    assert len(found) <= MAX_SPANS
    # the folded copies of the text, a few times its size at most
    assert peak < 16 * MIB


def test_a_json_key_with_a_full_width_at_sign_is_scanned():
    """A map keyed by address is scanned where the key has an ``@`` in any of the forms the
    scanner reads as one (full-width ``＠``, small ``﹫``), though it has no digit or URL."""
    from tasks.formats.recipe_privacy import TextPrivacy
    from tasks.policies.privacy import check_fields

    for at in ("@", "\uff20", "\ufe6b"):
        out = check_fields({"contacts": {f"jane.doe{at}example.com": "friend"}}, TextPrivacy(mode="redact"))
        assert list(out.meta["contacts"]) == ["<EMAIL>"], at
