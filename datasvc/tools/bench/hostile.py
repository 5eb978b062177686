"""Shards as real crawls and hand-made datasets come out, written for the soak (and anything else
that needs them): every class of bad data the service must survive, each a real tar (or .tar.gz)
next to good samples, so that one bad sample costs only itself and nothing goes uncounted.

``write_hostile_set(out_dir, photo, bomb_side)`` writes them all and returns their paths, and the
sample key a soak can hand to ``ServiceConfig.fault_injection["kill_on_key"]``.
"""
from __future__ import annotations

import gzip
import io
import json
import os
import pickle
import tarfile
import zlib


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
             write_tar(p("kill.tar"), [*good("before", photo), *good("killer", photo), *good("after", photo)])]
    data = open(good_shard, "rb").read()
    with open(p("truncated.tar"), "wb") as f:
        f.write(data[: len(data) * 2 // 3])
    with open(p("garbage.tar"), "wb") as f:
        f.write(os.urandom(20000))
    return paths + [p("truncated.tar"), p("garbage.tar")], f"{p('kill.tar')}/killer"
