"""Tests for tasks/formats/shards.py: writer round trips, recorded offsets, and hostile tars."""

from __future__ import annotations

import gzip
import io
import pickle
import random
import tarfile

import pytest

from tasks.formats.shards import ShardWriter, _member_header, _tarfile_header, iter_samples, split_key
from tasks.formats.tar_format import FIXED_MTIME, SHARD_ERROR_REASONS
from tasks.formats.tar_reader import ShardError, iter_tar_members

SAMPLES = {
    "src0-000000": {"jpg": b"\xff\xd8jpeg-bytes\xff\xd9", "txt": b"a cat on a mat", "json": b'{"w": 3}'},
    "src0-000001": {"jpg": bytes(range(256)) * 3, "txt": b"un chat", "json": b"{}"},
    # exactly one block, and an empty member: padding edge cases
    "src1-000000": {"jpg": b"x" * 512, "txt": b"", "latent.npy": b"\x93NUMPY" + bytes(100)},
}


def write_shard(samples=SAMPLES):
    buf = io.BytesIO()
    with ShardWriter(buf) as writer:
        for key, members in samples.items():
            writer.write_sample(key, members)
    return buf.getvalue(), writer


class NoSeek(io.RawIOBase):
    """A stream that only reads or writes, like a pipe; seek and tell raise."""

    def __init__(self, data: bytes = b"", chunk: int | None = None):
        self._src = io.BytesIO(data)
        self._chunk = chunk
        self.written = bytearray()

    def readable(self):
        return True

    def writable(self):
        return True

    def read(self, n=-1):
        if self._chunk is not None and n is not None and n > 0:
            n = min(n, self._chunk)  # short reads, as a pipe gives
        return self._src.read(n)

    def write(self, b):
        self.written += bytes(b)
        return len(b)

    def seek(self, *args):
        raise io.UnsupportedOperation("seek")

    def tell(self):
        raise io.UnsupportedOperation("tell")

    def seekable(self):
        return False


