"""Preprocessing actors and the pool a feeder (``datasvc.service.feeder``) runs its work items on: it starts
and replaces actors, and hands each failed item to ``datasvc.stream.recovery``, which decides what to redo."""
from __future__ import annotations

import logging
import os
import threading
import time

import ray
from ray.exceptions import RayActorError, RayError, RayTaskError

from datasvc.config import ServiceConfig
from datasvc.service.locality import NodeShare, near
from datasvc.stream.process import ItemProcessor
from datasvc.stream.producer import DataServiceError
from datasvc.stream.recovery import Recovery, Task
from datasvc.wire import ItemResult, WorkItem

log = logging.getLogger("vlmfeed.service")


@ray.remote
class PreprocessActor:
    """Runs ``ItemProcessor`` on the work items its feeder sends."""

    def __init__(self, cfg: ServiceConfig, device_id: int = 0):
        self.processor = ItemProcessor(cfg, device_id)
        self.hook = actor_hook(cfg.pool.actor_hook)

    def process(self, item: WorkItem) -> ItemResult:
        if self.hook is not None:
            self.hook(item)
        return self.processor(item)

    def pid(self) -> int:
        return os.getpid()


def actor_hook(spec: tuple):
    """The callable ``PoolConfig.actor_hook`` names, built (None without one)."""
    if not spec:
        return None
    import importlib

    module, name = spec[0].split(":", 1)
    return getattr(importlib.import_module(module), name)(**spec[1])


def _root_cause(exc: Exception) -> str:
    """The last ``SomeError: message`` line of a Ray error (the remote exception), else its type."""
    lines = [ln.strip() for ln in str(exc).splitlines() if "Error" in ln and ":" in ln]
    return (lines[-1] if lines else type(exc).__name__)[:300]


def _outcome(ref) -> tuple[str, object]:
    """("ok", result), ("raised", the item's error) or ("died", the actor's death) of a ready ref."""
    try:
        return "ok", ray.get(ref)
    except RayActorError as exc:
        return "died", exc
    except RayTaskError as exc:
        return "raised", exc
    except RayError as exc:  # out of memory, worker crashed: the actor is gone all the same
        return "died", exc


