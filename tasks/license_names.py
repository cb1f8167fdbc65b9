"""License names as manifests write them: the SPDX ids, references and aliases that normalisation knows."""

from __future__ import annotations

from tasks.spdx import UNKNOWN

# Ids on the SPDX License List (https://spdx.org/licenses/) that normalisation can produce.
# Every Creative Commons id on the list is here, ports included, so "CC BY-SA 3.0 DE" finds
# its port; the rest are the licenses that image, text and data manifests actually carry.
_CC_IDS = (
    "CC-BY-1.0", "CC-BY-2.0", "CC-BY-2.5", "CC-BY-2.5-AU", "CC-BY-3.0", "CC-BY-3.0-AT",
    "CC-BY-3.0-AU", "CC-BY-3.0-DE", "CC-BY-3.0-IGO", "CC-BY-3.0-NL", "CC-BY-3.0-US", "CC-BY-4.0",
    "CC-BY-NC-1.0", "CC-BY-NC-2.0", "CC-BY-NC-2.5", "CC-BY-NC-3.0", "CC-BY-NC-3.0-DE",
    "CC-BY-NC-4.0", "CC-BY-NC-ND-1.0", "CC-BY-NC-ND-2.0", "CC-BY-NC-ND-2.5", "CC-BY-NC-ND-3.0",
    "CC-BY-NC-ND-3.0-DE", "CC-BY-NC-ND-3.0-IGO", "CC-BY-NC-ND-4.0", "CC-BY-NC-SA-1.0",
    "CC-BY-NC-SA-2.0", "CC-BY-NC-SA-2.0-DE", "CC-BY-NC-SA-2.0-FR", "CC-BY-NC-SA-2.0-UK",
    "CC-BY-NC-SA-2.5", "CC-BY-NC-SA-3.0", "CC-BY-NC-SA-3.0-DE", "CC-BY-NC-SA-3.0-IGO",
    "CC-BY-NC-SA-4.0", "CC-BY-ND-1.0", "CC-BY-ND-2.0", "CC-BY-ND-2.5", "CC-BY-ND-3.0",
    "CC-BY-ND-3.0-DE", "CC-BY-ND-4.0", "CC-BY-SA-1.0", "CC-BY-SA-2.0", "CC-BY-SA-2.0-UK",
    "CC-BY-SA-2.1-JP", "CC-BY-SA-2.5", "CC-BY-SA-3.0", "CC-BY-SA-3.0-AT", "CC-BY-SA-3.0-DE",
    "CC-BY-SA-3.0-IGO", "CC-BY-SA-4.0", "CC-SA-1.0", "CC-PDDC", "CC-PDM-1.0", "CC0-1.0",
)
_OTHER_IDS = (
    "0BSD", "AGPL-3.0-only", "AGPL-3.0-or-later", "Apache-1.0", "Apache-1.1", "Apache-2.0",
    "Artistic-2.0", "BSD-2-Clause", "BSD-3-Clause", "BSD-4-Clause", "BSL-1.0",
    "CDLA-Permissive-1.0", "CDLA-Permissive-2.0", "CDLA-Sharing-1.0", "DL-DE-BY-2.0",
    "DL-DE-ZERO-2.0", "EPL-1.0", "EPL-2.0", "etalab-2.0", "GFDL-1.2-only", "GFDL-1.2-or-later",
    "GFDL-1.3-only", "GFDL-1.3-or-later", "GPL-2.0-only", "GPL-2.0-or-later", "GPL-3.0-only",
    "GPL-3.0-or-later", "ISC", "LGPL-2.1-only", "LGPL-2.1-or-later", "LGPL-3.0-only",
    "LGPL-3.0-or-later", "MIT", "MIT-0", "MPL-1.1", "MPL-2.0", "NLOD-2.0", "ODbL-1.0",
    "ODC-By-1.0", "OFL-1.1", "OGL-Canada-2.0", "OGL-UK-2.0", "OGL-UK-3.0", "PDDL-1.0",
    "Unlicense", "WTFPL", "Zlib",
)
SPDX_LISTED: frozenset[str] = frozenset(_CC_IDS + _OTHER_IDS)

