"""Shards as real crawls and hand-made datasets come out, written for the soak (and anything else
that needs them): every class of bad data the service must survive, each a real tar (or .tar.gz)
next to good samples, so that one bad sample costs only itself and nothing goes uncounted.

``write_hostile_set(out_dir, photo, bomb_side)`` writes them all and returns their paths, and the
sample key a soak can hand to ``faults.faults(kill_on_key=...)``.
"""
from __future__ import annotations

import gzip
import io
import json
import os
import pickle
import tarfile
import unicodedata
import zlib

from datasvc.read.tarscan import MAX_EXTENDED_HEADER


def add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_tar(path, members: list[tuple[str, bytes]]) -> str:
    with tarfile.open(str(path), "w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in members:
            add(tar, name, data)
    return str(path)


def good(key: str, photo: bytes, caption: str = "A cat.") -> list[tuple[str, bytes]]:
    return [(f"{key}.jpg", photo), (f"{key}.txt", caption.encode())]


def convo(text: str) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "<image> what is it?"},
                                    {"role": "assistant", "content": text}]}).encode()


def exception_members(photo: bytes) -> list[tuple[str, bytes]]:
    """Samples that raised out of per-sample handling: the member sort (k.jpg with k.0.jpg, k.0.jpg
    with k.a.jpg), json (100,000-deep nesting, a 5,000-digit integer), the tokenizer (a lone
    surrogate escape), between good neighbours."""
    return [
        *good("ok_a", photo),
        ("mixed.jpg", photo), ("mixed.0.jpg", photo), ("mixed.txt", b"two images, one unnumbered"),
        ("named.0.jpg", photo), ("named.a.jpg", photo), ("named.txt", b"a number and a name"),
        *good("ok_b", photo),
        ("deep.jpg", photo), ("deep.json", b"[" * 100_000 + b"]" * 100_000),
        ("bigint.jpg", photo), ("bigint.json", b'{"messages": [], "n": ' + b"7" * 5000 + b"}"),
        ("surrogate.jpg", photo), ("surrogate.json", convo("a lone \ud800 surrogate")),
        *good("ok_c", photo),
        ("chat.jpg", photo), ("chat.json", convo("A cat on a rug.")),
    ]


def duplicate_members(photo: bytes) -> list[tuple[str, bytes]]:
    """k.jpg, k.txt, k.jpg, k.txt in a row (duplicate_member), and a key repeated later in the shard."""
    return [*good("dup", photo), *good("dup", photo), *good("x", photo), *good("y", photo),
            *good("x", photo, "x again, later in the shard")]


def header_offset(path: str, name: str) -> int:
    with tarfile.open(path) as tar:
        return tar.getmember(name).offset


def write_corrupt_header(path: str, photo: bytes, n: int = 8, victim: int = 3) -> str:
    """A shard whose ``victim``-th sample's image header fails its checksum, mid-shard."""
    write_tar(path, [m for i in range(n) for m in good(f"s{i:02d}", photo)])
    data = bytearray(open(path, "rb").read())
    at = header_offset(path, f"s{victim:02d}.jpg")
    data[at + 148:at + 156] = b"0000000\0"  # the checksum field: the header fails its check
    open(path, "wb").write(bytes(data))
    return path


