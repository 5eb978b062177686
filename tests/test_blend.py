"""Blends: exact proportions at every prefix, deterministic and resumable orders, repeats and
subsampling per source, disjoint ranks, and the two ways to write a blend."""
import os

import numpy as np
import pytest

from datasvc.read.blend import (BlendSource, epoch_order, interleave, parse_blend, per_source, quotas, rank_order,
                           source_items)


def test_every_prefix_holds_each_share_to_within_one_item():
    counts = [700, 200, 100]
    order = interleave(counts)
    assert np.bincount(order).tolist() == counts
    taken = np.cumsum(np.eye(3, dtype=np.int64)[order], axis=0)
    ideal = np.outer(np.arange(1, len(order) + 1), np.asarray(counts) / sum(counts))
    assert np.abs(taken - ideal).max() < 1


def test_quotas_add_up_exactly():
    assert quotas([0.7, 0.3], 10) == [7, 3]
    assert quotas([1, 1, 1], 10) == [4, 3, 3] and sum(quotas([0.33, 0.33, 0.34], 1001)) == 1001
    assert quotas([1, 0], 5) == [5, 0]


def test_orders_are_pure_functions_of_their_arguments():
    sizes, weights = [50, 20], [0.7, 0.3]
    a = epoch_order(sizes, weights, seed=3, epoch=1)
    assert a == epoch_order(sizes, weights, seed=3, epoch=1)  # what an exact resume relies on
    assert a != epoch_order(sizes, weights, seed=3, epoch=2) and a != epoch_order(sizes, weights, seed=4, epoch=1)
    assert per_source(a, ["big", "small"]) == {"big": 49, "small": 21}


def test_a_small_source_repeats_only_after_all_its_items_and_a_big_one_goes_on_where_it_stopped():
    sizes, weights = [10, 1000], [0.5, 0.5]
    stream = [i for e in range(3) for s, i in epoch_order(sizes, weights, 0, e, per_epoch=40) if s == 0]
    assert len(stream) == 60
    for k in range(0, 60, 10):  # each pass over the small source is a permutation of its 10 items
        assert sorted(stream[k:k + 10]) == list(range(10))
    big = [i for e in range(3) for s, i in epoch_order(sizes, weights, 0, e, per_epoch=40) if s == 1]
    assert len(set(big)) == 60  # 60 of 1000 drawn over three epochs, none twice
    assert np.array_equal(source_items(7, 1, 0, 0, 21)[:7], np.random.default_rng([1, 7, 0, 0]).permutation(7))


def test_ranks_split_each_epoch_disjointly():
    sizes, weights = [33, 17, 9], [0.5, 0.3, 0.2]
    whole = epoch_order(sizes, weights, 5, 0)
    parts = [rank_order(sizes, weights, 5, 0, r, 4) for r in range(4)]
    assert sorted(p for part in parts for p in part) == sorted(whole)
    assert sum(len(p) for p in parts) == len(whole) == sum(sizes)


def test_a_zero_weight_source_is_never_drawn_and_an_empty_weighted_one_fails():
    assert {s for s, _ in epoch_order([5, 0], [1.0, 0.0], 0, 0)} == {0}
    with pytest.raises(ValueError, match="no items"):
        epoch_order([5, 0], [0.5, 0.5], 0, 0)


def test_blend_specs_on_the_command_line_and_in_yaml(tmp_path):
    assert parse_blend("data/a/*.tar:0.7,data/b/{0..3}.tar:0.3") == [
        BlendSource("data/a/*.tar", ("data/a/*.tar",), 0.7), BlendSource("data/b/{0..3}.tar", ("data/b/{0..3}.tar",), 0.3)]
    assert parse_blend("laion=s3://bucket/laion/*.tar:2, vqa=vqa.tar:1")[0] == \
        BlendSource("laion", ("s3://bucket/laion/*.tar",), 2.0)
    path = tmp_path / "blend.yaml"
    path.write_text("sources:\n  - {name: laion, shards: 'a/*.tar', weight: 0.7}\n"
                    "  - name: vqa\n    shards: [b/0.tar, b/1.tar]\n    weight: 0.3\n")
    assert parse_blend(str(path)) == [BlendSource("laion", ("a/*.tar",), 0.7),
                                      BlendSource("vqa", ("b/0.tar", "b/1.tar"), 0.3)]


@pytest.mark.parametrize("spec, match", [("a.tar", "PATTERN:WEIGHT"), ("a.tar:x", "not a number"),
                                         ("a.tar:-1", ">= 0"), ("a.tar:0,b.tar:0", "add up to 0"),
                                         ("x=a.tar:1,x=b.tar:1", "repeat"), ("missing.yaml", "does not exist")])
