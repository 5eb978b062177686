"""Many nodes on one machine (``ray.cluster_utils.Cluster``: raylets on 127.0.0.1): each DP rank's
feeder and its actors on the node asked for, the bytes that crossed nodes counted, one node's CPU
budget shared by its feeders, a node lost mid-epoch, and the head lost.

Per epoch the delivered sample keys must equal the epoch's multiset, and every rank's stream must be
the one the in-process producer makes (no loss, no duplicate, same order).
"""
import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from collections import Counter
from types import SimpleNamespace

import pytest
import ray
from ray.cluster_utils import Cluster

from datasvc.config import PoolConfig, ServiceConfig
from datasvc.read.shards import index_shard
from datasvc.service.client import DataClient, DataService
from datasvc.service.feeder import EndOfData
from datasvc.service.locality import Budget, replica_nodes, this_node
from datasvc.stream.producer import BlockProducer

SMALL = {"min_pixels": 32 * 32, "max_pixels": 64 * 64}
# Node deaths noticed in about two seconds instead of Ray's default half minute.
FAST_DEATH = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
              "health_check_failure_threshold": 4, "gcs_rpc_server_reconnect_timeout_s": 10}
NODE = {"object_store_memory": 80 * 1024 * 1024, "include_dashboard": False}


def cfg(shards, **kw):
    base = dict(shards=tuple(shards), seq_len=128, micro_batch_size=1, samples_per_item=4, items_per_block=2,
                pipeline_options=SMALL, epochs=2, dp_size=2, prefetch=1,
                pool=PoolConfig(min_actors=1, max_actors=1, autoscale_interval_s=60.0, max_batches_ahead=2))
    base.update(kw)
    return ServiceConfig(**base)


def reference(config, rank):
    """Rank ``rank``'s stream as the in-process producer makes it: [(epoch, keys), ...]."""
    return [(pos.epoch, list(b.sample_keys)) for b, pos in BlockProducer(config, rank).micro_batches()]


def epoch_keys(shards):
    return Counter(f"{s}/{x.key}" for s in shards for x in index_shard(s).samples)


def per_epoch(*streams):
    out: dict[int, Counter] = {}
    for stream in streams:
        for epoch, keys in stream:
            out.setdefault(epoch, Counter()).update(keys)
    return out


@ray.remote(num_cpus=0)
class Rank:
    """A CPU trainer rank: reads its DP rank's micro-batches through a ``DataClient``."""

    def __init__(self, config, dp_rank, run, state=None):
        self.client = DataClient(config, dp_rank, run=run, output="numpy")
        if state:
            self.client.restore_state(state)

    def node(self) -> str:
        return this_node()

    def take(self, n: int | None = None) -> list:
        """Up to ``n`` micro-batches (all that are left when None) as [(epoch, keys), ...]."""
        out = []
        try:
            while n is None or len(out) < n:
                batch = next(self.client)
                out.append((self.client.last_position["epoch"], list(batch.sample_keys)))
        except EndOfData:
            pass
        return out

    def save_state(self) -> dict:
        return self.client.save_state()


TEMP_DIRS: list[str] = []


@pytest.fixture(scope="module", autouse=True)
def _own_ray_connection():
    """These tests start and join clusters of their own, and a driver holds one connection: an
    earlier test's session cluster (conftest's ``ray_local``) is ended first. It is not made again
    here: a later module's torch DataLoader forks this process, which a live Ray connection's
    threads make unsafe; tests after this one connect when they need to."""
    if ray.is_initialized():
        ray.shutdown()
    yield
    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="module", autouse=True)
def _remove_temp_dirs():
    """Ray processes still exiting after a cluster's shutdown may write in its temp dir for a while:
    each is removed after its test and again when the module is done."""
    yield
    for path in TEMP_DIRS:
        for pid in _pids_using(path):  # only processes of the clusters these tests started
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(path, ignore_errors=True)


