"""A tokenizer from a local folder, refused in one line when the folder has none.

transformers 5 builds an empty tokenizer from a model's config alone (every word one id), so
loading is not proof of a tokenizer: the folder must hold its files, and what loads must have a
vocabulary besides its special tokens. Used by the dual encoder (curation), the frozen text
encoders (precache) and the fine-tuning token counter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# Files that hold a tokenizer's vocabulary (a pair: both of them), in a folder or its tokenizer/ subfolder.
TOKENIZER_FILES: tuple[tuple[str, ...], ...] = (
    ("tokenizer.json",),
    ("vocab.json", "merges.txt"),
    ("spiece.model",),
    ("tokenizer.model",),
    ("vocab.txt",),
    ("sentencepiece.bpe.model",),
)
# Without these files a folder may still hold a tokenizer that needs none (a byte-level one):
# its tokenizer_config.json says which.
TOKENIZER_CONFIG = "tokenizer_config.json"


def tokenizer_folder(path: str | Path) -> Path | None:
    """Where the tokenizer of folder ``path`` is: the folder itself or its ``tokenizer/``
    subfolder, whichever holds tokenizer files (``TOKENIZER_FILES``, else a tokenizer_config.json);
    None when neither does."""
    root = Path(path)
    places = [root, root / "tokenizer"]
    for names in (*TOKENIZER_FILES, (TOKENIZER_CONFIG,)):
        for place in places:
            if all((place / n).is_file() for n in names):
                return place
    return None


def _wanted() -> str:
    return ", ".join(" and ".join(names) for names in TOKENIZER_FILES)


def need_tokenizer_folder(path: str | Path, what: str, error: type[Exception] = ValueError) -> Path:
    """``tokenizer_folder(path)``, or ``error`` ("no tokenizer there") naming ``what`` and the
    folder; reads no file (imports no transformers): a preflight's check."""
    folder = tokenizer_folder(path)
    if folder is None:
        raise error(f"{what} {path}: no tokenizer there (none of {_wanted()} in it or in its tokenizer/ subfolder)")
    return folder


def local_tokenizer(path: str | Path, what: str, error: type[Exception] = ValueError, fallback: bool = False) -> Any:
    """The tokenizer of the local folder ``path`` (``AutoTokenizer``, never downloaded), or
    ``error`` naming the recipe field ``what`` and the folder in one line: when the folder holds
    no tokenizer files, when they do not load, or when what loads has no vocabulary besides its
    special tokens (transformers 5 builds such an empty tokenizer from a model's config alone,
    mapping every word to one id). ``fallback``: a bare tokenizer.json that AutoTokenizer does
    not read is loaded as a ``PreTrainedTokenizerFast``."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    folder = need_tokenizer_folder(path, what, error)
    wanted = _wanted()
    try:
        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as err:
        bare = folder / "tokenizer.json"
        if not (fallback and bare.is_file()):
            raise error(
                f"{what} {path}: no tokenizer there that loads ({type(err).__name__}: {one_line(err)})"
            ) from None
        tok = PreTrainedTokenizerFast(tokenizer_file=str(bare))
    special = set(tok.all_special_tokens)
    words = [t for t in tok.get_vocab() if t not in special]
    if not words:
        raise error(
            f"{what} {path}: no tokenizer there (what loads has no vocabulary besides its {len(special)} "
            f"special tokens: every word would be one token); put {wanted} in it"
        )
    return tok


def one_line(err: BaseException) -> str:
    """An error's message on one line, at most 300 characters."""
    text = " ".join(str(err).split())
    return text if len(text) <= 300 else text[:297] + "..."