def test_bad_blends_fail_fast_saying_what_to_change(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_blend(spec)


def test_blended_work_items_name_their_source():
    from datasvc.read.blend import BlendedItems
    from datasvc.wire import WorkItem

    laion = [WorkItem(f"laion/{i}.tar", 0, ()) for i in range(12)]
    vqa = [WorkItem(f"vqa/{i}.tar", 16, ()) for i in range(3)]
    blend = BlendedItems([("laion", 0.75, laion), ("vqa", 0.25, vqa)], seed=1, dp_size=2, per_epoch=16)
    got = [blend.items(0, r) for r in range(2)]
    assert [len(g) for g in got] == [blend.items_per_epoch(r) for r in range(2)] == [8, 8]
    assert sum(blend.source_of(i) == "vqa" for g in got for i in g) == 4
    assert blend.shares(0, 0) == {"laion": sum(i.shard.startswith("laion") for i in got[0]), "vqa": 8 - sum(
        i.shard.startswith("laion") for i in got[0])}
    assert got == [BlendedItems([("laion", 0.75, laion), ("vqa", 0.25, vqa)], 1, 2, 16).items(0, r) for r in range(2)]


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory):
    from datasvc.samples import write_photo_shards

    root = tmp_path_factory.mktemp("blend")
    a = write_photo_shards(str(root / "photos"), samples_per_shard=4, copies=1, conversations=False)
    b = write_photo_shards(str(root / "pairs"), samples_per_shard=3, copies=1)[-2:]  # the two-image ones
    return f"photos={root}/photos/*.tar:0.75,pairs={root}/pairs/{{{os.path.basename(b[0])[:-4]},"\
           f"{os.path.basename(b[1])[:-4]}}}.tar:0.25", root


def blend_config(spec, **kw):
    from datasvc.config import ServiceConfig

    return ServiceConfig(shards=(), blend=spec, seq_len=2048, micro_batch_size=2, samples_per_item=2,
                         items_per_block=4, epochs=2, pipeline_options={"max_pixels": 128 * 128,
                                                                        "min_pixels": 32 * 32}, **kw)


def test_the_epoch_plan_draws_by_the_weights(two_sources):
    from datasvc.pack.epoch import EpochPlan

    spec, root = two_sources
    cfg = blend_config(spec, dp_size=2)
    assert len(cfg.shards) == 2  # shards default to the blend's patterns
    plan = EpochPlan(cfg)
    n = len(plan._items)
    for epoch in range(2):
        got = [plan.items(epoch, r) for r in range(2)]
        assert sum(len(g) for g in got) == n and [len(g) for g in got] == [plan.items_per_epoch(r) for r in range(2)]
        pairs = sum("/pairs/" in i.shard for g in got for i in g)
        assert pairs == quotas([0.75, 0.25], n)[1]
    assert cfg.fingerprint() != blend_config(spec.replace("0.25", "0.5"), dp_size=2).fingerprint()


def test_a_blended_stream_resumes_exactly_and_counts_by_source(two_sources):
    from collections import Counter

    from datasvc.stream.producer import BlockProducer

    spec, root = two_sources
    cfg = blend_config(spec)
    first = BlockProducer(cfg)
    whole = [(b.sample_keys, p) for b, p in first.micro_batches()]
    per_source = Counter("pairs" if "/pairs/" in k else "photos" for keys, _ in whole for k in keys)
    assert per_source["pairs"] and per_source["photos"] > per_source["pairs"]
    stats = first.stats()  # the producer's own per-source accounting
    assert {name: a.delivered for name, a in stats.sources.counts.items()} == dict(per_source)
    assert sum(a.read for a in stats.sources.counts.values()) == stats.accounting.read
    assert stats.sources.weights == {"photos": 0.75, "pairs": 0.25}
    cut = len(whole) // 2
    producer = BlockProducer(cfg)
    it = producer.micro_batches()
    for _ in range(cut):
        next(it)
    saved = producer.position()
    producer.stop()
    rest = [b.sample_keys for b, _ in BlockProducer(cfg, start=saved).micro_batches()]
    assert rest == [keys for keys, _ in whole[cut:]]


def test_brace_alternatives_stay_inside_their_part():
    assert [s.shards for s in parse_blend("a/{0,1}.tar:1,b/{2..3}.tar:1")] == [("a/{0,1}.tar",), ("b/{2..3}.tar",)]


def test_per_source_accounting(two_sources, tmp_path):
    import sys

    from datasvc.pack.epoch import EpochPlan
    from datasvc.read.blend import SourceCounts
    from datasvc.samples import real_photos
    from datasvc.stream.process import ItemProcessor

    sys.path.insert(0, os.path.dirname(__file__))
    from test_formats import write_img2dataset_shard

    spec, root = two_sources
    write_img2dataset_shard(str(tmp_path / "laion-0.tar"), [p for p in real_photos() if p[1].ndim == 3][:8])
    cfg = blend_config(f"{spec},laion={tmp_path}/laion-*.tar:1", filters=("similarity>=0.28",))
    plan = EpochPlan(cfg)
    counts, process = SourceCounts(plan.blend), ItemProcessor(cfg)
    read = {}
    for item in plan.items(0, 0):
        res = process(item)
        counts.add_item(item, res)
        counts.add_delivered([f"{s.shard}/{s.key}" for s in res.samples])
        read[plan.blend.source_of(item)] = read.get(plan.blend.source_of(item), 0) + len(item.samples)
    got = counts.totals().as_dict()
    assert {name: d["read"] for name, d in got.items() if d["read"]} == read
    assert got["laion"]["read"] > 8  # half the weight, an eighth of the items: its samples repeat
    assert 0 < got["laion"]["skipped_by_rule"]["filter:similarity>=0.28"] < got["laion"]["read"]
    for d in got.values():
        assert d["read"] == d["delivered"] + sum(d["quarantined"].values()) + sum(d["skipped_by_rule"].values())
    twice = counts.totals()
    twice.merge(counts.totals())
    assert twice.as_dict()["photos"]["delivered"] == 2 * got["photos"]["delivered"]
