"""The data service on a real local Ray cluster (2 CPUs) with real shards and real DALI."""
import threading
import time
import uuid
from collections import Counter

import numpy as np
import pytest
import ray

from datasvc.config import PoolConfig, ServiceConfig
from datasvc.read.shards import NoShardsError
from datasvc.service.client import DataService
from datasvc.service.feeder import DataServiceError, EndOfData

SMALL = {"min_pixels": 32 * 32, "max_pixels": 128 * 128}


def config(shards, **kw):
    base = dict(shards=tuple(shards), seq_len=256, micro_batch_size=1, samples_per_item=4, items_per_block=2,
                pipeline_options=SMALL, epochs=1, pool=actors())
    base.update(kw)
    return ServiceConfig(**base)


def actors(**kw) -> PoolConfig:
    """The preprocessing actors, not autoscaled during a test unless it says so."""
    return PoolConfig(**{"autoscale_interval_s": 60.0, **kw})


def expected_keys(shards):
    from datasvc.read.shards import index_shard

    return Counter(f"{s}/{x.key}" for s in shards for x in index_shard(s).samples)


def drain(client, limit=10_000):
    out = []
    try:
        for _ in range(limit):
            out.append(next(client))
    except EndOfData:
        pass
    return out


@pytest.fixture
def service(ray_local):
    started = []

    def make(cfg, **kw):
        svc = DataService(cfg, run=f"t{uuid.uuid4().hex[:8]}", **kw)
        started.append(svc)
        return svc

    yield make
    for s in started:
        s.shutdown()


@pytest.mark.parametrize("chain_blocks", [1, 3])
def test_dp_replicas_identical_and_disjoint(photo_shards, service, chain_blocks):
    cfg = config(photo_shards, dp_size=2, consumers_per_replica=2, micro_batch_size=2, chain_blocks=chain_blocks)
    svc = service(cfg)
    clients = {(r, c): svc.client(r, c, output="numpy") for r in range(2) for c in range(2)}
    got = {}
    threads = [threading.Thread(target=lambda k=k: got.__setitem__(k, drain(clients[k]))) for k in clients]
    [t.start() for t in threads]
    [t.join(timeout=120) for t in threads]
    for r in range(2):
        a, b = got[(r, 0)], got[(r, 1)]
        assert len(a) == len(b) > 0
        for x, y in zip(a, b):
            assert x.sample_keys == y.sample_keys
            assert np.array_equal(x.tokens, y.tokens) and np.array_equal(x.pixels, y.pixels)
    keys0 = Counter(k for b in got[(0, 0)] for k in b.sample_keys)
    keys1 = Counter(k for b in got[(1, 0)] for k in b.sample_keys)
    assert not set(keys0) & set(keys1)
    assert keys0 + keys1 == expected_keys(photo_shards)
    assert svc.stats().accounting.balanced()


def test_deterministic_and_exact_resume(photo_shards, service):
    cfg = config(photo_shards, epochs=2, seed=7)
    svc = service(cfg)
    reference = [b.sample_keys for b in drain(svc.client(0, output="numpy"))]
    svc.shutdown()
    assert len(reference) > 14
    svc = service(cfg)
    again = [b.sample_keys for b in drain(svc.client(0, output="numpy"))]
    svc.shutdown()
    assert again == reference

    svc = service(cfg)
    c = svc.client(0, output="numpy")
    first = [next(c).sample_keys for _ in range(10)]
    state = c.save_state()
    svc.shutdown()
    svc2 = service(cfg)
    c2 = svc2.client(0, output="numpy")
    c2.restore_state(state)
    rest = [b.sample_keys for b in drain(c2)]
    assert first + rest == reference


def test_killed_preprocessing_actor_loses_nothing(photo_shards, service):
    cfg = config(photo_shards, epochs=1, pool=actors(max_batches_ahead=2))
    svc = service(cfg)
    c = svc.client(0, output="numpy")
    batches = [next(c) for _ in range(3)]
    feeder = svc.feeders[0]
    for actor in ray.get(feeder.actor_handles.remote()):
        ray.kill(actor, no_restart=True)
    batches += drain(c)
    keys = Counter(k for b in batches for k in b.sample_keys)
    assert keys == expected_keys(photo_shards)
    stats = ray.get(feeder.stats.remote())
    assert stats.actors_replaced >= 1
    a = stats.stream.accounting
    assert a.read >= a.delivered == sum(keys.values())


def test_stalled_consumer_keeps_memory_bounded(photo_shards, service):
    cfg = config(photo_shards, epochs=None, pool=actors(max_batches_ahead=2, max_bytes_ahead=1 << 20))
    svc = service(cfg)
    c = svc.client(0, output="numpy")
    next(c)
    time.sleep(4)
    s1 = ray.get(svc.feeders[0].stats.remote())
    time.sleep(2)
    s2 = ray.get(svc.feeders[0].stats.remote())
    assert s1.queue_depth <= 2 and s2.queue_depth <= 2
    assert s2.bytes_ahead <= 1 << 20
    # Production stopped: nothing more was read while the consumer stalled.
    assert s2.stream.accounting.read == s1.stream.accounting.read
    assert s2.producer_blocked_s > s1.producer_blocked_s
    more = [next(c) for _ in range(30)]  # and it goes on after the stall
    assert len(more) == 30


