"""Token counts: a Hugging Face tokenizer from a local folder, or a clearly named approximate counter."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

from tasks.formats.recipe_finetune import TokensConfig
from tasks.models.tokenizers import local_tokenizer


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