def tar_bytes(entries, fmt=tarfile.USTAR_FORMAT):
    """A tar built by the standard library: entries are (TarInfo, data or None)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for info, data in entries:
            tf.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def info(name, size=0, type_=tarfile.REGTYPE, linkname=""):
    ti = tarfile.TarInfo(name)
    ti.size = size
    ti.type = type_
    ti.linkname = linkname
    return ti


def raw_header(name: bytes, size: int, typeflag: bytes, *, size_field: bytes | None = None) -> bytes:
    """A ustar header built byte by byte, for fields tarfile will not write."""
    block = bytearray(512)
    block[0 : len(name)] = name
    block[100:108] = b"0000644\x00"
    block[108:116] = b"0000000\x00"
    block[116:124] = b"0000000\x00"
    block[124:136] = size_field if size_field is not None else b"%011o\x00" % size
    block[136:148] = b"00000000000\x00"
    block[156:157] = typeflag
    block[257:265] = b"ustar\x0000"
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\x00 " % sum(block)
    return bytes(block)


def pad(data: bytes) -> bytes:
    return data + bytes(-len(data) % 512)


def reason_of(data: bytes, path="shards/bad-000.tar", **kw) -> ShardError:
    with pytest.raises(ShardError) as excinfo:
        for _ in iter_tar_members(io.BytesIO(data), path=path, **kw):
            pass
    err = excinfo.value
    assert path in str(err)
    assert err.path == path
    assert err.reason in SHARD_ERROR_REASONS
    return err


# ---------------------------------------------------------------------------------------------
# Writer
# ---------------------------------------------------------------------------------------------


def test_round_trip_tarfile_and_ours():
    data, writer = write_shard()
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        got = {m.name: tf.extractfile(m).read() for m in tf.getmembers()}
        names = tf.getnames()
    expected = {f"{k}.{e}": v for k, ms in SAMPLES.items() for e, v in ms.items()}
    assert got == expected
    # members sorted by extension inside each sample, samples in write order
    assert names == [f"{k}.{e}" for k, ms in SAMPLES.items() for e in sorted(ms)]

    samples = list(iter_samples(io.BytesIO(data), path="x.tar"))
    assert [s.key for s in samples] == list(SAMPLES)
    assert [s.members for s in samples] == list(SAMPLES.values())
    assert [(s.offset, s.length) for s in samples] == [(r.offset, r.length) for r in writer.records]


def test_round_trip_webdataset(tmp_path):
    import webdataset as wds

    data, _ = write_shard()
    shard = tmp_path / "shard-000000.tar"
    shard.write_bytes(data)
    got = list(wds.WebDataset(str(shard), shardshuffle=False))
    assert [s["__key__"] for s in got] == list(SAMPLES)
    for sample, (_key, members) in zip(got, SAMPLES.items()):
        assert {k: v for k, v in sample.items() if not k.startswith("__")} == members


def test_recorded_offsets_match_the_bytes():
    data, writer = write_shard()
    records = writer.records
    assert len(records) == len(SAMPLES)
    for record, (key, members) in zip(records, SAMPLES.items()):
        assert record.key == key
        assert [m.name for m in record.members] == [f"{key}.{e}" for e in sorted(members)]
        for m in record.members:
            ext = m.name.split(".", 1)[1]
            assert m.size == len(members[ext])
            assert data[m.offset : m.offset + m.size] == members[ext]
        assert record.members_as_dicts() == [
            {"name": m.name, "offset": m.offset, "size": m.size} for m in record.members
        ]
        # the sample's range starts at its first header
        assert data[record.offset : record.offset + 100].rstrip(b"\x00") == record.members[0].name.encode()
    # the sample ranges tile the file exactly, leaving only the end-of-archive blocks
    assert records[0].offset == 0
    for a, b in zip(records, records[1:]):
        assert a.offset + a.length == b.offset
    rebuilt = b"".join(data[r.offset : r.offset + r.length] for r in records) + bytes(1024)
    assert rebuilt == data
    assert writer.bytes_written == len(data)


def test_sample_byte_ranges_copy_into_a_valid_shard():
    data, writer = write_shard()
    # a reshard by byte-range copy: take samples 2 and 0, no header parsing
    picked = [writer.records[2], writer.records[0]]
    copied = b"".join(data[r.offset : r.offset + r.length] for r in picked) + bytes(1024)
    keys = [s.key for s in iter_samples(io.BytesIO(copied))]
    assert keys == ["src1-000000", "src0-000000"]


def test_deterministic_bytes_and_fixed_mtime():
    first, _ = write_shard()
    # same samples, members given in another dict order
    shuffled = {k: dict(reversed(list(ms.items()))) for k, ms in SAMPLES.items()}
    second, _ = write_shard(shuffled)
    assert first == second
    with tarfile.open(fileobj=io.BytesIO(first)) as tf:
        for m in tf.getmembers():
            assert m.mtime == FIXED_MTIME
            assert (m.mode, m.uid, m.gid, m.uname, m.gname) == (0o644, 0, 0, "", "")
            assert m.isreg()


def test_member_headers_are_the_bytes_tarfile_writes():
    """The writer builds each header from a template; tarfile's own header is the reference."""
    rng = random.Random(7)
    names = [f"{'k' * n}.jpg" for n in range(1, 97)] + ["\u00e9t\u00e9.txt", "a" * 49 + "\u00fc" * 24 + ".x"]
    sizes = [0, 1, 511, 512, 513, 10**6, 8**11 - 1] + [rng.randrange(0, 8**11) for _ in range(200)]
    for i, name in enumerate(names):
        for size in sizes[i % 7 :: 7]:
            assert _member_header(name, size) == _tarfile_header(name, size), (name, size)
    # What tarfile refuses, the writer refuses too: a size over 11 octal digits, a name over 100 bytes.
    for name, size in (("k.jpg", 8**11), ("k.jpg", -1), ("\u00fc" * 51 + ".x", 1)):
        with pytest.raises(ValueError):
            _tarfile_header(name, size)
        with pytest.raises(ValueError):
            _member_header(name, size)


def test_non_seekable_output():
    out = NoSeek()
    with ShardWriter(out) as writer:
        for key, members in SAMPLES.items():
            writer.write_sample(key, members)
    expected, _ = write_shard()
    assert bytes(out.written) == expected
    assert writer.bytes_written == len(expected)


