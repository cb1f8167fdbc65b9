"""License strings as manifests write them normalise to SPDX ids, and the policy judges them."""

import datetime as dt

import pytest

from tasks.formats.recipe_download import LicensePolicy, LicenseReview
from tasks.policies.licenses import (
    ALL_RIGHTS_RESERVED,
    LICENSE_ALIASES,
    PUBLIC_DOMAIN,
    SPDX_KNOWN,
    SPDX_LISTED,
    UNKNOWN,
    license_verdict,
    normalize_license,
    policy_problems,
    review_problem,
)
from tasks.policies.ruling import Ruling

SPELLINGS = [
    # exact ids, any case
    ("CC0-1.0", "CC0-1.0"),
    ("cc0-1.0", "CC0-1.0"),
    ("cc-by-sa-4.0", "CC-BY-SA-4.0"),
    ("APACHE-2.0", "Apache-2.0"),
    ("odbl-1.0", "ODbL-1.0"),
    # CC0 and public-domain tools
    ("CC0", "CC0-1.0"),
    ("CC0 1.0", "CC0-1.0"),
    ("CC0 1.0 Universal", "CC0-1.0"),
    ("cc-zero", "CC0-1.0"),
    ("Public Domain Dedication", "CC0-1.0"),
    ("Creative Commons Zero v1.0 Universal", "CC0-1.0"),
    ("Public Domain Mark 1.0", "CC-PDM-1.0"),
    ("PDM-1.0", "CC-PDM-1.0"),
    ("Public Domain Dedication and Certification", "CC-PDDC"),
    ("Open Data Commons Public Domain Dedication and License", "PDDL-1.0"),
    # CC BY family in words
    ("CC BY 4.0", "CC-BY-4.0"),
    ("cc-by 4.0", "CC-BY-4.0"),
    ("CC_BY_4.0", "CC-BY-4.0"),
    ("CC BY 4", "CC-BY-4.0"),
    ("CC-BY-SA 4.0", "CC-BY-SA-4.0"),
    ("CC BY-NC-SA 3.0", "CC-BY-NC-SA-3.0"),
    ("CC BY-NC-ND 4.0 International", "CC-BY-NC-ND-4.0"),
    ("Attribution 4.0 International", "CC-BY-4.0"),
    ("Attribution-NonCommercial-ShareAlike 4.0 International", "CC-BY-NC-SA-4.0"),
    ("Creative Commons Attribution-Share Alike 3.0 Unported", "CC-BY-SA-3.0"),
    ("Creative Commons Attribution-NoDerivatives 4.0 International License", "CC-BY-ND-4.0"),
    ("Licensed under a Creative Commons Attribution 4.0 International License", "CC-BY-4.0"),
    ("CC BY 2.0 Generic", "CC-BY-2.0"),
    ("CC BY-SA 2.5 license", "CC-BY-SA-2.5"),
    ("ccbysa4.0", "CC-BY-SA-4.0"),
    # ports: the SPDX port when listed, else the unported id
    ("CC BY 3.0 DE", "CC-BY-3.0-DE"),
    ("CC BY-SA 3.0 AT", "CC-BY-SA-3.0-AT"),
    ("CC BY-SA 2.1 JP", "CC-BY-SA-2.1-JP"),
    ("CC BY 3.0 FR", "CC-BY-3.0"),
    # URLs
    ("https://creativecommons.org/licenses/by/4.0/", "CC-BY-4.0"),
    ("http://creativecommons.org/licenses/by-sa/2.0/deed.en", "CC-BY-SA-2.0"),
    ("https://creativecommons.org/licenses/by-nc-sa/3.0/de/legalcode", "CC-BY-NC-SA-3.0-DE"),
    ("http://creativecommons.org/licenses/by-nd-nc/1.0/", "CC-BY-NC-ND-1.0"),
    ("creativecommons.org/publicdomain/zero/1.0/", "CC0-1.0"),
    ("https://creativecommons.org/publicdomain/mark/1.0/", "CC-PDM-1.0"),
    ("https://spdx.org/licenses/CC-BY-4.0.html", "CC-BY-4.0"),
    ("https://opensource.org/licenses/MIT", "MIT"),
    ("http://www.apache.org/licenses/LICENSE-2.0.txt", "Apache-2.0"),
    ("https://www.gnu.org/licenses/gpl-3.0.en.html", "GPL-3.0-only"),
    ("https://opendatacommons.org/licenses/odbl/1-0/", "ODbL-1.0"),
    # software licenses
    ("Apache 2.0", "Apache-2.0"),
    ("Apache License, Version 2.0", "Apache-2.0"),
    ("Apache Software License 2.0", "Apache-2.0"),
    ("apache-2.0", "Apache-2.0"),
    ("ALv2", "Apache-2.0"),
    ("MIT", "MIT"),
    ("MIT License", "MIT"),
    ("The MIT License (MIT)", "MIT"),
    ("BSD-3-Clause", "BSD-3-Clause"),
    ("BSD 3-Clause License", "BSD-3-Clause"),
    ("New BSD License", "BSD-3-Clause"),
    ('BSD 3-Clause "New" or "Revised" License', "BSD-3-Clause"),
    ("Simplified BSD", "BSD-2-Clause"),
    ("GPL-3.0", "GPL-3.0-only"),
    ("GPLv3", "GPL-3.0-only"),
    ("GPLv3+", "GPL-3.0-or-later"),
    ("GNU General Public License v3 or later", "GPL-3.0-or-later"),
    ("GNU Lesser General Public License v2.1", "LGPL-2.1-only"),
    # public domain and no license granted
    ("Public domain", PUBLIC_DOMAIN),
    ("public-domain", PUBLIC_DOMAIN),
    ("PD-old-70", PUBLIC_DOMAIN),
    ("All rights reserved", ALL_RIGHTS_RESERVED),
    ("All Rights Reserved.", ALL_RIGHTS_RESERVED),
    ("© 2019 Jane Doe", ALL_RIGHTS_RESERVED),
    ("Copyright (c) 2020 ACME Corp", ALL_RIGHTS_RESERVED),
    ("copyrighted", ALL_RIGHTS_RESERVED),
    # custom refs pass through
    ("LicenseRef-Getty-Editorial", "LicenseRef-Getty-Editorial"),
]


