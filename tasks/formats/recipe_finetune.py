"""Recipe models of the fine-tuning phases: conversations, tiling, tokens, padding, packing, its gate."""

from __future__ import annotations

import string
from typing import Literal

from pydantic import Field, field_validator, model_validator

from tasks.formats.recipe_base import Frozen
from tasks.formats.recipe_privacy import TextPrivacy


class ConversationRules(Frozen):
    """Checks on LLaVA-style conversation records (tasks/finetune/conversations.py).

    Args:
        placeholder: the image placeholder in turn text; its count must equal the images.
        max_chars: largest total characters over all turns (``conversation_too_long``).
        max_turns: most turns per record.
        max_images: most images per record (``too_many_images``).
        image_root: folder that relative image paths resolve against (default: the records
            file's folder); they become ``file://`` URLs, so ``download.network.file_root``
            must contain it.
        license: license of the images of records that carry none (SPDX id or alias).
        max_record_bytes: a JSONL line or JSON record over this is ``unparsable_row``.
        range_bytes: a plain JSONL file is read by one task per this many bytes (a JSON array
            or a gzip file by one task).
        privacy: the recipe's top-level ``privacy.text``, copied here by the recipe: every turn
            is checked with it; not written under ``finetune:``.
    """

    placeholder: str = Field(default="<image>", min_length=1)
    max_chars: int = Field(default=200_000, ge=1)
    max_turns: int = Field(default=256, ge=2)
    max_images: int = Field(default=16, ge=1)
    image_root: str | None = None
    license: str | None = None
    max_record_bytes: int = Field(default=1 << 20, ge=1024)
    range_bytes: int = Field(default=128 << 20, ge=1024)
    privacy: TextPrivacy = TextPrivacy(mode="off")


class TilingConfig(Frozen):
    """NVLM dynamic high-resolution tiling with 1-D tile tags (tasks/finetune/tiling.py).

    Args:
        tile_size: side of a square tile, in pixels (448 in NVLM).
        min_tiles, max_tiles: bounds on rows x cols of the grid (1 and 6 in NVLM).
        thumbnail: add a global thumbnail (one more tile) when the grid has more than one tile.
        tokens_per_tile: image tokens each tile (and the thumbnail) costs (256 in NVLM).
        tile_tag: tag before tile ``i`` (1-based), formatted with ``i``: it must hold the field
            ``{i}`` (a format spec such as ``{i:02d}`` is allowed) and no other, and none of its
            tags may equal another tag below.
        thumbnail_tag: tag before the thumbnail.
        image_start, image_end: delimiters around one image's tags.
            The tags that are set (not empty) must all differ.
        store: ``grid`` stores the image and its grid (the loader cuts tiles); ``tiles`` also
            stores every tile and the thumbnail as JPEGs.
        quality: JPEG quality of stored tiles.
        max_pixels: width x height cap read from the header before any decoding.
    """

    tile_size: int = Field(default=448, ge=14, le=4096)
    min_tiles: int = Field(default=1, ge=1, le=64)
    max_tiles: int = Field(default=6, ge=1, le=64)
    thumbnail: bool = True
    tokens_per_tile: int = Field(default=256, ge=1, le=16384)
    tile_tag: str = "<tile_{i}>"
    thumbnail_tag: str = "<tile_global_thumbnail>"
    image_start: str = "<img>"
    image_end: str = "</img>"
    store: Literal["grid", "tiles"] = "grid"
    quality: int = Field(default=90, ge=1, le=100)
    max_pixels: int = Field(default=50_000_000, ge=1)

    @field_validator("tile_tag")
    @classmethod
    def _tile_tag_format(cls, value: str) -> str:
        try:
            fields = [name for _, name, _, _ in string.Formatter().parse(value) if name is not None]
        except ValueError as err:  # "<tile_{i>": an unbalanced brace
            raise ValueError(f"not a format string with the field {{i}}: {err}") from None
        other = sorted({name for name in fields if name != "i"})
        if other:
            shown = ", ".join("{" + name + "}" for name in other)
            raise ValueError(f"may hold only the field {{i}}, not {shown} (braces that are text are written {{{{ }}}})")
        if "i" not in fields:
            raise ValueError("must hold the field {i} (the tile's number): without it every tile has the same tag")
        try:
            value.format(i=1)
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as err:
            raise ValueError(f"does not format with i=1: {type(err).__name__}: {err}") from None
        return value

    @model_validator(mode="after")
    def _bounds(self) -> TilingConfig:
        if self.min_tiles > self.max_tiles:
            raise ValueError("min_tiles must not exceed max_tiles")
        # every tag a sample can hold (tiling.all_tags), the empty ones aside, told apart by the
        # counts of the release and the tokenizer: each must differ from the others
        seen: dict[str, str] = {}
        named = [
            ("image_start", self.image_start),
            ("image_end", self.image_end),
            ("thumbnail_tag", self.thumbnail_tag),
        ]
        for name, tag in named:
            if tag and tag in seen:
                raise ValueError(f"{name} {tag!r} is also {seen[tag]}: every tag must differ")
            if tag:
                seen[tag] = name
        for i in range(1, self.max_tiles + 1):
            tag = self.tile_tag.format(i=i)
            if tag in seen:
                raise ValueError(
                    f"tile_tag {self.tile_tag!r} gives {tag!r} for tile {i}, which is also {seen[tag]}: "
                    "every tag must differ"
                )
            seen[tag] = f"the tile_tag of tile {i}"
        return self


