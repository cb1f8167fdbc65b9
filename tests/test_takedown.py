"""Takedown lists: every kind of entry parsed, bad lines named by list and line, lists on disk and on S3, `takedown add`, and matching."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from tasks.formats.recipe_upkeep import TakedownList
from tasks.formats.takedown import (
    Entry,
    LoadedList,
    TakedownError,
    add,
    lists_digest,
    normalise_url,
    parse_entry,
    parse_list,
    read_list,
    read_lists,
    url_host,
)
from tasks.stages.upkeep import Matcher, normalise_urls, url_hosts

ROOT = Path(__file__).resolve().parent.parent
SHA = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"


# --------------------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    ("written", "kind", "value"),
    [
        ("url:http://Example.COM/A/b.jpg?x=Y", "url", "http://example.com/A/b.jpg?x=Y"),
        ("HTTPS://Images.Example.com:8443/p.png", "url", "https://images.example.com:8443/p.png"),
        ("url:s3://Bucket/key.jpg", "url", "s3://bucket/key.jpg"),
        ("domain:Example.COM.", "domain", "example.com"),
        ("domain:localhost", "domain", "localhost"),
        ("images.example.org", "domain", "images.example.org"),
        ("domain:bücher.de", "domain", "xn--bcher-kva.de"),
        ("key:photos-000000012", "key", "photos-000000012"),
        ("photos-000000012", "key", "photos-000000012"),
        ("key:shard.0001/img", "key", "shard.0001/img"),
        (f"sha256:{SHA.upper()}", "sha256", SHA),
        (SHA, "sha256", SHA),
        ("phash:0xC3A5F00F0FF0A5C3", "phash", "c3a5f00f0ff0a5c3"),
        ("c3a5f00f0ff0a5c3", "phash", "c3a5f00f0ff0a5c3"),
        ("0xC3A5F00F0FF0A5C3", "phash", "c3a5f00f0ff0a5c3"),  # as Python prints one: not a key
        ("0x123456789abcdef", "phash", "0123456789abcdef"),  # hex() drops leading zeros
        ("phash:0x1f", "phash", "000000000000001f"),
        ("PHASH:c3a5f00f0ff0a5c3", "phash", "c3a5f00f0ff0a5c3"),
    ],
)
def test_every_kind_written_out_or_recognised_bare(written, kind, value):
    assert parse_entry(written) == (kind, value)


def test_a_list_with_comments_blank_lines_notes_crlf_and_a_bom():
    text = (
        "\ufeff# takedowns of the legal team\r\n"
        "\r\n"
        "http://a.example/x.jpg\tadded 2026-12-01 by legal: ticket 7\r\n"
        "   # an indented comment\n"
        "  domain:b.example  \t  the whole site  \n"
        f"{SHA}\n"
        "s-000000003\t\n"
    )
    assert parse_list(text.encode(), "legal.txt") == [
        Entry("url", "http://a.example/x.jpg", 3, "added 2026-12-01 by legal: ticket 7"),
        Entry("domain", "b.example", 5, "the whole site"),
        Entry("sha256", SHA, 6, None),
        Entry("key", "s-000000003", 7, None),
    ]


@pytest.mark.parametrize(
    ("line", "why"),
    [
        ("http://a.example/x y.jpg", "an entry is one word; a note goes after a tab"),
        ("ftp://a.example/x.jpg", "only http(s) URLs are recognised bare; write url:ftp://a.example/x.jpg"),
        ("a.example/x.jpg", "looks like a URL without its scheme"),
        ("hash:0123", "unknown kind 'hash' (one of url, domain, key, sha256, phash)"),
        ("sha256:abc", "is not a sha256 digest (64 hex digits)"),
        ("phash:0123456789abcde", "is not a 64-bit perceptual hash (16 hex digits)"),
        ("domain:*.example.com", "a domain entry covers its subdomains already; write 'example.com'"),
        ("domain:a..example.com", "is not a host name (an empty label)"),
        ("domain:-bad.example.com", "is not a host name (the label '-bad')"),
        ("domain:http://a.example/", "is not a host name (a URL?"),
        ("url:", "url: has no value"),
        ("url:nothing-here", "is not a URL (scheme://...)"),
        ("bad_label-.example", "write key:bad_label-.example if it is a sample key"),
    ],
)
def test_a_bad_entry_is_an_error_naming_the_list_and_the_line(line, why):
    with pytest.raises(TakedownError) as err:
        parse_list(f"# header\n{SHA}\n{line}\n", "lists/legal.txt")
    assert str(err.value).startswith("lists/legal.txt:3: ")
    assert why in str(err.value)


def test_every_bad_line_is_named_and_many_are_cut_short():
    text = "\n".join(["sha256:nope"] * 25 + ["good.example"])
    with pytest.raises(TakedownError) as err:
        parse_list(text, "l.txt")
    lines = str(err.value).splitlines()
    assert lines[0].startswith("l.txt:1: ") and lines[19].startswith("l.txt:20: ")
    assert lines[-1] == "... and 5 more bad entries"


def test_bytes_that_are_not_utf8_name_their_line():
    with pytest.raises(TakedownError, match=r"^l\.txt:2: not UTF-8 text"):
        parse_list(b"a.example\nb\xff.example\n", "l.txt")


def test_urls_and_hosts_normalise_alike_in_python_and_in_arrow():
    urls = [
        "HTTP://User:Pw@WWW.Example.COM:8080/Path/A.JPG?Q=1#F",
        "https://example.com./x",
        "https://[2001:DB8::1]/x",
        "no scheme at all",
        "s3://Bucket/Key",
        "http:///no-host",
        "http://Bücher.example/a.jpg",
        "http://xn--bcher-kva.example/b.jpg",
        "http://bücher。example/c.jpg",
    ]
    arrow = normalise_urls(pa.array(urls)).to_pylist()
    assert arrow == [normalise_url(u) for u in urls]
    assert arrow[0] == "http://user:pw@www.example.com:8080/Path/A.JPG?Q=1#F"
    assert url_hosts(pa.array(urls)).to_pylist() == [url_host(u) for u in urls]
    idn = "xn--bcher-kva.example"  # an international host as its domain entry is written
    assert [url_host(u) for u in urls] == [
        *("www.example.com", "example.com", "[2001:db8::1]", None, "bucket", None),
        *(idn, idn, idn),
    ]


# --------------------------------------------------------------------------- reading and adding


def test_a_missing_list_is_an_error_never_an_empty_list(tmp_path):
    with pytest.raises(TakedownError, match="takedown list not found"):
        read_list(TakedownList(path=str(tmp_path / "nope.txt")))


def test_two_lists_of_one_name_are_refused(tmp_path):
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "list.txt").write_text("x.example\n")
    specs = [TakedownList(path=str(tmp_path / f / "list.txt")) for f in ("a", "b")]
    with pytest.raises(TakedownError, match=r"share a name \(list\.txt\)"):
        read_lists(specs)
    named = [TakedownList(path=specs[0].path, name="legal"), specs[1]]
    assert [(x.name, len(x.entries)) for x in read_lists(named)] == [("legal", 1), ("list.txt", 1)]


def test_add_appends_with_the_date_who_and_why_and_checks_every_entry_first(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDSMITH_NOW", "2026-12-05T02:00:00Z")
    path = str(tmp_path / "lists" / "legal.txt")
    added = add(path, ["https://A.example/x.jpg", "b.example"], "Ann\tLegal", "ticket\n7")
    assert [(e.text, e.line) for e in added] == [("url:https://a.example/x.jpg", 1), ("domain:b.example", 2)]
    text = Path(path).read_text()
    assert text == (
        "url:https://a.example/x.jpg\tadded 2026-12-05T02:00:00Z by Ann Legal: ticket 7\n"
        "domain:b.example\tadded 2026-12-05T02:00:00Z by Ann Legal: ticket 7\n"
    )
    # One bad entry adds none, and says which.
    with pytest.raises(TakedownError, match="sha256:12: .*not a sha256 digest"):
        add(path, [SHA, "sha256:12"], "ann", "t8")
    assert Path(path).read_text() == text
    # Appended after what is there (a last line without its newline included).
    Path(path).write_text(text + "# kept by hand\nc.example")
    monkeypatch.setenv("SHARDSMITH_NOW", "2026-12-06T02:00:00Z")
    (more,) = add(path, [SHA], "bob", "t9")
    assert more.line == 5
    loaded = read_list(TakedownList(path=path))
    assert [e.text for e in loaded.entries] == [
        "url:https://a.example/x.jpg",
        "domain:b.example",
        "domain:c.example",
        f"sha256:{SHA}",
    ]
    assert loaded.entries[-1].note == "added 2026-12-06T02:00:00Z by bob: t9"
    with pytest.raises(TakedownError, match="say who asks"):
        add(path, [SHA], "", "t9")
    # A time given with its offset is written in UTC
    monkeypatch.setenv("SHARDSMITH_NOW", "2026-12-07T01:30:00+01:00")
    (late,) = add(path, ["d.example"], "cy", "t10")
    assert late.note == "added 2026-12-07T00:30:00Z by cy: t10"


def test_add_never_appends_to_a_list_no_run_could_read(tmp_path):
    path = tmp_path / "legal.txt"
    path.write_text("sha256:nope\n")
    with pytest.raises(TakedownError, match=r"legal\.txt:1: "):
        add(str(path), ["a.example"], "ann", "t1")
    assert path.read_text() == "sha256:nope\n"


def test_lists_on_s3_are_read_added_to_and_digested(s3_bucket, tmp_path, monkeypatch):
    from tasks.formats.recipe import parse_recipe

    bucket, options = s3_bucket
    monkeypatch.setenv("SHARDSMITH_NOW", "2026-12-05T02:00:00Z")
    url = f"s3://{bucket}/lists/legal.txt"
    recipe = parse_recipe(
        {
            "dataset": "d",
            "storage": str(tmp_path / "store"),
            "storage_options": options,
            "sources": [{"name": "s", "manifest": str(tmp_path / "m.csv")}],
            "takedown": [{"path": url, "name": "legal", "phash_distance": 6}],
        }
    )
    with pytest.raises(TakedownError, match="takedown list not found"):
        read_lists(recipe.takedown, options)
    before = lists_digest(recipe)
    add(url, ["https://a.example/x.jpg"], "ann", "t1", options)
    (loaded,) = read_lists(recipe.takedown, options)
    assert (loaded.name, loaded.path, loaded.phash_distance) == ("legal", url, 6)
    assert [e.text for e in loaded.entries] == ["url:https://a.example/x.jpg"]
    after = lists_digest(recipe)
    assert after != before and after == lists_digest(recipe)
    add(url, ["b.example"], "ann", "t2", options)
    assert lists_digest(recipe) != after
    (loaded,) = read_lists(recipe.takedown, options)
    assert [e.line for e in loaded.entries] == [1, 2]


# --------------------------------------------------------------------------- the command


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDSMITH_")}
    env |= {"SHARDSMITH_WARM": "0", "SHARDSMITH_NOW": "2026-12-05T02:00:00Z", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def test_the_command_adds_to_a_file_or_to_a_recipes_list_and_checks_them(tmp_path):
    listed = tmp_path / "legal.txt"
    out = cli("takedown", "add", str(listed), "https://a.example/x.jpg", "--by", "ann", "--why", "t1", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "line 1: url:https://a.example/x.jpg" in out.stdout
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "dataset: d\nstorage: store\nsources:\n  - name: s\n    manifest: m.csv\n"
        "takedown:\n  - {path: legal.txt, name: legal}\n"
    )
    out = cli(
        "takedown", "add", "legal", SHA, "b.example", "--recipe", str(recipe), "--by", "bob", "--why", "t2", cwd=ROOT
    )
    assert out.returncode == 0, out.stderr
    assert listed.read_text().count("\n") == 3 and "by bob: t2" in listed.read_text()
    out = cli("takedown", "check", str(recipe), cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("legal: 3 entries (1 url, 1 domain, 1 sha256), phash distance 4: ")
    # Refusals exit 2 and say why, adding nothing.
    out = cli("takedown", "add", "other", SHA, "--recipe", str(recipe), "--by", "b", "--why", "w", cwd=ROOT)
    assert out.returncode == 2 and "names no takedown list 'other' (its lists: legal)" in out.stderr
    out = cli("takedown", "add", str(listed), "not a key", "--by", "b", "--why", "w", cwd=ROOT)
    assert out.returncode == 2 and "an entry is one word" in out.stderr
    listed.write_text(listed.read_text() + "phash:123\n")
    out = cli("takedown", "check", str(recipe), cwd=ROOT)
    assert out.returncode == 2 and f"{listed}:4: " in out.stderr and "Traceback" not in out.stderr


# --------------------------------------------------------------------------- matching


def loaded(name: str, lines: list[str], distance: int = 4) -> LoadedList:
    return LoadedList(name, f"{name}.txt", distance, tuple(parse_list("\n".join(lines), name)), "")


def facts(**columns) -> pa.Table:
    n = len(next(iter(columns.values())))
    types = {"key": pa.string(), "url": pa.string(), "sha256": pa.string(), "pixel_sha256": pa.string()}
    full = {name: pa.array(columns.get(name, [None] * n), t) for name, t in types.items()}
    full["phash"] = pa.array(columns.get("phash", [None] * n), pa.uint64())
    return pa.table(full)


def test_urls_match_exactly_but_for_the_case_of_scheme_and_host():
    m = Matcher([loaded("l", ["http://a.example/Img.jpg?id=1"])])
    urls = [
        "HTTP://A.EXAMPLE/Img.jpg?id=1",
        "http://a.example/img.jpg?id=1",
        "http://a.example/Img.jpg?id=2",
        "http://a.example/Img.jpg",
        "https://a.example/Img.jpg?id=1",
    ]
    assert m.match_facts(facts(url=urls)).tolist() == [0, -1, -1, -1, -1]


def test_a_domain_takes_itself_and_its_subdomains_never_lookalikes():
    m = Matcher([loaded("l", ["domain:example.com", "domain:localhost"])])
    urls = [
        "http://example.com/a.jpg",
        "https://img.cdn.EXAMPLE.com./a.jpg",
        "http://user@example.com:8080/a.jpg",
        "http://badexample.com/a.jpg",
        "http://example.com.evil.net/a.jpg",
        "http://evil.net/example.com/a.jpg",
        "http://evil.net/?u=http://example.com/",
        "http://localhost:8000/a.jpg",
        "http://com/a.jpg",
        None,
    ]
    assert m.match_facts(facts(url=urls)).tolist() == [0, 0, 0, -1, -1, -1, -1, 1, -1, -1]


def test_keys_and_every_digest_of_a_row_match():
    other = "0" * 64
    m = Matcher([loaded("l", ["key:s-000000001", f"sha256:{SHA}"])])
    table = facts(
        key=["s-000000001", "s-000000002", "s-000000003", "s-000000004"],
        sha256=[None, SHA, other, None],
        pixel_sha256=[None, None, SHA, other],
    )
    assert m.match_facts(table).tolist() == [0, 1, 1, -1]
    download = pa.table({"key": ["s-000000004", "s-000000001"], "sha256": [SHA, other]})
    assert m.match_download(download).tolist() == [1, 0]


@pytest.mark.parametrize("distance", [0, 1, 4, 7, 16])
def test_perceptual_hashes_match_within_the_lists_distance_and_not_one_bit_more(distance):
    base = 0xC3A5F00F0FF0A5C3
    m = Matcher([loaded("l", [f"phash:{base:016x}"], distance)])
    rng = np.random.default_rng(distance)
    query = []
    for bits in (0, distance, distance + 1):
        flip = rng.choice(64, size=bits, replace=False)
        query.append(base ^ int(sum(1 << int(b) for b in flip)))
    found = m.match_facts(facts(phash=query + [None])).tolist()
    assert found == [0, 0, -1, -1]


def test_the_perceptual_hash_index_finds_what_a_full_comparison_finds():
    rng = np.random.default_rng(7)
    entries = rng.integers(0, 2**63, 3000, dtype=np.int64).astype(np.uint64) * np.uint64(2) + np.uint64(1)
    rows = rng.integers(0, 2**63, 20000, dtype=np.int64).astype(np.uint64)
    # Plant near copies: rows 0..1999 within 0..6 bits of an entry.
    for i in range(2000):
        flip = rng.choice(64, size=int(rng.integers(0, 7)), replace=False)
        rows[i] = entries[i] ^ np.uint64(sum(1 << int(b) for b in flip))
    lines = [f"phash:{int(h):016x}" for h in entries]
    found = Matcher([loaded("l", lines, 5)]).match_facts(facts(phash=rows.tolist()))
    distances = np.bitwise_count(rows[:, None] ^ entries[None, :])
    near = distances <= 5
    expected = np.where(near.any(axis=1), near.argmax(axis=1), -1)
    assert (found == expected).all()
    assert 1500 < (found >= 0).sum() < 2000 + 10


def test_the_first_list_and_line_name_a_row_that_several_entries_match():
    m = Matcher([loaded("a", ["domain:example.com"]), loaded("b", ["http://example.com/x.jpg", "key:k1"])])
    table = facts(key=["k1", "k2"], url=["http://example.com/x.jpg", "http://other.org/x.jpg"])
    assert m.match_facts(table).tolist() == [0, -1]
    assert m.details == [
        "list a: entry domain:example.com",
        "list b: entry url:http://example.com/x.jpg",
        "list b: entry key:k1",
    ]


def test_an_empty_matcher_matches_nothing():
    m = Matcher([loaded("l", ["# nothing yet"])])
    assert m.empty
    assert m.match_facts(facts(key=["a"], url=["http://a.example/"], phash=[1])).tolist() == [-1]


def test_a_run_over_a_bad_list_stops_before_it_starts_naming_the_line(tmp_path, prefect_api_url):
    (tmp_path / "m.csv").write_text("url,caption,license\nhttp://127.0.0.1:9/a.jpg,a picture,CC0-1.0\n")
    (tmp_path / "legal.txt").write_text("# requests\nsha256:123\n")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"dataset: d\nstorage: {tmp_path / 'store'}\nsources:\n  - name: s\n    manifest: {tmp_path / 'm.csv'}\n"
        "takedown: [legal.txt]\nexecution: {cluster: local, workers: 1}\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDSMITH_")}
    env |= {"SHARDSMITH_WARM": "0", "PREFECT_API_URL": prefect_api_url}
    out = subprocess.run(
        [sys.executable, "-m", "cli", "run", str(recipe)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2, out.stderr[-3000:]
    assert f"{tmp_path / 'legal.txt'}:2: '123' is not a sha256 digest" in out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "store" / "d" / "download").exists()


def test_a_domain_entry_covers_its_host_however_a_url_spells_it():
    """``bücher.example`` is one host whether a URL writes it in Unicode, in any case, with an
    ideographic full stop or as its IDNA ASCII; its subdomains too."""
    legal = loaded("legal", ["domain:bücher.example"])
    urls = [
        "http://bücher.example/a.jpg",
        "http://xn--bcher-kva.example/b.jpg",
        "http://img.BÜCHER.example/c.jpg",
        "http://bücher。example/d.jpg",
        "http://bucher.example/e.jpg",
    ]
    assert Matcher([legal]).match_hosts(pa.array(urls)).tolist() == [0, 0, 0, 0, -1]
