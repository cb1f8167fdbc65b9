"""`shardsmith takedown add` and `takedown check`: a recipe's takedown lists, appended to with who and why, and checked."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Annotated

import typer

from cli import fail

if TYPE_CHECKING:
    from tasks.formats.recipe import Recipe

takedown = typer.Typer(
    no_args_is_help=True,
    help="Takedown lists: samples every later release leaves out, without a download or a manifest edit.",
)


def _recipe(path: str) -> Recipe:
    from tasks.formats.recipe import load_recipe
    from tasks.formats.recipe_base import RecipeError

    try:
        return load_recipe(path)
    except RecipeError as err:
        raise fail(str(err), 2) from None


@takedown.command()
def add(
    target: Annotated[
        str,
        typer.Argument(
            metavar="LIST",
            help="The list: a file or an s3:// URL (created when absent), or with --recipe a list's name there.",
        ),
    ],
    entries: Annotated[
        list[str],
        typer.Argument(
            metavar="ENTRY",
            help="URLs, domains, sample keys, sha256 digests, 16-hex perceptual hashes; kind:value to say which.",
        ),
    ],
    by: Annotated[str, typer.Option("--by", help="Who asks for the takedown (recorded in the list).")],
    why: Annotated[str, typer.Option("--why", help="Why (recorded in the list): a ticket, a request, a law.")],
    recipe: Annotated[
        str | None,
        typer.Option(help="A recipe: LIST may name one of its takedown lists, and its storage_options reach s3."),
    ] = None,
) -> None:
    """Append entries to a takedown list, with the date, who and why (one bad entry adds none)."""
    from tasks.formats.takedown import TakedownError
    from tasks.formats.takedown import add as add_entries

    path, options = target, None
    if recipe is not None:
        r = _recipe(recipe)
        from tasks.formats.takedown import list_name

        named = [s.path for s in r.takedown if target in (list_name(s), s.path)]
        if not named:
            known = ", ".join(list_name(s) for s in r.takedown) or "none"
            raise fail(f"{recipe} names no takedown list {target!r} (its lists: {known})", 2)
        path, options = named[0], r.storage_options
    try:
        added = add_entries(path, entries, by, why, options)
    except TakedownError as err:
        raise fail(str(err), 2) from None
    typer.echo(f"added {len(added)} {'entry' if len(added) == 1 else 'entries'} to {path}:")
    for entry in added:
        typer.echo(f"  line {entry.line}: {entry.text}")
    typer.echo("the next run releases without the samples they match")


@takedown.command()
def check(recipe: Annotated[str, typer.Argument(help="The recipe whose takedown lists to read.")]) -> None:
    """Read a recipe's takedown lists as a run would: each list's entries by kind, or every bad line."""
    from tasks.formats.takedown import KINDS, TakedownError, read_lists

    r = _recipe(recipe)
    if not r.takedown:
        typer.echo(f"{recipe} names no takedown list")
        return
    try:
        lists = read_lists(r.takedown, r.storage_options)
    except TakedownError as err:
        raise fail(str(err), 2) from None
    for loaded in lists:
        kinds = Counter(e.kind for e in loaded.entries)
        counts = ", ".join(f"{kinds[k]} {k}" for k in KINDS if kinds[k])
        typer.echo(
            f"{loaded.name}: {len(loaded.entries)} entries ({counts or 'none'}), "
            f"phash distance {loaded.phash_distance}: {loaded.path}"
        )
