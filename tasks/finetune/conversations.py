"""LLaVA-style conversation records: checks with stable reasons, image references, placeholder rendering."""

from __future__ import annotations

import io
import json
import posixpath
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import quote, urlsplit

from tasks.formats.recipe_finetune import ConversationRules
from tasks.formats.recipe_privacy import TextPrivacy
from tasks.policies.captions import INVISIBLE

HUMAN, GPT = "human", "gpt"
# Other spellings seen in public LLaVA-style sets, mapped to the two roles.
ROLE_ALIASES = {"human": HUMAN, "user": HUMAN, "gpt": GPT, "assistant": GPT}
REMOTE_SCHEMES = ("http", "https", "s3", "file")


@dataclass
class Conversation:
    """A record that passed (or failed) the checks.

    Args:
        reason, detail: ``None`` when it passed; else the stable reason.
        id: the record's ``id`` (string), or ``None``.
        turns: (role, text) with roles normalised to ``human`` / ``gpt``.
        images: the image references, in placeholder order.
        turn_images: placeholders per turn.
        license: the record's ``license`` field, if any.
        personal_data: kinds of personal data found in its turns, comma-joined ("" for none;
            None where they were not scanned).
        redacted: its turns were redacted.
    """

    reason: str | None = None
    detail: str | None = None
    id: str | None = None
    turns: list[tuple[str, str]] = field(default_factory=list)
    images: list[str] = field(default_factory=list)
    turn_images: list[int] = field(default_factory=list)
    license: str | None = None
    personal_data: str | None = None
    redacted: bool = False

    @property
    def ok(self) -> bool:
        return self.reason is None

    @property
    def text_only(self) -> bool:
        return not self.images

    def image_texts(self, placeholder: str) -> list[str]:
        """Per image, in placeholder order, the text that speaks of it: the reply to the human
        turn that holds its placeholder (that turn's own text when no reply follows). Curation
        aligns each image with it."""
        out = []
        for j, n in enumerate(self.turn_images):
            role = self.turns[j][0] if j < len(self.turns) else HUMAN
            text = self.turns[j + 1][1] if role == HUMAN and j + 1 < len(self.turns) else self.turns[j][1]
            out += [text.replace(placeholder, " ").strip()] * n
        return out


def _fail(reason: str, detail: str, **kw: Any) -> Conversation:
    return Conversation(reason=reason, detail=detail, **kw)


def image_refs(record: dict[str, Any]) -> list[str] | None:
    """The record's images as a list (``image`` or ``images``: a string or a list); None if malformed."""
    value = record.get("image")
    if value is None:  # absent, or null beside an "images" list
        value = record.get("images")
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value.strip() else None
    if isinstance(value, list) and all(isinstance(v, str) and v.strip() for v in value):
        return list(value)
    return None