class TokensConfig(Frozen):
    """How tokens are counted (tasks/finetune/tokens.py).

    Args:
        tokenizer: local directory of a Hugging Face tokenizer (``tokenizer.json`` or a
            ``save_pretrained`` folder); never downloaded. Unset: the approximate counter.
        chars_per_token: the approximate counter's UTF-8 bytes per token.
        turn_overhead: tokens each turn adds for its role header and end marker.
        tags_are_special: tile tags and image delimiters are single special tokens (added to
            the tokenizer, as NVLM does), not text split into pieces.
    """

    tokenizer: str | None = None
    chars_per_token: float = Field(default=4.0, gt=0, le=64)
    turn_overhead: int = Field(default=4, ge=0, le=64)
    tags_are_special: bool = True


class PaddingConfig(Frozen):
    """Constrained padding: the longest sample allowed (tasks/finetune/packing.py).

    Args:
        cutoff: ``percentile`` takes that percentile of the accepted samples' token counts
            (capped by ``max_tokens``); ``fixed`` uses ``max_tokens``.
        percentile: for ``cutoff: percentile``.
        max_tokens: the fixed cut-off, and the cap of the percentile one; never above the
            packing budget.
        policy: ``drop`` rejects longer samples (``sample_too_long``); ``truncate`` keeps
            the longest prefix of whole human/assistant exchanges that fits, and drops the
            sample when not even the first exchange fits.
    """

    cutoff: Literal["fixed", "percentile"] = "percentile"
    percentile: float = Field(default=99.0, gt=0, le=100)
    max_tokens: int = Field(default=8192, ge=1)
    policy: Literal["drop", "truncate"] = "truncate"


class PackingConfig(Frozen):
    """Multimodal packing under a token budget and per-pack image and tile caps.

    Args:
        packed: write packs (one WebDataset sample per pack); off writes one sample per record.
        algorithm: ``balanced_greedy`` (longest first into the least-loaded pack that fits
            both limits) or ``ffd`` (first-fit decreasing).
        budget: tokens per pack (text + image tokens).
        max_images: images per pack.
        max_tiles: tiles (thumbnails included) per pack; unset: no cap.
        compare_batch_size: batch size of the pad-to-longest baseline the report compares with.
    """

    packed: bool = True
    algorithm: Literal["balanced_greedy", "ffd"] = "balanced_greedy"
    budget: int = Field(default=8192, ge=16)
    max_images: int = Field(default=16, ge=1)
    max_tiles: int | None = Field(default=None, ge=1)
    compare_batch_size: int = Field(default=8, ge=1)


class FinetuneConfig(Frozen):
    """The fine-tuning dataset's stages (``kind: finetuning``).

    Args:
        conversation: record and conversation checks.
        tiling: dynamic high-resolution tiling and tile tags.
        tokens: token counting.
        padding: constrained padding cut-off and policy.
        packing: packing under a token budget.
        text_only_ratio: share of text-only records among accepted samples; surplus text-only
            records (chosen by a hash of their key) are rejected as ``text_only_over_ratio``.
            Unset keeps them all.
    """

    conversation: ConversationRules = ConversationRules()
    tiling: TilingConfig = TilingConfig()
    tokens: TokensConfig = TokensConfig()
    padding: PaddingConfig = PaddingConfig()
    packing: PackingConfig = PackingConfig()
    text_only_ratio: float | None = Field(default=None, ge=0, lt=1)


class FinetuneGate(Frozen):
    """Thresholds of the fine-tuning gate (conversations and packs).

    Args:
        min_samples: accepted samples at least this.
        max_reject_rate: records not accepted / records at most this.
        min_fill_ratio: useful tokens / (packs x budget) at least this (packed releases).
        min_text_only_ratio, max_text_only_ratio: bounds on text-only samples / accepted.
        max_personal_data_rate: accepted records released with personal data left in a turn
            (found under ``privacy.text: record``; redacted turns do not count) / accepted at
            most this: every turn of every record, text-only ones included (the validation
            gate's ``max_personal_data_rate`` sees only the text beside each image).
    """

    min_samples: int = Field(default=1, ge=1)
    max_reject_rate: float = Field(default=0.5, ge=0, le=1)
    min_fill_ratio: float = Field(default=0.9, ge=0, le=1)
    min_text_only_ratio: float = Field(default=0.0, ge=0, le=1)
    max_text_only_ratio: float = Field(default=1.0, ge=0, le=1)
    max_personal_data_rate: float = Field(default=0.05, ge=0, le=1)
