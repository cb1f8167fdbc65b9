"""TDM-Rep: the tdm-reservation header and the origin's tdmrep.json, parsed and matched, then honoured by the real fetch path at first download."""

from __future__ import annotations

import asyncio
import csv
import json

import pytest

from tasks.demo.webserver import ImageWeb
from tasks.formats.ledger import read_ledger
from tasks.formats.manifests import plan_source
from tasks.formats.recipe_download import DownloadConfig, NetworkConfig, SourceConfig
from tasks.formats.storage import Storage
from tasks.policies import tdmrep
from tasks.policies.tdmrep import TdmRules, header_verdict, pattern_matches, tdm_verdict
from tasks.stages.download import download_shard, shard_paths
from tasks.stages.fetch import Fetcher
from tasks.stages.fetched import judge

LOOPBACK = NetworkConfig(allowed_networks=("127.0.0.1/32",), any_port=True)
WHERE = "http://h/.well-known/tdmrep.json"
POLICY = "https://rights.example/policies/1.json"


def cfg(**kw) -> DownloadConfig:
    base = dict(timeout_s=5, retries=0, backoff_s=0.01, network=LOOPBACK)
    base.update(kw)
    return DownloadConfig(**base)


def rules(data) -> TdmRules:
    return TdmRules.parse(json.dumps(data).encode() if not isinstance(data, bytes) else data, WHERE)


def fetch_all(urls: list[str], config: DownloadConfig):
    async def go():
        async with Fetcher(config) as f:
            return [judge(got, config.allowed_formats) for got in await asyncio.gather(*(f.fetch(u) for u in urls))]

    return asyncio.run(go())


# --------------------------------------------------------------------------- the file's rules


def test_the_first_matching_rule_decides_and_names_the_policy():
    file = rules(
        [
            {"location": "/public/", "tdm-reservation": 0},
            {"location": "/", "tdm-reservation": 1, "tdm-policy": POLICY},
        ]
    )
    assert file.verdict("http://h/public/a.jpg").ok
    refused = file.verdict("http://h/img/a.jpg")
    assert (refused.reason, refused.value) == ("opted_out", POLICY)
    assert refused.detail == f"TDM-Rep: {WHERE} (location '/') reserves TDM rights (tdm-policy {POLICY})"


def test_no_matching_rule_is_no_reservation_and_a_rule_without_policy_says_so():
    file = rules([{"location": "/private/", "tdm-reservation": 1}])
    assert file.verdict("http://h/img/a.jpg").ok
    refused = file.verdict("http://h/private/x.png?size=2")
    assert refused.reason == "opted_out" and refused.detail.endswith("(no tdm-policy)")


@pytest.mark.parametrize(
    ("pattern", "path", "matches"),
    [
        ("/img/", "/img/a.jpg", True),
        ("/img/", "/images/a.jpg", False),
        ("/*.jpg$", "/deep/er/a.jpg", True),
        ("/*.jpg$", "/a.jpg?x=1", False),
        ("/*.jpg", "/a.jpg?x=1", True),
        ("/img/*/raw", "/img/2024/05/raw/a.png", True),
        ("/img/*/raw", "/img/raw", False),
        ("/exact$", "/exact", True),
        ("/exact$", "/exactly", False),
        ("*", "/anything", True),
        ("/a*b*c$", "/abcabc", True),
        ("/a*bc$", "/abcbc", True),
        ("/a*b*b$", "/ab", False),
    ],
)
def test_location_patterns_match_as_robots_txt_paths(pattern, path, matches):
    assert pattern_matches(pattern, path) is matches


def test_escapes_of_unreserved_characters_are_decoded_and_reserved_ones_kept():
    file = rules(
        [
            {"location": "/caf%7E/", "tdm-reservation": 1},
            {"location": "/a%2Fb", "tdm-reservation": 1},
        ]
    )
    assert not file.verdict("http://h/caf~/x.jpg").ok
    assert not file.verdict("http://h/caf%7e/x.jpg").ok
    assert not file.verdict("http://h/a%2Fb/x.jpg").ok
    assert file.verdict("http://h/a/b/x.jpg").ok  # an encoded slash is not a slash


@pytest.mark.parametrize("value", ["yes", 2, -1, True, None, 1.5, [1], {"v": 1}, " "])
def test_a_reservation_value_other_than_0_or_1_is_unset(value):
    # The first matching rule decides even so: its unset value reserves nothing.
    file = rules([{"location": "/", "tdm-reservation": value}, {"location": "/", "tdm-reservation": 1}])
    assert file.verdict("http://h/a.jpg").ok