@pytest.mark.parametrize(("raw", "expected"), SPELLINGS)
def test_spellings_normalise_to_spdx(raw, expected):
    assert normalize_license(raw) == expected


def test_the_table_is_large_and_every_result_is_known():
    assert len(SPELLINGS) >= 40
    produced = {normalize_license(raw) for raw, _ in SPELLINGS} - {"LicenseRef-Getty-Editorial"}
    assert produced <= SPDX_KNOWN
    assert set(LICENSE_ALIASES.values()) <= SPDX_KNOWN


def test_listed_ids_are_not_license_refs():
    assert not any(i.startswith("LicenseRef-") for i in SPDX_LISTED)
    assert {UNKNOWN, PUBLIC_DOMAIN, ALL_RIGHTS_RESERVED} <= SPDX_KNOWN - SPDX_LISTED


@pytest.mark.parametrize("raw", [None, "", "   ", "\t\n", "n/a", "N/A", "none", "null", "nan", "unknown", "?"])
def test_missing_values_are_none(raw):
    assert normalize_license(raw) is None


def test_loosely_typed_values():
    assert normalize_license(float("nan")) is None  # a pandas null
    assert normalize_license(["CC BY 4.0", "MIT"]) == UNKNOWN  # a list is not one license
    assert normalize_license("  CC BY 4.0  \n") == "CC-BY-4.0"
    assert normalize_license("CC\u00a0BY\u00a04.0") == "CC-BY-4.0"  # no-break spaces
    assert normalize_license("© " + "x" * 300) == ALL_RIGHTS_RESERVED  # long, uncached path


