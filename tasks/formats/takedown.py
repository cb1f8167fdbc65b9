"""Takedown lists: URLs, domains, sample keys, sha256 digests and perceptual hashes, one a line, parsed strictly, read and appended to."""

from __future__ import annotations

import hashlib
import posixpath
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from tasks.formats.recipe_upkeep import TakedownList
from tasks.formats.storage import FILE_MODE_OPTION, Storage

KINDS = ("url", "domain", "key", "sha256", "phash")
# Errors a message lists before it says how many more there are: a list pasted in the wrong
# format fails on every line, and the first few say what is wrong.
MAX_ERRORS = 20

# scheme://authority, then the rest. Python's re and Arrow's RE2 read it alike, so a URL of a
# list and a URL of a ledger are normalised the same way (``normalise_url``,
# tasks.stages.upkeep): the scheme and the authority are case-insensitive, the path is not.
URL_PARTS = r"(?s)^(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/?#]*)(?P<tail>.*)$"
# The host of a URL: the authority without user info and port (an IPv6 literal keeps its brackets).
URL_HOST = r"^[A-Za-z][A-Za-z0-9+.-]*://(?:[^/?#@]*@)?(?P<host>\[[^\]/?#]*\]|[^/?#:]*)"
_URL_PARTS = re.compile(URL_PARTS)
_URL_HOST = re.compile(URL_HOST)
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_HTTP = re.compile(r"^https?://", re.IGNORECASE)
_PREFIX = re.compile(r"^([A-Za-z][A-Za-z0-9_-]*):(.*)$", re.DOTALL)
_HEX64 = re.compile(r"^[0-9a-fA-F]{64}$")
_HEX16 = re.compile(r"^[0-9a-fA-F]{16}$")
_HEX_SHORT = re.compile(r"^[0-9a-fA-F]{1,16}$")
_LABEL = re.compile(r"^[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?$")
_SPACE = re.compile(r"\s")


class TakedownError(ValueError):
    """A takedown list that cannot be used: unreadable, or entries that are not entries (each
    named ``list:line: why``). A run stops on it rather than match nothing for a bad line."""


@dataclass(frozen=True)
class Entry:
    """One entry of a takedown list.

    Args:
        kind: url, domain, key, sha256 or phash.
        value: normalised: a URL with its scheme and authority in lower case, a domain in lower
            case (IDNA as ASCII, no trailing dot), a digest or hash in lower-case hex; a key as written.
        line: its line in the list (from 1; 0 for an entry not read from a file).
        note: what follows the entry after a tab (who asked, when, why), or None.
    """

    kind: str
    value: str
    line: int = 0
    note: str | None = None

    @property
    def text(self) -> str:
        """The entry as ledgers and lists name it: ``kind:value``."""
        return f"{self.kind}:{self.value}"


@dataclass(frozen=True)
class LoadedList:
    """A takedown list as read for one run.

    Args:
        name: how ledger rows name it (``TakedownList.name``, else the file's name).
        path: where it is (a local path or an ``s3://`` URL).
        phash_distance: bits a perceptual hash may differ in and still match.
        entries: its entries, in file order.
        sha256: of its bytes.
    """

    name: str
    path: str
    phash_distance: int
    entries: tuple[Entry, ...]
    sha256: str


def normalise_url(url: str) -> str:
    """``url`` with its scheme and authority in lower case (ledger URLs get the same in Arrow)."""
    m = _URL_PARTS.match(url)
    return m.group(1).lower() + m.group(2) if m else url


def url_host(url: str) -> str | None:
    """The host of ``url`` in lower case without a trailing dot, an international one as IDNA
    ASCII (as domain entries are: ``bücher.example`` is ``xn--bcher-kva.example``), or None
    when it names none."""
    m = _URL_HOST.match(url)
    host = ascii_host(m.group(1).lower().rstrip(".")) if m else ""
    return host or None


def ascii_host(host: str) -> str:
    """``host`` (lower case) as IDNA ASCII where it is an international name; as it is where it
    is ASCII already or not a valid name (it then matches no domain entry, which are valid)."""
    if host.isascii():
        return host
    try:
        return host.encode("idna").decode("ascii").rstrip(".")
    except UnicodeError:
        return host


