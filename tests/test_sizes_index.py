"""The shared sizes index of vision-balanced planning (``datasvc.pack.sizes``): the plan from the index
is the plan from headers, bit for bit; a feeder that finds every shard indexed reads no header to
plan; hostile shards keep every rejection and its reason; a changed setting or a damaged entry is
planned from headers again."""
import dataclasses
import os

import numpy as np
import pytest

from datasvc.config import ServiceConfig
from datasvc.pack.epoch import EpochPlan
from datasvc.pack.sizes import HeaderProcessor, SizesIndex, build_index
from datasvc.samples import encode_image, real_photos
from datasvc.stream.balanced import BalancedProducer
from datasvc.tools.bench.hostile import write_hostile_set
from tests.test_balance import stream_config, write_mixed_shards


@pytest.fixture(scope="module")
def mixed_shards(tmp_path_factory):
    return write_mixed_shards(tmp_path_factory.mktemp("mixed-sizes"), n=48, seed=2)


def stream(cfg, rank):
    return [(b.sample_keys, b.tokens.copy(), b.image_grid_thw.copy(), p) for b, p in
            BalancedProducer(cfg, rank).micro_batches()]


def same(a, b):
    assert len(a) == len(b) and len(a) > 0
    for (ka, ta, ga, pa), (kb, tb, gb, pb) in zip(a, b):
        assert ka == kb and pa == pb and np.array_equal(ta, tb) and np.array_equal(ga, gb)


def test_the_plan_from_the_index_is_the_plan_from_headers(mixed_shards, tmp_path, monkeypatch):
    plain = stream_config(mixed_shards)
    indexed = dataclasses.replace(plain, balance=dataclasses.replace(plain.balance, sizes_index=str(tmp_path / "sizes")))
    first = BalancedProducer(indexed, 0)
    same([(b.sample_keys, b.tokens.copy(), b.image_grid_thw.copy(), p) for b, p in first.micro_batches()],
         stream(plain, 0))
    built = first.stats().balance
    assert built.sizes_built == len(mixed_shards) and built.sizes_loaded == 0
    entries = os.listdir(tmp_path / "sizes")  # per shard: its sizes and its tar listing
    assert len(entries) == 2 * len(mixed_shards)
    assert len([e for e in entries if e.endswith(".listing.json")]) == len(mixed_shards)

    # Rank 1's feeder finds every shard indexed: planning reads no header at all.
    reference = stream(plain, 1)

    def no_headers(*_a, **_k):
        raise AssertionError("a header was read to plan")

    def no_tar_scan(*_a, **_k):
        raise AssertionError("a tar was scanned to list its samples")

    monkeypatch.setattr("datasvc.pack.headers.encode_from_headers", no_headers)
    monkeypatch.setattr("datasvc.read.listings.index_shard", no_tar_scan)
    second = BalancedProducer(indexed, 1)
    same([(b.sample_keys, b.tokens.copy(), b.image_grid_thw.copy(), p) for b, p in second.micro_batches()],
         reference)
    assert (second.stats().balance.sizes_built, second.stats().balance.sizes_loaded) == (0, len(mixed_shards))


def test_hostile_shards_keep_every_rejection_and_reason(tmp_path):
    photo = encode_image(real_photos()[1][1])
    good = write_mixed_shards(tmp_path / "good", n=16, seed=3)[0]
    paths, _ = write_hostile_set(str(tmp_path / "hostile"), photo, good, bomb_side=3000)
    cfg = ServiceConfig(shards=tuple(paths), seq_len=1024, micro_batch_size=1, samples_per_item=3,
                        pipeline_options={"max_pixels": 512 * 512})
    plan = EpochPlan(cfg)
    headers = HeaderProcessor(cfg)
    report = build_index(cfg, str(tmp_path / "sizes"), plan.indexes)
    assert report["built"] == len(plan.indexes) and report["already_there"] == 0
    sizes = SizesIndex(cfg, str(tmp_path / "sizes"), plan.indexes)
    reasons = set()
    for item in plan._items:
        want, got = headers(item), sizes(item)
        assert [(s.key, s.num_tokens, s.image_grid_thw.tolist(), s.num_patches) for s in got.samples] == \
               [(s.key, s.num_tokens, s.image_grid_thw.tolist(), s.num_patches) for s in want.samples]
        assert [(r.key, r.reason) for r in got.accounting.log] == [(r.key, r.reason) for r in want.accounting.log]
        assert got.accounting.read == want.accounting.read
        reasons.update(r.reason for r in got.accounting.log)
    assert sizes.built == 0 and sizes.loaded == len({i.shard for i in plan._items})
    assert len(reasons) >= 3  # the hostile set rejects for several reasons, each kept by name


