"""Token counts: a Hugging Face tokenizer from a local folder, or a clearly named approximate counter."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

from tasks.formats.recipe_finetune import TokensConfig


class TokenizerError(ValueError):
    """The configured tokenizer folder cannot be loaded; the run stops before any shard."""


class TokenCounter(Protocol):
    """Counts tokens of text; ``name`` goes into the release so readers know how lengths were made."""

    name: str
    exact: bool

    def count(self, text: str) -> int: ...

    def count_many(self, texts: Sequence[str]) -> list[int]: ...


def _tag_pattern(tags: Iterable[str]) -> re.Pattern[str] | None:
    tags = sorted({t for t in tags if t}, key=len, reverse=True)
    return re.compile("|".join(re.escape(t) for t in tags)) if tags else None


class ApproximateTokenCounter:
    """Not a tokenizer: ``ceil(utf8 bytes / chars_per_token)`` per text span, special tags 1 each.

    Used when the recipe names no tokenizer; its name (``approximate-bytes/4.0``) is recorded
    wherever counts are, so nobody mistakes them for exact ones.

    Args:
        chars_per_token: UTF-8 bytes per token (4.0 is about right for English BPE vocabularies).
        special: tags counted as one token each.
    """

    exact = False

    def __init__(self, chars_per_token: float = 4.0, special: Iterable[str] = ()) -> None:
        if chars_per_token <= 0:
            raise ValueError("chars_per_token must be positive")
        self.chars_per_token = chars_per_token
        self.name = f"approximate-bytes/{chars_per_token:g}"
        self._special = _tag_pattern(special)

    def _span(self, text: str) -> int:
        return math.ceil(len(text.encode("utf-8")) / self.chars_per_token) if text.strip() else 0

    def count(self, text: str) -> int:
        if self._special is None:
            return self._span(text)
        n = len(self._special.findall(text))
        return n + sum(self._span(part) for part in self._special.split(text))

    def count_many(self, texts: Sequence[str]) -> list[int]:
        return [self.count(t) for t in texts]


class HFTokenCounter:
    """A Hugging Face fast tokenizer loaded from a local folder; never downloads.

    Args:
        path: a ``save_pretrained`` folder (``AutoTokenizer``), or a folder / file holding a
            bare ``tokenizer.json`` (``PreTrainedTokenizerFast``).
        special: tags added as special tokens, so each counts as one token (NVLM adds its
            tile tags to the vocabulary).
    """

    exact = True

    def __init__(self, path: str, special: Iterable[str] = ()) -> None:
        self.path = path
        self.tokenizer = _load_tokenizer(path)
        special = [t for t in special if t]
        if special:
            self.tokenizer.add_special_tokens({"additional_special_tokens": special})
        self.name = f"hf:{Path(path).name}"

    def count(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def count_many(self, texts: Sequence[str]) -> list[int]:
        if not texts:
            return []
        return [len(ids) for ids in self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]]


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


def _load_tokenizer(path: str) -> Any:
    from transformers import PreTrainedTokenizerFast

    p = Path(path)
    if not p.exists():
        raise TokenizerError(f"tokenizer {path}: no such file or folder (tokenizers are never downloaded)")
    if p.is_file():
        return PreTrainedTokenizerFast(tokenizer_file=str(p))
    return local_tokenizer(p, "finetune.tokens.tokenizer", TokenizerError, fallback=True)


def load_counter(cfg: TokensConfig, special: Iterable[str] = ()) -> TokenCounter:
    """The recipe's tokenizer, or the approximate counter when it names none."""
    special = list(special) if cfg.tags_are_special else []
    if cfg.tokenizer:
        return HFTokenCounter(cfg.tokenizer, special)
    return ApproximateTokenCounter(cfg.chars_per_token, special)