class ActorPool:
    """Preprocessing actors of one feeder (an ``ItemRunner``); replaces the dead, redoes their items.

    A new actor gets work only once it has started: one that the cluster cannot place (no free
    CPUs) would otherwise hold its items forever. Items with no started actor wait in a backlog.

    Items that raise, and items whose actor dies, are redone as ``datasvc.stream.recovery`` decides: one
    bad sample costs only itself, and the stream goes on.
    """

    PENDING_WARN_S = 60.0
    # Killed actors are replaced forever; actors that cannot even start (a missing package, a bad
    # pipeline option) would be too, so this many failures in a row, with no start between, are fatal.
    MAX_START_FAILURES = 5
    DEAD_ACTOR_SETTLE_S = 30.0  # how long the other refs of a dead actor may take to resolve

    def __init__(self, cfg: ServiceConfig, rank: int, place: NodeShare | None = None):
        self.cfg, self.rank, self.place = cfg, rank, place  # place: its node, and that node's CPU budget
        self.actors: list = []  # started, assignable
        self.starting: dict = {}  # ready ref -> (actor, when asked for)
        self.retiring: list = []
        self.recovery = Recovery(rank)  # its backlog: tasks waiting for a started actor
        self.in_flight: dict = {}  # ref -> (task, actor)
        self.lock = threading.RLock()  # the producer and the autoscaler both change the pool
        self.replaced = 0
        self.start_failures = 0
        self._warned: set = set()
        for _ in range(cfg.pool.min_actors):
            self.grow()

    @property
    def size(self) -> int:
        return len(self.actors) + len(self.starting)

    def _new(self):
        opts = {"num_cpus": self.cfg.decode.threads}  # one CPU slot per decode thread: Ray packs actors by real load
        if env := self.cfg.pool.actor_env():  # read by glibc when the process starts: set per actor, not later
            opts["runtime_env"] = {"env_vars": env}
        if self.cfg.decode.device == "gpu":  # a fraction: the actor shares its node's GPU with the trainer rank
            opts["num_gpus"] = self.cfg.decode.gpu_share
        return PreprocessActor.options(**opts, **near(getattr(self.place, "node", None))).remote(self.cfg)

    def grow(self) -> None:
        with self.lock:
            actor = self._new()
            self.starting[actor.pid.remote()] = (actor, time.monotonic())

    def shrink(self) -> None:
        with self.lock:
            if self.starting:  # never started: nothing to drain
                ref = next(iter(self.starting))
                ray.kill(self.starting.pop(ref)[0])
            elif len(self.actors) > 1:
                self.retiring.append(self.actors.pop())

    def _promote(self) -> None:
        if not self.starting:
            return
        ready, _ = ray.wait(list(self.starting), num_returns=len(self.starting), timeout=0)
        for ref in ready:
            actor, _ = self.starting.pop(ref)
            try:
                ray.get(ref)
                self.actors.append(actor)
                self.start_failures = 0
            except (RayActorError, RayTaskError) as exc:  # ActorDiedError, ActorUnavailableError among them
                self.start_failures += 1
                cause = _root_cause(exc)
                if self.start_failures >= self.MAX_START_FAILURES:
                    raise DataServiceError(
                        f"rank {self.rank}: {self.start_failures} preprocessing actors in a row failed to start; "
                        f"the last one said: {cause}. Install the data path's dependencies (nvidia-dali, "
                        f"webdataset, the pipeline's tokenizer) on every node, or fix the data config") from None
                log.warning("rank %d: preprocessing actor failed to start (%s); starting another", self.rank, cause)
                self.grow()
        for ref, (_, since) in self.starting.items():
            if time.monotonic() - since > self.PENDING_WARN_S and ref not in self._warned:
                self._warned.add(ref)
                log.warning("rank %d: a preprocessing actor has waited %.0fs to be placed: the cluster has "
                            "no free CPUs for it (needs %d); lower max_actors or add CPUs", self.rank,
                            time.monotonic() - since, self.cfg.decode.threads)

    def load(self, actor) -> int:
        return sum(1 for _, a in self.in_flight.values() if a is actor)

    def _free_actor(self, solo: bool = False):
        """An actor for a task: two in flight keep an actor busy; a solo task gets an idle one, and
        an actor running a solo task gets nothing else."""
        running_solo = {id(a) for t, a in self.in_flight.values() if t.solo}
        candidates = [a for a in self.actors if id(a) not in running_solo and self.load(a) < (1 if solo else 2)]
        return min(candidates, key=self.load) if candidates else None

    def _dispatch(self, task: Task, actor) -> None:
        self.in_flight[actor.process.remote(task.item)] = (task, actor)

    def submit(self, key, item: WorkItem) -> bool:
        with self.lock:
            self._promote()
            actor = self._free_actor()
            if actor is None:
                return False
            self._dispatch(Task(key, item), actor)
            return True

    def has_room(self) -> bool:
        with self.lock:
            self._promote()
            return not self.recovery.backlog and self._free_actor() is not None

    def collect(self, timeout: float) -> list[tuple[object, ItemResult]]:
        with self.lock:
            self._promote()
            self._drain_backlog()
        if not self.in_flight:
            if self.starting:  # nothing to collect until an actor starts: wait for that instead
                ray.wait(list(self.starting), num_returns=1, timeout=timeout)
            return []
        ready, _ = ray.wait(list(self.in_flight), num_returns=1, timeout=timeout)
        with self.lock:
            return self._collect_ready(ready)

    def _collect_ready(self, ready) -> list[tuple[object, ItemResult]]:
        done: list = []
        for ref in ready:
            entry = self.in_flight.pop(ref, None)
            if entry is None:  # taken back when its actor was found dead
                continue
            task, actor = entry
            outcome, value = _outcome(ref)
            if outcome == "died":
                self._actor_died(actor, task, value, done)
            else:
                self._settle(task, outcome, value, done)
        self._drain_backlog()
        self._reap_retired()
        return done

    def _settle(self, task: Task, outcome: str, value, done: list) -> None:
        if outcome == "ok":
            self.recovery.finish(task, value, done)
        else:  # the item raised; the actor lives
            self.recovery.raised(task, _root_cause(value), done)

    def _actor_died(self, actor, task: Task, exc: Exception, done: list) -> None:
        """Every task the actor held is judged by its own outcome: those it finished before dying keep
        their results (``ray.wait`` may report the death first); the ones that died with it go to
        recovery, which charges a death only to a task that died alone."""
        others = {r: t for r, (t, a) in self.in_flight.items() if a is actor}
        for ref in others:
            del self.in_flight[ref]
        died = [task]
        if others:  # a dead actor's refs all resolve soon: to a result or to the death
            settled, _ = ray.wait(list(others), num_returns=len(others), timeout=self.DEAD_ACTOR_SETTLE_S)
            for ref, t in others.items():
                outcome, value = _outcome(ref) if ref in settled else ("died", exc)
                if outcome == "died":
                    died.append(t)
                else:
                    self._settle(t, outcome, value, done)
        self._replace(actor, exc)
        self.recovery.died(died, f"{type(exc).__name__}: {_root_cause(exc)}", done)

    def _drain_backlog(self) -> None:
        """Backlogged tasks in order, each as soon as an actor can take it (a solo task waits for an
        idle one without holding back those behind it)."""
        backlog = self.recovery.backlog
        for task in list(backlog):
            actor = self._free_actor(task.solo)
            if actor is not None:
                backlog.remove(task)
                self._dispatch(task, actor)

    def _replace(self, actor, exc) -> None:
        if actor not in self.actors:
            return  # retiring, or already replaced
        self.replaced += 1
        log.warning("rank %d: preprocessing actor died (%s); replacing it and redoing its items",
                    self.rank, type(exc).__name__)
        self.actors.remove(actor)
        self.grow()

    def _reap_retired(self) -> None:
        for a in list(self.retiring):
            if self.load(a) == 0:
                ray.kill(a)
                self.retiring.remove(a)

    def shutdown(self) -> None:
        for a in self.actors + self.retiring + [a for a, _ in self.starting.values()]:
            ray.kill(a)
        self.actors, self.retiring, self.starting = [], [], {}
