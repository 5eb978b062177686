"""Tar archives that GNU tar and Python's tarfile read, and that lost, invented or over-read samples
here: every sample that exists is delivered or counted under a reason that says what happened
(read == delivered + quarantined + skipped_by_rule), a header's declared size is checked before it
is read, a file rewritten after indexing is never read as if it were the old one, and the members a
scan finds are the members tarfile finds. Every archive here is written by the test."""
import logging
import os
import tarfile
import unicodedata

import pytest

from datasvc.read import tarscan
from datasvc.read.listings import ShardListings
from datasvc.read.shards import Member, ReadLimits, SampleIndex, expand_shards, index_shard, read_samples, split_name
from datasvc.read.tarscan import Scan, open_archive
from datasvc.samples import encode_image, real_photos
from datasvc.stream.process import encoded_parts, process_item
from datasvc.tools.bench import hostile
from datasvc.tools.bench.hostile import good, write_tar
from datasvc.wire import WorkItem

MiB = 1 << 20


@pytest.fixture(scope="module")
def photo() -> bytes:
    return encode_image(real_photos()[1][1])


def run(path, qwen3vl, decoder, limits=ReadLimits(), index=None):
    idx = index or index_shard(path)
    res = process_item(WorkItem(path, 0, tuple(idx.samples)), qwen3vl, decoder, limits)
    acct = res.accounting
    acct.delivered = len(res.samples)
    assert acct.balanced() and acct.read == len(idx.samples), acct.as_dict()
    return idx, res, {r.key: r.reason for r in acct.log}, sorted(s.key for s in res.samples)


class ReadSizes:
    """Every read_at an archive class serves, by size, to show what was (not) read."""

    def __init__(self, monkeypatch, cls):
        self.sizes = []
        original = cls.read_at

        def read_at(archive, offset, size):
            self.sizes.append(size)
            return original(archive, offset, size)
        monkeypatch.setattr(cls, "read_at", read_at)


# Memory and bytes

def test_a_padded_gzip_sample_is_refused_from_its_headers_unread(tmp_path, photo, qwen3vl, cpu_decoder, monkeypatch):
    path = hostile.write_padded_gzip(str(tmp_path / "padded.tar.gz"), photo, images=4, pad=3 * MiB)
    assert os.path.getsize(path) < MiB  # 12 MiB of members, a few hundred KB on disk
    reads = ReadSizes(monkeypatch, tarscan.GzipArchive)
    idx, res, reasons, delivered = run(path, qwen3vl, cpu_decoder, ReadLimits(max_sample_bytes=8 * MiB))
    assert reasons == {"padded": "sample_too_large"} and delivered == ["after", "before"]
    assert "12 MiB encoded > encoded_bytes_budget 8 MiB" in res.accounting.log[0].detail
    assert max(reads.sizes) <= MiB  # headers and the good samples: no padded member was read


def test_an_item_is_read_in_parts_under_the_encoded_budget(tmp_path, photo, qwen3vl, cpu_decoder, monkeypatch):
    big = photo + bytes(MiB - len(photo))
    path = write_tar(tmp_path / "big.tar", [m for i in range(8) for m in ((f"s{i}.jpg", big), (f"s{i}.txt", b"A cat."))])
    idx = index_shard(path)
    budget = 5 * MiB // 2
    assert [hi - lo for lo, hi in encoded_parts(tuple(idx.samples), budget)] == [2, 2, 2, 2]
    held = []
    import datasvc.stream.process as process

    def counting(shard, samples, limits, ignored=None):
        raws = list(read_samples(shard, samples, limits, ignored))
        held.append(sum(len(d) for r in raws for _, d in r.images))
        return raws
    monkeypatch.setattr(process, "read_samples", counting)
    _, res, reasons, delivered = run(path, qwen3vl, cpu_decoder, ReadLimits(max_sample_bytes=budget), idx)
    assert len(delivered) == 8 and not reasons
    assert len(held) == 4 and max(held) <= budget


def test_the_encoded_budget_is_a_checked_setting():
    from datasvc.config import BudgetConfig, InvalidConfig, ServiceConfig

    assert ServiceConfig(shards=("a.tar",)).budget.encoded_bytes_budget == 512 * MiB
    with pytest.raises(InvalidConfig, match="encoded_bytes_budget must be >= 1 MiB"):
        ServiceConfig(shards=("a.tar",), budget=BudgetConfig(encoded_bytes_budget=1000))


