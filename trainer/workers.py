"""Trainer ranks on Ray: one placement group, one actor per GPU (or per CPU rank), rank env, init.

Bundles are sorted by (node, GPU) before ranks are given out, so ranks of one node are contiguous
and LOCAL_RANK matches the GPU order; the rendezvous port is picked on rank 0's node from a range
below Linux's ephemeral ports, so it cannot collide with Ray's own outgoing connections.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from datasvc.host import machine
from trainer.rendezvous import LOOPBACK_ADDR, loopback_env

PORT_RANGE = (29500, 30500)
# What Ray sets for itself or the job and must not leak into torch.distributed / CUDA setup.
_STRIP_ENV = ("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", "RAY_JOB_ID", "RAY_RUNTIME_ENV_HOOK",
              "RAY_JOB_CONFIG_JSON_ENV_VAR", "RAY_SUBMISSION_ID")


@dataclass(frozen=True, slots=True)
class RankLayout:
    """Where one rank sits: Megatron's default order tp -> cp -> dp -> pp (fastest first)."""

    rank: int
    world: int
    tp: int = 1
    cp: int = 1
    pp: int = 1

    @property
    def model_parallel(self) -> int:
        return self.tp * self.cp * self.pp

    @property
    def dp_size(self) -> int:
        return self.world // self.model_parallel

    @property
    def dp_rank(self) -> int:
        return (self.rank // (self.tp * self.cp)) % self.dp_size

    @property
    def consumer(self) -> int:
        """This rank's index among the ranks that share one DP replica's micro-batches."""
        tp_rank = self.rank % self.tp
        cp_rank = (self.rank // self.tp) % self.cp
        pp_rank = self.rank // (self.tp * self.cp * self.dp_size)
        return tp_rank + self.tp * (cp_rank + self.cp * pp_rank)


@ray.remote
class TrainerWorker:
    def node_info(self) -> tuple[str, list[int], str]:
        """(node address, GPU ids, Ray node id)."""
        return (ray.util.get_node_ip_address(), [int(g) for g in ray.get_gpu_ids()],
                ray.get_runtime_context().get_node_id())

    def free_port(self) -> int:
        for port in range(*PORT_RANGE):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("", port))
                    return port
                except OSError:
                    continue
        raise RuntimeError(f"no free port in {PORT_RANGE}")

    def setup(self, rank: int, world: int, local_rank: int, master_addr: str, master_port: int,
              extra_env: dict[str, str] | None = None) -> None:
        for k in _STRIP_ENV:
            os.environ.pop(k, None)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local_rank),
                          MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), **(extra_env or {}))

    def run(self, fn, *args, **kwargs):
        """Run ``fn(*args, **kwargs)`` in this rank (a module-level function, pickled by reference)."""
        return fn(*args, **kwargs)


class WorkerGroup:
    """The trainer actors of one job, ranked and ready for torch.distributed."""

    def __init__(self, world: int, use_gpu: bool, cpus_per_rank: float = 1.0, gpu_per_rank: float = 1.0,
                 env: dict[str, str] | None = None, loopback: bool = False):
        """``loopback``: the embedded single-host cluster; the ranks' rendezvous, Gloo and NCCL then
        listen on 127.0.0.1 only (``trainer.rendezvous``)."""
        # gpu_per_rank < 1 leaves room on each rank's GPU for GPU-decoding data actors; above 0.5, two
        # ranks can never share one GPU.
        if use_gpu and not 0.5 < gpu_per_rank <= 1.0:
            raise ValueError(f"gpu_per_rank must be in (0.5, 1], not {gpu_per_rank}")
        bundle = {"CPU": cpus_per_rank, **({"GPU": gpu_per_rank} if use_gpu else {})}
        # PACK: ranks fill a node before the next, so NCCL groups stay on NVLink where they can
        self.pg = placement_group([dict(bundle) for _ in range(world)], strategy="PACK")
        ray.get(self.pg.ready(), timeout=600)
        # Each rank holds its bundle's CPUs and GPU share, so data actors never land on them; the env vars
        # (allocator, NCCL) must be set before torch starts in the worker, hence in its runtime env.
        actors = [TrainerWorker.options(
            num_cpus=cpus_per_rank, num_gpus=gpu_per_rank if use_gpu else 0,
            runtime_env={"env_vars": env} if env else None,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i),
        ).remote() for i in range(world)]
        infos = ray.get([a.node_info.remote() for a in actors])
        order = sorted(range(world), key=lambda i: (infos[i][0], infos[i][1]))
        self.actors = [actors[i] for i in order]
        nodes = [infos[i][0] for i in order]
        self.node_ids = [infos[i][2] for i in order]  # rank r's Ray node: where its data is placed
        master_addr, extra_env = nodes[0], None
        if loopback:
            if set(nodes) != {LOOPBACK_ADDR}:
                raise RuntimeError(f"a loopback rendezvous needs every rank on this host at {LOOPBACK_ADDR}; "
                                   f"the ranks are on {sorted(set(nodes))}")
            master_addr, extra_env = LOOPBACK_ADDR, loopback_env()
        master_port = ray.get(self.actors[0].free_port.remote())
        local = [nodes[:r].count(nodes[r]) for r in range(world)]
        ray.get([a.setup.remote(r, world, local[r], master_addr, master_port, extra_env)
                 for r, a in enumerate(self.actors)])
        self.world = world
        self.machines = by_host(ray.get([a.run.remote(machine) for a in self.actors]))

    def run_all(self, fn, per_rank_args: list[tuple]) -> list:
        """All ranks at once (collectives need every rank inside ``fn`` together). Waits in short
        slices, so the driver's signal handlers run while the ranks train."""
        refs = [a.run.remote(fn, *args) for a, args in zip(self.actors, per_rank_args)]
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=1.0)
            for ref in done:
                ray.get(ref)  # a rank that failed fails the job at once, not when the rest finish
        return ray.get(refs)

    def shutdown(self) -> None:
        for a in self.actors:
            ray.kill(a)
        remove_placement_group(self.pg)


def by_host(facts: list[dict]) -> list[dict]:
    """Each rank's ``machine()`` (in rank order) folded per host: the ranks on it and every GPU they
    see, once; what a run summary records of the machines that trained it."""
    hosts: dict[str, dict] = {}
    for rank, f in enumerate(facts):
        h = hosts.setdefault(f["host"], {**f, "ranks": [], "gpus": []})
        h["ranks"].append(rank)
        h["gpus"] += [g for g in f["gpus"] if g not in h["gpus"]]
    return list(hosts.values())
