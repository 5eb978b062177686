"""The data service on Ray: one feeder per data-parallel rank, over a pool of preprocessing actors
(``datasvc.service.pool``).

    DataService (datasvc.service.client; the driver: holds handles and config, never bulk data)
      └─ Feeder, one per DP rank: a ``BlockProducer`` (datasvc.stream.producer) fed by a pool of actors,
         bounding what is ahead and autoscaling the pool
           └─ PreprocessActor x [min_actors, max_actors] (read -> decode -> preprocess -> tokenize)
    DataClient, one per trainer rank (datasvc.service.client): pulls micro-batch refs from its feeder.

A micro-batch is put in the object store once by its feeder; every consumer rank of that
replica (TP/PP/CP) fetches the same object.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, fields

import ray

from datasvc.config import ServiceConfig
from datasvc.pack.plan import Position
from datasvc.service.locality import NodeShare, near
from datasvc.stream.balanced import BalancedProducer
from datasvc.stream.producer import BlockProducer, DataServiceError, EndOfData, check_dataset  # noqa: F401  (errors)
from datasvc.service.pool import ActorPool
from datasvc.service.scaling import ScalePolicy
from datasvc.stats import QueueStats
from datasvc.stream.loaderstate import LoaderState
from datasvc.stream.rankstats import RankStats

log = logging.getLogger("vlmfeed.service")


@dataclass(frozen=True, slots=True)
class End:
    """Sentinel returned by ``Feeder.next_batch`` after the last micro-batch (or on error)."""

    error: str = ""
    steps: int = 0


@dataclass(slots=True)
class FeederStats:
    """A feeder's report: its rank's stream (``RankStats``) with the queue ahead of the consumers and
    the actor pool behind it. ``as_dict()`` is the JSON form (the stream's keys at the top level)."""

    stream: RankStats
    queue_depth: int
    queue: dict  # QueueStats.as_dict(): occupancy and full rates
    bytes_ahead: int
    actors: int
    actors_starting: int
    actors_replaced: int
    items_split: int
    items_in_flight: int
    consumer_wait_s: float
    producer_blocked_s: float
    autoscale_decisions: list[dict]
    placement: dict  # NodeShare.as_dict(): bytes handed out on and off the node, the node's budget
    dataset: dict  # the shard files planned over (what a saved state is checked against)
    done: bool
    error: str

    def as_dict(self) -> dict:
        own = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("stream", "placement")}
        return {**self.stream.as_dict(), **own, **self.placement}


