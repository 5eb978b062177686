"""A DP rank's vision-balanced stream (``BalanceConfig``), with no Ray and no coordinator.

Every feeder plans every rank's micro-batches, then trains only its share:

1. **Plan.** One ``BlockProducer`` per DP rank runs the ordinary plan (epoch order, blocks, chains,
   packing) over ``HeaderProcessor``: each sample's exact token rows and patch count from its image
   headers and the pipeline's encoder, no pixel decoded. Packing depends on nothing else, so every
   feeder derives the same micro-batches for every rank, bit for bit.
2. **Deal.** Each optimizer step takes the next ``micro_batches_per_step`` planned micro-batches
   of every rank and ``balance.balance_step`` deals them so that the costliest rank is as cheap as
   possible: a pure function of the plan, identical in every feeder, a partition of the step.
3. **Make.** The feeder decodes the samples of the micro-batches dealt to it (any actor can process
   any samples: work items are shard ranges) and merges them into the planned rows.

A sample whose pixels fail to decode after its header passed leaves its row one sample shorter
(counted as a rejection); the deal stands. The stream ends at the last step every rank can fill.
Resume: a ``Position``'s ``step`` (micro-batches delivered) says where; the plan is replayed from
the start from headers (no decode), which costs header reads of every rank's data up to there.
Both costs fall to one header read per shard per job with ``BalanceConfig.sizes_index``
(``datasvc.pack.sizes``): the plan then reads each shard's sizes from a shared directory.
"""
from __future__ import annotations

import threading
from collections import deque
from itertools import islice
from typing import Iterator

import numpy as np

from datasvc.batch import EncodedSample, PackedBatch
from datasvc.config import ServiceConfig
from datasvc.pack import balance
from datasvc.pack.packing import PackingConfig, merge
from datasvc.pack.epoch import EpochPlan, Position
from datasvc.pack.sizes import HeaderProcessor, SizesIndex
from datasvc.rejects import Accounting
from datasvc.stats import StageTimes, StreamStats
from datasvc.stream.producer import BlockProducer, InlineRunner
from datasvc.stream.rankstats import BalanceStats, RankStats
from datasvc.wire import ItemResult, WorkItem


