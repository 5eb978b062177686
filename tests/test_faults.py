"""Fault injection on a real local Ray cluster: killed feeders, processes killed by signal, clients
that restart from a saved state. Per epoch the delivered keys must equal the expected multiset."""
import json
import os
import signal
import time
import uuid
from collections import Counter

import pytest
import ray

from datasvc.config import DecodeConfig, PoolConfig, ServiceConfig
from datasvc.read.shards import index_shard
from datasvc.service.client import DataService
from datasvc.service.feeder import EndOfData
from datasvc.tools.bench.faults import faults

SMALL = {"min_pixels": 32 * 32, "max_pixels": 128 * 128}


def cfg(shards, **kw):
    base = dict(shards=tuple(shards), seq_len=256, micro_batch_size=1, samples_per_item=4, items_per_block=2,
                pipeline_options=SMALL, epochs=1, pool=actors())
    base.update(kw)
    return ServiceConfig(**base)


def actors(**kw) -> PoolConfig:
    """The preprocessing actors, not autoscaled during a test, two micro-batches ahead."""
    return PoolConfig(**{"autoscale_interval_s": 60.0, "max_batches_ahead": 2, **kw})


def expected(shards):
    return Counter(f"{s}/{x.key}" for s in shards for x in index_shard(s).samples)


def keys_of(batches):
    return Counter(k for b in batches for k in b.sample_keys)


def drain(client):
    out = []
    try:
        while True:
            out.append(next(client))
    except EndOfData:
        return out


@pytest.mark.parametrize("chain_blocks", [1, 3])
def test_killed_feeder_is_restarted_where_it_stood(photo_shards, ray_local, chain_blocks):
    """The restarted feeder resumes from the client's position, and the stream goes on exactly as an
    uninterrupted one (mid-chain: after replaying the chain's earlier blocks to rebuild the rows
    they held)."""
    config = cfg(photo_shards, micro_batch_size=2, chain_blocks=chain_blocks)
    svc = DataService(config, run=f"r{uuid.uuid4().hex[:6]}")
    try:
        reference = [b.sample_keys for b in drain(svc.client(0, output="numpy"))]
    finally:
        svc.shutdown()
    svc = DataService(config, run=f"f{uuid.uuid4().hex[:6]}")
    try:
        c = svc.client(0, output="numpy")
        got = [next(c)]  # with chains of 3 here: the restart lands in the middle of the first chain
        ray.kill(svc.feeders[0], no_restart=True)
        got += drain(c)
        assert keys_of(got) == expected(photo_shards)
        assert [b.sample_keys for b in got] == reference
    finally:
        svc.shutdown()


def test_preprocess_process_killed_by_signal(photo_shards, ray_local):
    svc = DataService(cfg(photo_shards), run=f"s{uuid.uuid4().hex[:6]}")
    try:
        c = svc.client(0, output="numpy")
        got = [next(c)]
        for actor in ray.get(svc.feeders[0].actor_handles.remote()):
            os.kill(ray.get(actor.pid.remote()), signal.SIGKILL)
        got += drain(c)
        assert keys_of(got) == expected(photo_shards)
        assert ray.get(svc.feeders[0].stats.remote()).actors_replaced >= 1
    finally:
        svc.shutdown()


def test_client_restart_from_checkpointed_state(photo_shards, ray_local, tmp_path):
    """A trainer rank dies; the job restarts from the loader state saved with its checkpoint."""
    config = cfg(photo_shards, epochs=2, seed=3)
    run = f"c{uuid.uuid4().hex[:6]}"
    svc = DataService(config, run=run)
    try:
        ref = [b.sample_keys for b in drain(svc.client(0, output="numpy"))]
    finally:
        svc.shutdown()
    svc = DataService(config, run=run)
    c = svc.client(0, output="numpy")
    first = [next(c).sample_keys for _ in range(7)]
    (tmp_path / "ckpt.json").write_text(json.dumps(c.save_state()))  # what Megatron's checkpoint stores
    c.close()
    svc.shutdown()  # the whole job goes down
    svc = DataService(config, run=run)
    try:
        c2 = svc.client(0, output="numpy")
        c2.restore_state(json.loads((tmp_path / "ckpt.json").read_text()))
        rest = [b.sample_keys for b in drain(c2)]
        assert first + rest == ref
        per_epoch = Counter(k for keys in ref for k in keys)
        assert set(per_epoch.values()) == {2}  # every sample exactly once per epoch
    finally:
        svc.shutdown()