def write_gzip(path: str, photo: bytes, n: int = 6) -> str:
    """A .tar.gz shard, as WebDataset reads them."""
    plain = io.BytesIO()
    with tarfile.open(fileobj=plain, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for i in range(n):
            for name, data in good(f"gz{i}", photo):
                add(tar, name, data)
    open(path, "wb").write(gzip.compress(plain.getvalue()))
    return path


def write_links(path: str, photo: bytes) -> str:
    """A hardlink to a member of the same shard (resolved), symlinks (never followed), a dangling
    hardlink and a FIFO member."""
    with tarfile.open(path, "w") as tar:
        for name, data in good("orig", photo):
            add(tar, name, data)
        for kind, key, target in ((tarfile.LNKTYPE, "hard", "orig.jpg"), (tarfile.SYMTYPE, "soft", "orig.jpg"),
                                  (tarfile.SYMTYPE, "escape", "/etc/passwd"), (tarfile.LNKTYPE, "dangling", "gone.jpg")):
            info = tarfile.TarInfo(f"{key}.jpg")
            info.type, info.linkname = kind, target
            tar.addfile(info)
            add(tar, f"{key}.txt", b"a linked image")
        fifo = tarfile.TarInfo("fifo.jpg")
        fifo.type = tarfile.FIFOTYPE
        tar.addfile(fifo)
        add(tar, "fifo.txt", b"a fifo")
    return path


def exif_rotated(photo: bytes, orientation: int = 6) -> bytes:
    """The photo re-saved with an EXIF orientation tag (6: a portrait phone photo, rotated 90)."""
    from PIL import Image

    img = Image.open(io.BytesIO(photo))
    exif = Image.Exif()
    exif[0x0112] = orientation
    out = io.BytesIO()
    img.save(out, "JPEG", quality=90, exif=exif)
    return out.getvalue()


def bomb_png(side: int) -> bytes:
    """A PNG of side x side RGB: a few hundred KB on disk, side * side * 3 bytes decoded."""
    import struct

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    row = b"\0" + b"\0" * (3 * side)  # filter byte + pixels
    compressor = zlib.compressobj(9)
    body = b"".join(compressor.compress(row) for _ in range(side)) + compressor.flush()
    ihdr = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", body) + chunk(b"IEND", b"")


def image_members(photo: bytes, bomb_side: int) -> list[tuple[str, bytes]]:
    """A truncated JPEG (its first 5,000 bytes), an EXIF-rotated photo, a decompression-bomb PNG,
    between good samples."""
    return [*good("img_a", photo), ("trunc.jpg", photo[:5000]), ("trunc.txt", b"a cut photo"),
            ("exif.jpg", exif_rotated(photo)), ("exif.txt", b"a portrait phone photo"),
            ("bomb.png", bomb_png(bomb_side)), ("bomb.txt", b"a small file that decodes huge"),
            *good("img_b", photo)]


def junk_members(photo: bytes) -> list[tuple[str, bytes]]:
    """Empty and random image bytes, a caption-less cut, a pickle member, latin-1 text."""
    return [("zero.jpg", b""), ("zero.txt", b"zero"), ("rand.jpg", os.urandom(4000)), ("rand.txt", b"r"),
            ("nocap.jpg", photo[1024:9000]), ("evil.pyd", pickle.dumps({"x": 1})), ("evil.txt", b"pickle"),
            ("latin.jpg", b"\xff\xd8\xff"), ("latin.txt", "\xe9t\xe9".encode("latin-1"))]


def write_padded_gzip(path: str, photo: bytes, images: int = 32, pad: int = 60 << 20) -> str:
    """A .tar.gz of a few MB whose sample ``padded`` holds ``images`` JPEGs, each padded with zeros
    after its end to ``pad`` bytes (still a valid JPEG), between two good samples: GBs once read."""
    with tarfile.open(path, "w:gz", format=tarfile.GNU_FORMAT, compresslevel=1) as tar:
        for name, data in good("before", photo):
            add(tar, name, data)
        padded = photo + bytes(max(0, pad - len(photo)))
        for i in range(images):
            add(tar, f"padded.{i}.jpg", padded)
        add(tar, "padded.txt", b"many padded photos")
        for name, data in good("after", photo):
            add(tar, name, data)
    return path


def write_pax_tar(path: str, members: list[tuple[str, bytes, dict]]) -> str:
    """A POSIX (pax) tar whose members carry the given pax records."""
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data, records in members:
            info = tarfile.TarInfo(name)
            info.size, info.pax_headers = len(data), dict(records)
            tar.addfile(info, io.BytesIO(data))
    return path


def write_pax_size(path: str, photo: bytes, size: str = "-1", n: int = 8, victim: int = 3) -> str:
    """``n`` samples; the ``victim``-th image's pax header says ``size=<size>`` (its ustar header the
    true size), as a damaged or hostile writer leaves it."""
    return write_pax_tar(path, [(name, data, {"size": size} if i == victim and name.endswith(".jpg") else {})
                                for i in range(n) for name, data in good(f"s{i:02d}", photo)])


def write_big_pax_header(path: str, photo: bytes, header_bytes: int = 3 << 19, n: int = 20, victim: int = 6) -> str:
    """A valid POSIX tar of ``n`` samples whose ``victim``-th image has a pax header of about
    ``header_bytes`` (a long comment, as large extended attributes make them)."""
    return write_pax_tar(path, [(name, data, {"comment": "x" * header_bytes} if i == victim and name.endswith(".jpg")
                                 else {}) for i in range(n) for name, data in good(f"s{i:02d}", photo)])


def _sparse_pax(name: str, data: bytes, version: str) -> tuple[str, bytes, dict]:
    """A member as GNU tar --sparse --format=pax --sparse-version=<version> stores a file of one
    data segment: 1.0 with its map ahead of the data, 0.1 and 0.0 with it in pax records."""
    n = str(len(data))
    if version == "1.0":
        sparse_map = f"1\n0\n{n}\n".encode()
        return (f"./GNUSparseFile.0/{name}", sparse_map + bytes(-len(sparse_map) % 512) + data,
                {"GNU.sparse.major": "1", "GNU.sparse.minor": "0", "GNU.sparse.name": name, "GNU.sparse.realsize": n})
    if version == "0.1":
        return (f"./GNUSparseFile.0/{name}", data, {"GNU.sparse.size": n, "GNU.sparse.numblocks": "1",
                                                    "GNU.sparse.name": name, "GNU.sparse.map": f"0,{n}"})
    return name, data, {"GNU.sparse.size": n, "GNU.sparse.numblocks": "1", "GNU.sparse.offset": "0",
                        "GNU.sparse.numbytes": n}


def write_pax_sparse(path: str, photo: bytes, version: str = "1.0") -> str:
    """Sample ``sparse``'s caption stored sparse (pax ``version``), between good samples."""
    return write_pax_tar(path, [*((n, d, {}) for n, d in good("a", photo)), ("sparse.jpg", photo, {}),
                                _sparse_pax("sparse.txt", b"a caption stored sparse", version),
                                *((n, d, {}) for n, d in good("b", photo))])


def write_gnu_sparse(path: str, photo: bytes) -> str:
    """Sample ``sparse``'s image as an old GNU sparse member (type ``S``: its map in the header)."""
    write_tar(path, [*good("a", photo), *good("sparse", photo), *good("b", photo)])
    data = bytearray(open(path, "rb").read())
    at = header_offset(path, "sparse.jpg")
    block = data[at:at + 512]
    block[156:157] = tarfile.GNUTYPE_SPARSE
    block[386:410] = b"%011o\0%011o\0" % (0, len(photo))  # one segment: the whole file
    block[482:495] = b"\0" + b"%011o\0" % len(photo)  # not extended; the real size
    block[148:156] = b"%06o\0 " % tarfile.calc_chksums(bytes(block))[0]
    data[at:at + 512] = block
    open(path, "wb").write(bytes(data))
    return path


def write_zero_filled(path: str, size: int = 1 << 30) -> str:
    """A shard file allocated and never written: ``size`` zero bytes (sparse on disk)."""
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def unicode_members(photo: bytes, n: int = 4) -> list[tuple[str, bytes]]:
    """Images named in NFC and their captions in NFD (as macOS tools write them): the same keys."""
    keys = [f"caf\u00e9_{i}" for i in range(n)]
    return [m for k in keys for m in ((f"{k}.jpg", photo), (unicodedata.normalize("NFD", k) + ".txt", b"A cat."))]


def orphan_members(photo: bytes) -> list[tuple[str, bytes]]:
    """A caption without its image, an image without its caption, and a text-only conversation
    (allowed: it asks for no image), between good samples."""
    chat = json.dumps({"conversations": [{"from": "human", "value": "Say hello."},
                                         {"from": "gpt", "value": "Hello."}]}).encode()
    return [*good("a", photo), ("lonely.txt", b"a caption whose image is gone"), ("mute.jpg", photo),
            ("chat.json", chat), *good("b", photo)]


def dotted_members(photo: bytes) -> list[tuple[str, bytes]]:
    """Names with more dots than key.ext: ``img.001.jpg`` / ``img.001.txt`` (all sample ``img``),
    ``k.jpg.txt`` (a caption under extension ``jpg.txt``), ``cap.en.txt`` next to ``cap.txt``."""
    return [*good("a", photo), ("img.001.jpg", photo), ("img.001.txt", b"first"), ("img.002.jpg", photo),
            ("img.002.txt", b"second"), ("k.jpg", photo), ("k.jpg.txt", b"a caption named after its image"),
            ("cap.jpg", photo), ("cap.txt", b"A cat."), ("cap.en.txt", b"A cat, in English."), *good("b", photo)]


def rewrite_in_place(path: str) -> None:
    """The same bytes written again: a new modification time, as a rewrite of the file leaves it."""
    data = open(path, "rb").read()
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


def tar_edge_cases(out_dir: str, photo: bytes, pad: int = 4 << 20) -> list[str]:
    """The archives GNU tar and Python's tarfile read that lost or invented samples, and the ones
    that cost memory: a .tar.gz padded to GBs (``pad`` per image), a pax size of -1, a pax header
    over 1 MiB and one over the size read for a header, sparse members (pax 1.0, 0.1, 0.0 and old GNU), a zero-filled file, NFD captions,
    orphans and dotted names."""
    p = lambda name: os.path.join(out_dir, name)  # noqa: E731
    return [write_padded_gzip(p("padded.tar.gz"), photo, pad=pad),
            write_pax_size(p("pax-size.tar"), photo),
            write_big_pax_header(p("big-pax-header.tar"), photo),
            write_big_pax_header(p("huge-pax-header.tar"), photo, MAX_EXTENDED_HEADER + 1, n=4, victim=1),
            *(write_pax_sparse(p(f"sparse-{v}.tar"), photo, v) for v in ("1.0", "0.1", "0.0")),
            write_gnu_sparse(p("sparse-gnu.tar"), photo),
            write_zero_filled(p("zero-filled.tar"), 64 << 20),
            write_tar(p("unicode.tar"), unicode_members(photo)),
            write_tar(p("orphans.tar"), orphan_members(photo)),
            write_tar(p("dotted.tar"), dotted_members(photo))]


def write_hostile_set(out_dir: str, photo: bytes, good_shard: str, bomb_side: int = 5000) -> tuple[list[str], str]:
    """Every class above as its own shard under ``out_dir``, plus a truncated copy of ``good_shard``
    and a file that is not a tar. Returns (paths, the key of a good sample to kill its actor on)."""
    os.makedirs(out_dir, exist_ok=True)
    p = lambda name: os.path.join(out_dir, name)  # noqa: E731
    paths = [write_tar(p("exceptions.tar"), exception_members(photo)),
             write_tar(p("duplicates.tar"), duplicate_members(photo)),
             write_corrupt_header(p("corrupt-header.tar"), photo),
             write_gzip(p("gzipped.tar.gz"), photo),
             write_links(p("links.tar"), photo),
             write_tar(p("images.tar"), image_members(photo, bomb_side)),
             write_tar(p("bad-members.tar"), junk_members(photo)),
             write_tar(p("kill.tar"), [*good("before", photo), *good("killer", photo), *good("after", photo)]),
             *tar_edge_cases(out_dir, photo)]
    data = open(good_shard, "rb").read()
    with open(p("truncated.tar"), "wb") as f:
        f.write(data[: len(data) * 2 // 3])
    with open(p("garbage.tar"), "wb") as f:
        f.write(os.urandom(20000))
    return paths + [p("truncated.tar"), p("garbage.tar")], f"{p('kill.tar')}/killer"