# num_cpus=0: it only moves object refs, so it must not take a CPU slot from the preprocessing actors;
# max_concurrency: its consumers (every TP/PP/CP rank of the replica) wait in next_batch() at once, beside
# stats() and shutdown(), so one thread would serialize them
@ray.remote(num_cpus=0, max_concurrency=64)
class Feeder:
    """One data-parallel rank's stream: a ``BlockProducer`` over this feeder's pool, its micro-batches
    put in the object store and held, bounded, until every consumer of the replica took them."""

    def __init__(self, cfg: ServiceConfig, rank: int, start: Position | None = None, run: str = "vlmfeed"):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        self.cfg, self.rank = cfg, rank
        self.pool = ActorPool(cfg, rank, NodeShare(run, rank, cfg))  # its actors beside it, within the node's budget
        try:
            # balance_dp: this feeder plans every rank's micro-batches and decodes only its share.
            self.producer = (BalancedProducer if cfg.balance_dp else BlockProducer)(cfg, rank, start, self.pool)
        except BaseException:
            self.pool.shutdown()
            raise
        self.start = self.producer.start
        self.cond = threading.Condition()
        self.queue: OrderedDict[int, tuple] = OrderedDict()  # step -> (ref, position, nbytes, taken)
        self.queue_stats = QueueStats(cfg.max_batches_ahead)
        self.bytes_ahead = 0
        self.end: End | None = None
        self.consumer_wait_s = 0.0
        self._waiting: dict = {}  # consumer -> when its pending next_batch call started
        self.producer_blocked_s = 0.0
        self._blocked_since: float | None = None
        self.decisions: list[dict] = []
        self.scale_policy = ScalePolicy(cfg.min_actors, cfg.max_actors)
        self._stop = False
        self._stopping = threading.Event()  # wakes the autoscaler at once on shutdown
        self._thread = threading.Thread(target=self._produce, name=f"feeder-{rank}", daemon=True)
        self._thread.start()
        # Its own thread: the producer cannot notice it is blocked while it is blocked.
        self._scaler = threading.Thread(target=self._autoscale_loop, name=f"autoscale-{rank}", daemon=True)
        self._scaler.start()

    # ---- consumer side -------------------------------------------------------------------------
    def next_batch(self, consumer: int, step: int, node: str = "") -> list:
        """``[ref, position]`` of micro-batch ``step`` (``node``: the consumer's), or ``[End]`` after the last one."""
        t0 = time.perf_counter()
        with self.cond:
            if step not in self.queue:
                self._waiting[consumer] = t0
            while step not in self.queue and self.end is None:
                if self.queue and step < next(iter(self.queue)):
                    return [End(error=f"step {step} was already released; restore from a saved state")]
                self.cond.wait(timeout=0.5)
            self._waiting.pop(consumer, None)
            self.consumer_wait_s += time.perf_counter() - t0
            if step not in self.queue:
                return [self.end]
            ref, pos, nbytes, taken = self.queue[step]
            taken.add(consumer)
            self.pool.place.handed(node, nbytes)
            if len(taken) >= self.cfg.consumers_per_replica:
                del self.queue[step]
                self.queue_stats.get()
                self.bytes_ahead -= nbytes
                self.cond.notify_all()
            return [ref, pos.as_dict()]

    def stats(self) -> FeederStats:
        """The producer's stats (accounting, stages, tokens) with this feeder's queue and pool."""
        stream = self.producer.stats()
        with self.cond:
            return FeederStats(
                stream=stream, queue_depth=len(self.queue), queue=self.queue_stats.as_dict(),
                bytes_ahead=self.bytes_ahead, actors=self.pool.size, actors_starting=len(self.pool.starting),
                actors_replaced=self.pool.replaced, items_split=self.pool.recovery.splits,
                items_in_flight=len(self.pool.in_flight), consumer_wait_s=round(self.consumer_wait_s, 3),
                producer_blocked_s=round(self._blocked_total(), 3), autoscale_decisions=list(self.decisions),
                placement=self.pool.place.as_dict(), dataset=self.producer.plan.dataset,
                done=self.end is not None, error=self.end.error if self.end else "")

    def actor_handles(self) -> list:
        """The live preprocessing actors (the profiler meters their CPU time)."""
        return list(self.pool.actors)

    def shutdown(self) -> None:
        self._stop = True
        self.producer.stop()
        self._stopping.set()
        with self.cond:
            self.cond.notify_all()
        self._thread.join(timeout=10)
        self.pool.shutdown()

    # ---- producer side -------------------------------------------------------------------------
    def _produce(self) -> None:
        try:
            for batch, pos in self.producer.micro_batches():
                if not self._wait_for_room(batch.nbytes):
                    break
                ref = ray.put(batch)
                with self.cond:
                    self.queue[pos.step] = (ref, pos, batch.nbytes, set())
                    self.queue_stats.put()
                    self.bytes_ahead += batch.nbytes
                    self.cond.notify_all()
            end = End(steps=self.producer.position().step)
        except Exception as exc:  # delivered to every consumer instead of a hang
            log.exception("rank %d: producer failed", self.rank)
            end = End(error=f"{type(exc).__name__}: {exc}", steps=self.producer.position().step)
        self.pool.shutdown()  # the stream is over: give the actors' CPUs back
        with self.cond:
            self.end = end
            self.cond.notify_all()

    def _wait_for_room(self, nbytes: int) -> bool:
        """Block while the queue is full (by count or bytes); False when shut down meanwhile."""
        t0 = time.perf_counter()
        self._blocked_since = t0
        with self.cond:
            while (self.queue and (len(self.queue) >= self.cfg.max_batches_ahead
                                   or self.bytes_ahead + nbytes > self.cfg.max_bytes_ahead)
                   and not self._stop):
                self.cond.wait(timeout=0.5)
        self._blocked_since = None
        self.producer_blocked_s += time.perf_counter() - t0
        return not self._stop

    def _blocked_total(self) -> float:
        since = self._blocked_since
        return self.producer_blocked_s + (time.perf_counter() - since if since is not None else 0.0)

    def _autoscale_loop(self) -> None:
        wait_mark, blocked_mark = self._waited_total(), self._blocked_total()
        last_log = time.monotonic()
        while self.end is None and not self._stop:
            if time.monotonic() - last_log >= 30:
                last_log = time.monotonic()
                self._log_progress()
            t0 = time.monotonic()
            if self._stopping.wait(self.cfg.autoscale_interval_s):
                return
            waited, blocked = self._waited_total(), self._blocked_total()
            with self.pool.lock:
                if self.end is None:
                    self._autoscale(waited - wait_mark, blocked - blocked_mark, time.monotonic() - t0)
            wait_mark, blocked_mark = waited, blocked

    def _log_progress(self) -> None:
        s = self.producer.stats()
        a = s.accounting
        log.info("rank %d: %d micro-batches, read %d delivered %d quarantined %d, queue %d, actors %d, "
                 "consumer wait %.1fs, producer blocked %.1fs, stages %s", self.rank, s.stream.micro_batches, a.read,
                 a.delivered, a.n_quarantined, len(self.queue), self.pool.size,
                 self._waited_total(), self._blocked_total(), dict(s.stages.seconds.items()))

    def _waited_total(self) -> float:
        return self.consumer_wait_s + sum(time.perf_counter() - t for t in list(self._waiting.values()))

    def _autoscale(self, waited: float, blocked: float, interval: float) -> None:
        decision = self.scale_policy.decide(self.pool.size, waited, blocked, interval)
        if decision is None:
            return
        action, reason = decision
        if action == "up":
            if not self.pool.place.take():  # the node's preprocessing budget is spent
                return
            self.pool.grow()
        else:
            self.pool.shrink()
            self.pool.place.give()
        d = {"time": time.time(), "action": action, "actors": self.pool.size, "reason": reason}
        self.decisions.append(d)
        log.info("rank %d autoscale %s -> %d actors: %s", self.rank, action, d["actors"], reason)


def feeder_name(run: str, rank: int) -> str:
    return f"{run}-feeder-{rank}"


def start_feeder(cfg: ServiceConfig, run: str, rank: int, state: LoaderState | None = None, node: str | None = None):
    """The feeder of ``rank``, named for ``run``, on ``node`` if it fits; from a saved loader state if given."""
    if state:
        if state.fingerprint != cfg.fingerprint():
            raise DataServiceError("saved loader state was made with a different data config (shards, seed, "
                                   "seq_len, MBS, dp_size, items_per_block, blocks_span_epochs, chain_blocks, "
                                   "...); restore with the same one")
        check_dataset(cfg, state.dataset)
    start = state.position if state else None
    return Feeder.options(name=feeder_name(run, rank), **near(node, True)).remote(cfg, rank, start, run)  # num_cpus=0

