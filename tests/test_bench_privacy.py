"""bench_privacy.py's text and metadata stages run, on small inputs, through the code they measure.

They measure speed, which no test asserts; what they count besides (false cards and IBANs among
strings failing their checksums; metadata gone with the pixels unchanged) is checked here, and a
change that breaks a stage (a stand-in whose signature drifted from the code it replaces) fails here
rather than when someone next measures.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import bench_privacy  # noqa: E402


def _run(capsys, *argv: str) -> str:
    bench_privacy.main(list(argv))
    return capsys.readouterr().out


def test_the_text_stage_finds_no_false_card_or_iban(capsys):
    out = _run(capsys, "--stage", "text", "--repeats", "1", "--captions", "2000", "--strings", "2000")
    assert re.search(r"false cards in 2,000 Luhn-invalid 13-19 digit strings \| 0 \|", out), out
    assert re.search(r"false IBANs in 2,000 IBAN-shaped strings with a wrong mod-97 \| 0 \|", out), out
    assert "json fields (`check_fields`)" in out


def test_the_metadata_stage_keeps_the_pixels_and_removes_the_metadata(capsys):
    out = _run(capsys, "--stage", "metadata", "--repeats", "1", "--images", "12")
    assert "same pixels and pixel key, metadata gone: 12/12" in out, out