def test_restore_with_a_different_config_fails_fast(photo_shards, ray_local):
    import pytest

    from datasvc.service.feeder import DataServiceError

    svc = DataService(cfg(photo_shards), run=f"d{uuid.uuid4().hex[:6]}")
    try:
        c = svc.client(0, output="numpy")
        next(c)
        state = c.save_state()
    finally:
        svc.shutdown()
    other = DataService(cfg(photo_shards, seq_len=512), run=f"e{uuid.uuid4().hex[:6]}")
    try:
        with pytest.raises(DataServiceError, match="different data config"):
            other.client(0, output="numpy").restore_state(state)
    finally:
        other.shutdown()


def test_actor_the_cluster_cannot_place_holds_no_work(photo_shards, ray_local):
    """Two actors that each need all the free CPUs: one never starts; the other does all the work."""
    deadline = time.monotonic() + 60  # actors killed by earlier tests release their CPUs lazily
    while int(ray.available_resources().get("CPU", 0)) < 1 and time.monotonic() < deadline:
        time.sleep(0.5)
    free = int(ray.available_resources().get("CPU", 0))
    assert free >= 1, "an earlier test left no CPU free"
    svc = DataService(cfg(photo_shards, pool=actors(min_actors=2, max_actors=2), decode=DecodeConfig(threads=free)),
                      run=f"p{uuid.uuid4().hex[:6]}")
    try:
        c = svc.client(0, output="numpy")
        got = drain(c)
        assert keys_of(got) == expected(photo_shards)
    finally:
        svc.shutdown()


def test_an_item_its_actor_finished_before_dying_keeps_its_result(photo_shards, ray_local):
    """ray.wait may report an actor's death before the result of the item it finished first: that
    item is delivered, and the death is charged to the item the actor died on."""
    from datasvc.service.pool import ActorPool
    from datasvc.wire import WorkItem

    idx = index_shard(photo_shards[0])
    first, killer = (WorkItem(idx.path, i, (idx.samples[i],)) for i in (0, 1))
    pool = ActorPool(cfg(photo_shards, pool=actors(min_actors=1, max_actors=1,
                     actor_hook=faults(kill_on_key=f"{idx.path}/{idx.samples[1].key}"))), rank=0)
    try:
        deadline = time.monotonic() + 120
        while not pool.has_room() and time.monotonic() < deadline:
            time.sleep(0.2)
        # The killer goes in once the first item's result is back: killed straight after finishing
        # it, the actor could lose a reply it had not sent yet, and then it never finished it.
        assert pool.submit("first", first)
        (first_ref,) = pool.in_flight
        assert ray.wait([first_ref], timeout=120)[0]
        assert pool.submit("killer", killer)
        refs = {task.key: ref for ref, (task, _) in pool.in_flight.items()}
        assert ray.wait([refs["killer"]], timeout=120)[0]
        done = pool._collect_ready([refs["killer"]])  # the death seen first, the first result uncollected
        assert [key for key, _ in done] == ["first"] and len(done[0][1].samples) == 1
        (retry,) = pool.recovery.backlog
        assert retry.key == "killer" and retry.deaths == 1
    finally:
        pool.shutdown()


def test_items_redone_alone_run_on_an_idle_actor_with_nothing_behind_them(photo_shards, ray_local):
    from datasvc.service.pool import ActorPool
    from datasvc.stream.recovery import Task
    from datasvc.wire import WorkItem

    idx = index_shard(photo_shards[0])
    pool = ActorPool(cfg(photo_shards, pool=actors(min_actors=1, max_actors=1)), rank=0)
    try:
        deadline = time.monotonic() + 120
        while not pool.has_room() and time.monotonic() < deadline:
            time.sleep(0.2)
        tasks = [Task(f"s{i}", WorkItem(idx.path, i, (idx.samples[i],)), solo=True) for i in range(2)]
        pool.recovery.backlog.extend(tasks)
        done = []
        while len(done) < 2 and time.monotonic() < deadline:
            done += pool.collect(timeout=1.0)
            assert len(pool.in_flight) <= 1 and (not pool.in_flight or not pool.has_room())
        assert sorted(key for key, _ in done) == ["s0", "s1"]
        assert pool.has_room() and pool.submit("next", WorkItem(idx.path, 2, (idx.samples[2],)))
        assert pool.submit("and another", WorkItem(idx.path, 3, (idx.samples[3],)))  # two a busy actor
    finally:
        pool.shutdown()


