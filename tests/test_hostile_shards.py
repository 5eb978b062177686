"""Shards as real crawls and hand-made datasets come out: each bad sample costs only itself, every
sample that exists is counted (read == delivered + quarantined + skipped_by_rule), and the reader,
block sizing and inspect all survive the same bytes. Every shard here is a real tar the test writes."""
import gzip
import io
import json
import subprocess
import sys
import tarfile

import numpy as np
import pytest
from PIL import Image

from datasvc.pack.headers import encode_from_headers
from datasvc.rejects import Accounting
from datasvc.read.shards import NoShardsError, ReadLimits, expand_shards, index_shard, read_samples
from datasvc.samples import encode_image, real_photos
from datasvc.stream.process import process_item
from datasvc.tools.bench.hostile import add, convo, good, header_offset, write_links, write_tar
from datasvc.wire import WorkItem


@pytest.fixture(scope="module")
def photo() -> bytes:
    return encode_image(real_photos()[1][1])  # chelsea, 451x300


def run(path, qwen3vl, decoder):
    idx = index_shard(path)
    res = process_item(WorkItem(path, 0, tuple(idx.samples)), qwen3vl, decoder)
    acct = res.accounting
    acct.delivered = len(res.samples)
    assert acct.balanced(), acct.as_dict()
    return idx, res, {r.key: r.reason for r in acct.log}, sorted(s.key for s in res.samples)


@pytest.fixture
def exception_shard(tmp_path, photo):
    """Each bad sample here raised out of per-sample handling before: the member sort (TypeError),
    json.loads (RecursionError, ValueError), the tokenizer (TypeError on a lone surrogate)."""
    members = [
        *good("ok_a", photo),
        ("mixed.jpg", photo), ("mixed.0.jpg", photo), ("mixed.txt", b"two images, one unnumbered"),
        ("named.0.jpg", photo), ("named.a.jpg", photo), ("named.txt", b"a number and a name"),
        *good("ok_b", photo),
        ("deep.jpg", photo), ("deep.json", b"[" * 100_000 + b"]" * 100_000),
        ("bigint.jpg", photo), ("bigint.json", b'{"messages": [], "n": ' + b"7" * 5000 + b"}"),
        # json.dumps writes the lone surrogate as the escape \ud800, valid JSON the tokenizer cannot take.
        ("surrogate.jpg", photo), ("surrogate.json", convo("a lone \ud800 surrogate")),
        ("nested.jpg", photo), ("nested.json", b'{"meta": ' + b"[" * 200 + b"]" * 200 + b"}"),
        *good("ok_c", photo),
        ("chat.jpg", photo), ("chat.json", convo("A cat on a rug.")),
    ]
    return write_tar(tmp_path / "exceptions.tar", members)


def test_per_sample_exceptions_cost_only_their_sample(exception_shard, qwen3vl, cpu_decoder):
    idx, res, reasons, delivered = run(exception_shard, qwen3vl, cpu_decoder)
    assert res.accounting.read == len(idx.samples) == 10
    # A mix of numbered and named image members is ordered, not an error: both samples train with 2 images.
    assert delivered == ["chat", "mixed", "named", "ok_a", "ok_b", "ok_c"]
    by_key = {s.key: s for s in res.samples}
    assert len(by_key["mixed"].image_grid_thw) == len(by_key["named"].image_grid_thw) == 2
    assert reasons == {"deep": "bad_json", "bigint": "bad_json", "surrogate": "text_not_utf8", "nested": "bad_json"}
    details = {r.key: r.detail for r in res.accounting.log}
    assert "deeper" in details["deep"] and "digits" in details["bigint"] and "surrogate" in details["surrogate"]


def test_block_sizing_and_inspect_survive_the_same_samples(exception_shard, qwen3vl, tmp_path):
    from datasvc.config import ServiceConfig
    from datasvc.pack.epoch import sample_token_counts, size_blocks
    from datasvc.tools.inspect import inspect_shards

    cfg = ServiceConfig(shards=(exception_shard,), pipeline_options={"max_pixels": 256 * 256}, seq_len=1024)
    index = index_shard(exception_shard)
    assert len(sample_token_counts(cfg, [index])) == 6
    sized, sizing = size_blocks(cfg)
    assert sizing.probed_samples == 6 and sized.items_per_block >= 1
    for raw in read_samples(exception_shard, index.samples, ReadLimits()):
        if raw.problem:
            with pytest.raises(ValueError):  # ImageRejected carrying the reader's reason
                encode_from_headers(raw, qwen3vl)
        else:
            encode_from_headers(raw, qwen3vl)
    summary = inspect_shards([exception_shard], str(tmp_path / "inspect"), pipeline_options={"max_pixels": 256 * 256},
                             write_samples=False)
    assert summary["balanced"] and summary["accounting"]["read"] == 10
    assert summary["accounting"]["delivered"] == 6


