"""Where the data service runs on a cluster of many nodes.

- Each DP rank's feeder is placed on the node of the trainer ranks it feeds, and its preprocessing
  actors beside it (``near``: Ray's node affinity, soft, so a full or lost node only costs locality,
  never the stream). A feeder restarted by its client after a loss is placed on the client's node.
- The feeders of one node share that node's CPUs: a ``NodeBudget`` actor per node (named for the run
  and the node, ``num_cpus=0``) caps the preprocessing actors of all of them together, so with more
  DP ranks than cores the node's pools grow in turn instead of each rank sizing itself for the node.
  Each feeder's ``min_actors`` are always granted; growth beyond that asks the budget, which keeps
  room for every feeder of the node to reach its fair share.
- A feeder counts the packed-batch bytes it handed to consumers on its own node and on other nodes
  (``bytes_cross_node``: what crossed the network) in its stats.
"""
from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass

import ray
from ray.exceptions import RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

log = logging.getLogger("vlmfeed.locality")
BUDGET_PREFIX = "node-budget"


def this_node() -> str:
    """The Ray node id of the calling process (driver, actor or task)."""
    return ray.get_runtime_context().get_node_id()


def near(node: str | None, no_resources: bool = False) -> dict:
    """Actor options that place it on ``node`` when that node can take it, elsewhere otherwise.

    Ray's soft affinity does not hold an actor that asks for no resources (a ``num_cpus=0`` feeder
    landed on another node in every try), and such an actor fits on any live node: for those the
    affinity is hard, on a node that is alive now (else none)."""
    if not node:
        return {}
    if no_resources:
        alive = any(n["NodeID"] == node and n.get("Alive") for n in ray.nodes())
        return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node, soft=False)} if alive else {}
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node, soft=True)}


def replica_nodes(rank_nodes: list[str], dp_ranks: list[int]) -> dict[int, str]:
    """The node of each DP replica: where most of its trainer ranks are (ties: the lowest rank's).
    ``rank_nodes[r]`` and ``dp_ranks[r]`` are trainer rank r's node id and DP rank."""
    votes: dict[int, dict[str, int]] = {}
    for node, dp in zip(rank_nodes, dp_ranks):
        votes.setdefault(dp, {}).setdefault(node, 0)
        votes[dp][node] += 1
    return {dp: max(v, key=lambda n: (v[n], -list(v).index(n))) for dp, v in votes.items()}


def node_resources(node: str) -> dict:
    for n in ray.nodes():
        if n["NodeID"] == node:
            return dict(n.get("Resources", {}))
    return {}