@ray.remote(num_cpus=0)
class _CannotStart:
    """Stands in for a preprocessing actor on a node that lacks a data-path package."""

    def __init__(self, cfg):
        raise ModuleNotFoundError("No module named 'vlmfeed_missing_dependency'")

    def pid(self) -> int:
        return os.getpid()


def test_actors_that_cannot_start_fail_fast_with_the_cause(photo_shards, ray_local):
    import pytest

    from datasvc.service.feeder import DataServiceError, ActorPool

    class Pool(ActorPool):
        def _new(self):
            return _CannotStart.remote(self.cfg)

    pool = Pool(cfg(photo_shards, pool=actors(min_actors=2, max_actors=2)), rank=0)
    deadline = time.monotonic() + 120
    with pytest.raises(DataServiceError, match="vlmfeed_missing_dependency") as err:
        while time.monotonic() < deadline:
            pool.collect(timeout=1.0)
    assert f"{Pool.MAX_START_FAILURES} preprocessing actors in a row failed to start" in str(err.value)
    assert "Install the data path's dependencies" in str(err.value)


def test_shutdown_leaves_no_feeder_behind(photo_shards, ray_local):
    """A client's prefetch call that fails because the service shut down must not restart the feeder
    (as it must after a crash): a resurrected feeder and its actors would hold CPUs for good."""
    import pytest

    from datasvc.service.feeder import DataServiceError, feeder_name

    run = f"z{uuid.uuid4().hex[:6]}"
    # Streams forever with room to prefetch, so the client's thread is inside a next_batch call.
    svc = DataService(cfg(photo_shards, epochs=None, prefetch=8, pool=actors(max_batches_ahead=8)), run=run)
    c = svc.client(0, output="numpy")
    next(c)
    time.sleep(1.0)
    svc.shutdown()
    time.sleep(3.0)  # a restart would have named a new feeder by now
    with pytest.raises(ValueError):
        ray.get_actor(feeder_name(run, 0))
    with pytest.raises(DataServiceError, match="closed or its service shut down"):
        for _ in range(20):  # what was prefetched before the shutdown (8 at most), then the refusal
            next(c)


def test_restore_refuses_a_changed_shard_set_unless_asked_to_replan(photo_shards, ray_local, tmp_path):
    """A saved state records the shard files (paths, sizes, times): a file added to the glob or a
    shard rewritten in place fails the restore, naming it; replan_on_dataset_change goes on."""
    import dataclasses
    import shutil

    import pytest

    from datasvc.service.feeder import DataServiceError
    from datasvc.stream.producer import check_dataset

    data = tmp_path / "data"
    data.mkdir()
    for s in photo_shards[:2]:
        shutil.copy(s, data)
    config = cfg([str(data / "*.tar")])
    svc = DataService(config, run=f"g{uuid.uuid4().hex[:6]}")
    try:
        c = svc.client(0, output="numpy")
        next(c)
        state = json.loads(json.dumps(c.save_state()))  # as a checkpoint stores it
    finally:
        svc.shutdown()
    assert state["dataset"]["files"] == 2
    check_dataset(config, state["dataset"])  # unchanged: accepted

    shutil.copy(photo_shards[2], data / "added.tar")
    with pytest.raises(DataServiceError, match=r"1 added \(.*added\.tar\)"):
        DataService(config, run=f"g{uuid.uuid4().hex[:6]}", restore={0: state})
    (data / "added.tar").unlink()
    shutil.copy(photo_shards[3], data / os.path.basename(photo_shards[0]))  # rewritten in place
    with pytest.raises(DataServiceError, match=r"1 rewritten \(.*\).*replan_on_dataset_change=True"):
        DataService(config, run=f"g{uuid.uuid4().hex[:6]}", restore={0: state})

    replan = dataclasses.replace(config, replan_on_dataset_change=True)
    svc = DataService(replan, run=f"g{uuid.uuid4().hex[:6]}")
    try:
        c = svc.client(0, output="numpy")
        c.restore_state(state)
        assert len(drain(c)) > 0
        assert c.save_state()["dataset"] != state["dataset"]  # later states record the files as they are now
    finally:
        svc.shutdown()