def test_partial_writes_are_completed():
    class Trickle(NoSeek):
        def write(self, b):
            b = bytes(b)[:100]
            self.written += b
            return len(b)

    out = Trickle()
    with ShardWriter(out) as writer:
        for key, members in SAMPLES.items():
            writer.write_sample(key, members)
    assert bytes(out.written) == write_shard()[0]


@pytest.mark.parametrize("key", ["", "a.b", "a/b", "a b", "ключ", "a\x00", "k" * 97])
def test_bad_keys_raise(key):
    writer = ShardWriter(io.BytesIO())
    # "k" * 97 + ".jpg" is 101 bytes: too long for a ustar name
    with pytest.raises(ValueError):
        writer.write_sample(key, {"jpg": b"x"})
    assert writer.bytes_written == 0


def test_longest_name_fits():
    buf = io.BytesIO()
    with ShardWriter(buf) as writer:
        writer.write_sample("k" * 96, {"jpg": b"x"})
    assert [m.name for m in iter_tar_members(io.BytesIO(buf.getvalue()))] == ["k" * 96 + ".jpg"]


@pytest.mark.parametrize("ext", ["", "JPG", "j/p", ".jpg", "jpg.", "a..b", "jp g", "é"])
def test_bad_exts_raise_naming_the_key(ext):
    writer = ShardWriter(io.BytesIO())
    with pytest.raises(ValueError, match="sample-7"):
        writer.write_sample("sample-7", {"txt": b"ok", ext: b"x"})
    assert writer.bytes_written == 0


def test_duplicate_key_empty_sample_and_non_bytes_raise():
    writer = ShardWriter(io.BytesIO())
    writer.write_sample("a", {"jpg": b"1"})
    with pytest.raises(ValueError, match="already written"):
        writer.write_sample("a", {"txt": b"2"})
    with pytest.raises(ValueError):
        writer.write_sample("b", {})
    with pytest.raises(TypeError):
        writer.write_sample("c", {"txt": "not bytes"})
    assert [r.key for r in writer.records] == ["a"]


def test_close_on_clean_exit_only():
    buf = io.BytesIO()
    with pytest.raises(RuntimeError):
        with ShardWriter(buf) as writer:
            writer.write_sample("a", {"jpg": b"1"})
            raise RuntimeError("boom")
    assert not writer.closed
    assert buf.getvalue()[-1024:] != bytes(1024)  # no end-of-archive: not a valid tar
    assert reason_of(buf.getvalue()).reason == "tar_truncated"

    writer = ShardWriter(io.BytesIO())
    writer.close()
    writer.close()  # idempotent
    assert writer.bytes_written == 1024
    with pytest.raises(ValueError):
        writer.write_sample("a", {"jpg": b"1"})


# ---------------------------------------------------------------------------------------------
# Reader: good inputs
# ---------------------------------------------------------------------------------------------


def test_reader_offsets_match_writer_records():
    data, writer = write_shard()
    members = list(iter_tar_members(io.BytesIO(data)))
    recorded = [m for r in writer.records for m in r.members]
    assert [(m.name, m.offset, m.size) for m in members] == [(m.name, m.offset, m.size) for m in recorded]


def test_reader_on_non_seekable_short_reads():
    data, _ = write_shard()
    got = list(iter_samples(NoSeek(data, chunk=7), path="pipe"))
    assert [s.members for s in got] == list(SAMPLES.values())


def test_read_data_false_keeps_no_data():
    buf = io.BytesIO()
    with ShardWriter(buf) as writer:
        for i in range(500):
            writer.write_sample(f"k{i:04d}", {"jpg": bytes([i % 256]) * (i + 1), "txt": b"t"})
    members = list(iter_tar_members(io.BytesIO(buf.getvalue()), read_data=False))
    assert len(members) == 1000
    assert all(m.data is None for m in members)
    assert [(m.name, m.offset, m.size) for m in members] == [
        (m.name, m.offset, m.size) for r in writer.records for m in r.members
    ]


