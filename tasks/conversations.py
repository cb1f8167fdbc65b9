"""LLaVA-style instruction records (JSON or JSONL): reading, conversation checks with stable reasons."""

from __future__ import annotations

import gzip
import io
import json
import os
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import IO, Any, Iterator
from urllib.parse import quote, urlsplit

from tasks.recipe import ConversationRules

HUMAN, GPT = "human", "gpt"
# Other spellings seen in public LLaVA-style sets, mapped to the two roles.
ROLE_ALIASES = {"human": HUMAN, "user": HUMAN, "gpt": GPT, "assistant": GPT}
REMOTE_SCHEMES = ("http", "https", "s3", "file")


class RecordsError(ValueError):
    """A records file that cannot be read at all; the message names the file and the line."""


@dataclass
class RawRecord:
    """One input record as read: ``record`` is None when the row could not be parsed.

    Args:
        row: 0-based record number in the file (a JSONL line, or a JSON array element).
        record: the parsed object.
        reason, detail: why it could not be parsed (``unparsable_row``).
    """

    row: int
    record: Any = None
    reason: str | None = None
    detail: str | None = None


def records_format(name: str) -> str:
    """``json`` (one array of records) or ``jsonl`` (a record per line), from the file name."""
    base = name[:-3] if name.endswith(".gz") else name
    if base.endswith(".jsonl") or base.endswith(".ndjson"):
        return "jsonl"
    if base.endswith(".json"):
        return "json"
    raise RecordsError(f"{name}: records must be .json or .jsonl (optionally .gz)")


def iter_records(fh: IO[bytes], name: str, max_record_bytes: int = 1 << 20) -> Iterator[RawRecord]:
    """Records of a JSON or JSONL file (gzip when the name ends in ``.gz``), in file order.

    A bad JSONL line (not JSON, not UTF-8, over ``max_record_bytes``) is one ``unparsable_row``
    record; a JSON file that does not parse as one array fails as a whole.
    """
    fmt = records_format(name)
    stream: IO[bytes] = gzip.GzipFile(fileobj=fh) if name.endswith(".gz") else fh
    if fmt == "json":
        try:
            data = json.loads(stream.read())
        except (ValueError, OSError, EOFError) as err:
            raise RecordsError(f"{name}: not a JSON array of records: {err}") from None
        if not isinstance(data, list):
            raise RecordsError(f"{name}: top level is {type(data).__name__}, expected an array of records")
        for row, rec in enumerate(data):
            size = len(json.dumps(rec, ensure_ascii=False).encode())
            if size > max_record_bytes:
                yield RawRecord(row, None, "unparsable_row", f"record of {size} bytes over {max_record_bytes}")
            else:
                yield RawRecord(row, rec)
        return
    row = 0
    try:
        while True:
            line = stream.readline(max_record_bytes + 1)
            if not line:
                return
            if len(line) > max_record_bytes and not line.endswith(b"\n"):
                while line and not line.endswith(b"\n"):  # drain the rest of the long line
                    line = stream.readline(1 << 20)
                yield RawRecord(row, None, "unparsable_row", f"line over {max_record_bytes} bytes")
                row += 1
                continue
            if not line.strip():
                continue  # blank lines are not records
            try:
                yield RawRecord(row, json.loads(line.decode("utf-8")))
            except (UnicodeDecodeError, ValueError) as err:
                yield RawRecord(row, None, "unparsable_row", str(err)[:160])
            row += 1
    except (OSError, EOFError) as err:
        raise RecordsError(f"{name}: line {row + 1}: {err}") from None


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
    """

    reason: str | None = None
    detail: str | None = None
    id: str | None = None
    turns: list[tuple[str, str]] = field(default_factory=list)
    images: list[str] = field(default_factory=list)
    turn_images: list[int] = field(default_factory=list)
    license: str | None = None

    @property
    def ok(self) -> bool:
        return self.reason is None

    @property
    def text_only(self) -> bool:
        return not self.images


def _fail(reason: str, detail: str, **kw: Any) -> Conversation:
    return Conversation(reason=reason, detail=detail, **kw)


def image_refs(record: dict[str, Any]) -> list[str] | None:
    """The record's images as a list (``image`` or ``images``: a string or a list); None if malformed."""
    value = record.get("image", record.get("images"))
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value.strip() else None
    if isinstance(value, list) and all(isinstance(v, str) and v.strip() for v in value):
        return list(value)
    return None


def check_conversation(record: Any, rules: ConversationRules) -> Conversation:
    """Schema, roles (human first, alternating, gpt last), no empty turns, placeholders = images, bounds."""
    if not isinstance(record, dict):
        return _fail("conversation_schema", f"record is {type(record).__name__}, not an object")
    rid = record.get("id")
    rid = None if rid is None else str(rid)
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
        if not isinstance(turn, dict) or not isinstance(turn.get("from"), str) or not isinstance(turn.get("value"), str):
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
            return _fail("conversation_roles", f"turn {j} is {turns[j][0]!r}, expected {want}", **base)
    if roles[-1] != GPT:
        return _fail("conversation_roles", "the last turn is not gpt", **base)
    ph = rules.placeholder
    for j, (_, text) in enumerate(turns):
        if not text.replace(ph, "").strip():
            return _fail("conversation_empty_turn", f"turn {j} is empty", **base)
    turn_images = [text.count(ph) for _, text in turns]
    if sum(turn_images) != len(images):
        return _fail("placeholder_mismatch", f"{sum(turn_images)} {ph} placeholders for {len(images)} images", **base)
    if len(images) > rules.max_images:
        return _fail("too_many_images", f"{len(images)} images over {rules.max_images}", **base)
    chars = sum(len(t) for _, t in turns)
    if chars > rules.max_chars:
        return _fail("conversation_too_long", f"{chars} characters over {rules.max_chars}", **base)
    return Conversation(id=rid, turns=[(roles[j], t) for j, (_, t) in enumerate(turns)], images=images, turn_images=turn_images, license=lic)


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
    path = ref if os.path.isabs(ref) else os.path.join(base_dir, ref)
    return "file://" + quote(str(PurePosixPath(os.path.normpath(path))))


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
