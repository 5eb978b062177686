"""The data service on Ray: preprocessing actors and one feeder per data-parallel rank.

    DataService (driver: holds handles and config, never bulk data)
      └─ Feeder, one per DP rank (plans, packs, bounds what is ahead, autoscales its pool)
           └─ PreprocessActor x [min_actors, max_actors] (read -> decode -> preprocess -> tokenize)
    DataClient, one per trainer rank (datasvc.client): pulls micro-batch refs from its feeder.

A micro-batch is put in the object store once by its feeder; every consumer rank of that
replica (TP/PP/CP) fetches the same object.
"""
from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import OrderedDict, deque
from dataclasses import dataclass

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError

from datasvc.config import ServiceConfig
from datasvc.plan import EpochPlan, Position
from datasvc.process import ItemResult, StageTimes, WorkItem, process_item
from datasvc.rejects import Accounting
from datasvc.shards import ReadLimits, expand_shards

log = logging.getLogger("vlmfeed.service")


class DataServiceError(RuntimeError):
    """An error no retry can fix; raised in the client with the reason."""


class EndOfData(StopIteration):
    pass


@dataclass(frozen=True, slots=True)
class End:
    """Sentinel returned by ``Feeder.next_batch`` after the last micro-batch (or on error)."""

    error: str = ""
    steps: int = 0


@ray.remote
class PreprocessActor:
    def __init__(self, cfg: ServiceConfig, device_id: int = 0):
        from datasvc.decode import make_decoder
        from datasvc.registry import get_pipeline

        self.pipeline = get_pipeline(cfg.pipeline, **cfg.pipeline_options)
        self.decoder = make_decoder(cfg.decode, num_threads=cfg.decode_threads, device_id=device_id)
        self.limits = ReadLimits(max_images_per_sample=cfg.max_images_per_sample, max_text_bytes=cfg.max_text_bytes)

    def process(self, item: WorkItem) -> ItemResult:
        return process_item(item, self.pipeline, self.decoder, self.limits)

    def pid(self) -> int:
        import os

        return os.getpid()


def _quarantine_item(item: WorkItem, reason: str, detail: str) -> ItemResult:
    acct = Accounting()
    acct.read = len(item.samples)
    for s in item.samples:
        acct.reject(item.shard, s.key, reason, detail)
    return ItemResult(item.item_id, [], acct, StageTimes())


def _root_cause(exc: Exception) -> str:
    """The last ``SomeError: message`` line of a Ray error (the remote exception), else its type."""
    lines = [ln.strip() for ln in str(exc).splitlines() if "Error" in ln and ":" in ln]
    return (lines[-1] if lines else type(exc).__name__)[:300]