def test_a_changed_setting_or_a_damaged_entry_is_planned_again(mixed_shards, tmp_path):
    cfg = ServiceConfig(shards=tuple(mixed_shards[:1]), seq_len=1024, micro_batch_size=1,
                        pipeline_options={"max_pixels": 512 * 512})
    plan = EpochPlan(cfg)
    directory = str(tmp_path / "sizes")
    assert build_index(cfg, directory, plan.indexes)["built"] == 1
    assert build_index(cfg, directory, plan.indexes) == {"shards": 1, "built": 0, "already_there": 1,
                                                        "directory": directory}
    smaller = dataclasses.replace(cfg, pipeline_options={"max_pixels": 256 * 256})
    assert build_index(smaller, directory, EpochPlan(smaller).indexes)["built"] == 1  # its own entry
    entry = SizesIndex(cfg, directory, plan.indexes).entry_path(mixed_shards[0])
    with open(entry, "w") as f:
        f.write('{"samples": [')  # cut short
    assert build_index(cfg, directory, plan.indexes)["built"] == 1


def test_vlmfeed_sizes_fills_the_index_a_balanced_job_reads(mixed_shards, tmp_path, monkeypatch):
    import json
    import subprocess
    import sys

    out = tmp_path / "sizes"
    cmd = [sys.executable, "-m", "datasvc.tools.cli", "sizes", *mixed_shards, "--out", str(out),
           "--max-pixels", str(512 * 512), "--processes", "2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["built"] == len(mixed_shards) and "shards indexed" in done.stderr
    again = json.loads(subprocess.run(cmd, capture_output=True, text=True, timeout=300).stdout)
    assert again["built"] == 0 and again["already_there"] == len(mixed_shards)
    monkeypatch.setattr("datasvc.pack.headers.encode_from_headers", lambda *a, **k: pytest.fail("header read"))
    plain = stream_config(mixed_shards)
    cfg = dataclasses.replace(plain, balance=dataclasses.replace(plain.balance, sizes_index=str(out)))
    producer = BalancedProducer(cfg, 0)
    assert len(list(producer.micro_batches())) > 0
    assert (producer.stats().balance.sizes_built, producer.stats().balance.sizes_loaded) == (0, len(mixed_shards))


def test_a_kept_listing_is_the_tar_scan_and_is_dropped_when_the_shard_changes(tmp_path, caplog):
    """Hostile shards (truncated, repeated keys, damaged headers, unsafe names) list the same from the
    directory as from their tar; a rewritten shard or a damaged entry is scanned again."""
    from datasvc.read.listings import ShardListings, index_shards
    from datasvc.read.shards import index_shard

    photo = encode_image(real_photos()[1][1])
    good = write_mixed_shards(tmp_path / "good", n=16, seed=3)[0]
    paths, _ = write_hostile_set(str(tmp_path / "hostile"), photo, good, bomb_side=3000)
    directory = str(tmp_path / "sizes")
    first = ShardListings(directory)
    assert [first.index(p) for p in paths] == [index_shard(p) for p in paths]
    assert first.listed == len(paths) and first.loaded == 0
    again = ShardListings(directory)
    kept = [again.index(p) for p in paths]
    assert again.loaded == len(paths) and again.listed == 0
    assert kept == [index_shard(p) for p in paths] == index_shards(paths, directory)
    assert any(i.truncated for i in kept) and any(s.repeated for i in kept for s in i.samples)

    shard = paths[0]
    with open(shard, "ab") as f:  # rewritten: one more block at the end
        f.write(b"\0" * 512)
    changed = ShardListings(directory)
    assert changed.index(shard) == index_shard(shard) and changed.listed == 1
    with open(changed.entry_path(shard), "w") as f:
        f.write('{"format": 1, "samples": [')  # cut short
    damaged = ShardListings(directory)
    assert damaged.index(shard) == index_shard(shard) and damaged.listed == 1
    assert "unreadable" in caplog.text
