"""One data-parallel rank's stream of micro-batches, with no Ray: plan -> process -> pack -> chain
-> position. The one in-process path: the service's feeder runs it with its actor pool, and
inspect, the benches and the soak run it in this process.

    producer = BlockProducer(cfg, rank=0)               # items processed here, one at a time
    for batch, pos in producer.micro_batches():         # PackedBatch, and the Position it sits at
        ...
    producer.stats()                                    # accounting, stages, tokens, position

- ``BlockProducer(cfg, rank=0, start=None, process=None)``: ``start`` is a ``Position`` (or its
  dict) to continue a saved stream exactly; ``process`` is a callable ``WorkItem -> ItemResult``
  run inline (default: ``ItemProcessor(cfg)``, what a preprocessing actor runs) or an
  ``ItemRunner`` that keeps many items in flight (the feeder's actor pool).
- ``micro_batches()`` yields ``(PackedBatch, Position)``; ``blocks()`` / ``next_block()`` give
  whole packed ``Block``s instead. Use one of them per producer: they share the stream.
- ``position()``: where a restore would continue (the micro-batch after the last one handed out).
- ``stats()``: a ``RankStats`` (what the feeder's stats wrap with its queue and pool). Its
  ``in_flight`` counts samples read and packed but not handed out yet (the rest of the block being
  handed out, and the rows its chain holds for the next block), so that at any moment
  ``accounting.balanced(in_flight)``: read == delivered + quarantined + skipped_by_rule + in_flight.

Errors no retry can fix (a rank with no work, an epoch whose every sample was rejected, a failure
budget spent) raise ``DataServiceError`` from the iterator.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

from datasvc.batch import PackedBatch
from datasvc.config import ServiceConfig
from datasvc.pack.epoch import EpochPlan, Position, dataset_changes, dataset_fingerprint
from datasvc.read.blend import SourceCounts
from datasvc.read.shards import expand_shards
from datasvc.rejects import RULE_PREFIX, RULE_REASONS, Accounting
from datasvc.stats import StageTimes, StreamStats
from datasvc.stream.rankstats import RankStats
from datasvc.wire import ItemResult, WorkItem


class DataServiceError(RuntimeError):
    """An error no retry can fix; raised in the client with the reason."""


class EndOfData(StopIteration):
    """The configured epochs are exhausted."""


class ItemRunner(Protocol):
    """Processes work items, possibly many at once; results come back in any order."""

    def has_room(self) -> bool: ...

    def submit(self, key, item: WorkItem) -> bool: ...

    def collect(self, timeout: float) -> list[tuple[object, ItemResult]]: ...


class InlineRunner:
    """An ``ItemRunner`` that processes one item at a time, in this process, when collected."""

    def __init__(self, process: Callable[[WorkItem], ItemResult]):
        self.process = process
        self.pending: list = []

    def has_room(self) -> bool:
        return not self.pending

    def submit(self, key, item: WorkItem) -> bool:
        if self.pending:
            return False
        self.pending.append((key, item))
        return True

    def collect(self, timeout: float) -> list[tuple[object, ItemResult]]:
        done = [(key, self.process(item)) for key, item in self.pending]
        self.pending = []
        return done


@dataclass(frozen=True, slots=True)
class Block:
    """One packed block: its micro-batches to deliver (those a restore had already delivered left
    out), each with its position."""

    epoch: int
    index: int
    batches: list[tuple[PackedBatch, Position]]


class FailureBudget:
    """Stops a stream that rejects too much, naming the top reasons (SPDL's ``max_failures``,
    Energon's failure tolerance): ``max_consecutive`` quarantined samples in a row, or a share of
    quarantined samples above ``max_rate`` once ``min_samples`` were read. Rule skips do not count."""

    def __init__(self, max_consecutive: int | None, max_rate: float | None, min_samples: int):
        self.max_consecutive, self.max_rate, self.min_samples = max_consecutive, max_rate, min_samples
        self.consecutive = 0

    def observe(self, item: WorkItem, result: ItemResult, total: Accounting, rank: int) -> None:
        ruled = {r.key for r in result.accounting.log if r.reason in RULE_REASONS or r.reason.startswith(RULE_PREFIX)}
        bad = {r.key for r in result.accounting.log} - ruled
        good = {s.key for s in result.samples}
        self._check_rules(total, rank)
        for s in item.samples:
            if s.key in good:
                self.consecutive = 0
            elif s.key in bad:
                self.consecutive += 1
                if self.max_consecutive is not None and self.consecutive >= self.max_consecutive:
                    raise DataServiceError(
                        f"rank {rank}: {self.consecutive} samples in a row were rejected (max_consecutive_rejections="
                        f"{self.max_consecutive}); top reasons: {_top(total)}. Fix the data, or raise "
                        "max_consecutive_rejections (None: no limit)")
        rate = total.n_quarantined / max(1, total.read)
        if self.max_rate is not None and total.read >= self.min_samples and rate > self.max_rate:
            raise DataServiceError(
                f"rank {rank}: {total.n_quarantined} of {total.read} samples read ({rate:.1%}) were rejected, "
                f"over max_rejection_rate={self.max_rate}; top reasons: {_top(total)}. Fix the data, or raise "
                "max_rejection_rate (None: no limit)")


    def _check_rules(self, total: Accounting, rank: int) -> None:
        """A filter no sample passes is a mistake in the filter (a field no sample has, a threshold out
        of range), not bad data: stop once the failure budget's count of samples were read and every
        one was skipped by a rule, naming the rules."""
        limit = self.max_consecutive or self.min_samples
        if total.delivered == 0 and total.n_skipped >= limit:
            rules = ", ".join(f"{rule} x{count}" for rule, count in total.skipped_by_rule.most_common(3))
            raise DataServiceError(
                f"rank {rank}: none of the first {total.read} samples read passed the filters ({rules}); check each "
                "rule's field name and threshold against the data (vlmfeed info shows the metadata fields), or raise "
                "max_consecutive_rejections for a rule this selective")


def check_dataset(cfg: ServiceConfig, saved: dict | None) -> None:
    """A saved loader state (its ``dataset``: ``plan.dataset_fingerprint``) resumes exactly only over
    the shard files it was planned over: raise saying what changed, or, with
    ``cfg.replan_on_dataset_change``, warn that the stream is re-planned over the files as they are."""
    if not saved:  # a state saved before states recorded their files
        return
    changes = dataset_changes(saved, dataset_fingerprint(expand_shards(list(cfg.shards))))
    if not changes:
        return
    if not cfg.replan_on_dataset_change:
        raise DataServiceError(
            f"the shard files changed since this loader state was saved: {changes}. Restore over the files as "
            "they were, or set replan_on_dataset_change=True to re-plan over the files as they are now (samples "
            "of the epoch under way may then repeat or be missed)")
    logging.getLogger("vlmfeed.service").warning(
        "the shard files changed since this loader state was saved (%s); re-planning over the files as they are "
        "now, from the saved position (replan_on_dataset_change)", changes)


def mark_samples(item: WorkItem, samples: list) -> None:
    """Give each encoded sample of ``item`` the epoch it was drawn for and its ordinal in the plan.
    A key the item holds twice (``repeated_key``) gives its ordinals out in order, one per sample:
    two samples with one ordinal would carry one of them twice into a restored chain."""
    ordinals: dict[str, list[int]] = {}
    for s, ordinal in zip(item.samples, item.ordinals):
        ordinals.setdefault(s.key, []).append(ordinal)
    for s in samples:
        left = ordinals.get(s.key)
        s.epoch, s.ordinal = item.epoch, left.pop(0) if left else -1


def _top(acct: Accounting, n: int = 3) -> str:
    return ", ".join(f"{reason} x{count}" for reason, count in acct.quarantined.most_common(n)) or "none"


class BlockProducer:
    """A rank's deterministic stream of packed micro-batches (see the module docstring)."""

    LOOKAHEAD_BLOCKS = 3  # blocks whose items are in flight at once: keeps a pool busy across blocks

    def __init__(self, cfg: ServiceConfig, rank: int = 0, start: Position | dict | None = None,
                 process: Callable[[WorkItem], ItemResult] | ItemRunner | None = None, *,
                 plan: EpochPlan | None = None):
        self.cfg, self.rank = cfg, rank
        self.plan = plan if plan is not None else EpochPlan(cfg)
        self.start = (start if isinstance(start, Position) else Position(**start) if start
                      else Position(epoch=self.plan.first_epoch))
        layout = cfg.model_layout()
        self.pad_id, self.spec = layout.pad_id, layout.vision
        if process is None:
            from datasvc.stream.process import ItemProcessor

            process = ItemProcessor(cfg)
        self.runner: ItemRunner = process if hasattr(process, "submit") else InlineRunner(process)
        self.acct = Accounting()
        self.sources = SourceCounts(self.plan.blend) if cfg.blend else None  # per blend source
        self.times = StageTimes()
        self.stream = StreamStats()
        self.budget = FailureBudget(cfg.budget.max_consecutive_rejections, cfg.budget.max_rejection_rate,
                                    cfg.budget.rejection_rate_min_samples)
        self._held: list = []  # samples of the rows the last block held for the next one
        self._carry_in = self.start.carry  # (epoch, ordinal[, waited]) of the samples held into the current chain
        self._carried_waits = {(c[0], c[1]): c[2] for c in self.start.carry if len(c) > 2}  # read again on restore
        self._packed_any = False
        self._unsent = 0  # samples in packed micro-batches not handed out yet
        self._packing = 0  # samples of the block being packed (read, not packed yet)
        self._next = self.start
        self._stop = False
        self._lock = threading.Lock()  # stats() may be called from another thread
        self._blocks_iter: Iterator[Block] | None = None

    # ---- the stream --------------------------------------------------------------------------
    def micro_batches(self) -> Iterator[tuple[PackedBatch, Position]]:
        for block in self._packed_blocks():
            for batch, pos in block.batches:
                self._hand_out(batch, pos)
                yield batch, pos

    def blocks(self) -> Iterator[Block]:
        for block in self._packed_blocks():
            for batch, pos in block.batches:
                self._hand_out(batch, pos)
            yield block

    def next_block(self) -> Block | None:
        """The next packed block, or None at the end of the configured epochs."""
        if self._blocks_iter is None:
            self._blocks_iter = self.blocks()
        return next(self._blocks_iter, None)

    def position(self) -> Position:
        """The position of the next micro-batch: where a restore would continue."""
        return self._next

    def stop(self) -> None:
        """End the stream at the next item boundary (from any thread)."""
        self._stop = True

    def stats(self) -> RankStats:
        with self._lock:
            return RankStats.snapshot(self.rank, self.start, self._next, self.acct, self._in_flight(), self.times,
                                      self.stream, self.sources.totals() if self.sources else None)

    def _in_flight(self) -> int:
        return self._unsent + len(self._held) + self._packing

    def _hand_out(self, batch: PackedBatch, pos: Position) -> None:
        with self._lock:
            self.acct.delivered += len(batch.sample_keys)
            self._unsent -= len(batch.sample_keys)
            if self.sources:
                self.sources.add_delivered(batch.sample_keys)
            self.stream.add_batch(batch, self.spec.merge_size)
            self._next = pos.moved(1)

    # ---- planning ----------------------------------------------------------------------------
    def _schedule(self):
        """(epoch, block, items, ends_stream) lazily, from the first block of the start
        position's chain: the blocks before the start position only rebuild the rows that chain holds.
        A restore's first block reads the samples carried into its chain first."""
        chain = self.cfg.chain_blocks
        first = self.start.block - self.start.block % chain
        spanning = self.cfg.blocks_span_epochs and self.plan.items_per_epoch(self.rank) > 0
        blocks = self.plan.spanning_blocks(self.rank, first) if spanning else self._epoch_blocks(first)
        current = next(blocks, None)
        carried = [self.plan.sample_item(c[0], c[1]) for c in self.start.carry]
        while current is not None:
            following = next(blocks, None)
            epoch, block, items = current
            # Rows are held over to the next block until the stream ends (or, when blocks do not span
            # epochs, until the epoch ends): only its very last rows train part empty.
            ends_stream = following is None or (not spanning and following[0] != epoch)
            yield epoch, block, carried + items, ends_stream
            carried = []
            current = following

    def _epoch_blocks(self, first: int):
        epoch = self.start.epoch
        while self.cfg.epochs is None or epoch < self.cfg.epochs:
            blocks = self.plan.blocks(epoch, self.rank)
            if not blocks and self.plan.partly_trained(epoch):
                epoch += 1  # an epoch the remainder had nearly done: nothing of it left for this rank
                continue
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

    # ---- processing and packing ----------------------------------------------------------------
    def _packed_blocks(self) -> Iterator[Block]:
        schedule = self._schedule()
        upcoming: deque = deque()  # (epoch, block, items, ends_stream) fetched, not yet packed
        results: dict = {}
        submitted: set = set()
        step = self.start.step
        epoch_samples: dict[int, int] = {}  # samples that reached packing and fit a row, per epoch
        exhausted = False
        while not self._stop:
            while not exhausted and len(upcoming) < self.LOOKAHEAD_BLOCKS:
                nxt = next(schedule, None)
                if nxt is None:
                    exhausted = True
                else:
                    upcoming.append(nxt)
            if not upcoming:
                break
            for e, b, items, _ in upcoming:  # keep the runner busy: this block's items, then the next's
                for i, item in enumerate(items):
                    key = (e, b, i)
                    if key not in submitted and self.runner.has_room() and self.runner.submit(key, item):
                        submitted.add(key)
            for key, res in self.runner.collect(timeout=0.2):
                results[key] = res
            e, b, items, ends_stream = upcoming[0]
            if all((e, b, i) in results for i in range(len(items))):
                upcoming.popleft()
                done = [results.pop((e, b, i)) for i in range(len(items))]
                submitted.difference_update((e, b, i) for i in range(len(items)))
                block = self._pack(e, b, items, done, step, epoch_samples, ends_stream)
                step += len(block.batches)
                yield block
        if self._stop:  # stopped mid-stream: an epoch cut short is not an all-rejected epoch
            return
        for e, n in epoch_samples.items():
            if n == 0:
                raise DataServiceError(f"rank {self.rank}: epoch {e} produced no micro-batches; every sample "
                                       f"was rejected: {self.acct.as_dict()}")

    def _pack(self, epoch: int, block: int, items: list[WorkItem], results: list[ItemResult], step: int,
              epoch_samples: dict, ends_stream: bool) -> Block:
        samples = []
        with self._lock:
            for item, r in zip(items, results):
                mark_samples(item, r.samples)
                if self._carried_waits:
                    for s in r.samples:
                        s.waited = self._carried_waits.pop((s.epoch, s.ordinal), s.waited)
                samples.extend(r.samples)
                self.acct.merge(r.accounting)
                if self.sources:
                    self.sources.add_item(item, r)
                self.times.merge(r.times)
                self.stream.images += r.images
                self.stream.megapixels += r.megapixels
            self._packing = len(samples)
        for item, r in zip(items, results):
            self.budget.observe(item, r, self.acct, self.rank)
        if block % self.cfg.chain_blocks == 0 and self._packed_any:  # a chain starts with what the last one held
            self._carry_in = tuple((s.epoch, s.ordinal, s.waited) if s.waited else (s.epoch, s.ordinal)
                                   for s in self._held)
        self._packed_any = True
        t0 = time.perf_counter()
        to_pack = self._held + samples
        oldest = min((s.epoch for s in to_pack), default=epoch)
        batches, too_long, held = self.plan.pack_block(to_pack, epoch, self.rank, block, self.pad_id,
                                                       self.spec.patch_dim, hold=not ends_stream)
        with self._lock:
            self._held, self._packing = held, 0
            self.times.add("pack", time.perf_counter() - t0, len(batches))
            for s in too_long:
                self.acct.reject(s.shard, s.key, "longer_than_seq_len",
                                 f"{s.num_tokens} tokens > seq_len {self.cfg.seq_len}")
            epoch_samples[epoch] = epoch_samples.get(epoch, 0) + len(samples) - len(too_long)
            if self._before_start(epoch, block):
                skip = len(batches)
            elif (epoch, block) == (self.start.epoch, self.start.block):
                skip = self.start.batch
            else:
                skip = 0
            # Samples of skipped micro-batches were delivered before the restore.
            self.acct.delivered += sum(len(b.sample_keys) for b in batches[:skip])
            if self.sources:
                for b in batches[:skip]:
                    self.sources.add_delivered(b.sample_keys)
            self._unsent += sum(len(b.sample_keys) for b in batches[skip:])
        out = [(batch, Position(epoch, block, i, step + i - skip, self._carry_in, oldest))
               for i, batch in enumerate(batches) if i >= skip]
        return Block(epoch, block, out)