@pytest.mark.parametrize(
    "raw",
    [
        "Foo Public License",
        "cc-by",  # no version: the versions grant different terms
        "Attribution-NonCommercial-ShareAlike License",
        "CC BY 5.0",  # no such version
        "CC BY-ND-SA 4.0",  # ND and SA exclude each other
        "CC BY 4.0 except commercial use",
        "Some rights reserved",
        "(c) Jane Doe, CC BY-SA 4.0",  # a grant we cannot parse is not "all rights reserved"
        "GPL",
        "https://example.com/my-license",
        "https://creativecommons.org/licenses/by/",
    ],
)
def test_present_but_unrecognised_is_unknown_not_missing(raw):
    assert normalize_license(raw) == UNKNOWN


# --- the policy ------------------------------------------------------------------------


def policy(**kw):
    return LicensePolicy(**kw)


def _value_reason(verdict: Ruling) -> tuple:
    return verdict.value, verdict.reason


def test_allowed_license_passes_with_its_id():
    assert license_verdict("CC BY 4.0", "web", policy()) == Ruling("CC-BY-4.0")


def test_license_outside_allowlist_is_not_allowed_and_named():
    verdict = license_verdict("CC BY-NC 4.0", "web", policy())
    assert (verdict.value, verdict.reason) == ("CC-BY-NC-4.0", "license_not_allowed")
    assert "CC-BY-NC-4.0" in verdict.detail


def test_all_rights_reserved_is_not_allowed():
    assert _value_reason(license_verdict("© 2020 Jane", "web", policy())) == (
        ALL_RIGHTS_RESERVED,
        "license_not_allowed",
    )


def test_missing_without_default_is_license_missing():
    verdict = license_verdict(None, "web", policy())
    assert (verdict.value, verdict.reason) == (None, "license_missing")
    assert "web" in verdict.detail
    assert _value_reason(license_verdict("  ", "web", policy())) == (None, "license_missing")


def test_missing_takes_the_source_default_normalised():
    p = policy(source_defaults={"wiki": "CC BY-SA 4.0"})
    assert license_verdict(None, "wiki", p) == Ruling("CC-BY-SA-4.0")
    assert license_verdict("n/a", "wiki", p) == Ruling("CC-BY-SA-4.0")
    # only for the source it names
    assert license_verdict(None, "other", p).reason == "license_missing"
    # a present license wins over the default
    assert license_verdict("CC BY-NC 4.0", "wiki", p).reason == "license_not_allowed"


def test_source_default_is_judged_like_any_license():
    p = policy(source_defaults={"flickr": "CC BY-NC 2.0", "odd": "whatever terms"})
    verdict = license_verdict(None, "flickr", p)
    assert (verdict.value, verdict.reason) == ("CC-BY-NC-2.0", "license_not_allowed")
    assert "source default" in verdict.detail
    verdict = license_verdict(None, "odd", p)
    assert (verdict.value, verdict.reason) == (None, "license_not_allowed")
    assert "unrecognised license: 'whatever terms'" in verdict.detail


def test_allowlist_entries_may_be_aliases():
    p = policy(allow=("CC BY 4.0", "https://creativecommons.org/publicdomain/zero/1.0/", "apache 2", "Public domain"))
    assert license_verdict("cc-by-4.0", "s", p).reason is None
    assert license_verdict("CC0", "s", p) == Ruling("CC0-1.0")
    assert license_verdict("Apache-2.0", "s", p).reason is None
    assert license_verdict("PD-US", "s", p) == Ruling(PUBLIC_DOMAIN)
    assert license_verdict("MIT", "s", p).reason == "license_not_allowed"


def test_default_allowlist_accepts_the_public_domain_mark():
    # the default lists "PDM-1.0"; SPDX's id is CC-PDM-1.0, and the alias bridges them
    assert license_verdict("https://creativecommons.org/publicdomain/mark/1.0/", "s", policy()) == Ruling("CC-PDM-1.0")


def test_unknown_rejected_by_default_with_the_raw_value():
    verdict = license_verdict("Foo Public License", "s", policy())
    assert (verdict.value, verdict.reason) == (None, "license_not_allowed")
    assert verdict.detail == "unrecognised license: 'Foo Public License'"


