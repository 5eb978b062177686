"""Joining or starting Ray: the embedded default is a local cluster on loopback only."""
from __future__ import annotations

import os

import ray


def connect(address: str | None = None, num_cpus: int | None = None,
            object_store_memory: int | None = None) -> None:
    """``address`` or RAY_ADDRESS (set by ``ray job submit``) joins a cluster; otherwise start one
    bound to 127.0.0.1 with no dashboard, so nothing listens beyond this host."""
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    env = {"env_vars": {"PYTHONPATH": _project_root() + os.pathsep + os.environ.get("PYTHONPATH", "")}}
    if address:
        ray.init(address=address, runtime_env=env, log_to_driver=True)
        return
    ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=num_cpus,
             object_store_memory=object_store_memory, runtime_env=env, log_to_driver=True)


def _project_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
