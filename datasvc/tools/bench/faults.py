"""Real failures in the preprocessing actors, for the soak bench and the tests of fault handling:
given to the service as its actor hook, never in a real run::

    ServiceConfig(..., actor_hook=faults(kill_on_key="shard.tar/000042"))

- ``kill_on_key``: SIGKILL, on an item holding that sample ("shard/key"); what a decoder crash or an
  OOM kill does.
- ``raise_on_key``: the whole item raises.
- ``address_space_headroom_bytes``: RLIMIT_AS at the address space the process holds now plus this;
  allocations past it fail.
- ``rss_headroom_bytes``: SIGKILL once resident memory grows this much past what it holds now, as
  the kernel kills a process over its memory cgroup's limit.
"""
from __future__ import annotations

import os
import signal
import threading
import time

from datasvc.wire import WorkItem

KINDS = ("kill_on_key", "raise_on_key", "address_space_headroom_bytes", "rss_headroom_bytes")


def faults(**kinds) -> tuple[str, dict]:
    """The ``PoolConfig.actor_hook`` that injects ``kinds`` (see the module docstring)."""
    if unknown := set(kinds) - set(KINDS):
        raise ValueError(f"unknown faults {sorted(unknown)}; known: {', '.join(KINDS)}")
    return (f"{__name__}:FaultInjection", dict(kinds))


class FaultInjection:
    """Built in each preprocessing actor from ``faults(...)``; called with every work item before the
    actor processes it."""

    def __init__(self, **faults):
        import psutil

        self.faults = faults
        mem = psutil.Process().memory_info()
        if "address_space_headroom_bytes" in faults:
            import resource

            limit = mem.vms + int(faults["address_space_headroom_bytes"])
            resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
        if "rss_headroom_bytes" in faults:
            limit = mem.rss + int(faults["rss_headroom_bytes"])
            threading.Thread(target=self._watch_rss, args=(limit,), name="rss-limit", daemon=True).start()

    @staticmethod
    def _watch_rss(limit: int) -> None:
        import psutil

        proc = psutil.Process()
        while True:
            if proc.memory_info().rss > limit:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.002)

    def __call__(self, item: WorkItem) -> None:
        keys = {f"{item.shard}/{s.key}" for s in item.samples}
        if self.faults.get("kill_on_key") in keys:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.faults.get("raise_on_key") in keys:
            raise RuntimeError(f"injected failure on {self.faults['raise_on_key']}")