class _Pool:
    """Preprocessing actors of one feeder; replaces the dead, resubmits their items.

    A new actor gets work only once it has started: one that the cluster cannot place (no free
    CPUs) would otherwise hold its items forever. Items with no started actor wait in a backlog.
    """

    PENDING_WARN_S = 60.0
    # Killed actors are replaced forever; actors that cannot even start (a missing package, a bad
    # pipeline option) would be too, so this many failures in a row, with no start between, are fatal.
    MAX_START_FAILURES = 5

    def __init__(self, cfg: ServiceConfig, rank: int):
        self.cfg = cfg
        self.rank = rank
        self.actors: list = []  # started, assignable
        self.starting: dict = {}  # ready ref -> (actor, when asked for)
        self.retiring: list = []
        self.backlog: list = []  # (key, item, attempts) waiting for a started actor
        self.in_flight: dict = {}  # ref -> (item_key, item, actor, attempts)
        self.lock = threading.RLock()  # the producer and the autoscaler both change the pool
        self.replaced = 0
        self.start_failures = 0
        self._warned: set = set()
        for _ in range(cfg.min_actors):
            self.grow()

    @property
    def size(self) -> int:
        return len(self.actors) + len(self.starting)

    def _new(self):
        opts = {"num_cpus": self.cfg.decode_threads}
        if self.cfg.decode == "gpu":
            opts["num_gpus"] = self.cfg.decode_gpu_share
        return PreprocessActor.options(**opts).remote(self.cfg)

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
            except (ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError) as exc:
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
                            time.monotonic() - since, self.cfg.decode_threads)

    def load(self, actor) -> int:
        return sum(1 for _, _, a, _ in self.in_flight.values() if a is actor)

    def _free_actor(self):
        candidates = [a for a in self.actors if self.load(a) < 2]
        return min(candidates, key=self.load) if candidates else None

    def submit(self, key, item: WorkItem, attempts: int = 0) -> bool:
        with self.lock:
            self._promote()
            actor = self._free_actor()
            if actor is None:
                return False
            self.in_flight[actor.process.remote(item)] = (key, item, actor, attempts)
            return True

    def has_room(self) -> bool:
        with self.lock:
            self._promote()
            return not self.backlog and self._free_actor() is not None

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
        done = []
        for ref in ready:
            key, item, actor, attempts = self.in_flight.pop(ref)
            try:
                done.append((key, ray.get(ref)))
            except (ActorDiedError, ActorUnavailableError, RayActorError) as exc:
                self._replace(actor, exc)
                self.backlog.append((key, item, attempts))
            except RayTaskError as exc:
                if attempts < 1:
                    self.backlog.append((key, item, attempts + 1))
                else:  # a deterministic failure: count every sample of the item, move on
                    done.append((key, _quarantine_item(item, "worker_error", str(exc).splitlines()[-1][:200])))
        self._drain_backlog()
        self._reap_retired()
        return done

    def _drain_backlog(self) -> None:
        while self.backlog:
            actor = self._free_actor()
            if actor is None:
                return
            key, item, attempts = self.backlog.pop(0)
            self.in_flight[actor.process.remote(item)] = (key, item, actor, attempts)

    def _replace(self, actor, exc) -> None:
        if actor not in self.actors:
            return  # already replaced while collecting an earlier item of the same actor
        self.replaced += 1
        log.warning("rank %d: preprocessing actor died (%s); replacing it and redoing its items",
                    self.rank, type(exc).__name__)
        self.actors.remove(actor)
        self.grow()
        # Items that were queued on the dead actor fail too and come back through collect().

    def _reap_retired(self) -> None:
        for a in list(self.retiring):
            if self.load(a) == 0:
                ray.kill(a)
                self.retiring.remove(a)

    def shutdown(self) -> None:
        for a in self.actors + self.retiring + [a for a, _ in self.starting.values()]:
            ray.kill(a)
        self.actors, self.retiring, self.starting = [], [], {}