def test_unknown_detail_is_cut_short():
    detail = license_verdict("x" * 500, "s", policy()).detail
    assert len(detail) < 120


def test_unknown_allowed_when_policy_says_so():
    p = policy(unknown="allow")
    assert license_verdict("Foo Public License", "s", p) == Ruling(UNKNOWN)
    # a recognised license outside the allowlist is still rejected
    assert license_verdict("CC BY-NC 4.0", "s", p).reason == "license_not_allowed"
    # and missing is still missing
    assert license_verdict(None, "s", p).reason == "license_missing"


def test_only_the_two_reasons_exist():
    p = policy(source_defaults={"a": "MIT"})
    reasons = {
        license_verdict(raw, src, p).reason
        for raw in (None, "", "CC BY 4.0", "CC BY-NC 4.0", "junk", "© me", "MIT")
        for src in ("a", "b")
    }
    assert reasons == {None, "license_missing", "license_not_allowed"}


def test_policy_problems_name_entries_that_match_nothing():
    p = policy(allow=("CC-BY-4.0", "CC BY", "Apache 2.0"), source_defaults={"web": "see website"})
    problems = policy_problems(p)
    assert len(problems) == 2
    assert "'CC BY'" in problems[0] and "validate.license.allow" in problems[0]
    assert "source_defaults.web" in problems[1]
    assert policy_problems(policy()) == []


def test_review_problem():
    assert review_problem(policy()) == (
        "no license review recorded: add validate.license.review {reviewed_by, reviewed_on} "
        "to the recipe after checking the sources' terms"
    )
    reviewed = policy(review=LicenseReview(reviewed_by="data-legal", reviewed_on=dt.date(2025, 3, 1)))
    assert review_problem(reviewed, today=dt.date(2025, 3, 1)) is None
    future = review_problem(reviewed, today=dt.date(2025, 2, 28))
    assert future is not None and "2025-03-01" in future


# --- SPDX expressions (license-expression) ------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("MIT OR Apache-2.0", "MIT OR Apache-2.0"),
        ("mit or apache-2.0", "MIT OR Apache-2.0"),  # operators in lower case, ids in any case
        ("CC BY 4.0 AND ODbL", "CC-BY-4.0 AND ODbL-1.0"),  # parts go through the aliases
        ("(MIT AND (GPL-3.0+ OR Apache 2.0))", "MIT AND (GPL-3.0-or-later OR Apache-2.0)"),
        ("MIT AND Apache-2.0 OR CC0", "(MIT AND Apache-2.0) OR CC0-1.0"),  # AND binds tighter
        ("GPL-2.0-or-later WITH Classpath-exception-2.0", "GPL-2.0-or-later WITH Classpath-exception-2.0"),
        ("gpl-2.0 with classpath-exception-2.0", "GPL-2.0-only WITH Classpath-exception-2.0"),
        ("GPL-2.0-only WITH Our-Own-Exception", "GPL-2.0-only WITH AdditionRef-Unknown"),
        ("Foo-1.0 OR MIT", "LicenseRef-Unknown OR MIT"),
        ("CC BY 4.0 OR Public domain", "CC-BY-4.0 OR LicenseRef-Public-Domain"),
        ("LicenseRef-Getty-Editorial AND CC-BY-4.0", "LicenseRef-Getty-Editorial AND CC-BY-4.0"),
        ("Beerware OR MIT", "Beerware OR MIT"),  # every SPDX-listed id, from license-expression
        # Not expressions: aliases that contain "or", free text, broken syntax.
        ('BSD 3-Clause "New" or "Revised" License', "BSD-3-Clause"),
        ("GNU General Public License v3 or later", "GPL-3.0-or-later"),
        ("photo by Jane with permission", UNKNOWN),
        ("MIT OR", UNKNOWN),
        ("(MIT AND Apache-2.0", UNKNOWN),
        ("Apache License, Version 2.0 OR MIT", UNKNOWN),  # a comma is not allowed in a part
    ],
)
def test_expressions_normalise_part_by_part(raw, expected):
    assert normalize_license(raw) == expected


