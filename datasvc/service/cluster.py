"""Joining or starting Ray: the embedded default is a local cluster that listens on loopback only.

What ``connect`` does for the embedded cluster, and why:

- Node address 127.0.0.1, for real. Ray on Linux replaces a loopback ``_node_ip_address`` by the
  host's routable address (``services.resolve_ip_for_localhost``) unless its single-machine mode is
  on, and every gRPC server (GCS, raylet, core workers, the driver), both agents and the metrics
  exporter then listen on all interfaces or on that address. With the single-machine mode on (Ray's
  own default on macOS and Windows), the node address stays 127.0.0.1 and each of them binds
  loopback. ``tests/test_loopback.py`` lists every listening socket of the job's processes.
- No dashboard (``include_dashboard=False``); the dashboard agent and the runtime-env agent still
  run (Ray starts them on every node) and bind loopback like the rest.
- Its own Ray temp dir (``/tmp/vlmfeed-ray`` unless told): never joins another cluster of this host
  by accident, as ray.init does when a cluster's address is left in the default one.
- Token authentication with a token of this cluster's own, in the environment the cluster's
  processes inherit: whatever ``~/.ray/auth_token`` holds (a token of another cluster, junk, or
  nothing) is neither read nor written, and a process on the same host needs the token to talk to
  the cluster.

With ``address`` (or RAY_ADDRESS, set by ``ray job submit``) this joins that cluster as it is
configured, deciding token authentication by the rule ``ray start`` applies (``_join_auth``).
"""
from __future__ import annotations

import os
import secrets
import socket
import sys
import tempfile

import ray


NAMESPACE = "vlmfeed"
"""The Ray namespace the service's named actors live in: every process of a job that joins it
(``torchrun`` ranks, a driver) finds the same feeders by name."""


def connect(address: str | None = None, num_cpus: int | None = None,
            object_store_memory: int | None = None, temp_dir: str | None = None,
            namespace: str = NAMESPACE) -> None:
    """Join ``address`` (or RAY_ADDRESS), or start the embedded loopback-only cluster, in ``namespace``."""
    if ray.is_initialized():
        return
    if not (sys.stdout.isatty() and sys.stderr.isatty()):  # the ranks' and actors' log lines, printed here: no colour codes in a file
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    address = address or os.environ.get("RAY_ADDRESS")
    env = {"env_vars": {"PYTHONPATH": _project_root() + os.pathsep + os.environ.get("PYTHONPATH", "")}}
    if address:
        _join_auth()
        ray.init(address=address, runtime_env=env, log_to_driver=True, namespace=namespace)
        return
    _loopback_node()
    _use_auth_env(local_auth_env())
    # A temp dir of our own: in Ray's default one (/tmp/ray), a cluster someone else started on this
    # host (``ray start``, ``ray.cluster_utils``) leaves its address, and ray.init would join it.
    temp_dir = temp_dir or os.path.join(tempfile.gettempdir(), "vlmfeed-ray")
    ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=num_cpus, namespace=namespace,
             object_store_memory=object_store_memory, runtime_env=env, log_to_driver=True, _temp_dir=temp_dir)


def head_address() -> str | None:
    """The address of this process's Ray head (its GCS), None when not connected."""
    try:
        return ray.get_runtime_context().gcs_address
    except Exception:  # not connected, or a Ray whose context lacks it
        return None


def unreachable_head(timeout_s: float = 2.0, address: str | None = None) -> str | None:
    """``address`` (this process's Ray head unless told) when it no longer accepts connections,
    else None. Asked after a Ray call failed, to tell a lost head from a lost actor: Ray's own
    wording for it differs with whichever of its clients notices first. Callers that may ask once
    the head is gone pass the address they noted while connected: by then Ray may have torn down
    the context that holds it."""
    address = address or head_address()
    if not address:
        return None
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return None
    except OSError:
        return address


def local_auth_env() -> dict[str, str]:
    """Environment for the processes of a cluster started on this host (``ray start`` included) and
    for its clients: token authentication with a fresh token, so no ``~/.ray/auth_token`` is used.
    Kept across calls in one process, so a restarted embedded cluster and its clients agree."""
    token = os.environ.get("VLMFEED_RAY_TOKEN") or secrets.token_hex(32)
    os.environ["VLMFEED_RAY_TOKEN"] = token
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}


def _join_auth() -> None:
    """Decide token authentication as ``ray start`` did for the cluster: unless RAY_AUTH_MODE says,
    tokens are on when a token is found (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token).
    ``ray.init(address=...)`` alone leaves them off, so a ``ray start`` that found a token file (one an
    earlier local run left) started a cluster that such a driver could not join."""
    try:
        from ray._private.authentication.authentication_token_setup import maybe_enable_token_auth_if_token_available
    except ImportError:  # a Ray without token authentication
        return
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def _use_auth_env(env: dict[str, str]) -> None:
    """Put ``env`` in this process's environment, and have Ray's config (read once per process) and
    its token cache read it again, as Ray does when it enables tokens for a new local cluster."""
    from ray._raylet import AuthenticationTokenLoader, Config

    os.environ.update(env)
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def _loopback_node() -> None:
    """Ray's single-machine mode, so that the node address 127.0.0.1 is kept (see the module doc).
    The environment variable reaches the processes Ray starts; the constant, read when Ray is first
    imported, is set again for this process."""
    from ray._private import ray_constants

    os.environ[ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


def _project_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