@ray.remote(num_cpus=0, max_concurrency=64)
class Feeder:
    """One data-parallel rank's stream: plan, preprocess (through its pool), pack, bound, serve."""

    def __init__(self, cfg: ServiceConfig, rank: int, start: dict | None = None):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        self.cfg = cfg
        self.rank = rank
        self.start = Position(**start) if start else Position()
        self.plan = EpochPlan(cfg)
        from datasvc.registry import get_layout

        layout = get_layout(cfg.pipeline, **cfg.pipeline_options)
        self.pad_id, self.patch_dim = layout.pad_id, layout.vision.patch_dim
        self.pool = _Pool(cfg, rank)
        self.cond = threading.Condition()
        self.queue: OrderedDict[int, tuple] = OrderedDict()  # step -> (ref, position, nbytes, taken)
        self.bytes_ahead = 0
        self.end: End | None = None
        self.acct = Accounting()
        self.times = StageTimes()
        self.images = 0
        self.megapixels = 0.0
        self.text_tokens = 0
        self.vision_tokens = 0
        self.real_tokens = 0
        self.row_tokens = 0
        self.batches = 0
        self._held: list = []  # samples of the rows the last block held for the next one of its chain
        self.consumer_wait_s = 0.0
        self._waiting: dict = {}  # consumer -> when its pending next_batch call started
        self.producer_blocked_s = 0.0
        self._blocked_since: float | None = None
        self.decisions: list[dict] = []
        self._stop = False
        self._stopping = threading.Event()  # wakes the autoscaler at once on shutdown
        self._thread = threading.Thread(target=self._produce, name=f"feeder-{rank}", daemon=True)
        self._thread.start()
        # Its own thread: the producer cannot notice it is blocked while it is blocked.
        self._scaler = threading.Thread(target=self._autoscale_loop, name=f"autoscale-{rank}", daemon=True)
        self._scaler.start()

    # ---- consumer side -------------------------------------------------------------------------
    def next_batch(self, consumer: int, step: int) -> list:
        """``[ref, position]`` of micro-batch ``step``, or ``[End]`` after the last one."""
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
            if len(taken) >= self.cfg.consumers_per_replica:
                del self.queue[step]
                self.bytes_ahead -= nbytes
                self.cond.notify_all()
            return [ref, pos.as_dict()]

    def stats(self) -> dict:
        with self.cond:
            return {
                "rank": self.rank,
                "start": self.start.as_dict(),
                "accounting": self.acct.as_dict(),
                "stages": self.times.as_dict(),
                "queue_depth": len(self.queue),
                "bytes_ahead": self.bytes_ahead,
                "actors": self.pool.size,
                "actors_starting": len(self.pool.starting),
                "actors_replaced": self.pool.replaced,
                "items_in_flight": len(self.pool.in_flight),
                "consumer_wait_s": round(self.consumer_wait_s, 3),
                "producer_blocked_s": round(self._blocked_total(), 3),
                "micro_batches": self.batches,
                "images": self.images,
                "megapixels": round(self.megapixels, 3),
                "text_tokens": self.text_tokens,
                "vision_tokens": self.vision_tokens,
                "packing_efficiency": round(self.real_tokens / max(1, self.row_tokens), 4),
                "autoscale_decisions": list(self.decisions),
                "rejections": [{"shard": r.shard, "key": r.key, "reason": r.reason, "detail": r.detail}
                               for r in self.acct.log[-50:]],
                "done": self.end is not None,
                "error": self.end.error if self.end else "",
            }

    def _blocked_total(self) -> float:
        since = self._blocked_since
        return self.producer_blocked_s + (time.perf_counter() - since if since is not None else 0.0)

    def actor_handles(self) -> list:
        """The live preprocessing actors (for fault-injection tests and tools)."""
        return list(self.pool.actors)

    def shutdown(self) -> None:
        self._stop = True
        self._stopping.set()
        with self.cond:
            self.cond.notify_all()
        self._thread.join(timeout=10)
        self.pool.shutdown()

    # ---- producer side -------------------------------------------------------------------------
    def _schedule(self):
        """(epoch, block, items, ends_chain) lazily, from the first block of the start position's
        chain: the blocks before the start position only rebuild the rows that chain holds."""
        chain = self.cfg.chain_blocks
        first = self.start.block - self.start.block % chain
        spanning = self.cfg.blocks_span_epochs and self.plan.items_per_epoch(self.rank) > 0
        blocks = self.plan.spanning_blocks(self.rank, first) if spanning else self._epoch_blocks(first)
        current = next(blocks, None)
        while current is not None:
            following = next(blocks, None)
            epoch, block, items = current
            ends_chain = (following is None or (block + 1) % chain == 0
                          or (not spanning and following[0] != epoch))
            yield epoch, block, items, ends_chain
            current = following

    def _epoch_blocks(self, first: int):
        epoch = self.start.epoch
        while self.cfg.epochs is None or epoch < self.cfg.epochs:
            blocks = self.plan.blocks(epoch, self.rank)
            if not blocks:
                raise DataServiceError(
                    f"rank {self.rank} gets no work: {len(self.plan._items)} work items for dp_size="
                    f"{self.cfg.dp_size}; lower samples_per_item or dp_size, or add shards")
            for b in range(first if epoch == self.start.epoch else 0, len(blocks)):
                yield epoch, b, blocks[b]
            epoch += 1

    def _before_start(self, epoch: int, block: int) -> bool:
        """A block of the start position's chain that was delivered before the restore."""
        if self.cfg.blocks_span_epochs:
            return block < self.start.block
        return epoch == self.start.epoch and block < self.start.block

    def _produce(self) -> None:
        try:
            self._produce_all()
            end = End(steps=self.start.step + self.batches)
        except Exception as exc:  # delivered to every consumer instead of a hang
            log.exception("rank %d: producer failed", self.rank)
            end = End(error=f"{type(exc).__name__}: {exc}", steps=self.start.step + self.batches)
        self.pool.shutdown()  # the stream is over: give the actors' CPUs back
        with self.cond:
            self.end = end
            self.cond.notify_all()

    def _produce_all(self) -> None:
        schedule = self._schedule()
        upcoming: deque = deque()  # (epoch, block, items) fetched from the schedule, not yet packed
        results: dict = {}
        submitted: set = set()
        step = self.start.step
        epoch_samples: dict[int, int] = {}  # samples that reached packing and fit a row, per epoch
        exhausted = False
        while not self._stop:
            # Keep the pool busy: submit items of the current and following blocks.
            while not exhausted and len(upcoming) < 3:
                nxt = next(schedule, None)
                if nxt is None:
                    exhausted = True
                else:
                    upcoming.append(nxt)
            if not upcoming:
                break
            for e, b, items, _ in upcoming:
                for i, item in enumerate(items):
                    key = (e, b, i)
                    if key not in submitted and self.pool.has_room() and self.pool.submit(key, item):
                        submitted.add(key)
            for key, res in self.pool.collect(timeout=0.2):
                results[key] = res
            e, b, items, ends_chain = upcoming[0]
            if all((e, b, i) in results for i in range(len(items))):
                upcoming.popleft()
                block = [results.pop((e, b, i)) for i in range(len(items))]
                for i in range(len(items)):
                    submitted.discard((e, b, i))
                step = self._emit_block(e, b, block, step, epoch_samples, ends_chain)
        if self._stop:  # shut down mid-stream: an epoch cut short is not an all-rejected epoch
            return
        for e, n in epoch_samples.items():
            if n == 0:
                raise DataServiceError(f"rank {self.rank}: epoch {e} produced no micro-batches; every sample "
                                       f"was rejected: {self.acct.as_dict()}")

    def _emit_block(self, epoch, block, results: list[ItemResult], step, epoch_samples, ends_chain: bool) -> int:
        samples = []
        for r in results:
            samples.extend(r.samples)
            self.acct.merge(r.accounting)
            self.times.merge(r.times)
            self.images += r.images
            self.megapixels += r.megapixels
        t0 = time.perf_counter()
        batches, too_long, held = self.plan.pack_block(self._held + samples, epoch, self.rank, block, self.pad_id,
                                                       self.patch_dim, hold=not ends_chain)
        self._held = held
        self.times.add("pack", time.perf_counter() - t0, len(batches))
        for s in too_long:
            self.acct.reject(s.shard, s.key, "longer_than_seq_len", f"{s.num_tokens} tokens > seq_len {self.cfg.seq_len}")
        epoch_samples[epoch] = epoch_samples.get(epoch, 0) + len(samples) - len(too_long)
        if self._before_start(epoch, block):
            skip = len(batches)
        elif (epoch, block) == (self.start.epoch, self.start.block):
            skip = self.start.batch
        else:
            skip = 0
        for i, batch in enumerate(batches):
            if i < skip:
                continue
            nbytes = batch.nbytes
            t0 = time.perf_counter()
            self._blocked_since = t0
            with self.cond:
                while (self.queue and (len(self.queue) >= self.cfg.max_batches_ahead
                                       or self.bytes_ahead + nbytes > self.cfg.max_bytes_ahead)
                       and not self._stop):
                    self.cond.wait(timeout=0.5)
            self._blocked_since = None
            self.producer_blocked_s += time.perf_counter() - t0
            if self._stop:
                return step
            ref = ray.put(batch)
            with self.cond:
                self.queue[step] = (ref, Position(epoch, block, i, step), nbytes, set())
                self.bytes_ahead += nbytes
                self.cond.notify_all()
            self.acct.delivered += len(batch.sample_keys)
            n_img_tok = int(batch.image_grid_thw.prod(axis=1).sum()) // 4 if len(batch.image_grid_thw) else 0
            self.vision_tokens += n_img_tok
            self.text_tokens += batch.real_tokens - n_img_tok
            self.real_tokens += batch.real_tokens
            self.row_tokens += batch.tokens.size
            self.batches += 1
            step += 1
        # Samples of skipped (already delivered) micro-batches were delivered before the restore.
        for batch in batches[:skip]:
            self.acct.delivered += len(batch.sample_keys)
        return step

    def _autoscale_loop(self) -> None:
        wait_mark, blocked_mark = self._waited_total(), self._blocked_total()
        last_log = time.monotonic()
        while self.end is None and not self._stop:
            if time.monotonic() - last_log >= 30:
                last_log = time.monotonic()
                a = self.acct
                log.info("rank %d: %d micro-batches, read %d delivered %d quarantined %d, queue %d, actors %d, "
                         "consumer wait %.1fs, producer blocked %.1fs, stages %s", self.rank, self.batches, a.read,
                         a.delivered, a.n_quarantined, len(self.queue), self.pool.size,
                         self._waited_total(), self._blocked_total(),
                         {k: v["seconds"] for k, v in self.times.as_dict().items()})
            t0 = time.monotonic()
            if self._stopping.wait(self.cfg.autoscale_interval_s):
                return
            waited, blocked = self._waited_total(), self._blocked_total()
            with self.pool.lock:
                if self.end is None:
                    self._autoscale(waited - wait_mark, blocked - blocked_mark, time.monotonic() - t0)
            wait_mark, blocked_mark = waited, blocked

    def _waited_total(self) -> float:
        return self.consumer_wait_s + sum(time.perf_counter() - t for t in list(self._waiting.values()))

    def _autoscale(self, waited: float, blocked: float, interval: float) -> None:
        n = self.pool.size
        action, reason = None, ""
        if waited > 0.1 * interval and n < self.cfg.max_actors:
            self.pool.grow()
            action, reason = "up", f"consumers waited {waited:.2f}s of {interval:.2f}s for data"
        elif blocked > 0.5 * interval and waited < 0.02 * interval and n > self.cfg.min_actors:
            self.pool.shrink()
            action, reason = "down", f"producer blocked {blocked:.2f}s of {interval:.2f}s on a full queue"
        if action:
            d = {"time": time.time(), "action": action, "actors": self.pool.size, "reason": reason}
            self.decisions.append(d)
            log.info("rank %d autoscale %s -> %d actors: %s", self.rank, action, d["actors"], reason)