def test_standard_tar_with_dirs_gnu_longname_and_pax():
    long_name = "deep/" * 30 + "k1.jpg"  # over 100 bytes: GNU 'L' header
    gnu = tar_bytes(
        [(info("./", type_=tarfile.DIRTYPE), None), (info(long_name, 3), b"abc"), (info("./deep/k1.txt", 1), b"t")],
        fmt=tarfile.GNU_FORMAT,
    )
    members = list(iter_tar_members(io.BytesIO(gnu)))
    assert [(m.name, m.data) for m in members] == [(long_name, b"abc"), ("deep/k1.txt", b"t")]
    # the long name header belongs to the member's byte range
    assert members[0].header_offset == 512
    assert members[0].offset == 512 * 4

    pax = tar_bytes([(info("dir/ключ.jpg", 2), b"ok")], fmt=tarfile.PAX_FORMAT)
    assert [(m.name, m.data) for m in iter_tar_members(io.BytesIO(pax))] == [("dir/ключ.jpg", b"ok")]
    samples = list(iter_samples(io.BytesIO(pax)))
    assert [(s.key, s.members) for s in samples] == [("dir/ключ", {"jpg": b"ok"})]


def test_global_pax_header_is_ignored_and_outside_the_sample():
    buf = io.BytesIO()
    # git archive writes a global header like this one before the first member
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT, pax_headers={"comment": "c0ffee"}) as tf:
        tf.addfile(info("k.jpg", 2), io.BytesIO(b"ok"))
    members = list(iter_tar_members(io.BytesIO(buf.getvalue())))
    assert [(m.name, m.header_offset, m.offset) for m in members] == [("k.jpg", 1024, 1536)]
    assert [(s.key, s.offset, s.length) for s in iter_samples(io.BytesIO(buf.getvalue()))] == [("k", 1024, 1024)]


def test_long_link_target_still_refused_as_a_link():
    data = tar_bytes(
        [(info("ok.txt", 1), b"x"), (info("a.jpg", type_=tarfile.SYMTYPE, linkname="/" + "t" * 200), None)],
        fmt=tarfile.GNU_FORMAT,
    )
    assert reason_of(data).reason == "tar_symlink"


def test_pax_size_overrides_header_size():
    pax_data = b"9 size=5\n"
    data = (
        raw_header(b"PaxHeader", len(pax_data), b"x")
        + pad(pax_data)
        + raw_header(b"a.bin", 0, b"0")
        + pad(b"hello")
        + bytes(1024)
    )
    assert [(m.name, m.data) for m in iter_tar_members(io.BytesIO(data))] == [("a.bin", b"hello")]


def test_empty_archive_yields_nothing():
    assert list(iter_tar_members(io.BytesIO(bytes(10240)))) == []
    assert list(iter_samples(io.BytesIO(tar_bytes([])))) == []


def test_compression_magic_in_a_valid_tar_name_is_a_tar():
    data = tar_bytes([(info("BZh91.txt", 1), b"x")])
    assert [m.name for m in iter_tar_members(io.BytesIO(data))] == ["BZh91.txt"]


# ---------------------------------------------------------------------------------------------
# Reader: hostile inputs
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "entry, reason",
    [
        ((info("a.jpg", type_=tarfile.SYMTYPE, linkname="/etc/passwd"), None), "tar_symlink"),
        ((info("a.jpg", type_=tarfile.LNKTYPE, linkname="b.jpg"), None), "tar_hardlink"),
        ((info("a.jpg", type_=tarfile.CHRTYPE), None), "tar_device"),
        ((info("a.jpg", type_=tarfile.BLKTYPE), None), "tar_device"),
        ((info("a.jpg", type_=tarfile.FIFOTYPE), None), "tar_device"),
        ((info("/etc/passwd", 1), b"x"), "tar_absolute_name"),
        ((info(".//etc/passwd", 1), b"x"), "tar_absolute_name"),
        ((info("../x.jpg", 1), b"x"), "tar_parent_reference"),
        ((info("a/../../x.jpg", 1), b"x"), "tar_parent_reference"),
        ((info("a/..", type_=tarfile.DIRTYPE), None), "tar_parent_reference"),
        ((info("a.jpg", type_=tarfile.CONTTYPE), None), "tar_unsupported_member"),
        ((info("a.jpg", type_=b"V"), None), "tar_unsupported_member"),
    ],
)
def test_hostile_member_types_and_names(entry, reason):
    # a good member first, so the hostile one is not the first block
    data = tar_bytes([(info("ok.txt", 2), b"ok"), entry])
    err = reason_of(data)
    assert err.reason == reason
    assert err.member is not None
    assert err.offset == 1024


