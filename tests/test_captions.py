"""Captions are cleaned like scraped text needs, and each rule rejects at its boundary."""

import pytest

from tasks.formats.recipe_download import CaptionRules
from tasks.policies.captions import caption_verdict, clean_caption, count_words, non_text_ratio
from tasks.policies.ruling import Ruling

CLEANUP = [
    # HTML references
    ("Tom &amp; Jerry", "Tom & Jerry"),
    ("it&#39;s &quot;fine&quot;", 'it\'s "fine"'),
    ("caf&#xE9; &eacute;t&eacute;", "café été"),
    ("double &amp;amp; escaped", "double & escaped"),
    ("triple &amp;amp;amp; stays once", "triple &amp; stays once"),
    ("see &notes and AT&T", "see &notes and AT&T"),  # no ";", no reference
    ("a&nbsp;b", "a b"),
    # tags, only real ones
    ("<b>Bold</b> move", "Bold move"),
    ("line one<br/>line two<BR>three", "line one line two three"),
    ("<a href=\"https://x.org/?a=1&b=2\" class='c'>a link</a>", "a link"),
    ("<p>para</p><p>graph</p>", "para graph"),
    ("&lt;i&gt;escaped&lt;/i&gt; tags", "escaped tags"),
    ("<!-- note -->visible<script>alert(1)</script>", "visible"),
    ("I <3 cats", "I <3 cats"),
    ("a < b and c > d", "a < b and c > d"),
    ("vector <EPS> file", "vector <EPS> file"),
    # whitespace
    ("  many\t\ttabs\nand\r\nlines  ", "many tabs and lines"),
    ("no\u00a0break\u2009thin\u3000ideographic", "no break thin ideographic"),
    # Unicode NFC
    ("Cafe\u0301", "Caf\u00e9"),
    ("A\u030angstr\u00f6m", "\u00c5ngstr\u00f6m"),
    # control and invisible characters
    ("nul\x00 bell\x07 del\x7f c1\x90", "nul bell del c1"),
    ("\ufeffzero\u200bwidth\u00ad", "zerowidth"),
    ("bidi \u202eoverride", "bidi override"),
    # emoji sequences keep their joiners
    ("family \U0001f468\u200d\U0001f469\u200d\U0001f467", "family \U0001f468\u200d\U0001f469\u200d\U0001f467"),
]


@pytest.mark.parametrize(("raw", "expected"), CLEANUP)
def test_cleanup(raw, expected):
    assert clean_caption(raw) == expected


@pytest.mark.parametrize("raw", [None, "", "   ", "\n\t\u00a0", "<br/>", "\x00\x01", float("nan")])
def test_nothing_left_is_none(raw):
    assert clean_caption(raw) is None


def test_non_strings_become_text_and_surrogates_become_replacement():
    assert clean_caption(1984) == "1984"
    cleaned = clean_caption("lone \ud800 surrogate")
    assert cleaned == "lone \ufffd surrogate"
    cleaned.encode("utf-8")  # writable, unlike the raw value


# --- rules -----------------------------------------------------------------------------


def rules(**kw):
    return CaptionRules(**kw)


def test_missing_when_required_only():
    assert caption_verdict(None, rules()) == Ruling(None, "caption_missing", "no caption after cleanup")
    assert caption_verdict(" <br> ", rules()) == Ruling(None, "caption_missing", "no caption after cleanup")
    assert caption_verdict(None, rules(required=False)) == Ruling(None)


def test_min_chars_boundary():
    r = rules(min_chars=5, min_words=0)
    assert caption_verdict("abcde", r) == Ruling("abcde")
    short = caption_verdict("abcd", r)
    assert (short.value, short.reason) == ("abcd", "caption_too_short")
    assert short.detail == "4 characters, 1 words (min_chars 5, min_words 0)"
    # counted after cleanup: entities and padding do not make a caption long enough
    cleaned = caption_verdict("  a&amp;b  ", rules(min_chars=4, min_words=0))
    assert (cleaned.value, cleaned.reason) == ("a&b", "caption_too_short")


def test_min_words_boundary():
    r = rules(min_chars=0, min_words=3)
    assert caption_verdict("a red car", r).reason is None
    assert caption_verdict("red car", r).reason == "caption_too_short"
    assert caption_verdict("red car !!! ---", r).reason == "caption_too_short"  # punctuation is no word


def test_max_chars_boundary():
    r = rules(max_chars=10)
    assert caption_verdict("x" * 10, r).reason is None
    assert caption_verdict("x" * 11, r) == Ruling("x" * 11, "caption_too_long", "11 characters > max_chars 10")
    assert caption_verdict("x" * 10 + "   \n", r).reason is None  # trailing whitespace is not counted


def test_too_short_applies_without_required():
    assert caption_verdict("ab", rules(required=False)).reason == "caption_too_short"


MULTILINGUAL = [
    "一只猫坐在沙发上",
    "猫がソファに座っている",
    "소파에 앉아 있는 고양이",
    "قطة تجلس على الأريكة",
    "חתול יושב על הספה",
    "सोफे पर बैठी एक बिल्ली",
    "แมวนั่งบนโซฟา",
    "Кошка сидит на диване",
    "Γάτα στον καναπέ",
    "Ein Kätzchen auf dem Sofa, 50 % größer",
    "SÃO PAULO à noite",
    "a cat \U0001f431 on a sofa \U0001f44d\U0001f3fd \u2764\ufe0f",
    "new emoji \U0001fae8 still text",  # unassigned in Unicode 14, emoji in 15
    "math ∑ ∫ ≤ ≥ and arrows → ←, box ┌─┐",
]


@pytest.mark.parametrize("caption", MULTILINGUAL)
def test_any_script_passes_even_with_zero_tolerance(caption):
    assert caption_verdict(caption, rules(max_non_text_ratio=0.0)) == Ruling(caption)
    assert non_text_ratio(caption) == 0.0


@pytest.mark.parametrize(
    "caption",
    [
        "Ã©tÃ© Ã\u00a0 Paris",  # "été à Paris" read as Latin-1
        "donâ€™t â€œquoteâ€\x9d me",  # cp1252 smart quotes
        "caf\ufffd \ufffd\ufffd \ufffd",
        "\ue000\ue001\ue002 x",  # private use
        "\u0378\u0379 ab",  # unassigned
        "ab\x00\x01\x02\x03\x04",  # binary: the removed controls still count
    ],
)
def test_mojibake_and_junk_fail_charset(caption):
    assert caption_verdict(caption, rules(min_chars=0, min_words=0)).reason == "caption_charset"


def test_charset_ratio_boundary():
    # 3 junk characters in 10: passes at 0.3, fails just below
    caption = "abcdefg\ufffd\ufffd\ufffd"
    assert non_text_ratio(caption) == pytest.approx(0.3)
    assert caption_verdict(caption, rules(max_non_text_ratio=0.3)).reason is None
    assert caption_verdict(caption, rules(max_non_text_ratio=0.29)).reason == "caption_charset"


def test_mojibake_counts_both_characters():
    assert non_text_ratio("CafÃ© x") == pytest.approx(2 / 7)


def test_charset_is_reported_before_length():
    assert caption_verdict("\ufffd\ufffd", rules()).reason == "caption_charset"


def test_word_count_by_script():
    assert count_words("a red car") == 3
    assert count_words("一只猫") == 3  # one word per ideograph
    assert count_words("iPhone手机") == 3
    assert count_words("แมวนั่งบนโซฟา") == 1  # no spaces, not CJK: one run
    assert count_words("!!! \U0001f431 ---") == 0
    assert count_words("सोफे पर") == 2  # combining marks stay inside the word