def feeder_name(run: str, rank: int) -> str:
    return f"{run}-feeder-{rank}"


class DataService:
    """Starts one feeder per DP rank; hands out per-rank clients; aggregates stats."""

    def __init__(self, cfg: ServiceConfig, run: str = "vlmfeed", restore: dict[int, dict] | None = None):
        expand_shards(list(cfg.shards))  # fail fast, in the driver, when nothing matches
        from datasvc.registry import get_layout

        try:  # fail fast, in the driver, on an unknown pipeline or option
            get_layout(cfg.pipeline, **cfg.pipeline_options)
        except TypeError as exc:
            raise ValueError(f"pipeline {cfg.pipeline!r} does not take these options: {exc}") from None
        self.cfg = cfg
        self.run = run
        self.feeders = [start_feeder(cfg, run, r, (restore or {}).get(r)) for r in range(cfg.dp_size)]
        self._clients: weakref.WeakSet = weakref.WeakSet()

    def client(self, dp_rank: int, consumer: int = 0, **kwargs):
        from datasvc.client import DataClient

        client = DataClient(self.cfg, dp_rank, consumer, run=self.run, **kwargs)
        self._clients.add(client)
        return client

    def stats(self) -> dict:
        per_rank = ray.get([f.stats.remote() for f in self.feeders])
        total = Accounting()
        for s in per_rank:
            a = s["accounting"]
            total.read += a["read"]
            total.delivered += a["delivered"]
            total.quarantined.update(a["quarantined"])
            total.skipped_by_rule.update(a["skipped_by_rule"])
            total.ignored_members.update(a["ignored_members"])
        return {"ranks": per_rank, "accounting": total.as_dict()}

    def shutdown(self) -> None:
        # Halt this service's clients first: a client whose call fails on a killed feeder would
        # otherwise restart it, as it must after a crash, and the restarted feeder would outlive us.
        clients = list(self._clients)
        for c in clients:
            c.halt()
        for f in self.feeders:
            try:
                ray.get(f.shutdown.remote(), timeout=30)
            except Exception:
                pass
            ray.kill(f)
        for c in clients:
            c.close()


def start_feeder(cfg: ServiceConfig, run: str, rank: int, state: dict | None = None):
    start = None
    if state:
        if state.get("fingerprint") != cfg.fingerprint():
            raise DataServiceError("saved loader state was made with a different data config (shards, seed, "
                                   "seq_len, MBS, dp_size, items_per_block, blocks_span_epochs, chain_blocks, "
                                   "...); restore with the same one")
        start = {k: state[k] for k in ("epoch", "block", "batch", "step")}
    return Feeder.options(name=feeder_name(run, rank)).remote(cfg, rank, start)