def test_missing_shards_are_named_at_start(tmp_path, photo):
    real = write_tar(tmp_path / "real-000.tar", good("a", photo))
    (tmp_path / "adir").mkdir()
    with pytest.raises(NoShardsError, match="nope.tar.*no such file"):
        expand_shards([real, str(tmp_path / "nope.tar")])
    with pytest.raises(NoShardsError, match="a directory"):
        expand_shards([real, str(tmp_path / "adir")])
    with pytest.raises(NoShardsError, match=r"real-001.tar \(no such file\)"):
        expand_shards(str(tmp_path / "real-{000..001}.tar"))
    with pytest.raises(NoShardsError, match="matches no file"):
        expand_shards([real, str(tmp_path / "other-*.tar")])
    with pytest.raises(NoShardsError, match="no shard files match"):
        expand_shards(str(tmp_path / "missing-{000..003}.tar"))
    assert expand_shards([real, str(tmp_path / "real-*.tar")]) == [real]
    with pytest.raises(NoShardsError, match="pipe: URLs"):
        expand_shards(f"pipe:cat {real}")
    assert expand_shards(f"file://{real}") == [real]


def test_a_directory_is_its_tars_sorted(tmp_path, photo):
    folder = tmp_path / "shards"
    folder.mkdir()
    made = [write_tar(folder / name, good(name[:1], photo)) for name in ("b.tar", "a.tgz", "c.tar.gz")]
    (folder / "notes.txt").write_text("not a shard")
    (folder / "sub").mkdir()
    write_tar(folder / "sub" / "d.tar", good("d", photo))  # only the folder's own files
    assert expand_shards(str(folder)) == sorted(made)


def test_gzip_shards_read_like_plain_ones(tmp_path, photo, qwen3vl, cpu_decoder):
    members = [m for i in range(12) for m in good(f"s{i:02d}", photo, f"Cat number {i}.")]
    plain = write_tar(tmp_path / "plain.tar", members)
    data = open(plain, "rb").read()
    for name in ("a.tar.gz", "b.tgz"):
        with open(tmp_path / name, "wb") as f:
            f.write(gzip.compress(data))
    # Two gzip members back to back (as `cat a.gz b.gz` makes) are one stream.
    half = len(data) // 2
    with open(tmp_path / "multi.tar.gz", "wb") as f:
        f.write(gzip.compress(data[:half]) + gzip.compress(data[half:]))
    want = list(read_samples(plain, index_shard(plain).samples, ReadLimits()))
    for name in ("a.tar.gz", "b.tgz", "multi.tar.gz"):
        path = str(tmp_path / name)
        idx = index_shard(path)
        assert not idx.truncated and [s.key for s in idx.samples] == [r.key for r in want]
        # Work items are read in any order, each by itself.
        got = {r.key: r for r in read_samples(path, idx.samples[::-1], ReadLimits())}
        assert all(got[w.key].images == w.images and got[w.key].text == w.text for w in want)
        _, res, reasons, delivered = run(path, qwen3vl, cpu_decoder)
        assert len(delivered) == 12 and not reasons