def check_conversation(record: Any, rules: ConversationRules, reserved: tuple[str, ...] = ()) -> Conversation:
    """Schema, roles (human first, alternating, gpt last), no empty turns (nothing visible but
    placeholders), no ``reserved`` tag (the tiler's: ``tiling.all_tags``) in a turn's text,
    placeholders = images, bounds."""
    if not isinstance(record, dict):
        return _fail("conversation_schema", f"record is {type(record).__name__}, not an object")
    rid = record.get("id")
    # as written: a number's digits, anything else but a string its JSON (not Python's repr)
    rid = None if rid is None else rid if isinstance(rid, str) else json.dumps(rid, ensure_ascii=False)
    images = image_refs(record)
    if images is None:
        return _fail("conversation_schema", "image must be a non-empty string or a list of them", id=rid)
    lic = record.get("license")
    lic = lic if isinstance(lic, str) and lic.strip() else None
    conv = record.get("conversations")
    if not isinstance(conv, list):
        return _fail("conversation_schema", "conversations is missing or not a list", id=rid, images=images)
    turns: list[tuple[str, str]] = []
    for j, turn in enumerate(conv):
        if (
            not isinstance(turn, dict)
            or not isinstance(turn.get("from"), str)
            or not isinstance(turn.get("value"), str)
        ):
            return _fail("conversation_schema", f"turn {j} is not {{from, value}} strings", id=rid, images=images)
        turns.append((turn["from"], turn["value"]))
    base = dict(id=rid, images=images, license=lic)
    if not turns:
        return _fail("conversation_empty", "no turns", **base)
    if len(turns) > rules.max_turns:
        return _fail("conversation_roles", f"{len(turns)} turns over {rules.max_turns}", **base)
    roles = [ROLE_ALIASES.get(r.strip().lower()) for r, _ in turns]
    for j, role in enumerate(roles):
        want = HUMAN if j % 2 == 0 else GPT
        if role != want:
            from tasks.policies.personal import masked

            role_shown = masked(turns[j][0][:40] + ("..." if len(turns[j][0]) > 40 else ""))
            return _fail("conversation_roles", f"turn {j} is {role_shown!r}, expected {want}", **base)
    if roles[-1] != GPT:
        return _fail("conversation_roles", "the last turn is not gpt", **base)
    ph = rules.placeholder
    for j, (_, text) in enumerate(turns):
        # nothing visible: only whitespace and the invisible format characters captions drop
        # (zero-width space, word joiner, BOM, bidi controls: tasks/policies/captions.py)
        if not INVISIBLE.sub("", text.replace(ph, "")).strip():
            return _fail("conversation_empty_turn", f"turn {j} is empty", **base)
        tag = next((t for t in reserved if t in text), None)
        if tag is not None:  # "What does the <img> tag do?": released as written, it reads as an image's start
            return _fail("conversation_reserved_tag", f"turn {j} holds {tag!r}, a tag of finetune.tiling", **base)
    turn_images = [text.count(ph) for _, text in turns]
    if sum(turn_images) != len(images):
        return _fail("placeholder_mismatch", f"{sum(turn_images)} {ph} placeholders for {len(images)} images", **base)
    if len(images) > rules.max_images:
        return _fail("too_many_images", f"{len(images)} images over {rules.max_images}", **base)
    chars = sum(len(t) for _, t in turns)
    if chars > rules.max_chars:
        return _fail("conversation_too_long", f"{chars} characters over {rules.max_chars}", **base)
    # The roles are the ones checked above: human first, alternating.
    return Conversation(
        id=rid,
        turns=[(HUMAN if j % 2 == 0 else GPT, t) for j, (_, t) in enumerate(turns)],
        images=images,
        turn_images=turn_images,
        license=lic,
    )


def resolve_image(ref: str, base_dir: str) -> str:
    """An image reference as a URL: URLs stay, paths become ``file://`` URLs under ``base_dir``.

    Paths are not trusted here: the download's SSRF guard checks every ``file://`` URL against
    ``download.network.file_root``, so ``../`` cannot reach outside it.
    """
    scheme = urlsplit(ref).scheme.lower()
    if scheme in REMOTE_SCHEMES:
        return ref
    if len(scheme) > 1:
        return ref  # an unsupported scheme; the download rejects it with its own reason
    # posixpath, not pathlib: this runs once per image of every record, and pathlib objects
    # cost several times as much for the same normalisation.
    return "file://" + quote(posixpath.normpath(posixpath.join(base_dir, ref)))


def render_turns(turns: list[tuple[str, str]], tag_texts: list[str], placeholder: str) -> list[str]:
    """Turn texts with the n-th placeholder replaced by the n-th image's tag text."""
    it = iter(tag_texts)
    out = []
    for _, text in turns:
        parts = text.split(placeholder)
        buf = io.StringIO()
        buf.write(parts[0])
        for part in parts[1:]:
            buf.write(next(it))
            buf.write(part)
        out.append(buf.getvalue())
    return out


def private_turns(conv: Conversation, rules: TextPrivacy) -> Conversation:
    """A checked record after the privacy check of every turn (tasks/policies/privacy.py):
    ``personal_data`` at the first turn that refuses it, else its turns redacted where asked;
    what was found (kinds and offsets per turn, never the values) goes into its detail."""
    if not conv.ok or rules.mode == "off":
        return conv
    from tasks.policies.personal import Span, describe
    from tasks.policies.privacy import check_text, kinds_of

    turns, notes, found = [], [], list[Span]()
    for j, (role, text) in enumerate(conv.turns):
        got = check_text(text, rules, f"turn {j}")
        found += got.spans
        if got.reason is not None:
            return replace(conv, reason=got.reason, detail=got.detail, personal_data=kinds_of(tuple(found)))
        turns.append((role, got.text or text))
        if got.spans:
            notes.append(describe(got.spans, f"turn {j}"))
    if not notes:
        return replace(conv, personal_data="")
    redacted = rules.mode == "redact"
    done = "redacted: " if redacted else "personal data kept: "
    kinds = kinds_of(tuple(found))
    return replace(conv, turns=turns, detail=done + "; ".join(notes), personal_data=kinds, redacted=redacted)