def test_string_values_0_and_1_are_read():
    assert not rules([{"location": "/", "tdm-reservation": " 1 "}]).verdict("http://h/a").ok
    assert rules([{"location": "/", "tdm-reservation": "0"}]).verdict("http://h/a").ok


# --------------------------------------------------------------------------- hostile files


@pytest.mark.parametrize(
    ("body", "note"),
    [
        (b"{not json", "not valid JSON"),
        (b"\xff\xfe[]", "not valid JSON"),  # not UTF-8
        (b"[" * 300_000 + b"]" * 300_000, "over"),  # deep and over the cap
        (b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),  # deep, under the cap: RecursionError
        (b'[{"location": "/", "tdm-reservation": ' + b"9" * 100_000 + b"}]", "not valid JSON"),  # a huge number
        (b'{"location": "/", "tdm-reservation": 1}', "not a JSON array"),
        (b'"[]"', "not a JSON array"),
        (b"", "not valid JSON"),
        (b" " * (tdmrep.MAX_BYTES + 1), "over"),
    ],
)
def test_a_malformed_or_oversized_file_reserves_nothing(body, note):
    file = TdmRules.parse(body, WHERE)
    assert file.rules == [] and note in file.note
    assert file.verdict("http://h/a.jpg").ok


def test_bad_rules_are_skipped_and_the_good_ones_kept():
    file = rules(
        [
            "not an object",
            17,
            None,
            {"tdm-reservation": 1},  # no location
            {"location": 5, "tdm-reservation": 1},
            {"location": ["/"], "tdm-reservation": 1},
            {"location": "", "tdm-reservation": 1},
            {"location": "img/", "tdm-reservation": 1},  # not a path
            {"location": "/" + "x" * (tdmrep.MAX_PATTERN_CHARS + 1), "tdm-reservation": 1},
            {"location": "/img/", "tdm-reservation": 1, "tdm-policy": 42},  # a policy that is no string
        ]
    )
    assert [r.location for r in file.rules] == ["/img/"] and file.note == "9 bad rules skipped"
    refused = file.verdict("http://h/img/a.jpg")
    assert refused.reason == "opted_out" and refused.value is None


def test_rules_past_the_cap_are_ignored():
    many = [{"location": f"/r{i}/", "tdm-reservation": 1} for i in range(tdmrep.MAX_RULES + 5)]
    file = rules(many)
    assert len(file.rules) == tdmrep.MAX_RULES and "ignored" in file.note
    assert not file.verdict(f"http://h/r{tdmrep.MAX_RULES - 1}/a").ok
    assert file.verdict(f"http://h/r{tdmrep.MAX_RULES}/a").ok


def test_a_pattern_of_many_stars_is_matched_without_backtracking():
    # A regular expression of 2,000 ``.*`` would backtrack for ever on this path; the pieces
    # are found left to right instead. No timing assertion: a regression would hang the test.
    pattern = "/" + "*a" * 1000 + "*b$"
    file = rules([{"location": pattern, "tdm-reservation": 1}])
    assert file.rules and file.verdict("http://h/" + "a" * 1999).ok
    assert not file.verdict("http://h/" + "a" * 1000 + "b").ok


def test_a_policy_with_control_characters_is_shown_printable_and_short():
    file = rules([{"location": "/", "tdm-reservation": 1, "tdm-policy": "https://p/\x1b[31m\n" + "x" * 5000}])
    detail = file.verdict("http://h/a").detail
    assert "\x1b" not in detail and "\n" not in detail and len(detail) < 500


# --------------------------------------------------------------------------- the headers


def test_the_header_reserves_and_names_its_policy():
    refused = header_verdict(["1"], [POLICY])
    assert refused.reason == "opted_out" and refused.value == POLICY
    assert refused.detail == f"TDM-Rep: the tdm-reservation: 1 header reserves TDM rights (tdm-policy {POLICY})"


def test_the_header_supersedes_the_file_either_way():
    reserving = rules([{"location": "/", "tdm-reservation": 1, "tdm-policy": POLICY}])
    allowing = rules([{"location": "/", "tdm-reservation": 0}])
    assert tdm_verdict(["0"], [], reserving, "http://h/a.jpg").ok
    assert not tdm_verdict(["1"], [], allowing, "http://h/a.jpg").ok
    # An invalid or absent header leaves it to the file.
    assert not tdm_verdict(["2"], [], reserving, "http://h/a.jpg").ok
    assert not tdm_verdict([], [], reserving, "http://h/a.jpg").ok
    assert tdm_verdict(["maybe"], [], None, "http://h/a.jpg").ok
    # Of several values a 1 wins.
    assert not tdm_verdict(["0, 1"], [], None, "http://h/a.jpg").ok


# --------------------------------------------------------------------------- the real fetch path