@pytest.mark.parametrize("size", ["-1", "99999999999", "12abc"])
def test_a_pax_size_that_is_not_the_members_costs_that_sample_alone(tmp_path, photo, qwen3vl, cpu_decoder,
                                                                     monkeypatch, size):
    path = hostile.write_pax_size(str(tmp_path / "pax.tar"), photo, size=size)
    reads = ReadSizes(monkeypatch, tarscan.PlainArchive)
    idx, res, reasons, delivered = run(path, qwen3vl, cpu_decoder)
    assert reasons == {"s03": "corrupt_tar_header"} and len(delivered) == 7 and not idx.truncated
    assert f"pax size={size}" in res.accounting.log[0].detail or f"pax size='{size}'" in res.accounting.log[0].detail
    assert all(m.size >= 0 for s in idx.samples for m in s.members)
    assert 0 <= min(reads.sizes) and max(reads.sizes) <= MiB  # headers, members, never "the rest of the file"


def test_a_listed_size_the_file_cannot_hold_is_refused_before_reading(tmp_path, photo, monkeypatch):
    path = write_tar(tmp_path / "a.tar", good("a", photo))
    whole = index_shard(path).samples[0]
    reads = ReadSizes(monkeypatch, tarscan.PlainArchive)
    for bad in (Member("jpg", 512, -1), Member("jpg", 512, 10 ** 12), Member("jpg", -512, 100)):
        sample = SampleIndex("a", (bad, whole.members[1]))
        (raw,) = read_samples(path, [sample], ReadLimits(max_image_bytes=10 ** 13, max_sample_bytes=10 ** 13))
        assert raw.problem == "truncated_tar" and "does not hold" in raw.detail
    assert all(0 <= n <= tarscan.BLOCK for n in reads.sizes)


# Tar edge cases that lost or invented samples