class BalancedProducer:
    """Rank ``rank``'s balanced stream; the same interface as ``BlockProducer`` (``micro_batches``,
    ``position``, ``stop``, ``stats``, ``start``), so the feeder runs either."""

    def __init__(self, cfg: ServiceConfig, rank: int = 0, start: Position | dict | None = None,
                 process=None, *, plan: EpochPlan | None = None):
        if not cfg.balance.enabled:
            raise ValueError("BalancedProducer needs ServiceConfig.balance.enabled")
        self.cfg, self.rank, self.k = cfg, rank, cfg.balance.micro_batches_per_step
        self.plan = plan if plan is not None else EpochPlan(cfg)
        self.start = (start if isinstance(start, Position) else Position(**start) if start
                      else Position(epoch=self.plan.first_epoch))
        self.model = balance.cost_model(cfg.pipeline, **cfg.balance.cost)
        header = HeaderProcessor(cfg)
        if cfg.balance.sizes_index:
            header = SizesIndex(cfg, cfg.balance.sizes_index, self.plan.indexes, header)
        self.sizes = header if cfg.balance.sizes_index else None
        self.planners = [BlockProducer(cfg, r, None, header, plan=self.plan) for r in range(cfg.dp_size)]
        if process is None:
            from datasvc.stream.process import ItemProcessor

            process = ItemProcessor(cfg)
        self.runner = process if hasattr(process, "submit") else InlineRunner(process)
        layout = cfg.model_layout()
        self.packing = PackingConfig(seq_len=cfg.seq_len, micro_batch_size=cfg.micro_batch_size, pad_id=layout.pad_id)
        self.spec = layout.vision
        self.where = {f"{idx.path}/{s.key}": (idx.path, i, s) for idx in self.plan.indexes
                      for i, s in enumerate(idx.samples)}
        self.acct, self.times, self.stream = Accounting(), StageTimes(), StreamStats()
        self.ratios: list[tuple[float, float]] = []  # (unbalanced, balanced) per step made here
        self._next, self._stop, self._lock = self.start, False, threading.Lock()

    # ---- the stream ------------------------------------------------------------------------------
    LOOKAHEAD_STEPS = 2  # steps whose samples are in flight at once: keeps the pool busy across steps

    def micro_batches(self) -> Iterator[tuple[PackedBatch, Position]]:
        first_step = self.start.step // self.k
        steps = ((s, planned, out) for s, (planned, out) in enumerate(self._steps()) if s >= first_step)
        window: deque = deque()  # (step, this rank's planned micro-batches, their work items, deal)
        results: dict = {}
        submitted: set = set()
        exhausted = False
        while not self._stop:
            while not exhausted and len(window) < self.LOOKAHEAD_STEPS:
                nxt = next(steps, None)
                if nxt is None:
                    exhausted = True
                else:
                    s, planned, out = nxt
                    mine = [planned[i] for i in out.ranks[self.rank]]
                    window.append((s, mine, self._items([b for b, _ in mine]), out))
            if not window:
                return
            for s, _, items, _ in window:
                for i, item in enumerate(items):
                    if (s, i) not in submitted and self.runner.has_room() and self.runner.submit((s, i), item):
                        submitted.add((s, i))
            results.update(self.runner.collect(timeout=0.2))
            s, mine, items, out = window[0]
            if any((s, i) not in results for i in range(len(items))):
                continue
            window.popleft()
            made = self._merge([b for b, _ in mine], [results.pop((s, i)) for i in range(len(items))])
            submitted.difference_update((s, i) for i in range(len(items)))
            with self._lock:
                self.ratios.append((out.straggler_ratio_unbalanced, out.straggler_ratio))
            for j, (batch, (_, src)) in enumerate(zip(made, mine)):
                m = s * self.k + j
                if m >= self.start.step:
                    pos = Position(src.epoch, src.block, src.batch, m, oldest=src.oldest)
                    self._hand_out(batch, pos)
                    yield batch, pos

    def position(self) -> Position:
        return self._next

    def stop(self) -> None:
        self._stop = True
        for p in self.planners:
            p.stop()

    def stats(self) -> RankStats:
        with self._lock:
            ratios = np.asarray(self.ratios).reshape(-1, 2)
            own = self.planners[self.rank].acct  # header-time rejections of this rank's own items
            acct = Accounting()
            acct.merge(own)
            acct.merge(self.acct)
            acct.read, acct.delivered = own.read, self.acct.delivered  # the planner "delivers" every plan
            balance = BalanceStats(
                steps=len(ratios), model=self.model.name, cost_model=self.model.source,
                sizes_built=self.sizes.built if self.sizes else None,
                sizes_loaded=self.sizes.loaded if self.sizes else None,
                straggler_ratio=float(ratios[:, 1].mean()) if len(ratios) else None,
                straggler_ratio_unbalanced=float(ratios[:, 0].mean()) if len(ratios) else None)
            return RankStats.snapshot(self.rank, self.start, self._next, acct, 0, self.times, self.stream,
                                      balance=balance)

    # ---- plan and deal ---------------------------------------------------------------------------
    def _steps(self):
        """(every rank's planned micro-batches of the step, rank 0's first, and the deal), per step."""
        streams = [iter(p.micro_batches()) for p in self.planners]
        while not self._stop:
            planned = []
            for r, it in enumerate(streams):
                got = list(islice(it, self.k))
                if len(got) < self.k:
                    return
                planned.extend(got)
            shapes = [balance.shape_of(b, key=f"{i // self.k}/{p.epoch}/{p.block}/{p.batch}")
                      for i, (b, p) in enumerate(planned)]
            yield planned, balance.balance_step(shapes, self.cfg.dp_size, self.model)

    # ---- make this rank's micro-batches --------------------------------------------------------------
    def _items(self, planned: list[PackedBatch]) -> list[WorkItem]:
        """The planned micro-batches' samples as work items, one a shard (any actor can process any)."""
        by_shard: dict[str, list] = {}
        for batch in planned:
            for key in batch.sample_keys:
                path, at, index = self.where[key]
                by_shard.setdefault(path, []).append((at, index))
        return [WorkItem(path, min(at for at, _ in got), tuple(s for _, s in sorted(got, key=lambda x: x[0])))
                for path, got in sorted(by_shard.items())]

    def _merge(self, planned: list[PackedBatch], results: list[ItemResult]) -> list[PackedBatch]:
        """The decoded samples merged into the planned rows (a sample rejected here leaves a gap)."""
        encoded: dict[str, EncodedSample] = {}
        with self._lock:
            for r in results:
                self.acct.merge(r.accounting)
                self.times.merge(r.times)
                self.stream.images += r.images
                self.stream.megapixels += r.megapixels
                encoded.update((f"{s.shard}/{s.key}", s) for s in r.samples)
        out = []
        for batch in planned:
            rows: list[list[EncodedSample]] = [[] for _ in range(batch.tokens.shape[0])]
            for key, row, epoch, ordinal in zip(batch.sample_keys, batch.sample_rows.tolist(),
                                                batch.sample_epochs.tolist(), batch.sample_ordinals.tolist()):
                if key in encoded:
                    encoded[key].epoch, encoded[key].ordinal = epoch, ordinal
                    rows[row].append(encoded[key])
            for row in rows:  # headers and pixels disagree on a sample's length: it waits out this row
                while sum(x.num_tokens for x in row) > self.packing.seq_len:
                    late = row.pop()
                    with self._lock:
                        self.acct.reject(late.shard, late.key, "length_changed_after_planning",
                                         f"{late.num_tokens} tokens decoded; its header-planned row is full")
            out.append(merge(rows, self.packing, self.spec.patch_dim))
        return out

    def _hand_out(self, batch: PackedBatch, pos: Position) -> None:
        with self._lock:
            self.acct.delivered += len(batch.sample_keys)
            self.stream.add_batch(batch, self.spec.merge_size)
            self._next = pos.moved(1)