def normalise_domain(text: str) -> str:
    """A domain entry's value: lower case, IDNA as ASCII, no trailing dot; ValueError says why not."""
    host = text.strip().lower().removesuffix(".")
    if not host:
        raise ValueError("an empty domain")
    if host.startswith("*."):
        raise ValueError(f"{text!r}: a domain entry covers its subdomains already; write {host[2:]!r}")
    if "/" in host or ":" in host or "@" in host:
        raise ValueError(f"{text!r} is not a host name (a URL? write it whole, with http:// or url:)")
    if not host.isascii():
        try:
            host = host.encode("idna").decode("ascii")
        except UnicodeError as err:
            raise ValueError(f"{text!r} is not a valid international domain name ({err})") from None
    if len(host) > 253:
        raise ValueError(f"{text!r} is longer than a host name can be (253 characters)")
    bad = next((label for label in host.split(".") if not _LABEL.match(label)), None)
    if bad is not None:
        why = "an empty label" if bad == "" else f"the label {bad!r}"
        raise ValueError(f"{text!r} is not a host name ({why})")
    return host


def _explicit(kind: str, value: str) -> str:
    """The normalised value of an entry written ``kind:value``; ValueError says why it is not one."""
    if not value:
        raise ValueError(f"{kind}: has no value")
    if kind == "url":
        scheme = _SCHEME.match(value)
        if scheme is None or scheme.end() == len(value):
            raise ValueError(f"{value!r} is not a URL (scheme://...)")
        return normalise_url(value)
    if kind == "domain":
        return normalise_domain(value)
    if kind == "key":
        if any(not ch.isprintable() for ch in value):
            raise ValueError(f"the key {value!r} holds a control character")
        return value
    if kind == "sha256":
        if not _HEX64.match(value):
            raise ValueError(f"{value!r} is not a sha256 digest (64 hex digits)")
        return value.lower()
    # phash
    if value[:2].lower() == "0x" and _HEX_SHORT.match(value[2:]):  # as hex() prints it: leading zeros dropped
        return value[2:].lower().rjust(16, "0")
    if not _HEX16.match(value):
        raise ValueError(f"{value!r} is not a 64-bit perceptual hash (16 hex digits)")
    return value.lower()


def parse_entry(text: str) -> tuple[str, str]:
    """(kind, normalised value) of one entry as written; ValueError says why it is none.

    ``kind:value`` names its kind; a bare value is recognised: ``http(s)://`` a URL, 64 hex
    digits a sha256, 16 (or ``0x`` and 16) a perceptual hash, a dotted host name a domain, anything else a sample
    key (sample keys have no dots: write ``key:`` before one that does, ``domain:`` before a
    host without a dot such as ``localhost``).
    """
    if not text:
        raise ValueError("an empty entry")
    if _SPACE.search(text):
        raise ValueError(f"{text!r}: an entry is one word; a note goes after a tab")
    if _HTTP.match(text):
        return "url", _explicit("url", text)
    prefix = _PREFIX.match(text)
    if prefix is not None and not _SCHEME.match(text):
        kind = prefix.group(1).lower()
        if kind not in KINDS:
            raise ValueError(f"unknown kind {prefix.group(1)!r} (one of {', '.join(KINDS)})")
        return kind, _explicit(kind, prefix.group(2))
    if _SCHEME.match(text):
        raise ValueError(f"{text!r}: only http(s) URLs are recognised bare; write url:{text}")
    if _HEX64.match(text):
        return "sha256", text.lower()
    if _HEX16.match(text):
        return "phash", text.lower()
    if text[:2].lower() == "0x" and _HEX_SHORT.match(text[2:]):  # a perceptual hash as Python prints one
        return "phash", _explicit("phash", text)
    if "/" in text:
        raise ValueError(f"{text!r} looks like a URL without its scheme; write http://... or https://...")
    if "." in text:
        try:
            return "domain", normalise_domain(text)
        except ValueError as err:
            raise ValueError(f"{err}; write key:{text} if it is a sample key") from None
    return "key", _explicit("key", text)


def parse_list(data: bytes | str, where: str) -> list[Entry]:
    """The entries of a list's bytes (UTF-8; a BOM is allowed); ``where`` names it in errors.

    One entry a line; ``#`` starts a comment line; blank lines are skipped; text after the
    first tab is the entry's note. Every bad line is a ``TakedownError`` (``where:line: why``).
    """
    if isinstance(data, bytes):
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as err:
            at = data[: err.start].count(b"\n") + 1
            raise TakedownError(f"{where}:{at}: not UTF-8 text (byte {err.start})") from None
    else:
        text = data
    entries: list[Entry] = []
    errors: list[str] = []
    for number, raw in enumerate(text.removeprefix("\ufeff").split("\n"), start=1):
        line = raw.removesuffix("\r")
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        head, tab, note = line.partition("\t")
        try:
            kind, value = parse_entry(head.strip())
        except ValueError as err:
            errors.append(f"{where}:{number}: {err}")
            continue
        entries.append(Entry(kind, value, number, (note.strip() or None) if tab else None))
    if errors:
        more = len(errors) - MAX_ERRORS
        tail = [f"... and {more} more bad entries"] if more > 0 else []
        raise TakedownError("\n".join(errors[:MAX_ERRORS] + tail))
    return entries


