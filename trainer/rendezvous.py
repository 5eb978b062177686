"""torch.distributed for the trainer ranks, with a rendezvous that listens on loopback only in the
embedded single-host job.

torch's env:// rendezvous (a ``TCPStore`` that rank 0 serves) listens on every interface (``::``)
whatever MASTER_ADDR says. On the embedded cluster (``trainer.run`` started Ray itself, on
127.0.0.1), ``WorkerGroup`` sets ``LOOPBACK_ENV`` in each rank: rank 0 binds the store's socket to
127.0.0.1 itself and hands it to the store (``master_listen_fd``), the other ranks connect to it,
and the process group is built on that store. Gloo's and NCCL's own sockets are kept on the
loopback interface by ``GLOO_SOCKET_IFNAME=lo`` / ``NCCL_SOCKET_IFNAME=lo`` (``loopback_env``).
On a real cluster MASTER_ADDR is rank 0's node address and torch's own rendezvous is used.
"""
from __future__ import annotations

import datetime
import os
import socket

LOOPBACK_ENV = "VLMFEED_LOOPBACK_RENDEZVOUS"
LOOPBACK_ADDR = "127.0.0.1"
_listeners: list[socket.socket] = []  # the store's listening sockets: open as long as the process group


def loopback_env() -> dict[str, str]:
    """What a rank of the embedded job needs so that every socket of torch.distributed is on loopback."""
    return {LOOPBACK_ENV: "1", "GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}


def on_loopback() -> bool:
    return os.environ.get(LOOPBACK_ENV) == "1"


def init_distributed(backend: str, timeout: datetime.timedelta | None = None) -> None:
    """``init_process_group`` for this rank (RANK, WORLD_SIZE, MASTER_PORT from the rank env)."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    kwargs = {"timeout": timeout} if timeout is not None else {}
    if not on_loopback():
        dist.init_process_group(backend, rank=rank, world_size=world, **kwargs)
        return
    store = loopback_store(rank, world, int(os.environ["MASTER_PORT"]), timeout or datetime.timedelta(minutes=10))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, **kwargs)


def loopback_store(rank: int, world: int, port: int, timeout: datetime.timedelta):
    """The rendezvous store on 127.0.0.1:``port``: served by rank 0 on a socket bound to loopback."""
    from torch.distributed import TCPStore

    if rank != 0:
        return TCPStore(LOOPBACK_ADDR, port, world, is_master=False, timeout=timeout)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((LOOPBACK_ADDR, port))
    sock.listen(max(world, 128))
    _listeners.append(sock)
    return TCPStore(LOOPBACK_ADDR, port, world, is_master=True, timeout=timeout, master_listen_fd=sock.fileno())
