"""MkDocs hook: the reference pages generated from the code at build time (recipe models, reasons, CLI), never hand-copied."""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path
from typing import Any, get_args, get_origin

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PAGES = {"reference/recipe.md", "reference/reasons.md", "reference/cli.md"}


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    for uri, text in generate().items():
        files.append(File.generated(config, uri, content=text))
    return files


def generate() -> dict[str, str]:
    return {
        "reference/recipe.md": recipe_page(),
        "reference/reasons.md": reasons_page(),
        "reference/cli.md": cli_page(),
    }


# ----------------------------------------------------------------------------------- recipe


def _args_of(model: type) -> dict[str, str]:
    """``name: text`` entries of a class docstring's ``Args:`` block (continuation lines joined;
    ``a, b: text`` documents both)."""
    doc = inspect.getdoc(model) or ""
    if "Args:" not in doc:
        return {}
    out: dict[str, str] = {}
    current: list[str] = []
    for line in doc.split("Args:", 1)[1].splitlines():
        m = re.match(r"^    ([a-z_][\w, ]*):\s*(.*)$", line)
        if m:
            current = [n.strip() for n in m.group(1).split(",")]
            for name in current:
                out[name] = m.group(2).strip()
        elif line.startswith("        ") and current:
            for name in current:
                out[name] += " " + line.strip()
        elif line.strip() and not line.startswith(" "):
            break
    return out


def _md(text: str) -> str:
    """Docstring text in a table cell: reST literals as markdown ones, pipes escaped."""
    return re.sub(r"``([^`]+)``", r"`\1`", text).replace("|", "&#124;")


def _summary(model: type) -> str:
    doc = inspect.getdoc(model) or ""
    return doc.split("\n\n", 1)[0].replace("\n", " ")


def _type_text(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) if get_origin(annotation) is None else None
    if text and text not in ("Literal",):
        return text
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is not None and getattr(origin, "__name__", "") == "Literal":
        return " | ".join(repr(a) for a in args)
    if args:
        parts = [_type_text(a) for a in args if a is not type(None) and a is not Ellipsis]
        name = getattr(origin, "__name__", str(origin))
        if name == "tuple" and Ellipsis in args:
            name = "list"  # a YAML list, kept as a tuple (frozen)
        if name in ("Union", "UnionType"):
            return " | ".join(parts) + (" | null" if type(None) in args else "")
        return f"{name}[{', '.join(parts)}]"
    return str(annotation).replace("typing.", "")


def _models(annotation: Any) -> list[type]:
    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found = []
    for a in get_args(annotation):
        found += _models(a)
    return found


def _default_text(field: Any) -> str:
    from pydantic import BaseModel

    if field.is_required():
        return "required"
    if field.default_factory is not None:
        value = field.default_factory()
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "(see below)"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return f"`{value!r}`" if not isinstance(value, (int, float)) else f"`{value}`"


def recipe_page() -> str:
    from tasks.formats.recipe import Recipe

    lines = [
        "# Recipe reference",
        "",
        "Generated from the recipe's pydantic models (`tasks/formats/recipe*.py`) when the site is built:",
        "every key, its type, its default and what its model's docstring says of it. Unknown keys are",
        "errors; `${VAR}` and `${VAR:-default}` expand in string values; `--set key.path=value` overrides",
        "any key for one run.",
        "",
    ]
    seen: set[type] = set()
    queue: list[tuple[str, type]] = [("(top level)", Recipe)]
    while queue:
        path, model = queue.pop(0)
        if model in seen:
            continue
        seen.add(model)
        args = _args_of(model)
        lines += [
            f"## `{path}`" if path != "(top level)" else "## Top level",
            "",
            f"`{model.__name__}`: {_md(_summary(model))}",
            "",
        ]
        lines += ["| key | type | default | meaning |", "|---|---|---|---|"]
        for name, field in model.model_fields.items():
            key = field.alias or name
            subs = _models(field.annotation)
            meaning = args.get(name, args.get(key, "")) or (_summary(subs[0]) if subs else "")
            meaning = _md(meaning)
            lines.append(
                f"| `{key}` | {_type_text(field.annotation).replace('|', '&#124;')} | {_default_text(field)} | {meaning} |"
            )
            for sub in subs:
                queue.append((f"{path + '.' if path != '(top level)' else ''}{key}", sub))
        lines.append("")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------- reasons


def reasons_page() -> str:
    from tasks.formats.reasons import FAMILIES, REASONS

    lines = [
        "# Reasons",
        "",
        "Every ledger row that is not `ok` carries one of these stable reasons (generated from",
        "`tasks/formats/reasons.py` when the site is built). A reason never changes meaning; its status",
        "says whether the row was refused by a rule (`rejected`) or failed (`error`).",
        "",
        "| reason | status | meaning |",
        "|---|---|---|",
    ]
    for reason, (status, meaning) in REASONS.items():
        lines.append(f"| `{reason}` | {status} | {meaning.replace('|', '&#124;')} |")
    lines += [
        "",
        "## Families",
        "",
        "A stable prefix and a variable part, grouped by their prefix in reports and gates.",
        "",
    ]
    lines += ["| prefix | status | meaning |", "|---|---|---|"]
    for prefix, (status, meaning) in FAMILIES.items():
        lines.append(f"| `{prefix}...` | {status} | {meaning.replace('|', '&#124;')} |")
    return "\n".join(lines) + "\n"


# -------------------------------------------------------------------------------------- cli


def cli_page() -> str:
    import typer

    from cli.main import app

    group = typer.main.get_command(app)
    ctx = group.context_class(group, info_name="shardsmith")
    lines = ["# Command line", "", "Generated from the `shardsmith` command's own parser when the site is built.", ""]
    todo = [(name, group.get_command(ctx, name), ctx) for name in group.list_commands(ctx)]
    while todo:
        name, cmd, parent = todo.pop(0)
        sub = cmd.context_class(cmd, info_name=name.rsplit(" ", 1)[-1], parent=parent)
        if hasattr(cmd, "list_commands"):  # a command of commands (`shardsmith takedown add`)
            todo[:0] = [(f"{name} {n}", cmd.get_command(sub, n), sub) for n in cmd.list_commands(sub)]
        lines += [
            f"## `shardsmith {name}`",
            "",
            (cmd.help or "").strip().split("\n\n")[0],
            "",
            "```text",
            " ".join(cmd.collect_usage_pieces(sub)).join(["shardsmith " + name + " ", ""]),
            "```",
            "",
        ]
        rows = []
        for p in cmd.params:
            if p.param_type_name == "argument":
                rows.append(
                    f"| `{p.name}` (argument) | {'required' if p.required else 'optional'} | {(getattr(p, 'help', '') or '').replace('|', '&#124;')} |"
                )
            elif p.param_type_name == "option" and "--help" not in p.opts:
                opts = ", ".join(f"`{o}`" for o in (*p.opts, *p.secondary_opts))
                kind = "flag" if p.is_flag else p.display_type(sub).strip("<>").replace("|", "&#124;")
                default = "" if p.default in (None, False, ()) else f" (default `{p.default}`)"
                rows.append(f"| {opts} | {kind}{default} | {(p.help or '').replace('|', '&#124;')} |")
        if rows:
            lines += ["| option | takes | meaning |", "|---|---|---|", *rows, ""]
    return "\n".join(lines) + "\n"
