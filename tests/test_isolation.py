"""One bad sample costs only itself: items that raise are redone sample by sample, samples that
kill their actor are found by bisection and quarantined, decoding stays under a memory budget
(tested under real limits on the actors' memory), and a failure budget stops a run that rejects
too much. Real Ray, real DALI, shards written here; read == delivered + quarantined + skipped."""
import io
import tarfile
import uuid
from collections import Counter

import pytest
from PIL import Image

from datasvc.config import BudgetConfig, PoolConfig, ServiceConfig
from datasvc.read.shards import index_shard
from datasvc.samples import encode_image, real_photos
from datasvc.service.client import DataService
from datasvc.service.feeder import EndOfData
from datasvc.stream.process import quarantine_item, split_item
from datasvc.stream.producer import BlockProducer, DataServiceError
from datasvc.stream.recovery import Recovery, Task
from datasvc.tools.bench.faults import faults
from datasvc.wire import WorkItem

SMALL = {"min_pixels": 32 * 32, "max_pixels": 128 * 128}
MiB = 1 << 20


def cfg(shards, **kw):
    base = dict(shards=tuple(shards), seq_len=512, micro_batch_size=1, samples_per_item=4, items_per_block=2,
                pipeline_options=SMALL, epochs=1,
                pool=PoolConfig(autoscale_interval_s=60.0, min_actors=1, max_actors=1))
    base.update(kw)
    return ServiceConfig(**base)


def hooked(hook) -> PoolConfig:
    """One actor that runs ``hook`` with every work item."""
    return PoolConfig(autoscale_interval_s=60.0, min_actors=1, max_actors=1, actor_hook=hook)


