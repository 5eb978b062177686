"""Hostile and broken input: every bad sample gets a counted, recorded reason; nothing crashes;
read == delivered + quarantined + skipped_by_rule."""
import io
import json
import os
import struct
import tarfile
import zlib

import numpy as np
import pytest
from PIL import Image

from datasvc.read.shards import index_shard
from datasvc.samples import encode_image, real_photos
from datasvc.stream.process import process_item
from datasvc.wire import WorkItem


def add(tar: tarfile.TarFile, name: str, data: bytes):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def png_bomb_header(w: int, h: int) -> bytes:
    """A valid PNG signature and IHDR declaring w x h, with a tiny compressed body."""
    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 1024)) + chunk(b"IEND", b"")


def jpeg_declaring(jpeg: bytes, width: int, height: int) -> bytes:
    """A real JPEG whose frame header (SOF0/SOF2) claims another size (JPEG's limit is 65535)."""
    data = bytearray(jpeg)
    i = 2
    while i < len(data):
        marker, length = data[i + 1], int.from_bytes(data[i + 2:i + 4], "big")
        if marker in (0xC0, 0xC2):
            data[i + 5:i + 7] = height.to_bytes(2, "big")
            data[i + 7:i + 9] = width.to_bytes(2, "big")
            return bytes(data)
        i += 2 + length
    raise AssertionError("no SOF marker")