def test_oversize_member_refused_before_reading():
    data = tar_bytes([(info("big.bin", 5000), b"z" * 5000)])
    err = reason_of(data, max_member_bytes=4096)
    assert (err.reason, err.member) == ("tar_member_too_large", "big.bin")
    # a header claiming a petabyte (base-256 size) with no data behind it: refused, not read
    huge = raw_header(b"big.bin", 0, b"0", size_field=b"\x80" + (2**50).to_bytes(11, "big"))
    assert reason_of(huge + bytes(1024)).reason == "tar_member_too_large"
    # and with a limit above the claim, the missing data is truncation, not a hang
    assert reason_of(huge + bytes(1024), max_member_bytes=2**51, read_data=False).reason == "tar_truncated"


def test_compressed_tar():
    data = gzip.compress(tar_bytes([(info("a.txt", 1), b"x")]), mtime=0)
    assert reason_of(data).reason == "tar_compressed"
    for magic in (b"BZh91AY&SY", b"\xfd7zXZ\x00\x00", b"\x28\xb5\x2f\xfd\x00"):
        assert reason_of(magic + bytes(600)).reason == "tar_compressed"


def test_random_bytes_and_empty_input_are_not_a_tar():
    assert reason_of(random.Random(0).randbytes(4096)).reason == "not_a_tar"
    assert reason_of(b"").reason == "not_a_tar"
    assert reason_of(b"hello").reason == "not_a_tar"