def test_a_pax_header_over_a_mib_is_read_and_the_shard_goes_on(tmp_path, photo, qwen3vl, cpu_decoder, monkeypatch):
    path = hostile.write_big_pax_header(str(tmp_path / "pax.tar"), photo, header_bytes=3 * MiB // 2)
    idx, res, reasons, delivered = run(path, qwen3vl, cpu_decoder)
    assert len(delivered) == 20 and not reasons and not idx.truncated
    monkeypatch.setattr(tarscan, "MAX_EXTENDED_HEADER", MiB)  # over the limit: its member alone is lost
    idx, res, reasons, delivered = run(path, qwen3vl, cpu_decoder)
    assert reasons == {"s06": "tar_header_too_large"} and len(delivered) == 19 and not idx.truncated


@pytest.mark.parametrize("layout", ["1.0", "0.1", "0.0", "gnu"])
def test_sparse_members_are_counted_under_their_real_names(tmp_path, photo, qwen3vl, cpu_decoder, layout):
    path = str(tmp_path / "sparse.tar")
    if layout == "gnu":
        hostile.write_gnu_sparse(path, photo)
    else:
        hostile.write_pax_sparse(path, photo, layout)
    idx, res, reasons, delivered = run(path, qwen3vl, cpu_decoder)
    assert [s.key for s in idx.samples] == ["a", "sparse", "b"]  # no phantom GNUSparseFile.N/ sample
    assert reasons == {"sparse": "sparse_member"} and delivered == ["a", "b"]


def test_a_shard_with_no_member_is_counted(tmp_path, photo, qwen3vl, cpu_decoder):
    zeros = hostile.write_zero_filled(str(tmp_path / "zeros.tar"), 16 * MiB)
    empty = str(tmp_path / "empty.tar")
    open(empty, "wb").close()
    dirs = str(tmp_path / "dirs.tar")
    with tarfile.open(dirs, "w") as tar:
        info = tarfile.TarInfo("only/")
        info.type = tarfile.DIRTYPE
        tar.addfile(info)
    for path, says in ((zeros, "all 16777216 bytes are zero"), (empty, "ends without"), (dirs, "all directories")):
        idx, res, reasons, delivered = run(path, qwen3vl, cpu_decoder)
        assert list(reasons.values()) == ["unreadable_tar"] and not delivered
        assert says in res.accounting.log[0].detail


def rewrite_caption(path: str, photo: bytes, caption: bytes) -> None:
    """The shard written again in place, one caption longer (same file size: tar pads to blocks)."""
    size = os.path.getsize(path)
    write_tar(path, [m for i in range(4) for m in good(f"s{i}", photo, caption.decode() if i == 1 else "A cat.")])
    assert os.path.getsize(path) == size
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # a coarse clock may not have moved


def test_a_shard_rewritten_after_indexing_is_not_read(tmp_path, photo, qwen3vl, cpu_decoder):
    path = write_tar(tmp_path / "s.tar", [m for i in range(4) for m in good(f"s{i}", photo)])
    idx = index_shard(path)
    rewrite_caption(path, photo, b"A much longer caption than the one indexed." * 5)
    _, res, reasons, delivered = run(path, qwen3vl, cpu_decoder, index=idx)
    assert not delivered and set(reasons.values()) == {"shard_changed"} and len(reasons) == 4
    assert "changed since it was indexed" in res.accounting.log[0].detail
    _, _, reasons, delivered = run(path, qwen3vl, cpu_decoder)  # a new index reads the new bytes
    assert len(delivered) == 4 and not reasons


def test_a_shard_rewritten_while_an_item_is_read_costs_the_rest(tmp_path, photo):
    path = write_tar(tmp_path / "s.tar", [m for i in range(4) for m in good(f"s{i}", photo)])
    idx = index_shard(path)
    samples = read_samples(path, idx.samples, ReadLimits())
    assert not next(samples).problem
    rewrite_caption(path, photo, b"Another caption.")
    assert [r.problem for r in samples] == ["shard_changed"] * 3


def test_a_listing_of_a_rewritten_shard_is_not_used(tmp_path, photo):
    path = write_tar(tmp_path / "s.tar", [m for i in range(4) for m in good(f"s{i}", photo)])
    listings = ShardListings(str(tmp_path / "listings"))
    listings.index(path)
    rewrite_caption(path, photo, b"Another caption, longer than before.")
    again = listings.index(path)
    assert listings.listed == 2 and listings.loaded == 0
    (raw,) = [r for r in read_samples(path, again.samples, ReadLimits()) if r.key == "s1"]
    assert raw.text == "Another caption, longer than before." and not raw.problem
    loaded = ShardListings(str(tmp_path / "listings")).index(path)
    assert loaded.samples[0].stamp == again.samples[0].stamp and loaded.stamp == again.stamp


def test_one_file_named_several_ways_is_read_once(tmp_path, photo, monkeypatch, caplog):
    real = tmp_path / "data"
    real.mkdir()
    path = write_tar(real / "a.tar", good("a", photo))
    write_tar(real / "b.tar", good("b", photo))
    (tmp_path / "alias").symlink_to(real, target_is_directory=True)
    os.link(path, tmp_path / "hard.tar")
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.WARNING, logger="vlmfeed.shards"):
        got = expand_shards(["data/a.tar", path, str(tmp_path / "alias" / "a.tar"), "hard.tar", "data/b.tar"])
    assert sorted(os.path.realpath(p) for p in got) == [os.path.realpath(path), os.path.realpath(real / "b.tar")]
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "named 4 ways" in warning and "hard.tar" in warning and "alias" in warning


# Keys (WebDataset's rule)

def test_a_caption_without_its_image_is_counted_not_trained_text_only(tmp_path, photo, qwen3vl, cpu_decoder):
    path = write_tar(tmp_path / "orphans.tar", hostile.orphan_members(photo))
    idx, res, reasons, delivered = run(path, qwen3vl, cpu_decoder)
    assert reasons == {"lonely": "missing_image", "mute": "missing_text"}
    assert delivered == ["a", "b", "chat"]  # a conversation that asks for no image is text-only by design
    assert len(next(s for s in res.samples if s.key == "chat").image_grid_thw) == 0
    text_only = write_tar(tmp_path / "text.tar", [(f"t{i}.txt", b"Just text.") for i in range(3)])
    _, _, reasons, delivered = run(text_only, qwen3vl, cpu_decoder)  # a text dataset stays one
    assert len(delivered) == 3 and not reasons


def test_nfd_captions_meet_their_nfc_images(tmp_path, photo, qwen3vl, cpu_decoder):
    path = write_tar(tmp_path / "unicode.tar", hostile.unicode_members(photo))
    idx, res, reasons, delivered = run(path, qwen3vl, cpu_decoder)
    assert not reasons and len(delivered) == 4
    assert all(unicodedata.is_normalized("NFC", k) and len(s.image_grid_thw) == 1
               for k, s in zip(delivered, sorted(res.samples, key=lambda s: s.key)))