def test_listed_ids_beyond_the_alias_table_come_from_the_spdx_list():
    assert normalize_license("beerware") == "Beerware"
    assert normalize_license("Classpath-exception-2.0") == UNKNOWN  # an exception is not a license


def test_or_passes_when_one_alternative_is_allowed():
    p = policy(allow=("MIT",))
    assert license_verdict("MIT OR Apache-2.0", "s", p) == Ruling("MIT OR Apache-2.0")
    assert license_verdict("GPL-3.0-only OR MIT", "s", p).reason is None
    verdict = license_verdict("GPL-3.0-only OR Apache-2.0", "s", p)
    assert (verdict.value, verdict.reason) == ("GPL-3.0-only OR Apache-2.0", "license_not_allowed")
    assert (
        "Apache-2.0 is not in validate.license.allow" in verdict.detail and "GPL-3.0-only is not in" in verdict.detail
    )


def test_and_passes_only_when_every_part_is_allowed():
    p = policy(allow=("CC-BY-4.0",))
    verdict = license_verdict("CC BY 4.0 AND ODbL-1.0", "s", p)
    assert (verdict.value, verdict.reason) == ("CC-BY-4.0 AND ODbL-1.0", "license_not_allowed")
    assert "ODbL-1.0 is not in validate.license.allow" in verdict.detail and "CC-BY-4.0 is not" not in verdict.detail
    assert license_verdict("CC BY 4.0 AND ODbL-1.0", "s", policy(allow=("CC-BY-4.0", "ODbL-1.0"))).reason is None


def test_parentheses_decide_what_binds():
    p = policy(allow=("MIT", "Apache-2.0"))
    assert license_verdict("MIT AND (GPL-3.0-only OR Apache-2.0)", "s", p).reason is None
    assert license_verdict("(MIT AND GPL-3.0-only) OR Apache-2.0", "s", p).reason is None
    assert license_verdict("(MIT OR Apache-2.0) AND GPL-3.0-only", "s", p).reason == "license_not_allowed"


def test_with_an_exception_passes_where_its_license_does():
    raw = "GPL-2.0-or-later WITH Classpath-exception-2.0"
    # A listed exception only adds permissions: allowed when the license is.
    assert license_verdict(raw, "s", policy(allow=("GPL-2.0-or-later",))).reason is None
    # Or when the allowlist names the whole term, and only that term.
    only_term = policy(allow=(raw,))
    assert license_verdict(raw, "s", only_term).reason is None
    assert license_verdict("GPL-2.0-or-later", "s", only_term).reason == "license_not_allowed"
    assert license_verdict("GPL-2.0-or-later WITH LLVM-exception", "s", only_term).reason == "license_not_allowed"
    assert license_verdict(raw, "s", policy(allow=("MIT",))).reason == "license_not_allowed"


def test_unknown_parts_follow_the_unknown_policy():
    reject = policy(allow=("MIT",))
    allow = policy(allow=("MIT",), unknown="allow")
    # An allowed alternative is enough whatever the other one is.
    assert license_verdict("Foo-1.0 OR MIT", "s", reject) == Ruling("LicenseRef-Unknown OR MIT")
    verdict = license_verdict("Foo-1.0 AND MIT", "s", reject)
    assert (verdict.value, verdict.reason) == ("LicenseRef-Unknown AND MIT", "license_not_allowed")
    assert (
        "an unrecognised license (validate.license.unknown: reject)" in verdict.detail
        and "'Foo-1.0 AND MIT'" in verdict.detail
    )
    assert license_verdict("Foo-1.0 AND MIT", "s", allow) == Ruling("LicenseRef-Unknown AND MIT")
    exception = "MIT WITH Our-Own-Exception"
    assert "an unrecognised exception" in license_verdict(exception, "s", reject).detail
    assert license_verdict(exception, "s", allow) == Ruling("MIT WITH AdditionRef-Unknown")
    # A recognised part outside the allowlist still fails under unknown: allow.
    assert license_verdict("Foo-1.0 AND GPL-3.0-only", "s", allow).reason == "license_not_allowed"


