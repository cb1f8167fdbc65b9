"""The tar format as shards use it: block size, limits, the reasons a shard is refused, name rules."""

from __future__ import annotations

import re

FIXED_MTIME = 0

BLOCK = 512
ZERO_BLOCK = bytes(BLOCK)
END_OF_ARCHIVE = bytes(2 * BLOCK)
SKIP_CHUNK = 1 << 20  # bounded reads when discarding member data

DEFAULT_MAX_MEMBER_BYTES = 64 * 2**20
DEFAULT_MAX_MEMBERS = 1_000_000
DEFAULT_MAX_HEADER_BYTES = 64 * 1024

# Every reason a ShardError can carry. These are per-shard failures (the shard raises and is
# retried), so they are not ledger reasons; they are stable snake_case all the same.
SHARD_ERROR_REASONS: dict[str, str] = {
    "not_a_tar": "the input is empty or its first block is not a tar header",
    "tar_compressed": "the input starts with a gzip, bzip2, xz or zstd magic; shards are plain tar",
    "tar_truncated": "the input ends inside a header or member, or before the end-of-archive block",
    "tar_bad_checksum": "a header block after the first fails its checksum",
    "tar_bad_header": "a header field (size, name prefix, PAX record) is malformed, an extension "
    "header has no member after it, or a directory carries data",
    "tar_header_too_large": "a GNU long name or PAX header is larger than max_header_bytes",
    "tar_symlink": "a symbolic link member",
    "tar_hardlink": "a hard link member",
    "tar_device": "a character device, block device or fifo member",
    "tar_absolute_name": "a member name that starts with /",
    "tar_parent_reference": "a member name with a .. path component",
    "tar_member_too_large": "a member larger than max_member_bytes",
    "tar_too_many_members": "more members than max_members",
    "tar_unsupported_member": "a member type other than file or directory (sparse, volume, vendor types)",
    "tar_bad_name": "a member name that is empty, not UTF-8, holds a NUL, or has no key.ext form",
    "tar_key_not_grouped": "a sample key appears again after other keys (webdataset would split the sample)",
    "tar_duplicate_member": "the same key.ext twice within one sample",
    "tar_missing_member": "a sample lacks a member extension that the caller requires",
}

# Checked only when the first block is not a valid header: a plain tar whose first member
# name happens to start with "BZh" must still read as a tar.
COMPRESSION_MAGICS = (
    b"\x1f\x8b",  # gzip
    b"BZh",  # bzip2
    b"\xfd7zXZ\x00",  # xz
    b"\x28\xb5\x2f\xfd",  # zstd
)

KEY_RE = re.compile(r"[A-Za-z0-9_-]+")
EXT_RE = re.compile(r"[a-z0-9_]+(?:\.[a-z0-9_]+)*")
OCTAL_RE = re.compile(rb"[0-7]+")
DECIMAL_RE = re.compile(rb"[0-9]+")

REGULAR_TYPES = (b"0", b"\x00")
DEVICE_TYPES = (b"3", b"4", b"6")


def padded(size: int) -> int:
    return (size + BLOCK - 1) // BLOCK * BLOCK