@pytest.mark.parametrize("victim", [0, 2, 5])
def test_a_lost_image_header_never_leaves_its_caption_to_train_alone(tmp_path, photo, qwen3vl, cpu_decoder, victim):
    # Mixed member sets, so that no usual set of extensions tells which neighbour lost a member.
    members = [m for i in range(6) for m in good(f"s{i}", photo) + ([(f"s{i}.json", b'{"url": "x"}')] if i % 2 else [])]
    path = write_tar(tmp_path / "mixed.tar", members)
    data = bytearray(open(path, "rb").read())
    at = hostile.header_offset(path, f"s{victim}.jpg")
    data[at:at + 512] = os.urandom(512)
    open(path, "wb").write(bytes(data))
    idx, res, reasons, delivered = run(path, qwen3vl, cpu_decoder)
    assert f"s{victim}" not in delivered and reasons.get(f"s{victim}") in ("corrupt_tar_header", "missing_image")
    assert all(len(s.image_grid_thw) == 1 for s in res.samples)


def test_dotted_names_follow_webdatasets_key_rule(tmp_path, photo, qwen3vl, cpu_decoder):
    from webdataset.tariterators import base_plus_ext

    for name in ("img.001.jpg", "k.jpg.txt", "dir.v2/x.TAR.gz", "a/b/c.0.JPG", "cap.en.txt"):
        key, ext = base_plus_ext(name)
        assert split_name(name) == (key, ext.lower())
    path = write_tar(tmp_path / "dotted.tar", hostile.dotted_members(photo))
    idx, res, reasons, delivered = run(path, qwen3vl, cpu_decoder)
    assert [s.key for s in idx.samples] == ["a", "img", "k", "cap", "b"]
    assert reasons == {"img": "dotted_text_member", "k": "dotted_text_member"} and delivered == ["a", "b", "cap"]
    details = {r.key: r.detail for r in res.accounting.log}
    assert ".001.txt, .002.txt" in details["img"] and ".jpg.txt" in details["k"] and "first dot" in details["k"]
    assert res.accounting.ignored_members["unused_dotted_text"] == 1  # cap.en.txt beside cap.txt


# The scan against tarfile

def tarfile_members(path: str) -> list[tarfile.TarInfo]:
    """What tarfile lists: it stops quietly at a bad header, or says the file is no tar."""
    try:
        with tarfile.open(path) as tar:
            return list(tar)
    except tarfile.ReadError:
        return []


def scan_entries(path: str) -> list:
    with open_archive(path) as archive:
        return [e for e in Scan(archive) if isinstance(e, tarscan.Entry)]


def test_every_member_tarfile_finds_the_scan_finds(tmp_path, photo):
    paths = hostile.tar_edge_cases(str(tmp_path), photo, pad=MiB)
    paths += [hostile.write_corrupt_header(str(tmp_path / "corrupt.tar"), photo),
              hostile.write_links(str(tmp_path / "links.tar"), photo),
              hostile.write_gzip(str(tmp_path / "plain.tar.gz"), photo),
              write_tar(tmp_path / "exceptions.tar", hostile.exception_members(photo)),
              write_tar(tmp_path / "long.tar", good("crawl/" + "x" * 150 + "/0001", photo))]
    stops_early = {"pax-size.tar", "corrupt.tar"}  # tarfile ends at the bad header, quietly
    for path in paths:
        theirs, ours = tarfile_members(path), scan_entries(path)
        name = os.path.basename(path)
        assert len(ours) >= len(theirs) if name in stops_early else len(ours) == len(theirs), name
        for t, e in zip(theirs, ours):
            assert (e.name, e.kind == "sparse") == (t.name, t.issparse()), name
            if e.kind in ("file", "special") and not e.problem:
                assert (e.offset, e.size) == (t.offset_data, t.size), (name, e.name)
            if e.kind in ("hardlink", "symlink"):
                assert e.linkname == t.linkname, (name, e.name)


def test_a_key_repeated_in_one_item_gives_each_sample_its_own_ordinal():
    """Both samples of duplicates.tar's repeated key ``x`` must be told apart in a restored chain."""
    from types import SimpleNamespace

    from datasvc.stream.producer import mark_samples

    item = WorkItem("d.tar", 0, (SampleIndex("x", ()), SampleIndex("y", ()), SampleIndex("x", ())), epoch=3,
                    ordinals=(51, 52, 53))
    samples = [SimpleNamespace(key=k) for k in ("x", "y", "x")]
    mark_samples(item, samples)
    assert [(s.epoch, s.ordinal) for s in samples] == [(3, 51), (3, 52), (3, 53)]