def node_actor_cap(node: str, decode_threads: int, data_cpus: int | None) -> int:
    """Preprocessing actors a node can hold for all its feeders: ``data_cpus`` (else the node's
    CPUs less one per GPU, the trainer ranks') over each actor's threads."""
    res = node_resources(node)
    cpus = data_cpus if data_cpus is not None else res.get("CPU", 1) - math.ceil(res.get("GPU", 0))
    return max(1, int(cpus) // max(1, decode_threads))


class Budget:
    """The preprocessing-actor budget of one node, shared by the feeders placed there (the logic of
    the ``NodeBudget`` actor)."""

    def __init__(self, cap: int):
        self.cap = cap
        self.held: dict[int, int] = {}

    def join(self, rank: int, floor: int) -> int:
        """A feeder (new, or restarted) holds its ``floor`` actors; returns the cap."""
        self.held[rank] = floor
        return self.cap

    def take(self, rank: int) -> bool:
        """One more actor for ``rank``, if the node has room once every other feeder of the node
        could still reach its fair share."""
        total = sum(self.held.values())
        if rank not in self.held or total >= self.cap:
            return False
        fair = math.ceil(self.cap / len(self.held))
        owed = sum(max(0, fair - n) for r, n in self.held.items() if r != rank)
        if self.held[rank] >= fair and total + 1 + owed > self.cap:
            return False
        self.held[rank] += 1
        return True

    def give(self, rank: int) -> None:
        if self.held.get(rank, 0) > 0:
            self.held[rank] -= 1

    def state(self) -> dict:
        return {"cap": self.cap, "held": dict(self.held)}


NodeBudget = ray.remote(num_cpus=0)(Budget)  # a coordinator: holds no CPU of the node it budgets


def budget_name(run: str, node: str) -> str:
    return f"{run}-{BUDGET_PREFIX}-{node}"


@dataclass(frozen=True, slots=True)
class BudgetShare:
    """A feeder's dealings with its node's actor budget."""

    cap: int  # preprocessing actors the node's budget allows
    granted: int
    refused: int


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a feeder runs and where its micro-batches went (``as_dict``: the JSON form)."""

    node: str
    bytes_same_node: int
    bytes_cross_node: int
    batches_cross_node: int
    node_budget: BudgetShare

    def as_dict(self) -> dict:
        return asdict(self)


class NodeShare:
    """A feeder's place: its node, its share of that node's budget (the budget actor is made by the
    first feeder there), and the bytes it handed to consumers on its node and on other nodes.

    The budget outlives any one feeder (a killed feeder's successor joins again, which resets what
    the rank holds), so it is detached, and ``release_budgets`` ends a run's budgets at shutdown.
    When the budget cannot be reached, the feeder keeps what it holds and does not grow.
    """

    def __init__(self, run: str, rank: int, cfg):
        self.run, self.rank, self.floor = run, rank, cfg.pool.min_actors
        self.node = this_node()
        self.cap = node_actor_cap(self.node, cfg.decode.threads, cfg.pool.node_data_cpus)
        self.granted = self.refused = 0
        self.bytes_same_node = self.bytes_cross_node = self.batches_cross_node = 0
        self.actor = None
        self._call("join", self.floor)

    def _call(self, method: str, *args):
        for attempt in range(2):
            try:
                if self.actor is None:
                    self.actor = NodeBudget.options(  # num_cpus=0: held on its node by hard affinity
                        name=budget_name(self.run, self.node), get_if_exists=True, lifetime="detached",
                        **near(self.node, no_resources=True)).remote(self.cap)
                    if method != "join":  # a new budget knows nothing of this feeder yet
                        ray.get(self.actor.join.remote(self.rank, self.floor))
                return ray.get(getattr(self.actor, method).remote(self.rank, *args), timeout=30)
            except (RayActorError, ray.exceptions.GetTimeoutError) as exc:
                self.actor = None
                if attempt:
                    log.warning("rank %d: node budget unreachable (%s); not growing", self.rank, type(exc).__name__)
        return None

    def take(self) -> bool:
        """One more preprocessing actor, if the node's budget has room for it."""
        ok = bool(self._call("take"))
        self.granted += ok
        self.refused += not ok
        return ok

    def give(self) -> None:
        self._call("give")

    def handed(self, consumer_node: str, nbytes: int) -> None:
        """A consumer on ``consumer_node`` took a micro-batch of ``nbytes`` from this feeder."""
        if consumer_node and consumer_node != self.node:
            self.bytes_cross_node += nbytes
            self.batches_cross_node += 1
        else:
            self.bytes_same_node += nbytes

    def report(self) -> Placement:
        return Placement(self.node, self.bytes_same_node, self.bytes_cross_node, self.batches_cross_node,
                         BudgetShare(self.cap, self.granted, self.refused))


def release_budgets(run: str) -> None:
    """End the node budgets of ``run`` (called by the service's shutdown)."""
    prefix = f"{run}-{BUDGET_PREFIX}-"
    for entry in ray.util.list_named_actors(all_namespaces=False):
        name = entry if isinstance(entry, str) else entry.get("name", "")
        if name.startswith(prefix):
            try:
                ray.kill(ray.get_actor(name))
            except ValueError:
                pass
