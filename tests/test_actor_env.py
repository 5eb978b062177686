"""The preprocessing actors' process environment: glibc's allocator settings (``GLIBC_TUNABLES``),
which glibc reads only when a process starts, reach each actor's process."""
import time

import pytest
import ray

from datasvc.config import ACTOR_MALLOC_TUNABLES, PoolConfig, ServiceConfig


def test_the_default_tunables_are_in_the_actors_env(monkeypatch):
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    assert PoolConfig().actor_env() == {"GLIBC_TUNABLES": ACTOR_MALLOC_TUNABLES}
    assert PoolConfig(actor_malloc_tunables="").actor_env() == {}


def test_tunables_the_cluster_was_started_with_come_last_and_so_win(monkeypatch):
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=0")
    env = PoolConfig().actor_env()["GLIBC_TUNABLES"]
    assert env.startswith(ACTOR_MALLOC_TUNABLES + ":") and env.endswith(":glibc.malloc.hugetlb=0")
    assert PoolConfig(actor_malloc_tunables="").actor_env() == {
        "GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}


@pytest.mark.parametrize("bad", ["hugetlb=1", "glibc.malloc.hugetlb", "glibc.malloc.hugetlb=1;glibc.malloc.x=2"])
def test_a_malformed_tunable_fails_fast_saying_what_to_write(bad):
    with pytest.raises(ValueError, match=r"actor_malloc_tunables: .*glibc\.NAMESPACE\.NAME=VALUE"):
        ServiceConfig(shards=("a.tar",), pool=PoolConfig(actor_malloc_tunables=bad))


def test_a_started_actor_process_has_them(photo_shards, ray_local, monkeypatch):
    from datasvc.service.pool import ActorPool

    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    # One entry: glibc 2.36 cuts the process's own copy of the variable (what /proc shows) at the
    # first ':' once it has read it; the process itself, and os.environ, keep the whole.
    tunables = "glibc.malloc.trim_threshold=1048576"
    pool = ActorPool(ServiceConfig(shards=tuple(photo_shards), pool=PoolConfig(actor_malloc_tunables=tunables)), rank=0)
    try:
        deadline = time.monotonic() + 120
        while not pool.actors and time.monotonic() < deadline:
            pool.collect(timeout=1.0)  # promotes the actor once it has started
        assert pool.actors, "the preprocessing actor did not start"
        pid = ray.get(pool.actors[0].pid.remote())
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
        assert environ[b"GLIBC_TUNABLES"].decode() == tunables
        assert b"PYTHONPATH" in environ  # the job's own environment is kept beside it
    finally:
        pool.shutdown()
