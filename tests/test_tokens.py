"""Tests for token counting: a real local HF tokenizer and the approximate counter."""

from __future__ import annotations

import pytest

from tasks.finetune.tokens import ApproximateTokenCounter, HFTokenCounter, TokenizerError, load_counter
from tasks.formats.recipe_finetune import TokensConfig


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A tiny word-level tokenizer saved with ``save_pretrained``: one token per known word."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "[PAD]", "what", "is", "in", "the", "image", "a", "cat", "on", "mat", "?", "."]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace()])
    path = tmp_path_factory.mktemp("tok")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]").save_pretrained(str(path))
    return path


def test_hf_counter_counts_real_tokens(tokenizer_dir):
    c = HFTokenCounter(str(tokenizer_dir))
    assert c.exact and c.name == f"hf:{tokenizer_dir.name}"
    assert c.count("what is in the image ?") == 6
    assert c.count_many(["a cat", "a cat on the mat ."]) == [2, 6]
    assert c.count_many([]) == []


def test_hf_counter_tags_are_single_special_tokens(tokenizer_dir):
    tags = ["<img>", "</img>", "<tile_1>", "<tile_global_thumbnail>"]
    special = HFTokenCounter(str(tokenizer_dir), tags)
    plain = HFTokenCounter(str(tokenizer_dir))
    text = "<img><tile_1><tile_global_thumbnail></img> a cat"
    assert special.count(text) == 4 + 2
    assert plain.count(text) > special.count(text)  # split into <, img, >, ... otherwise


def test_bare_tokenizer_json(tokenizer_dir):
    c = HFTokenCounter(str(tokenizer_dir / "tokenizer.json"))
    assert c.count("a cat") == 2


def test_missing_tokenizer_is_an_error(tmp_path):
    with pytest.raises(TokenizerError, match="never downloaded"):
        HFTokenCounter(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerError):
        HFTokenCounter(str(tmp_path / "empty"))


def test_approximate_counter_is_named_and_counts_bytes():
    c = ApproximateTokenCounter(4.0, ["<tile_1>", "<img>", "</img>"])
    assert not c.exact and c.name == "approximate-bytes/4"
    assert c.count("abcd") == 1 and c.count("abcde") == 2 and c.count("") == 0 and c.count("   ") == 0
    assert c.count("<img><tile_1></img>") == 3
    assert c.count("<img><tile_1></img>abcdefgh") == 5
    assert c.count("é" * 4) == 2  # bytes, not characters


def test_load_counter_picks_by_recipe(tokenizer_dir):
    assert isinstance(load_counter(TokensConfig()), ApproximateTokenCounter)
    hf = load_counter(TokensConfig(tokenizer=str(tokenizer_dir)), ["<tile_1>"])
    assert isinstance(hf, HFTokenCounter) and hf.count("<tile_1>") == 1
    assert load_counter(TokensConfig(tags_are_special=False), ["<tile_1>"]).count("<tile_1>") == 2