# What the SPDX list has no id for gets a LicenseRef (SPDX's form for ids outside the list).
PUBLIC_DOMAIN = "LicenseRef-Public-Domain"
ALL_RIGHTS_RESERVED = "LicenseRef-All-Rights-Reserved"
# A license string that was present but could not be recognised (tasks.spdx.UNKNOWN,
# "LicenseRef-Unknown"): normalize_license returns it (never None) so that "the manifest said
# something we do not understand" stays distinct from "the manifest said nothing".
LICENSE_REFS: frozenset[str] = frozenset({PUBLIC_DOMAIN, ALL_RIGHTS_RESERVED, UNKNOWN})

SPDX_KNOWN: frozenset[str] = SPDX_LISTED | LICENSE_REFS
_BY_LOWER = {i.lower(): i for i in SPDX_KNOWN}

# Values that mean "no license given" rather than "a license we do not know": a source
# default then applies. Spreadsheet and dataframe exports write nulls in all these ways.
MISSING_VALUES = frozenset({"", "none", "null", "nil", "nan", "n/a", "na", "-", "--", "?", "unknown",
                            "not specified", "unspecified"})

# Free-form spellings, compacted by _compact at import, so each entry covers its case,
# spacing, punctuation, "License"/"Version" words and "v2"/"2.0" variants at once. The
# Creative Commons BY family is parsed structurally instead (_parse_cc), since its elements,
# versions and ports combine into too many spellings to list.
LICENSE_ALIASES: dict[str, str] = {
    # Creative Commons public-domain tools
    "CC0": "CC0-1.0", "CC0 1.0": "CC0-1.0", "CC-0": "CC0-1.0", "CC Zero": "CC0-1.0", "CC Zero 1.0": "CC0-1.0",
    "Creative Commons Zero": "CC0-1.0", "Creative Commons CC0": "CC0-1.0",
    "Public Domain Dedication": "CC0-1.0", "CC0 Public Domain Dedication": "CC0-1.0",
    "CC0 1.0 Universal Public Domain Dedication": "CC0-1.0",
    "Public Domain Mark": "CC-PDM-1.0", "Public Domain Mark 1.0": "CC-PDM-1.0",
    "PDM": "CC-PDM-1.0", "PDM 1.0": "CC-PDM-1.0", "CC PDM": "CC-PDM-1.0", "CC PDM 1.0": "CC-PDM-1.0",
    "Creative Commons Public Domain Mark": "CC-PDM-1.0",
    "Public Domain Dedication and Certification": "CC-PDDC",
    "Creative Commons Public Domain Dedication and Certification": "CC-PDDC",
    "Public domain": PUBLIC_DOMAIN, "PD": PUBLIC_DOMAIN,
    # Open Data Commons and government data licenses
    "PDDL": "PDDL-1.0", "ODC PDDL": "PDDL-1.0", "Public Domain Dedication and License": "PDDL-1.0",
    "Open Data Commons Public Domain Dedication and License": "PDDL-1.0",
    "ODbL": "ODbL-1.0", "ODC ODbL": "ODbL-1.0", "Open Database License": "ODbL-1.0",
    "Open Data Commons Open Database License": "ODbL-1.0",
    "ODC-By": "ODC-By-1.0", "Open Data Commons Attribution License": "ODC-By-1.0",
    "OGL-UK 3.0": "OGL-UK-3.0", "OGL 3.0": "OGL-UK-3.0", "Open Government Licence 3.0": "OGL-UK-3.0",
    "Open Government Licence 2.0": "OGL-UK-2.0", "Open Government Licence Canada 2.0": "OGL-Canada-2.0",
    "Etalab 2.0": "etalab-2.0", "Licence Ouverte 2.0": "etalab-2.0",
    "Datenlizenz Deutschland Namensnennung 2.0": "DL-DE-BY-2.0",
    "Datenlizenz Deutschland Zero 2.0": "DL-DE-ZERO-2.0",
    "CDLA Permissive 1.0": "CDLA-Permissive-1.0", "CDLA Permissive 2.0": "CDLA-Permissive-2.0",
    "CDLA Sharing 1.0": "CDLA-Sharing-1.0",
    "Community Data License Agreement Permissive 2.0": "CDLA-Permissive-2.0",
    # permissive software licenses
    "Apache 2.0": "Apache-2.0", "ASL 2.0": "Apache-2.0", "AL 2.0": "Apache-2.0",
    "Apache 1.1": "Apache-1.1", "Apache 1.0": "Apache-1.0",
    "MIT": "MIT", "The MIT License (MIT)": "MIT", "Expat": "MIT", "MIT/Expat": "MIT",
    "MIT No Attribution": "MIT-0",
    "BSD 3-Clause": "BSD-3-Clause", "BSD-3": "BSD-3-Clause", "3-Clause BSD": "BSD-3-Clause",
    "New BSD": "BSD-3-Clause", "Modified BSD": "BSD-3-Clause", "Revised BSD": "BSD-3-Clause",
    'BSD 3-Clause "New" or "Revised" License': "BSD-3-Clause",
    "BSD 2-Clause": "BSD-2-Clause", "BSD-2": "BSD-2-Clause", "2-Clause BSD": "BSD-2-Clause",
    "Simplified BSD": "BSD-2-Clause", "FreeBSD": "BSD-2-Clause",
    'BSD 2-Clause "Simplified" License': "BSD-2-Clause",
    "BSD 4-Clause": "BSD-4-Clause", "Original BSD": "BSD-4-Clause",
    "Zero-Clause BSD": "0BSD", "BSD Zero Clause": "0BSD",
    "ISC": "ISC", "Unlicense": "Unlicense", "WTFPL": "WTFPL", "zlib": "Zlib",
    "Boost Software License 1.0": "BSL-1.0", "Boost 1.0": "BSL-1.0",
    "MPL 2.0": "MPL-2.0", "Mozilla Public License 2.0": "MPL-2.0", "MPL 1.1": "MPL-1.1",
    "EPL 2.0": "EPL-2.0", "Eclipse Public License 2.0": "EPL-2.0", "EPL 1.0": "EPL-1.0",
    "SIL Open Font License 1.1": "OFL-1.1", "OFL 1.1": "OFL-1.1", "Artistic 2.0": "Artistic-2.0",
    # GNU family: a bare version means "only", as SPDX's deprecated GPL-3.0 did
    "GPL 2": "GPL-2.0-only", "GPL 2+": "GPL-2.0-or-later",
    "GPL 3": "GPL-3.0-only", "GPL 3+": "GPL-3.0-or-later",
    "LGPL 2.1": "LGPL-2.1-only", "LGPL 2.1+": "LGPL-2.1-or-later",
    "LGPL 3": "LGPL-3.0-only", "LGPL 3+": "LGPL-3.0-or-later",
    "AGPL 3": "AGPL-3.0-only", "AGPL 3+": "AGPL-3.0-or-later",
    "GFDL 1.2": "GFDL-1.2-only", "GFDL 1.2+": "GFDL-1.2-or-later",
    "GFDL 1.3": "GFDL-1.3-only", "GFDL 1.3+": "GFDL-1.3-or-later",
    # no license granted
    "All rights reserved": ALL_RIGHTS_RESERVED, "Copyright": ALL_RIGHTS_RESERVED,
    "Copyrighted": ALL_RIGHTS_RESERVED, "Proprietary": ALL_RIGHTS_RESERVED,
    "In Copyright": ALL_RIGHTS_RESERVED,
}

# Deprecated SPDX ids still common in manifests.
DEPRECATED_IDS = {
    "gpl-2.0": "GPL-2.0-only", "gpl-2.0+": "GPL-2.0-or-later", "gpl-3.0": "GPL-3.0-only",
    "gpl-3.0+": "GPL-3.0-or-later", "lgpl-2.1": "LGPL-2.1-only", "lgpl-2.1+": "LGPL-2.1-or-later",
    "lgpl-3.0": "LGPL-3.0-only", "lgpl-3.0+": "LGPL-3.0-or-later", "agpl-3.0": "AGPL-3.0-only",
    "gfdl-1.2": "GFDL-1.2-only", "gfdl-1.3": "GFDL-1.3-only",
}
