"""The data service on Ray: one feeder per data-parallel rank, over a pool of preprocessing actors
(``datasvc.service.pool``).

    DataService (datasvc.service.client; the driver: holds handles and config, never bulk data)
      └─ Feeder, one per DP rank: a ``BlockProducer`` (datasvc.stream.producer) fed by a pool of actors,
         bounding what is ahead (datasvc.service.ready) and autoscaling the pool (datasvc.service.scaling)
           └─ PreprocessActor x [min_actors, max_actors] (read -> decode -> preprocess -> tokenize)
    DataClient, one per trainer rank (datasvc.service.client): pulls micro-batch refs from its feeder.

A micro-batch is put in the object store once by its feeder; every consumer rank of that
replica (TP/PP/CP) fetches the same object.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, fields

import ray

from datasvc.config import ServiceConfig
from datasvc.pack.epoch import Position
from datasvc.service.locality import NodeShare, Placement, near
from datasvc.stream.balanced import BalancedProducer
from datasvc.stream.producer import BlockProducer, DataServiceError, EndOfData, check_dataset  # noqa: F401  (errors)
from datasvc.service.pool import ActorPool
from datasvc.service.ready import End, Handout, ReadyQueue
from datasvc.service.scaling import Autoscaler, ScalePolicy, ScaleRecord
from datasvc.stream.loaderstate import LoaderState
from datasvc.stream.rankstats import RankStats

log = logging.getLogger("vlmfeed.service")


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
    autoscale_decisions: list[ScaleRecord]
    placement: Placement  # bytes handed out on and off the node, the node's budget
    dataset: dict  # the shard files planned over (what a saved state is checked against)
    done: bool
    error: str

    def as_dict(self) -> dict:
        own = {f.name: getattr(self, f.name) for f in fields(self)
               if f.name not in ("stream", "placement", "autoscale_decisions")}
        return {**self.stream.as_dict(), **own, "autoscale_decisions": [d.as_dict() for d in self.autoscale_decisions],
                **self.placement.as_dict()}


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
            self.producer = (BalancedProducer if cfg.balance.enabled else BlockProducer)(cfg, rank, start, self.pool)
        except BaseException:
            self.pool.shutdown()
            raise
        self.start = self.producer.start
        self.ready = ReadyQueue(cfg.pool.max_batches_ahead, cfg.pool.max_bytes_ahead, cfg.consumers_per_replica)
        self.autoscaler = Autoscaler(ScalePolicy(cfg.pool.min_actors, cfg.pool.max_actors))
        # The consumers of a replica take a step at once, and the placement counters are plain ints.
        self._placement_lock = threading.Lock()
        self._stopping = threading.Event()  # wakes the autoscaler at once on shutdown
        self._thread = threading.Thread(target=self._produce, name=f"feeder-{rank}", daemon=True)
        self._thread.start()
        # Its own thread: the producer cannot notice it is blocked while it is blocked.
        self._scaler = threading.Thread(target=self._autoscale_loop, name=f"autoscale-{rank}", daemon=True)
        self._scaler.start()

    # ---- consumer side -------------------------------------------------------------------------
    def next_batch(self, consumer: int, step: int, node: str = "") -> Handout | End:
        """Micro-batch ``step`` (``node``: the consumer's), or ``End`` after the last one."""
        ready = self.ready.take(consumer, step)
        if isinstance(ready, End):
            return ready
        with self._placement_lock:
            self.pool.place.handed(node, ready.nbytes)
        return Handout(ready.ref, ready.position)

    def stats(self) -> FeederStats:
        """The producer's stats (accounting, stages, tokens) with this feeder's queue and pool."""
        stream = self.producer.stats()
        queue = self.ready.report()
        return FeederStats(
            stream=stream, queue_depth=queue.depth, queue=queue.occupancy, bytes_ahead=queue.bytes_ahead,
            actors=self.pool.size, actors_starting=len(self.pool.starting), actors_replaced=self.pool.replaced,
            items_split=self.pool.recovery.splits, items_in_flight=len(self.pool.in_flight),
            consumer_wait_s=round(queue.consumer_wait_s, 3), producer_blocked_s=round(queue.producer_blocked_s, 3),
            autoscale_decisions=list(self.autoscaler.decisions),
            placement=self.pool.place.report(), dataset=self.producer.plan.dataset,
            done=queue.end is not None, error=queue.end.error if queue.end else "")

    def actor_handles(self) -> list:
        """The live preprocessing actors (the profiler meters their CPU time)."""
        return list(self.pool.actors)

    def shutdown(self) -> None:
        self.ready.stop()  # a producer waiting for room gives up at once
        self.producer.stop()
        self._stopping.set()
        self._thread.join(timeout=10)
        self.pool.shutdown()

    # ---- producer side -------------------------------------------------------------------------
    def _produce(self) -> None:
        try:
            for batch, pos in self.producer.micro_batches():
                if not self.ready.wait_for_room(batch.nbytes):
                    break
                self.ready.put(pos.step, ray.put(batch), pos, batch.nbytes)
            end = End(steps=self.producer.position().step)
        except Exception as exc:  # delivered to every consumer instead of a hang
            log.exception("rank %d: producer failed", self.rank)
            end = End(error=f"{type(exc).__name__}: {exc}", steps=self.producer.position().step)
        self.pool.shutdown()  # the stream is over: give the actors' CPUs back
        self.ready.finish(end)

    def _autoscale_loop(self) -> None:
        last_log = time.monotonic()
        while not self.ready.done and not self._stopping.is_set():
            if time.monotonic() - last_log >= 30:
                last_log = time.monotonic()
                self._log_progress()
            t0 = time.monotonic()
            if self._stopping.wait(self.cfg.pool.autoscale_interval_s):
                return
            waited, blocked = self.ready.waited_total(), self.ready.blocked_total()
            with self.pool.lock:
                if not self.ready.done:
                    self._autoscale(waited, blocked, time.monotonic() - t0)

    def _log_progress(self) -> None:
        s = self.producer.stats()
        a = s.accounting
        log.info("rank %d: %d micro-batches, read %d delivered %d quarantined %d, queue %d, actors %d, "
                 "consumer wait %.1fs, producer blocked %.1fs, stages %s", self.rank, s.stream.micro_batches, a.read,
                 a.delivered, a.n_quarantined, self.ready.depth, self.pool.size,
                 self.ready.waited_total(), self.ready.blocked_total(), dict(s.stages.seconds.items()))

    def _autoscale(self, waited_total: float, blocked_total: float, interval: float) -> None:
        decision = self.autoscaler.decide(self.pool.size, waited_total, blocked_total, interval)
        if decision is None:
            return
        if decision.action == "up":
            if not self.pool.place.take():  # the node's preprocessing budget is spent
                return
            self.pool.grow()
        else:
            self.pool.shrink()
            self.pool.place.give()
        record = self.autoscaler.carried_out(decision, self.pool.size)
        log.info("rank %d autoscale %s -> %d actors: %s", self.rank, record.action, record.actors, record.reason)


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