def test_gzip_shard_larger_than_its_access_point_spacing(tmp_path):
    from datasvc.read.tarscan import _SPACING

    rng = np.random.default_rng(0)
    blobs = [rng.integers(0, 256, 1 << 20, dtype=np.uint8).tobytes() for _ in range(3 * _SPACING // (1 << 20))]
    members = [m for i, b in enumerate(blobs) for m in ((f"k{i:03d}.bin", b), (f"k{i:03d}.txt", f"{i}".encode()))]
    plain = write_tar(tmp_path / "big.tar", members)
    path = str(tmp_path / "big.tar.gz")
    with open(path, "wb") as f:
        f.write(gzip.compress(open(plain, "rb").read(), compresslevel=1))
    idx = index_shard(path)
    assert len(idx.samples) == len(blobs) and not idx.truncated
    for first in (len(blobs) - 2, 0, len(blobs) // 2, 5):  # backwards and forwards, past access points
        (raw,) = read_samples(path, [idx.samples[first]], ReadLimits())
        assert raw.text == str(first) and not raw.problem


def test_cut_gzip_shard_counts_its_last_sample(tmp_path, photo, qwen3vl, cpu_decoder):
    members = [m for i in range(10) for m in good(f"s{i}", photo)]
    data = gzip.compress(open(write_tar(tmp_path / "p.tar", members), "rb").read())
    path = str(tmp_path / "cut.tar.gz")
    open(path, "wb").write(data[: int(len(data) * 0.6)])
    idx, res, reasons, delivered = run(path, qwen3vl, cpu_decoder)
    assert idx.truncated and list(reasons.values()) == ["truncated_tar"]
    assert 3 <= len(delivered) < 10 and res.accounting.read == len(delivered) + 1


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT])
def test_long_member_names(tmp_path, photo, qwen3vl, cpu_decoder, fmt):
    key = "crawl/" + "x" * 150 + "/0001"
    path = str(tmp_path / "long.tar")
    with tarfile.open(path, "w", format=fmt) as tar:
        for name, data in good(key, photo) + good("short", photo):
            add(tar, name, data)
    idx, res, reasons, delivered = run(path, qwen3vl, cpu_decoder)
    assert delivered == sorted([key, "short"]) and not reasons


def test_damaged_header_costs_its_sample_and_the_shard_reads_on(tmp_path, photo, qwen3vl, cpu_decoder):
    keys = [f"s{i:02d}" for i in range(8)]
    members = [m for k in keys for m in good(k, photo)]
    path = write_tar(tmp_path / "damaged.tar", members)
    data = bytearray(open(path, "rb").read())
    at = header_offset(path, "s03.jpg")
    data[at + 148:at + 156] = b"0000000\0"  # checksum field: the header fails its check, its name reads
    open(path, "wb").write(bytes(data))
    idx, res, reasons, delivered = run(path, qwen3vl, cpu_decoder)
    assert idx.damaged_headers == 1 and not idx.truncated
    assert reasons == {"s03": "corrupt_tar_header"}  # blamed alone: its image was the member lost
    assert delivered == [k for k in keys if k != "s03"]
    assert res.accounting.read == len(keys)


def garble(path: str, *names: str) -> None:
    data = bytearray(open(path, "rb").read())
    for name in names:
        at = header_offset(path, name)
        # Nothing of the header left to read: bytes that are no UTF-8 name and no octal size. (Random
        # bytes would now and then read as a short printable name, and blame a sample by it.)
        data[at:at + 512] = bytes([0xFF]) * 512
    open(path, "wb").write(bytes(data))


def test_unreadable_header_blames_the_sample_it_cost(tmp_path, photo, qwen3vl, cpu_decoder):
    keys = [f"s{i:02d}" for i in range(8)]
    path = write_tar(tmp_path / "garbled.tar", [m for k in keys for m in good(k, photo)])
    garble(path, "s05.jpg")
    idx, res, reasons, delivered = run(path, qwen3vl, cpu_decoder)
    # s05 is left with its caption alone, s04 is whole: the lost image was s05's.
    assert reasons == {"s05": "corrupt_tar_header"} and delivered == [k for k in keys if k != "s05"]
    assert res.accounting.read == len(keys) and idx.damaged_headers == 1


def test_a_sample_lost_whole_behind_unreadable_headers_is_counted(tmp_path, photo, qwen3vl, cpu_decoder):
    keys = [f"s{i:02d}" for i in range(8)]
    path = write_tar(tmp_path / "garbled.tar", [m for k in keys for m in good(k, photo)])
    garble(path, "s05.jpg", "s05.txt")
    idx, res, reasons, delivered = run(path, qwen3vl, cpu_decoder)
    assert delivered == [k for k in keys if k != "s05"]  # both neighbours are whole: delivered
    assert list(reasons.values()) == ["corrupt_tar_header"] and res.accounting.read == len(keys)


def test_a_whole_sample_behind_damaged_headers_is_counted(tmp_path, photo, qwen3vl, cpu_decoder):
    path = write_tar(tmp_path / "lost.tar", good("a", photo) + [("b.txt", b"lone member")] + good("c", photo))
    data = bytearray(open(path, "rb").read())
    at = header_offset(path, "b.txt")
    data[at + 148:at + 156] = b"0000000\0"
    open(path, "wb").write(bytes(data))
    idx, res, reasons, delivered = run(path, qwen3vl, cpu_decoder)
    assert delivered == ["a", "c"] and reasons == {"b": "corrupt_tar_header"}


def test_concatenated_archives_are_one_shard(tmp_path, photo, qwen3vl, cpu_decoder):
    a = write_tar(tmp_path / "a.tar", good("a", photo))
    b = write_tar(tmp_path / "b.tar", good("b", photo))
    path = str(tmp_path / "ab.tar")
    open(path, "wb").write(open(a, "rb").read() + open(b, "rb").read())
    idx, res, reasons, delivered = run(path, qwen3vl, cpu_decoder)
    assert delivered == ["a", "b"] and idx.damaged_headers == 0


def test_links_hardlinks_resolved_symlinks_rejected(tmp_path, photo, qwen3vl, cpu_decoder):
    path = write_links(str(tmp_path / "links.tar"), photo)
    idx, res, reasons, delivered = run(path, qwen3vl, cpu_decoder)
    assert delivered == ["hard", "orig"]
    hard, orig = sorted(res.samples, key=lambda s: s.key)
    assert np.array_equal(hard.pixels, orig.pixels)
    assert reasons == {"soft": "symlink_member", "escape": "symlink_member", "dangling": "dangling_hardlink",
                       "fifo": "special_member"}


def _save(img: Image.Image, fmt: str, **kw) -> bytes:
    b = io.BytesIO()
    img.save(b, fmt, **kw)
    return b.getvalue()


def test_gif_bmp_tiff_are_decoded_and_capped(tmp_path, photo, qwen3vl, cpu_decoder):
    base = Image.fromarray(real_photos()[1][1])
    frames = [base, base.transpose(Image.Transpose.FLIP_LEFT_RIGHT)]
    gif = _save(frames[0], "GIF", save_all=True, append_images=frames[1:])
    huge_gif = bytearray(_save(Image.new("P", (8, 8)), "GIF"))
    huge_gif[6:10] = (60000).to_bytes(2, "little") * 2  # logical screen 60000 x 60000
    members = [
        ("gif.gif", gif), ("gif.txt", b"an animated gif"),
        ("bmp.bmp", _save(base, "BMP")), ("bmp.txt", b"a bmp"),
        ("tiff.tif", _save(base, "TIFF")), ("tiff.txt", b"a tiff"),
        ("hugegif.gif", bytes(huge_gif)), ("hugegif.txt", b"a gif declaring 3.6 gigapixels"),
        ("heic.heic", b"\0\0\0\x18ftypheic" + b"\0" * 64), ("heic.txt", b"an image we do not decode"),
        ("avi.jpg", photo), ("avi.avi", b"RIFF\0\0\0\0AVI "), ("avi.txt", b"a video we do not decode"),
        ("gz.jpg.gz", gzip.compress(photo)), ("gz.txt", b"a compressed image member"),
    ]
    path = write_tar(tmp_path / "formats.tar", members)
    idx, res, reasons, delivered = run(path, qwen3vl, cpu_decoder)
    assert delivered == ["bmp", "gif", "tiff"]
    assert all(len(s.image_grid_thw) == 1 for s in res.samples)  # none trained text-only
    assert reasons == {"hugegif": "too_many_pixels", "heic": "unsupported_format", "avi": "unsupported_format",
                       "gz": "unsupported_format"}


def test_duplicate_members_and_repeated_keys(tmp_path, photo, qwen3vl, cpu_decoder):
    members = [*good("dup", photo), *good("dup", photo),  # k.jpg, k.txt, k.jpg, k.txt: one group, twice
               *good("x", photo), *good("y", photo), *good("x", photo, "x again, later in the shard")]
    path = write_tar(tmp_path / "dups.tar", members)
    idx, res, reasons, delivered = run(path, qwen3vl, cpu_decoder)
    assert reasons == {"dup": "duplicate_member"}
    assert delivered == ["x", "x", "y"]
    assert res.accounting.noted["repeated_key"] == 1
    assert res.accounting.as_dict()["noted"] == {"repeated_key": 1}
    # the service's total over ranks keeps what each rank noted
    total = Accounting()
    for _ in range(2):
        total.merge(res.accounting)
    one = res.accounting
    assert total.noted == {"repeated_key": 2} and total.quarantined == {"duplicate_member": 2}
    assert (total.read, total.delivered) == (2 * one.read, 2 * one.delivered)


def test_importing_the_decoders_leaves_pils_limit_alone():
    code = ("import PIL.Image as I; before = I.MAX_IMAGE_PIXELS; import datasvc.media.decode, datasvc.stream.process, "
            "datasvc.media.imagefile; assert I.MAX_IMAGE_PIXELS == before, I.MAX_IMAGE_PIXELS; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]


def png_header(w: int, h: int) -> bytes:
    """A PNG whose IHDR declares w x h, with a tiny body (never decoded here)."""
    import struct
    import zlib

    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def test_our_cap_decides_not_pils_process_wide_limit():
    from datasvc.media.imagefile import probe
    from datasvc.media.vision import ImageRejected

    before = Image.MAX_IMAGE_PIXELS
    big = png_header(20000, 10000)  # 200 MP: over twice PIL's default limit, which would raise
    assert probe(big, 300_000_000).pixels == 200_000_000
    with pytest.raises(ImageRejected) as e:
        probe(big, 64_000_000)
    assert e.value.reason == "too_many_pixels"
    assert Image.MAX_IMAGE_PIXELS == before