class Exploit:
    """Unpickling this would create a file: proves pickle members are never loaded."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture
def hostile_shard(tmp_path):
    import pickle

    photo = encode_image(real_photos()[1][1])  # chelsea
    good = lambda k: [(f"{k}.jpg", photo), (f"{k}.txt", b"A cat.")]
    canary = str(tmp_path / "pwned")
    members = [
        *good("ok_1"),
        ("corrupt.jpg", photo[:200] + os.urandom(3000)), ("corrupt.txt", b"corrupt"),
        ("truncjpg.jpg", photo[: len(photo) // 3]), ("truncjpg.txt", b"truncated jpeg"),
        ("zero.jpg", b""), ("zero.txt", b"zero bytes"),
        ("random.jpg", os.urandom(5000)), ("random.txt", b"random bytes"),
        ("gif.jpg", _gif()), ("gif.txt", b"a gif, named .jpg: decoded by what it is"),
        ("psd.jpg", b"8BPS" + os.urandom(200)), ("psd.txt", b"a Photoshop file, named .jpg"),
        ("notext.jpg", photo),
        ("latin1.jpg", photo), ("latin1.txt", "caf\xe9".encode("latin-1")),
        ("wide.png", encode_image(np.zeros((4, 1000, 3), np.uint8), "png")), ("wide.txt", b"too wide"),
        ("bomb.png", png_bomb_header(100000, 100000)), ("bomb.txt", b"png bomb"),
        ("hugejpeg.jpg", jpeg_declaring(photo, 65535, 65535)), ("hugejpeg.txt", b"SOF says 65535 x 65535"),
        ("pickled.jpg", photo), ("pickled.txt", b"has a pickle"), ("pickled.pyd", pickle.dumps(Exploit(canary))),
        ("pickled.pickle", pickle.dumps(Exploit(canary))),
        ("../escape.jpg", photo), ("../escape.txt", b"path traversal"),
        ("/abs/olute.jpg", photo), ("/abs/olute.txt", b"absolute path"),
        ("convo.0.jpg", photo), ("convo.json", json.dumps({"messages": [
            {"role": "user", "content": "<image><image> two markers, one image"},
            {"role": "assistant", "content": "mismatch"}]}).encode()),
        ("badjson.jpg", photo), ("badjson.json", b"{not json"),
        ("nocaption.jpg", photo), ("nocaption.json", json.dumps({"caption": 5, "url": "x"}).encode()),
        ("huge.jpg", photo), ("huge.txt", b"word " * 300000),
        ("unknown.jpg", photo), ("unknown.txt", b"has an unknown member"), ("unknown.xyz", b"??"),
        *good("ok_2"),
    ]
    many = [(f"many.{i}.jpg", photo) for i in range(10000)] + [("many.txt", b"10000 images")]
    path = str(tmp_path / "hostile.tar")
    with tarfile.open(path, "w") as tar:
        for name, data in members + many + good("ok_3"):
            add(tar, name, data)
    return path, canary


def _gif() -> bytes:
    b = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 10, 10)).save(b, "GIF")
    return b.getvalue()


EXPECTED = {
    "corrupt": {"corrupt_image", "undecodable_image", "truncated_image"}, "truncjpg": "truncated_image",
    "zero": "empty_image", "random": "undecodable_image", "psd": "unsupported_format", "notext": "missing_text",
    "latin1": "text_not_utf8", "wide": "aspect_ratio", "bomb": "too_many_pixels",
    "../escape": "unsafe_member_name", "/abs/olute": "unsafe_member_name",
    "convo": "image_count_mismatch", "badjson": "bad_json", "nocaption": "missing_text", "huge": "text_too_long",
    "many": "too_many_images", "hugejpeg": "too_many_pixels",
}


def test_hostile_shard_is_counted_not_crashed(hostile_shard, qwen3vl, cpu_decoder):
    path, canary = hostile_shard
    idx = index_shard(path)
    res = process_item(WorkItem(path, 0, tuple(idx.samples)), qwen3vl, cpu_decoder)
    acct = res.accounting
    acct.delivered = len(res.samples)
    reasons = {r.key: r.reason for r in acct.log}
    details = {r.key: r.detail for r in acct.log}
    assert details["notext"] == "no txt or json member" and "keys: caption, url" in details["nocaption"]
    for key, reason in EXPECTED.items():
        allowed = reason if isinstance(reason, set) else {reason}
        assert reasons.get(key) in allowed, (key, reasons.get(key))
    delivered = sorted(s.key for s in res.samples)
    assert delivered == ["gif", "ok_1", "ok_2", "ok_3", "pickled", "unknown"]
    assert acct.balanced()
    assert acct.read == len(idx.samples)
    assert acct.ignored_members["pickle_never_loaded"] == 2
    assert acct.ignored_members["unknown:xyz"] == 1
    assert not os.path.exists(canary), "a pickle member was unpickled"
    # Delivered samples are intact: token/pad counts agree with their grids.
    for s in res.samples:
        pads = int((s.input_ids == 151655).sum())
        assert pads == int(s.image_grid_thw.prod(axis=1).sum()) // 4
        assert s.pixels.shape == (int(s.image_grid_thw.prod(axis=1).sum()), 768)


def test_truncated_tar(tmp_path, photo_shards, qwen3vl, cpu_decoder):
    data = open(photo_shards[0], "rb").read()
    cut = str(tmp_path / "cut.tar")
    for frac in (0.3, 0.6, 0.85):
        with open(cut, "wb") as f:
            f.write(data[: int(len(data) * frac)])
        idx = index_shard(cut)
        assert idx.truncated
        res = process_item(WorkItem(cut, 0, tuple(idx.samples)), qwen3vl, cpu_decoder)
        res.accounting.delivered = len(res.samples)
        assert res.accounting.balanced()
        assert res.accounting.quarantined["truncated_tar"] >= 1
        assert len(res.samples) >= 1 or frac < 0.3


def test_garbage_file_is_one_counted_rejection(tmp_path, qwen3vl, cpu_decoder):
    path = str(tmp_path / "garbage.tar")
    with open(path, "wb") as f:
        f.write(os.urandom(4096))
    idx = index_shard(path)
    res = process_item(WorkItem(path, 0, tuple(idx.samples)), qwen3vl, cpu_decoder)
    assert res.accounting.quarantined["unreadable_tar"] == 1


def test_block_sizing_probe_skips_bad_samples_and_never_unpickles(hostile_shard):
    from datasvc.config import ServiceConfig
    from datasvc.pack.epoch import sample_token_counts, size_blocks
    from datasvc.read.shards import index_shard

    path, canary = hostile_shard
    cfg = ServiceConfig(shards=(path,), pipeline="qwen3vl", pipeline_options={"max_pixels": 256 * 256},
                        seq_len=1024, micro_batch_size=2)
    index = index_shard(path)
    lengths = sample_token_counts(cfg, [index])
    # The three good samples at least; never the ones whose headers or text the run rejects.
    assert 3 <= len(lengths) < len(index.samples)
    assert all(0 < n <= 1024 for n in lengths)
    sized, sizing = size_blocks(cfg, indexes=[index])
    assert sized.items_per_block >= 1 and sizing.probed_samples == len(lengths)
    assert not os.path.exists(canary)
