"""License strings as manifests write them normalise to SPDX ids, and the policy judges them."""

import datetime as dt

import pytest

from tasks.licenses import (
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
from tasks.recipe import LicensePolicy, LicenseReview

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


def test_allowed_license_passes_with_its_id():
    assert license_verdict("CC BY 4.0", "web", policy()) == ("CC-BY-4.0", None, None)


def test_license_outside_allowlist_is_not_allowed_and_named():
    spdx, reason, detail = license_verdict("CC BY-NC 4.0", "web", policy())
    assert (spdx, reason) == ("CC-BY-NC-4.0", "license_not_allowed")
    assert "CC-BY-NC-4.0" in detail


def test_all_rights_reserved_is_not_allowed():
    assert license_verdict("© 2020 Jane", "web", policy())[:2] == (ALL_RIGHTS_RESERVED, "license_not_allowed")


def test_missing_without_default_is_license_missing():
    spdx, reason, detail = license_verdict(None, "web", policy())
    assert (spdx, reason) == (None, "license_missing")
    assert "web" in detail
    assert license_verdict("  ", "web", policy())[:2] == (None, "license_missing")


def test_missing_takes_the_source_default_normalised():
    p = policy(source_defaults={"wiki": "CC BY-SA 4.0"})
    assert license_verdict(None, "wiki", p) == ("CC-BY-SA-4.0", None, None)
    assert license_verdict("n/a", "wiki", p) == ("CC-BY-SA-4.0", None, None)
    # only for the source it names
    assert license_verdict(None, "other", p)[1] == "license_missing"
    # a present license wins over the default
    assert license_verdict("CC BY-NC 4.0", "wiki", p)[1] == "license_not_allowed"


def test_source_default_is_judged_like_any_license():
    p = policy(source_defaults={"flickr": "CC BY-NC 2.0", "odd": "whatever terms"})
    spdx, reason, detail = license_verdict(None, "flickr", p)
    assert (spdx, reason) == ("CC-BY-NC-2.0", "license_not_allowed")
    assert "source default" in detail
    spdx, reason, detail = license_verdict(None, "odd", p)
    assert (spdx, reason) == (None, "license_not_allowed")
    assert "unrecognised license: 'whatever terms'" in detail


def test_allowlist_entries_may_be_aliases():
    p = policy(allow=("CC BY 4.0", "https://creativecommons.org/publicdomain/zero/1.0/", "apache 2", "Public domain"))
    assert license_verdict("cc-by-4.0", "s", p)[1] is None
    assert license_verdict("CC0", "s", p) == ("CC0-1.0", None, None)
    assert license_verdict("Apache-2.0", "s", p)[1] is None
    assert license_verdict("PD-US", "s", p) == (PUBLIC_DOMAIN, None, None)
    assert license_verdict("MIT", "s", p)[1] == "license_not_allowed"


def test_default_allowlist_accepts_the_public_domain_mark():
    # the default lists "PDM-1.0"; SPDX's id is CC-PDM-1.0, and the alias bridges them
    assert license_verdict("https://creativecommons.org/publicdomain/mark/1.0/", "s", policy()) == ("CC-PDM-1.0", None, None)


def test_unknown_rejected_by_default_with_the_raw_value():
    spdx, reason, detail = license_verdict("Foo Public License", "s", policy())
    assert (spdx, reason) == (None, "license_not_allowed")
    assert detail == "unrecognised license: 'Foo Public License'"


def test_unknown_detail_is_cut_short():
    detail = license_verdict("x" * 500, "s", policy())[2]
    assert len(detail) < 120


def test_unknown_allowed_when_policy_says_so():
    p = policy(unknown="allow")
    assert license_verdict("Foo Public License", "s", p) == (UNKNOWN, None, None)
    # a recognised license outside the allowlist is still rejected
    assert license_verdict("CC BY-NC 4.0", "s", p)[1] == "license_not_allowed"
    # and missing is still missing
    assert license_verdict(None, "s", p)[1] == "license_missing"


def test_only_the_two_reasons_exist():
    p = policy(source_defaults={"a": "MIT"})
    reasons = {
        license_verdict(raw, src, p)[1]
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