def test_the_tdm_header_rejects_at_first_download_with_the_policy(web):
    got = fetch_all([f"{web.base_url}/tdm/a.jpg", f"{web.base_url}/img/a.jpg?tdm"], cfg())
    assert got[0].reason == "opted_out" and got[0].data is None
    assert got[0].detail == (
        "TDM-Rep: the tdm-reservation: 1 header reserves TDM rights (tdm-policy https://rights.example/policies/tdm.json)"
    )
    assert got[1].reason is None
    off = fetch_all([f"{web.base_url}/tdm/a.jpg"], cfg(respect_tdmrep=False))[0]
    assert off.reason is None and off.format == "jpeg"


def test_the_origin_file_is_read_once_per_shard_and_honoured(image_dir):
    body = json.dumps([{"location": "/img/b*", "tdm-reservation": 1, "tdm-policy": POLICY}])
    with ImageWeb(image_dir, tdmrep_json=body) as site:
        urls = [f"{site.base_url}/img/{name}?i={i}" for i in range(3) for name in ("a.jpg", "b.png")]
        got = fetch_all(urls, cfg())
        assert [g.reason for g in got] == [None, "opted_out"] * 3
        assert got[1].detail == (
            f"TDM-Rep: {site.base_url}/.well-known/tdmrep.json (location '/img/b*') reserves TDM rights"
            f" (tdm-policy {POLICY})"
        )
        assert site.hits["/.well-known/tdmrep.json"] == 1
        # A header of the answer lifts the file's reservation.
        site.img_headers = {"tdm-reservation": "0"}
        assert fetch_all([f"{site.base_url}/img/b.png"], cfg())[0].reason is None
        # respect_tdmrep off: the file is not even asked for.
        site.reset_stats()
        site.img_headers = {}
        assert fetch_all([f"{site.base_url}/img/b.png"], cfg(respect_tdmrep=False))[0].reason is None
        assert site.hits["/.well-known/tdmrep.json"] == 0


@pytest.mark.parametrize(
    "answer",
    [None, 403, 500, "{oops", "[" * 5000 + "]" * 5000, '[{"location": 3}]', "x" * (tdmrep.MAX_BYTES + 10)],
    ids=["404", "403", "500", "malformed", "deep", "bad-rule", "huge"],
)
def test_an_unusable_file_reserves_nothing(image_dir, answer):
    with ImageWeb(image_dir, tdmrep_json=answer) as site:
        assert fetch_all([f"{site.base_url}/img/a.jpg"], cfg())[0].reason is None


class RedirectingWeb(ImageWeb):
    """An ImageWeb whose tdmrep.json answers 302 to ``file_at``."""

    file_at = ""

    async def _tdmrep(self, request):
        from aiohttp import web as aioweb

        raise aioweb.HTTPFound(self.file_at)


def test_the_file_follows_redirects_under_the_url_policy(image_dir):
    reserving = json.dumps([{"location": "/", "tdm-reservation": 1, "tdm-policy": POLICY}])
    with ImageWeb(image_dir, tdmrep_json=reserving) as target, RedirectingWeb(image_dir) as site:
        site.file_at = f"{target.base_url}/.well-known/tdmrep.json"
        got = fetch_all([f"{site.base_url}/img/a.jpg"], cfg())[0]
        assert got.reason == "opted_out" and f"{target.base_url}/.well-known/tdmrep.json" in got.detail
        # A redirect to a URL the policy refuses (a private address) is not followed: no file.
        site.file_at = "http://10.20.30.40/.well-known/tdmrep.json"
        assert fetch_all([f"{site.base_url}/img/a.jpg"], cfg())[0].reason is None


def test_tdm_at_first_download_is_an_opted_out_ledger_row(tmp_path, web):
    manifest = tmp_path / "m.csv"
    with open(manifest, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["url", "caption"])
        w.writerow([f"{web.base_url}/img/a.jpg?first", "kept"])
        w.writerow([f"{web.base_url}/tdm/b.png?policy=https://rights.example/p2", "reserved"])
    storage = Storage(str(tmp_path / "store"))
    plan = plan_source(SourceConfig(name="web", manifest=str(manifest)), storage, "ds")
    tar_rel, ledger_rel = shard_paths("ds", plan.chunks[0], "cfg")
    download_shard(plan.chunks[0], storage, cfg(), tar_rel, ledger_rel)
    rows = read_ledger(storage, ledger_rel).to_pylist()
    assert [(r["status"], r["reason"]) for r in rows] == [("ok", None), ("rejected", "opted_out")]
    assert rows[1]["http_status"] == 200
    assert (
        rows[1]["detail"]
        == "TDM-Rep: the tdm-reservation: 1 header reserves TDM rights (tdm-policy https://rights.example/p2)"
    )