def test_truncated_tar():
    data, writer = write_shard()
    member = writer.records[1].members[0]
    err = reason_of(data[: member.offset + member.size // 2])
    assert (err.reason, err.member) == ("tar_truncated", member.name)
    # mid-header, and at a member boundary before the end-of-archive block
    assert reason_of(data[: writer.records[1].offset + 100]).reason == "tar_truncated"
    assert reason_of(data[: writer.records[1].offset]).reason == "tar_truncated"
    assert reason_of(data[: member.offset + member.size // 2], read_data=False).reason == "tar_truncated"


def test_every_truncation_point_raises():
    data, _ = write_shard()
    for cut in range(1, len(data) - 1024, 37):
        err = reason_of(data[:cut])
        assert err.reason in ("tar_truncated", "not_a_tar"), cut
        assert err.reason == "not_a_tar" or cut >= 512


def test_bad_checksum():
    data = bytearray(write_shard()[0])
    second_header = 512 * 2  # first member is one block of data
    assert data[second_header : second_header + 11] == b"src0-000000"
    data[second_header] ^= 0x01
    err = reason_of(bytes(data))
    assert (err.reason, err.offset) == ("tar_bad_checksum", second_header)
    data = bytearray(write_shard()[0])
    data[0] ^= 0x01
    assert reason_of(bytes(data)).reason == "not_a_tar"


def test_signed_checksum_is_accepted():
    name = "é.txt".encode()  # bytes over 127: signed and unsigned sums differ
    block = bytearray(raw_header(name, 1, b"0"))
    block[148:156] = b" " * 8
    signed = sum(b - 256 if b > 127 else b for b in block)
    block[148:156] = b"%06o\x00 " % signed
    data = bytes(block) + pad(b"x") + bytes(1024)
    assert [m.name for m in iter_tar_members(io.BytesIO(data))] == ["é.txt"]


def test_oversize_extension_headers():
    pax_info = info("a.txt", 1)
    pax_info.pax_headers = {"comment": "c" * 5000}
    pax = tar_bytes([(pax_info, b"x")], fmt=tarfile.PAX_FORMAT)
    assert [m.name for m in iter_tar_members(io.BytesIO(pax))] == ["a.txt"]
    assert reason_of(pax, max_header_bytes=4096).reason == "tar_header_too_large"

    gnu = tar_bytes([(info("n" * 5000 + ".txt", 1), b"x")], fmt=tarfile.GNU_FORMAT)
    assert [m.name for m in iter_tar_members(io.BytesIO(gnu))] == ["n" * 5000 + ".txt"]
    assert reason_of(gnu, max_header_bytes=4096).reason == "tar_header_too_large"


@pytest.mark.parametrize(
    "pax_data",
    [b"x", b"99 path=a\n", b"3 a\n", b"8 path=a", b"-1 path=a\n", b"6 =abc\n", b"0 \n"],
)
def test_malformed_pax(pax_data):
    data = raw_header(b"PaxHeader", len(pax_data), b"x") + pad(pax_data) + raw_header(b"a.bin", 0, b"0") + bytes(1024)
    assert reason_of(data).reason == "tar_bad_header"


def test_bad_names():
    # not UTF-8
    assert reason_of(raw_header(b"\xff\xfe.jpg", 0, b"0") + bytes(1024)).reason == "tar_bad_name"
    # NUL inside a GNU long name
    long_name = b"a\x00b.jpg\x00"
    data = raw_header(b"././@LongLink", len(long_name), b"L") + pad(long_name) + raw_header(b"x", 0, b"0") + bytes(1024)
    assert reason_of(data).reason == "tar_bad_name"
    # empty, and empty once the ./ is gone
    assert reason_of(raw_header(b"", 0, b"0") + bytes(1024)).reason == "tar_bad_name"
    assert reason_of(raw_header(b"./", 0, b"0") + bytes(1024)).reason == "tar_bad_name"
    # but "./" as an old-style directory (typeflag NUL, trailing slash) is skipped
    v7_dir = raw_header(b"./", 0, b"\x00") + raw_header(b"x.txt", 0, b"0") + bytes(1024)
    assert [m.name for m in iter_tar_members(io.BytesIO(v7_dir))] == ["x.txt"]
    # dangling extension header
    assert reason_of(raw_header(b"./@LongLink", 3, b"L") + pad(b"ab\x00") + bytes(1024)).reason == "tar_bad_header"


def test_sparse_and_directory_with_data_refused():
    sparse = b"22 GNU.sparse.major=1\n"
    data = raw_header(b"PaxHeader", len(sparse), b"x") + pad(sparse) + raw_header(b"s.bin", 0, b"0") + bytes(1024)
    assert reason_of(data).reason == "tar_unsupported_member"
    assert reason_of(raw_header(b"dir/", 10, b"5") + pad(b"0123456789") + bytes(1024)).reason == "tar_bad_header"


def test_too_many_members():
    data = tar_bytes([(info(f"k{i}.txt", 1), b"x") for i in range(11)])
    assert len(list(iter_tar_members(io.BytesIO(data), max_members=11))) == 11
    err = reason_of(data, max_members=10)
    assert (err.reason, err.member) == ("tar_too_many_members", "k10.txt")


def test_mutated_tars_raise_only_shard_errors():
    data, _ = write_shard()
    rng = random.Random(1234)
    for _ in range(300):
        mutated = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            pos = rng.randrange(1536)  # headers and early data
            mutated[pos] = rng.randrange(256)
        try:
            for _ in iter_samples(io.BytesIO(bytes(mutated)), path="m.tar", max_member_bytes=4096):
                pass
        except ShardError as err:
            assert err.reason in SHARD_ERROR_REASONS


def test_shard_error_pickles():
    err = ShardError("tar_symlink", path="s3://b/x.tar", member="a.jpg", detail="link", offset=512)
    back = pickle.loads(pickle.dumps(err))
    assert (back.reason, back.path, back.member, back.offset, str(back)) == (
        "tar_symlink",
        "s3://b/x.tar",
        "a.jpg",
        512,
        str(err),
    )
    assert "s3://b/x.tar" in str(err) and "a.jpg" in str(err)


# ---------------------------------------------------------------------------------------------
# Samples
# ---------------------------------------------------------------------------------------------


def test_split_key_follows_webdataset():
    assert split_key("a/b.c/d.jpg.json") == ("a/b.c/d", "jpg.json")
    assert split_key("k.latent.npy") == ("k", "latent.npy")
    assert split_key("noext") is None
    assert split_key("dir/.hidden") is None


def test_iter_samples_groups_consecutive_members():
    data = tar_bytes([(info(n, 1), n[0:1].encode()) for n in ["a.jpg", "a.txt", "b.jpg", "dir/a.jpg", "dir/a.txt"]])
    samples = list(iter_samples(io.BytesIO(data), required=["jpg"]))
    assert [(s.key, s.members) for s in samples] == [
        ("a", {"jpg": b"a", "txt": b"a"}),
        ("b", {"jpg": b"b"}),
        ("dir/a", {"jpg": b"d", "txt": b"d"}),
    ]
    assert [(s.offset, s.length) for s in samples] == [(0, 2048), (2048, 1024), (3072, 2048)]


def test_iter_samples_errors():
    def samples_reason(names, **kw):
        data = tar_bytes([(info(n, 1), b"x") for n in names])
        with pytest.raises(ShardError) as excinfo:
            list(iter_samples(io.BytesIO(data), path="g.tar", **kw))
        assert "g.tar" in str(excinfo.value)
        return excinfo.value.reason

    assert samples_reason(["a.jpg", "b.jpg", "a.txt"]) == "tar_key_not_grouped"
    assert samples_reason(["a.jpg", "noext"]) == "tar_bad_name"
    assert samples_reason(["a.jpg", "a.jpg"]) == "tar_duplicate_member"
    assert samples_reason(["a.jpg", "a.txt", "b.txt"], required=["jpg"]) == "tar_missing_member"


# ---------------------------------------------------------------------------------------------
# Agreement with tarfile (what webdataset reads with)
# ---------------------------------------------------------------------------------------------


def test_ustar_prefix_names_and_ambiguous_headers():
    long_path = "p" * 90 + "/" + "q" * 60 + ".jpg"  # over 100 bytes: ustar splits it into prefix/name
    data = tar_bytes([(info(long_path, 1), b"x")])
    assert [m.name for m in iter_tar_members(io.BytesIO(data))] == [long_path]

    # a prefix in a header without the POSIX magic: tarfile would join it, GNU tar would not
    block = bytearray(raw_header(b"a.jpg", 0, b"0"))
    block[257:265] = b"\x00" * 8
    block[345:348] = b"dir"
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\x00 " % sum(block)
    assert reason_of(bytes(block) + bytes(1024)).reason == "tar_bad_header"

    # a file name ending in '/' is not a file
    assert reason_of(raw_header(b"a.jpg/", 0, b"0") + bytes(1024)).reason == "tar_bad_name"
    # an old-style directory whose long name hides the slash still carries no data
    long_name = b"d" * 120 + b".jpg\x00"
    data = (
        raw_header(b"././@LongLink", len(long_name), b"L")
        + pad(long_name)
        + raw_header(b"d/", 3, b"\x00")
        + pad(b"abc")
    )
    assert reason_of(data + bytes(1024)).reason == "tar_bad_header"


def test_accepted_mutations_read_as_tarfile_reads_them():
    bases = [write_shard()[0], tar_bytes([(info("dir/ключ.jpg", 2), b"ok")], fmt=tarfile.PAX_FORMAT)]
    rng = random.Random(99)
    compared = 0
    for _ in range(400):
        data = bytearray(rng.choice(bases))
        start = rng.randrange(min(len(data) // 512, 8)) * 512
        for _ in range(rng.randint(1, 3)):
            pos = start + rng.choice(
                [rng.randrange(512), 156, 124 + rng.randrange(12), rng.randrange(100), 345, 257 + rng.randrange(8)]
            )
            data[pos] = rng.choice([0, 0x20, 0x30, 0x31, 0x2E, 0x2F, 0x35, 0x80, rng.randrange(256)])
        # keep the header checksum valid so the mutation reaches the header parser
        block = data[start : start + 512]
        block[148:156] = b" " * 8
        block[148:156] = b"%06o\x00 " % sum(block)
        data[start : start + 512] = block
        try:
            ours = [(m.name, m.data) for m in iter_tar_members(io.BytesIO(bytes(data)))]
        except ShardError as err:
            assert err.reason in SHARD_ERROR_REASONS
            continue
        try:
            with tarfile.open(fileobj=io.BytesIO(bytes(data)), encoding="utf-8", errors="strict") as tf:
                theirs = [(m.name.removeprefix("./"), tf.extractfile(m).read()) for m in tf.getmembers() if m.isreg()]
        except Exception:
            continue  # tarfile refuses a header field we do not use (mode, uid, ...)
        if len(theirs) < len(ours) and ours[: len(theirs)] == theirs:
            continue  # tarfile ends the archive silently at a header it cannot parse
        assert ours == theirs
        compared += 1
    assert compared > 100