def test_a_source_default_may_be_an_expression():
    p = policy(allow=("CC0-1.0",), source_defaults={"scans": "CC0-1.0 OR CC-BY-4.0"})
    assert license_verdict(None, "scans", p) == Ruling("CC0-1.0 OR CC-BY-4.0")
    assert policy_problems(p) == []


@pytest.mark.parametrize("raw", [["MIT"], ["CC BY 4.0", "MIT"], {"id": "MIT"}, 42, True])
def test_a_value_that_is_not_a_string_is_refused_never_read_as_its_first_element(raw):
    for p in (policy(allow=("MIT", "CC-BY-4.0")), policy(allow=("MIT", "CC-BY-4.0"), unknown="allow")):
        verdict = license_verdict(raw, "s", p)
        assert (verdict.value, verdict.reason) == (None, "license_not_allowed")
        assert f"license value is a {type(raw).__name__}, not a string" in verdict.detail
    assert normalize_license(raw) == UNKNOWN


def test_policy_problems_name_expressions_in_the_allowlist():
    p = policy(
        allow=("MIT OR Apache-2.0", "GPL-2.0-only WITH Classpath-exception-2.0", "Foo WITH Classpath-exception-2.0")
    )
    problems = policy_problems(p)
    assert len(problems) == 2
    assert "'MIT OR Apache-2.0' joins licenses with AND or OR" in problems[0]
    assert "'Foo WITH Classpath-exception-2.0' is not a recognised license" in problems[1]


def test_expressions_through_the_validate_stage(tmp_path, web):
    """Manifest rows with expressions, downloaded from the loopback server and validated: the
    ledger carries each row's reason and the normalised expression."""
    import csv

    from tasks.formats.ledger import read_parquet
    from tasks.formats.manifests import plan_source
    from tasks.formats.recipe_download import DownloadConfig, ImageRules, NetworkConfig, SourceConfig, ValidateConfig
    from tasks.formats.storage import Storage
    from tasks.stages.download import download_shard, shard_paths
    from tasks.stages.validate import candidate_paths, validate_shard

    rows = [  # license as written, (normalised, reason)
        ("mit or apache-2.0", ("MIT OR Apache-2.0", None)),
        ("CC BY 4.0 AND ODbL-1.0", ("CC-BY-4.0 AND ODbL-1.0", "license_not_allowed")),
        (
            "GPL-2.0-or-later WITH Classpath-exception-2.0 OR CC0",
            ("GPL-2.0-or-later WITH Classpath-exception-2.0 OR CC0-1.0", None),
        ),
        ("Foo-1.0 AND MIT", ("LicenseRef-Unknown AND MIT", "license_not_allowed")),
    ]
    manifest = tmp_path / "m.csv"
    with open(manifest, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["url", "caption", "license"])
        for i, (lic, _) in enumerate(rows):
            w.writerow([f"{web.base_url}/img/photo.jpg?n={i}", f"caption {i}", lic])
    storage = Storage(str(tmp_path / "store"))
    ref = plan_source(SourceConfig(name="web", manifest=str(manifest)), storage, "ds").chunks[0]
    tar, ledger = shard_paths("ds", ref, "x")
    dl = DownloadConfig(
        timeout_s=5, retries=0, network=NetworkConfig(allowed_networks=("127.0.0.1/32",), any_port=True)
    )
    assert download_shard(ref, storage, dl, tar, ledger).counts.ok == len(rows)
    cfg = ValidateConfig(license=LicensePolicy(allow=("MIT", "CC0-1.0", "CC-BY-4.0")), image=ImageRules(min_side=32))
    cand_tar, cand_table = candidate_paths("ds", "web", 0, tar, "cfg")
    cand = validate_shard(storage, "web", 0, tar, ledger, cfg, cand_tar, cand_table)
    got = read_parquet(storage, cand.table, ["row", "license", "reason"]).to_pylist()
    assert [(r["license"], r["reason"]) for r in sorted(got, key=lambda r: r["row"])] == [want for _, want in rows]