def test_autoscaler_grows_when_starved_and_shrinks_when_blocked(photo_shards, service):
    cfg = config(photo_shards, epochs=None, pool=actors(min_actors=1, max_actors=2, autoscale_interval_s=0.5, max_batches_ahead=1),
                 pipeline_options={"max_pixels": 1024 * 1024}, samples_per_item=2)
    svc = service(cfg)
    c = svc.client(0, output="numpy")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        next(c)
        if any(d.action == "up" for d in ray.get(svc.feeders[0].stats.remote()).autoscale_decisions):
            break
    deadline = time.monotonic() + 30  # stalled consumer: the producer blocks on a full queue
    while time.monotonic() < deadline:
        decisions = ray.get(svc.feeders[0].stats.remote()).autoscale_decisions
        actions = [d.action for d in decisions]
        if "up" in actions and "down" in actions[actions.index("up"):]:
            break
        time.sleep(0.5)
    assert "up" in actions and "down" in actions[actions.index("up"):], decisions
    assert all(d.reason for d in decisions)


def test_clear_errors(tmp_path, photo_shards, service):
    with pytest.raises(NoShardsError, match="no shard files match"):
        service(config([str(tmp_path / "missing-{000..003}.tar")]))
    with pytest.raises(ValueError, match="unknown pipeline"):
        service(config(photo_shards, pipeline="nope"))
    with pytest.raises(ValueError, match="does not take these options.*max_pixel"):
        service(config(photo_shards, pipeline_options={"max_pixel": 4096}))
    with pytest.raises(ValueError, match="min_actors"):
        config(photo_shards, pool=actors(min_actors=3, max_actors=2))

    import tarfile, io
    bad = str(tmp_path / "allbad.tar")
    with tarfile.open(bad, "w") as tar:
        for i in range(5):
            for name, data in ((f"s{i}.jpg", b"not a jpeg"), (f"s{i}.txt", b"caption")):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    c = service(config([bad])).client(0, output="numpy")
    with pytest.raises(DataServiceError, match="rejected"):
        next(c)

    c = service(config(photo_shards[:1])).client(0, output="numpy")
    drain(c)
    with pytest.raises(EndOfData, match="exhausted"):
        next(c)


def test_blocks_spanning_epochs_deliver_each_sample_once_per_epoch_and_resume(photo_shards, service):
    cfg = config(photo_shards, epochs=2, seed=5, micro_batch_size=2, items_per_block=3, blocks_span_epochs=True)
    svc = service(cfg)
    batches = drain(svc.client(0, output="numpy"))
    svc.shutdown()
    reference = [b.sample_keys for b in batches]
    delivered = Counter(k for keys in reference for k in keys)
    want = expected_keys(photo_shards)
    assert delivered == Counter({k: 2 * n for k, n in want.items()})  # every sample, once per epoch

    svc = service(cfg)
    c = svc.client(0, output="numpy")
    first = [next(c).sample_keys for _ in range(7)]
    state = c.save_state()
    svc.shutdown()
    c2 = service(cfg).client(0, output="numpy")
    c2.restore_state(state)
    assert first + [b.sample_keys for b in drain(c2)] == reference

    # Per-epoch blocks end each epoch on part-empty rows of their own; spanning ones only the stream.
    per_epoch = service(config(photo_shards, epochs=2, seed=5, micro_batch_size=2, items_per_block=3))
    rows = drain(per_epoch.client(0, output="numpy"))
    fill = lambda bs: sum(b.real_tokens for b in bs) / sum(b.tokens.size for b in bs)
    assert len(batches) <= len(rows) and fill(batches) >= fill(rows)


@pytest.mark.parametrize("span", [False, True], ids=["per-epoch", "spanning"])
def test_chained_blocks_fill_rows_keep_epochs_and_resume_exactly(photo_shards, service, span):
    """A block's part-filled rows wait for the next block, across chains too, so only the stream's
    (per-epoch blocks: the epoch's) last rows are part empty; every sample still arrives once per
    epoch, and a restore anywhere replays its chain's earlier blocks, and reads the samples the chain
    before carried into it, to the same stream. chain_blocks bounds that work, not the rows' fill."""
    base = dict(epochs=2, seed=3, micro_batch_size=2, samples_per_item=2, items_per_block=2, blocks_span_epochs=span)
    cfg = config(photo_shards, chain_blocks=3, **base)
    assert cfg.fingerprint() != config(photo_shards, **base).fingerprint()
    svc = service(cfg)
    batches = drain(svc.client(0, output="numpy"))
    svc.shutdown()
    reference = [b.sample_keys for b in batches]
    want = expected_keys(photo_shards)
    assert Counter(k for keys in reference for k in keys) == Counter({k: 2 * n for k, n in want.items()})
    if not span:  # a chain ends with its epoch: all of epoch 0 arrives before any of epoch 1
        n, seen = sum(want.values()), []
        for keys in reference:
            seen.extend(keys)
            if len(seen) >= n:
                break
        assert len(seen) == n and Counter(seen) == want

    unchained = service(config(photo_shards, **base))
    loose = drain(unchained.client(0, output="numpy"))
    empty_rows = lambda bs: sum(int((b.num_samples == 0).sum()) for b in bs)
    assert [b.sample_keys for b in loose] == reference and empty_rows(batches) == empty_rows(loose)

    for cut in (3, 4, 7):  # restores at different places in and between chains
        svc = service(cfg)
        c = svc.client(0, output="numpy")
        first = [next(c).sample_keys for _ in range(cut)]
        state = c.save_state()
        svc.shutdown()
        c2 = service(cfg).client(0, output="numpy")
        c2.restore_state(state)
        assert first + [b.sample_keys for b in drain(c2)] == reference, f"restore after {cut} micro-batches"


def test_bad_chain_blocks_fails_fast(photo_shards):
    with pytest.raises(ValueError, match="chain_blocks must be >= 1"):
        config(photo_shards, chain_blocks=0)