def _pids_using(marker: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if marker in f.read().decode(errors="replace"):
                        pids.append(int(entry))
            except OSError:
                continue
    return pids


@pytest.fixture
def temp_dir():
    path = tempfile.mkdtemp(prefix="vmn", dir="/tmp")  # short: raylet socket paths are limited
    TEMP_DIRS.append(path)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def start_head(connect: bool = False, **head_args) -> Cluster:
    """A ``Cluster`` with its head started. ``Cluster`` writes the head's address into Ray's default
    temp dir whatever ``temp_dir`` says, so that dir must exist (on a fresh machine it does not);
    a head that fails to start is shut down, not left running under the tests that follow."""
    from ray._common.utils import get_default_ray_temp_dir

    os.makedirs(get_default_ray_temp_dir(), exist_ok=True)
    c = Cluster()
    try:
        c.add_node(**head_args)
        if connect:
            c.connect()
    except BaseException:
        c.shutdown()
        raise
    return c


@pytest.fixture
def cluster(temp_dir):
    """Head (1 CPU, runs the driver) and two workers of 1 CPU, each with a resource naming it."""
    c = start_head(**NODE, num_cpus=1, resources={"head": 1}, temp_dir=temp_dir, _system_config=FAST_DEATH)
    nodes = {"n1": c.add_node(num_cpus=1, resources={"n1": 1}, **NODE),
             "n2": c.add_node(num_cpus=1, resources={"n2": 1}, **NODE)}
    c.wait_for_nodes()
    c.connect()
    try:
        yield c, nodes
    finally:
        ray.shutdown()
        c.shutdown()


def on(name):
    return {"resources": {name: 0.01}}


def actor_node(handle) -> str:
    return ray._private.state.actors(handle._actor_id.hex())["Address"]["NodeID"]


@pytest.mark.slow  # three raylets and five actor processes: 60-110 s on two busy cores
def test_feeders_beside_their_ranks_and_a_lost_node(photo_shards, cluster):
    """Rank 0 trains on n1 while its feeder was put on n2 (its batches cross nodes and are counted);
    rank 1 and its feeder share the head. n2 is removed mid-epoch: rank 0's client restarts the feeder
    on its own node, with its actors, where the stream stood. Then rank 1 is restarted on n1 from its
    saved state. Each rank's stream is the in-process one, and each epoch holds every sample once."""
    c, nodes = cluster
    config = cfg(photo_shards)
    ids = {name: n.node_id for name, n in nodes.items()}
    head = c.head_node.node_id
    refs = [reference(config, r) for r in range(2)]
    run = f"m{uuid.uuid4().hex[:6]}"
    svc = DataService(config, run=run, nodes={0: ids["n2"], 1: head})
    try:
        ranks = [Rank.options(**on("n1")).remote(config, 0, run), Rank.options(**on("head")).remote(config, 1, run)]
        got = [ray.get(ranks[0].take.remote(2)), ray.get(ranks[1].take.remote(2))]
        stats = svc.stats()
        f0, f1 = (r.placement for r in stats.ranks)
        assert (f0.node, f1.node) == (ids["n2"], head)
        assert {actor_node(a) for a in ray.get(svc.feeders[0].actor_handles.remote())} == {ids["n2"]}
        assert f0.bytes_cross_node > 0 and f0.batches_cross_node >= 2 and f0.bytes_same_node == 0
        assert f1.bytes_cross_node == 0 and f1.bytes_same_node > 0
        assert stats.as_dict()["bytes_cross_node"] == f0.bytes_cross_node
        assert f0.node_budget.cap == 1 == f1.node_budget.cap  # 1 CPU a node, no GPU

        c.remove_node(nodes["n2"], allow_graceful=False)  # feeder 0, its actors and its queued batches
        got[0] += ray.get(ranks[0].take.remote(), timeout=180)
        moved = svc.stats().ranks[0].placement
        assert moved.node == ids["n1"] and moved.bytes_cross_node == 0

        got[1] += ray.get(ranks[1].take.remote(1))
        state = ray.get(ranks[1].save_state.remote())
        ray.kill(ranks[1])  # the trainer rank is lost; a new one resumes from its saved state elsewhere
        resumed = Rank.options(**on("n1")).remote(config, 1, run, state)
        got[1] += ray.get(resumed.take.remote(), timeout=180)
    finally:
        svc.shutdown()
    assert not [n for n in ray.util.list_named_actors() if "node-budget" in str(n)]  # ended with the service
    assert got == refs
    everything = epoch_keys(photo_shards)
    assert per_epoch(*got) == {0: everything, 1: everything}


def test_node_budget_shares_one_node_between_feeders():
    """Two feeders of one node with 4 actor slots: neither takes the other's fair share. (The budget's
    logic alone; the node-loss test runs it as the per-node actor.)"""
    budget = Budget(4)
    assert [budget.join(0, 1), budget.join(1, 1)] == [4, 4]
    assert budget.take(0) is True  # 2 + 1 held: rank 1 can still reach its share of 2
    assert budget.take(0) is False  # rank 0 has its share, and one slot is owed to rank 1
    assert budget.take(1) is True
    assert budget.take(1) is False  # 4 held: the node is full
    budget.give(0)
    assert budget.take(1) is False  # the slot rank 0 gave back stays owed to it
    assert budget.take(0) is True
    assert budget.state() == {"cap": 4, "held": {0: 2, 1: 2}}
    budget.join(1, 1)  # rank 1's feeder restarted: it holds its floor again
    assert budget.take(0) is False and budget.take(1) is True
    assert budget.take(7) is False  # a feeder that never joined gets nothing
    assert replica_nodes(["a", "b", "b", "c"], [0, 0, 0, 1]) == {0: "b", 1: "c"}


LOST_HEAD = re.compile(r"CLIENT-ERROR DataServiceError .*the Ray head at \S+ is unreachable"
                       r"|Failed to connect to GCS|raylet (failed|death|is dead|has died)|Raylet IPC connection failed"
                       r"|connection to the plasma store is failed", re.I)


def driver_core_log(temp_dir: str, pid: int) -> str:
    paths = glob.glob(os.path.join(temp_dir, "session_2*", "logs", f"python-core-driver-*_{pid}.log"))
    return "".join(open(p, errors="replace").read() for p in paths)


def test_unreachable_head_tells_a_listening_gcs_from_a_closed_port(monkeypatch):
    from datasvc.service import cluster

    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        live = "127.0.0.1:%d" % listening.getsockname()[1]
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
            gone = "127.0.0.1:%d" % closed.getsockname()[1]
            for address, expected in ((live, None), (gone, gone)):
                monkeypatch.setattr(cluster.ray, "get_runtime_context", lambda a=address: SimpleNamespace(gcs_address=a))
                assert cluster.unreachable_head(timeout_s=1.0) == expected


HEAD_LOSS_DRIVER = textwrap.dedent("""
    import json, os, sys, time
    import ray
    from datasvc.config import PoolConfig, ServiceConfig
    from datasvc.service.client import DataService
    address, cfg_json, out = sys.argv[1:4]
    ray.init(address=address)
    fields = json.loads(cfg_json)
    pool = PoolConfig(**fields.pop("pool"))
    config = ServiceConfig(**fields, pool=pool)
    svc = DataService(config, run="headloss")
    client = svc.client(0, output="numpy")
    got = [list(next(client).sample_keys) for _ in range(3)]
    json.dump({"got": got, "state": client.save_state()}, open(out, "w"))
    open(out + ".ready", "w").close()
    deadline = time.monotonic() + 120
    while not os.path.exists(out + ".killed") and time.monotonic() < deadline:
        time.sleep(0.05)  # read on only once the head is gone, so the epoch cannot end first
    try:
        while True:
            next(client)
    except Exception as exc:
        print("CLIENT-ERROR", type(exc).__name__, exc, flush=True)
        sys.exit(3)
""")


@pytest.mark.slow  # two clusters one after the other: about 80 s on two busy cores
def test_head_loss_is_a_clear_error_and_a_new_cluster_resumes(photo_shards, temp_dir):
    """The head dies under a running driver: the driver stops with an error that names the cause;
    a new cluster resumes from the state the driver saved, and the stream continues exactly."""
    config = cfg(photo_shards, dp_size=1, epochs=1)
    fields = dict(shards=list(config.shards), seq_len=128, micro_batch_size=1, samples_per_item=4, items_per_block=2,
                  pipeline_options=SMALL, epochs=1, dp_size=1, prefetch=1,
                  pool=dict(max_actors=1, autoscale_interval_s=60.0, max_batches_ahead=2))
    ref = [keys for _, keys in reference(config, 0)]
    out = os.path.join(temp_dir, "driver.json")
    c = start_head(**NODE, num_cpus=1, temp_dir=temp_dir, _system_config=FAST_DEATH)
    try:
        driver = subprocess.Popen([sys.executable, "-c", HEAD_LOSS_DRIVER, c.address, json.dumps(fields), out],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 120
        while not os.path.exists(out + ".ready") and driver.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert os.path.exists(out + ".ready"), driver.communicate(timeout=30)[0][-3000:]
        c.remove_node(c.head_node, allow_graceful=False)
        open(out + ".killed", "w").close()
        log, _ = driver.communicate(timeout=120)
    finally:
        if driver.poll() is None:
            driver.kill()
        c.shutdown()
    assert driver.returncode != 0
    # Either the client's error reaches the driver and names the lost head, or Ray ends the driver
    # first, naming the cause in whichever way it notices: the GCS stays unreachable (said on stderr),
    # or the local raylet is gone (said in the driver's core log), or with it the raylet's object store
    # (said on stderr).
    said = log + driver_core_log(temp_dir, driver.pid)
    assert LOST_HEAD.search(said), (driver.returncode, [ln for ln in said.splitlines() if "CLIENT-ERROR" in ln],
                                    said[-3000:])
    saved = json.load(open(out))
    assert saved["got"] == ref[:3]

    c = start_head(connect=True, **NODE, num_cpus=1, temp_dir=temp_dir + "/again")
    try:
        svc = DataService(config, run="resumed")
        try:
            client = svc.client(0, output="numpy")
            client.restore_state(saved["state"])
            rest = [list(b.sample_keys) for b in _drain(client)]
        finally:
            svc.shutdown()
    finally:
        ray.shutdown()
        c.shutdown()
    assert saved["got"] + rest == ref


def _drain(client):
    out = []
    try:
        while True:
            out.append(next(client))
    except EndOfData:
        return out