def big_png(side: int, seed: int) -> bytes:
    """A large image that compresses to little (as crawled scans and screenshots do)."""
    img = Image.new("RGB", (side, side), (seed * 40 % 256, 90, 200))
    img.paste((255, 255, 255), (0, 0, side // 3, side // 3))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def write_shard(path, samples):
    """samples: [(key, [image bytes...])]; each gets a caption."""
    with tarfile.open(path, "w") as tar:
        for key, images in samples:
            members = [(f"{key}.{i}.png" if len(images) > 1 else f"{key}.png", data) for i, data in enumerate(images)]
            members.append((f"{key}.txt", f"sample {key}".encode()))
            for name, data in members:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return str(path)


@pytest.fixture(scope="module")
def photos():
    return [encode_image(img) for _, img, _ in real_photos()[:6]]


def drain(client):
    out = []
    try:
        while True:
            out.append(next(client))
    except EndOfData:
        return out


def run(config):
    svc = DataService(config, run=f"i{uuid.uuid4().hex[:6]}")
    try:
        got = Counter(k for b in drain(svc.client(0, output="numpy")) for k in b.sample_keys)
        return got, svc.stats()
    finally:
        svc.shutdown()


def balanced(acct):
    return acct.balanced()


def rejected(stats):
    return {r.key: r.reason for rank in stats.ranks for r in rank.stream.accounting.log}


# ---- decisions, without Ray ----------------------------------------------------------------------
def test_recovery_bisects_down_to_the_sample_that_kills_its_actor(photo_shards):
    idx = index_shard(photo_shards[0])
    item = WorkItem(idx.path, 0, tuple(idx.samples[:5]))
    killer = idx.samples[3].key
    rec, done = Recovery(rank=0), []
    rec.backlog.append(Task("root", item))
    deaths = 0
    while rec.backlog:
        task = rec.backlog.pop(0)
        if any(s.key == killer for s in task.item.samples):
            deaths += 1
            rec.died([task], "SIGKILL", done)
        else:  # stands in for the actor's result: every sample delivered
            rec.finish(task, quarantine_item(task.item, "ok", ""), done)
    (key, result), = done
    assert key == "root" and result.item_id == item.item_id
    reasons = {r.key: r.reason for r in result.accounting.log}
    assert reasons[killer] == "worker_died" and Counter(reasons.values()) == Counter({"ok": 4, "worker_died": 1})
    assert result.accounting.read == 5
    assert deaths == 2 * 4  # two tries at each size: 5 samples, 3, 2, 1
    assert [len(p.samples) for p in split_item(item, 2)] == [2, 3]
    assert [p.first for p in split_item(item, 9)] == [0, 1, 2, 3, 4]


def test_a_death_is_charged_only_to_an_item_that_died_alone(photo_shards):
    """An actor that dies holding two items names neither (the one it finished may have lost its
    result with it): both are redone alone, and only deaths alone count."""
    idx = index_shard(photo_shards[0])
    a, b = (WorkItem(idx.path, i, (idx.samples[i],)) for i in (0, 1))
    rec, done = Recovery(rank=0), []
    ta, tb = Task("a", a), Task("b", b)
    for _ in range(3):
        rec.died([tb, ta], "SIGKILL", done)
        assert rec.backlog == [tb, ta] and ta.solo and tb.solo
        rec.backlog.clear()
    assert done == [] and ta.deaths == tb.deaths == 0
    for _ in range(2):
        rec.died([ta], "SIGKILL", done)
        rec.backlog.clear()
    assert [k for k, _ in done] == ["a"] and ta.deaths == 2 and tb.deaths == 0
    assert [r.reason for r in done[0][1].accounting.log] == ["worker_died"]


def test_failure_budget_stops_the_run_naming_the_top_reasons(tmp_path, photos):
    bad = [(f"b{i:02d}", [b"not an image"]) for i in range(6)]
    good = [(f"g{i:02d}", [photos[i % len(photos)]]) for i in range(2)]
    shard = write_shard(tmp_path / "mostly-bad.tar", good[:1] + bad + good[1:])
    in_a_row = r"5 samples in a row were rejected \(max_consecutive_rejections=5\); top reasons: undecodable_image x6"
    with pytest.raises(DataServiceError, match=in_a_row):
        list(BlockProducer(cfg([shard], budget=BudgetConfig(max_consecutive_rejections=5))).micro_batches())
    with pytest.raises(DataServiceError, match=r"6 of 8 samples read \(75.0%\).*max_rejection_rate=0.5"):
        list(BlockProducer(cfg([shard], budget=BudgetConfig(rejection_rate_min_samples=8))).micro_batches())
    # The defaults are generous: this shard streams, its bad samples counted.
    producer = BlockProducer(cfg([shard]))
    delivered = sum(len(b.sample_keys) for b, _ in producer.micro_batches())
    acct = producer.stats().accounting
    assert delivered == 2 and acct.quarantined == {"undecodable_image": 6} and balanced(acct)
    with pytest.raises(ValueError, match="max_rejection_rate must be in"):
        cfg([shard], budget=BudgetConfig(max_rejection_rate=0))


# ---- on a real cluster ---------------------------------------------------------------------------
def test_an_item_that_raises_is_redone_sample_by_sample(tmp_path, photos, ray_local):
    shard = write_shard(tmp_path / "s.tar", [(f"k{i}", [photos[i % len(photos)]]) for i in range(8)])
    victim = f"{shard}/k2"
    got, stats = run(cfg([shard], pool=hooked(faults(raise_on_key=victim))))
    assert got == Counter({f"{shard}/k{i}": 1 for i in range(8) if i != 2})
    assert rejected(stats) == {"k2": "worker_error"}
    assert "injected failure" in stats.ranks[0].stream.accounting.log[0].detail
    assert balanced(stats.accounting) and stats.ranks[0].items_split == 1


def test_samples_that_kill_their_actor_are_quarantined_and_the_stream_goes_on(tmp_path, photos, ray_local):
    """One sample SIGKILLs its actor; another decodes past the actor's memory limit, which kills it
    as the kernel kills a process over its cgroup's limit. Both are found and quarantined as
    worker_died; every other sample is delivered."""
    samples = [(f"k{i}", [photos[i % len(photos)]]) for i in range(8)]
    samples[5] = ("k5", [big_png(4000, s) for s in range(4)])  # 4 x 48 MB decoded: ~240 MiB at 4-6 bytes a pixel
    shard = write_shard(tmp_path / "s.tar", samples)
    hook = faults(kill_on_key=f"{shard}/k1", rss_headroom_bytes=150 * MiB)
    got, stats = run(cfg([shard], samples_per_item=2, pool=hooked(hook)))
    assert got == Counter({f"{shard}/k{i}": 1 for i in range(8) if i not in (1, 5)})
    assert rejected(stats) == {"k1": "worker_died", "k5": "worker_died"}
    assert balanced(stats.accounting)
    assert stats.ranks[0].actors_replaced >= 4


def test_decoding_stays_under_the_budget_within_a_real_memory_limit(tmp_path, photos, ray_local):
    """Actors killed once their memory grows 300 MiB: an item of four large images decodes in parts
    that fit the 200 MiB budget, and a sample that alone would not fit is rejected sample_too_large
    before any of it is decoded; no actor dies. Without the budget the same item kills its actor."""
    samples = [(f"big{i}", [big_png(4000, i)]) for i in range(4)]  # ~100 MiB each to decode and resize
    samples += [("huge", [big_png(4000, s) for s in range(3)]), ("small", [photos[0]])]
    shard = write_shard(tmp_path / "s.tar", samples)
    limited = dict(samples_per_item=6, items_per_block=1, pool=hooked(faults(rss_headroom_bytes=300 * MiB)))
    got, stats = run(cfg([shard], budget=BudgetConfig(decoded_bytes_budget=200 * MiB), **limited))
    assert got == Counter({f"{shard}/{k}": 1 for k in ("big0", "big1", "big2", "big3", "small")})
    assert rejected(stats) == {"huge": "sample_too_large"}
    assert "> decoded_bytes_budget 200 MiB" in stats.ranks[0].stream.accounting.log[0].detail
    assert stats.ranks[0].actors_replaced == 0 and balanced(stats.accounting)

    got, stats = run(cfg([shard], **limited))  # the default budget (2 GiB) is beyond this actor's limit
    assert stats.ranks[0].actors_replaced >= 1 and balanced(stats.accounting)
