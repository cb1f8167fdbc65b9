"""The documentation: references generated from the code cover all of it, and the README's links resolve."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "docs" / "hooks"))


def test_the_recipe_reference_names_every_key_of_every_model():
    from pydantic import BaseModel
    from reference import _models, recipe_page

    from tasks.formats.recipe import Recipe

    page = recipe_page()
    seen, queue, keys = set(), [Recipe], 0
    while queue:
        model = queue.pop()
        if model in seen:
            continue
        seen.add(model)
        assert f"`{model.__name__}`" in page
        for name, field in model.model_fields.items():
            assert f"| `{field.alias or name}` |" in page, f"{model.__name__}.{name}"
            keys += 1
            queue += [m for m in _models(field.annotation) if issubclass(m, BaseModel)]
    assert keys > 100 and "CurateConfig" in page and "| `semdedup` |" in page


def test_the_reasons_reference_lists_every_reason_and_family():
    from reference import reasons_page

    from tasks.formats.reasons import FAMILIES, REASONS

    page = reasons_page()
    assert all(f"| `{r}` | {status} |" in page for r, (status, _) in REASONS.items())
    assert all(f"| `{p}...` |" in page for p in FAMILIES)


def test_the_cli_reference_lists_every_command_and_option():
    from reference import cli_page

    page = cli_page()
    for command in ("run", "demo", "report", "releases", "diff", "serve", "alerts"):
        assert f"## `shardsmith {command}`" in page
    assert "`--examples` | flag |" in page and "`--set` |" in page


def test_readme_fits_two_screens_and_its_links_resolve():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 60
    assert "make demo" in text and "make test" in text
    for target in re.findall(r"\]\(([^)#]+)\)", text):
        if "://" not in target:
            assert (ROOT / target).exists(), target