def list_name(spec: TakedownList) -> str:
    """How rows and reports name a list: its ``name``, else its file's name."""
    return spec.name or posixpath.basename(spec.path.rstrip("/"))


def _located(path: str, storage_options: dict[str, Any] | None) -> tuple[Storage, str]:
    """(a Storage over the list's folder, its file name): s3:// objects with the recipe's options;
    a local file with none but its file mode (object-store options mean nothing to it)."""
    if "://" in path and not path.startswith("file://"):
        folder, _, name = path.rstrip("/").rpartition("/")
        return Storage(folder, storage_options), name
    local = path.removeprefix("file://")
    options = {k: v for k, v in (storage_options or {}).items() if k == FILE_MODE_OPTION}
    return Storage(posixpath.dirname(local) or ".", options), posixpath.basename(local)


def _read(path: str, storage_options: dict[str, Any] | None) -> bytes | None:
    """The list's bytes, or None where there is no such file."""
    storage, name = _located(path, storage_options)
    try:
        return storage.read_bytes(name)
    except FileNotFoundError:
        return None
    except OSError as err:
        raise TakedownError(f"{path}: cannot read the takedown list: {err}") from None


def read_list(spec: TakedownList, storage_options: dict[str, Any] | None = None) -> LoadedList:
    """Read and parse one list of a recipe; a list that is not there is an error, never an empty list."""
    data = _read(spec.path, storage_options)
    if data is None:
        raise TakedownError(f"{spec.path}: takedown list not found (`shardsmith takedown add` creates one)")
    return LoadedList(
        name=list_name(spec),
        path=spec.path,
        phash_distance=spec.phash_distance,
        entries=tuple(parse_list(data, spec.path)),
        sha256=hashlib.sha256(data).hexdigest(),
    )


def read_lists(specs: Sequence[TakedownList], storage_options: dict[str, Any] | None = None) -> list[LoadedList]:
    """Every list, in recipe order; two lists of one name are an error (rows could not say which)."""
    names = [list_name(s) for s in specs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise TakedownError(f"takedown lists share a name ({', '.join(twice)}); give each a distinct name:")
    return [read_list(s, storage_options) for s in specs]


def lists_digest(recipe: Any) -> str:
    """A digest of the recipe's takedown lists as they are now (names, settings, contents), for
    the up-to-date check: an edited list is new work though the recipe is unchanged. Empty
    when the recipe names no list."""
    if not recipe.takedown:
        return ""
    sha = hashlib.sha256()
    for spec in recipe.takedown:
        data = _read(spec.path, recipe.storage_options)
        digest = hashlib.sha256(data).hexdigest() if data is not None else "missing"
        sha.update(f"{list_name(spec)}\0{spec.path}\0{spec.phash_distance}\0{digest}\n".encode())
    return sha.hexdigest()


def _one_line(text: str) -> str:
    """``text`` with tabs, newlines and other control characters as spaces (a note is one line)."""
    return " ".join("".join(c if c.isprintable() else " " for c in text).split())


def add(
    path: str,
    entries: Iterable[str],
    by: str,
    why: str,
    storage_options: dict[str, Any] | None = None,
) -> list[Entry]:
    """Append entries to the list at ``path`` (created when absent), each as ``kind:value`` with a
    note of the date (``tasks.formats.clock.now``), who and why. Every entry is checked first: one
    bad entry appends none (``TakedownError`` names each). Returns what was appended.

    The list is rewritten whole (atomically): object stores have no append. Two people adding to
    one list at the same moment can lose one addition; the audit trail is the list itself.
    """
    from tasks.formats.clock import stamp

    texts = [e.strip() for e in entries]
    if not texts:
        raise TakedownError("give at least one entry")
    by, why = _one_line(by), _one_line(why)
    if not by or not why:
        raise TakedownError("say who asks (--by) and why (--why): the list is the audit trail")
    parsed, errors = [], []
    for text in texts:
        try:
            parsed.append(parse_entry(text))
        except ValueError as err:
            errors.append(f"{text}: {err}")
    if errors:
        raise TakedownError("\n".join(errors))
    old = _read(path, storage_options)
    if old is not None:
        parse_list(old, path)  # never append to a list that no run could use
    when = stamp()
    lines = [f"{kind}:{value}\tadded {when} by {by}: {why}\n" for kind, value in parsed]
    head = old or b""
    if head and not head.endswith(b"\n"):
        head += b"\n"
    storage, name = _located(path, storage_options)
    storage.write_bytes(name, head + "".join(lines).encode("utf-8"))
    first = head.count(b"\n") + 1
    return [Entry(kind, value, first + i, f"added {when} by {by}: {why}") for i, (kind, value) in enumerate(parsed)]
