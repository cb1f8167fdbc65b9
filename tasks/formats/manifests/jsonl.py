"""JSON-lines manifests read a block at a time: every non-blank line a row, a line that is no JSON object ``unparsable_row`` with json's own message."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import IO, Any

import numpy as np
import pyarrow as pa

import tasks.formats.manifests.careful as careful
from tasks.formats.manifests.careful import ByteSource, Lines, TooLong, too_long
from tasks.formats.manifests.values import Mapping, RawBatch, dumps, extra_column, json_value

BLOCK_BYTES = 1 << 20  # the per-line work dominates; a small block keeps memory small
_JSON_SPACE = " \t\n\r"
_JSON_KINDS = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}
# json.loads without its Python wrapper: the same C scanner and decoder settings, so the same
# values and the same failures (json.loads itself is called again only to word an error).
_scan = json.JSONDecoder().scan_once


def _loads(text: str) -> Any:
    idx = 0 if text[:1] == "{" else len(text) - len(text.lstrip(_JSON_SPACE))
    try:
        obj, end = _scan(text, idx)
    except StopIteration:
        return json.loads(text)  # raises json's JSONDecodeError ("Expecting value")
    if end != len(text) and text[end:].strip(_JSON_SPACE):
        return json.loads(text)  # raises "Extra data"
    return obj


class JsonlFile:
    """One jsonl file read into RawBatches.

    Args:
        stream: the decompressed bytes.
        where: the file, for messages.
        mapping: the source's column mapping.
        careful_only: read every line through ``Lines`` (the reference the block path is
            tested against).
    """

    def __init__(self, stream: IO[bytes], where: str, mapping: Mapping, careful_only: bool = False):
        self.where = where
        self.mapping = mapping
        self.careful_only = careful_only
        self.source = ByteSource(stream, where, lambda: self.lines.count + 1)
        self.lines = Lines(self.source, where)
        self.extras = mapping.all_extras or bool(mapping.named_extras)
        self._clear()

    def _clear(self) -> None:
        self.at: list[int] = []
        self.urls: list[Any] = []
        self.captions: list[Any] = []
        self.licenses: list[Any] = []
        self.extra: list[str | None] = []
        self.bad: dict[int, tuple[str, str]] = {}

    def batches(self) -> Iterator[RawBatch]:
        while True:
            block = None if self.careful_only else self.source.read_block(BLOCK_BYTES)
            if block is None:  # careful: one line through Lines (a line longer than a block is skipped in pieces)
                if not self._careful_line():
                    break
            elif not block:
                break
            else:
                self._block(block)
            if len(self.at) >= careful.BATCH_ROWS:
                yield self._take()
        if self.at:
            yield self._take()

    def _careful_line(self) -> bool:
        start = self.lines.start_record()
        try:
            text = next(self.lines)
        except StopIteration:
            return False
        except TooLong:
            self._unparsable(start, too_long(start))
            return True
        self._line(start, text)
        return True

    def _block(self, block: bytes) -> None:
        base = self.lines.count
        try:
            text = block.decode("utf-8")
        except UnicodeDecodeError:
            # The careful reader says which line is not UTF-8 (or skips it when over the cap).
            a = np.frombuffer(block, np.uint8)
            ends = np.flatnonzero(a == 10) + 1
            if ends.size == 0 or ends[-1] != len(block):
                ends = np.append(ends, len(block))
            starts = np.concatenate(([0], ends[:-1]))
            self.lines.preload(block, starts, ends, 0, len(ends))
            while self.lines.preloaded_left():
                self._careful_line()
            self.lines.drop_preloaded()
            return
        parts = text.split("\n")
        if parts[-1] == "":
            parts.pop()
        bom = 0
        if base == 0 and parts and parts[0].startswith("\ufeff"):
            parts[0] = parts[0][1:]  # a byte order mark, as Lines drops it
            bom = 3  # its bytes still count toward the line's size, as Lines counts them
        cap = careful.MAX_ROW_BYTES
        ascii_only = len(text) == len(block)
        last = len(parts) - 1
        for k, part in enumerate(parts):
            start = base + k + 1
            line = part + "\n" if k < last or block.endswith(b"\n") else part
            extra = bom if k == 0 else 0
            fits = ascii_only or len(line) * 4 + extra <= cap  # then the characters tell enough
            size = (len(line) if fits else len(line.encode("utf-8", "surrogatepass"))) + extra
            if size > cap:
                self._unparsable(start, too_long(start))
            else:
                self._line(start, line)
        self.lines.count = base + len(parts)

    def _unparsable(self, start: int, detail: str) -> None:
        self.bad[len(self.at)] = ("unparsable_row", detail)
        self._add(start, None)

    def _line(self, start: int, text: str) -> None:
        if not text.strip():
            return
        try:
            obj = _loads(text)
        except ValueError as err:
            self._unparsable(start, f"line {start}: {err}")
            return
        except RecursionError:  # "[[[[..." nested past the stack
            self._unparsable(start, f"line {start}: nested too deeply to parse")
            return
        if type(obj) is not dict:
            kind = _JSON_KINDS.get(type(obj), type(obj).__name__)
            self._unparsable(start, f"line {start}: a JSON {kind}, not an object")
            return
        self._add(start, obj)

    def _add(self, start: int, obj: dict | None) -> None:
        mapping = self.mapping
        self.at.append(start)
        if obj is None:
            self.urls.append(None)
            self.captions.append(None)
            self.licenses.append(None)
            self.extra.append(None)
            return
        self.urls.append(obj.get(mapping.url))
        self.captions.append(obj.get(mapping.caption) if mapping.caption is not None else None)
        self.licenses.append(obj.get(mapping.license) if mapping.license is not None else None)
        if self.extras:
            self.extra.append(dumps({name: json_value(obj.get(name)) for name in mapping.extra_names(list(obj))}))

    def _take(self) -> RawBatch:
        at, urls, captions, licenses, bad = self.at, self.urls, self.captions, self.licenses, self.bad
        extra = self.extra if self.extras else None
        mapping = self.mapping
        # JSON escapes can spell lone surrogates ("\ud800"), which no UTF-8 column can hold.
        named = (
            (mapping.url, urls),
            (mapping.caption, captions),
            (mapping.license, licenses),
            ("the extra columns", extra or []),
        )
        for column, values in named:
            try:
                pa.array(values, pa.string())
                continue
            except (UnicodeEncodeError, pa.ArrowTypeError, pa.ArrowInvalid):
                pass  # a surrogate, or numbers, lists, objects (values.finish judges those)
            for i, value in enumerate(values):
                if isinstance(value, str) and i not in bad:
                    try:
                        value.encode("utf-8")
                    except UnicodeEncodeError:
                        shown = column if column == "the extra columns" else f"column {column!r}"
                        bad[i] = (
                            "unparsable_row",
                            f"line {at[i]}: a lone surrogate in {shown} (a JSON \\ud800-\\udfff escape), which UTF-8 cannot hold",
                        )
        for i in bad:
            urls[i] = captions[i] = licenses[i] = None
            if extra:
                extra[i] = None
        batch = RawBatch(
            lines=np.array(at, np.int64),
            url=urls,
            caption=captions if mapping.caption is not None else None,
            license=licenses if mapping.license is not None else None,
            extra=pa.array(extra, pa.string()) if extra is not None else extra_column((), {}, len(at)),
            reasons=bad,
        )
        self._clear()
        return batch
