"""Deterministic order: which work items each DP rank gets in each epoch, and how a block becomes
micro-batches. Pure functions of (config, epoch, rank, block), and of the rows the block before it
held when blocks pack in chains (``ServiceConfig.chain_blocks``): that is what makes resume exact
and lets any actor redo any item.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, replace

import numpy as np

from datasvc.batch import EncodedSample, PackedBatch
from datasvc.config import ServiceConfig
from datasvc.pack.packing import PackingConfig, hold_partial, micro_batches, plan_block
from datasvc.read.listings import index_shards
from datasvc.read.shards import ShardIndex, expand_shards, index_shard


@dataclass(frozen=True, slots=True)
class Position:
    """Where a rank's stream stands: the next micro-batch to deliver."""

    epoch: int = 0
    block: int = 0
    batch: int = 0  # index within the block
    step: int = 0  # micro-batches delivered so far in total
    # (epoch, plan ordinal[, blocks waited]) of the samples the chain before this block's chain carried
    # into it: the rows it would have trained part empty. A restore reads them again, so the chain
    # packs as it did.
    carry: tuple = ()
    # The oldest epoch a sample still in flight may belong to: the samples packed in this block (those
    # held into it included) and those it holds for the next. Blocks spanning epochs, and rows that
    # wait, put samples of older epochs in flight than ``epoch``; a resume at another DP size deals
    # anew from here. None: ``epoch``.
    oldest: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "carry", tuple(tuple(int(x) for x in c) for c in self.carry))

    def as_dict(self) -> dict:
        return {"epoch": self.epoch, "block": self.block, "batch": self.batch, "step": self.step,
                "carry": [list(c) for c in self.carry], **({"oldest": self.oldest} if self.oldest is not None else {})}

    @classmethod
    def from_dict(cls, d: dict) -> "Position":
        """``as_dict``'s form back, from a mapping that may hold other keys too (a saved loader state);
        positions saved before ``carry`` or ``oldest`` existed leave them empty."""
        return cls(d["epoch"], d["block"], d["batch"], d["step"], tuple(d.get("carry", ())), d.get("oldest"))

    def moved(self, batches: int) -> "Position":
        """The position ``batches`` micro-batches on (or back) within the same block."""
        return replace(self, batch=self.batch + batches, step=self.step + batches)

    @property
    def in_flight_from(self) -> int:
        return self.epoch if self.oldest is None else min(self.epoch, self.oldest)


class EpochPlan:
    def __init__(self, cfg: ServiceConfig, indexes: list[ShardIndex] | None = None):
        from datasvc.remainder import TrainedSamples
        from datasvc.wire import WorkItem

        self.cfg = cfg
        if indexes is None:  # with a sizes index, the shards' tar listings are kept beside it
            indexes = index_shards(expand_shards(list(cfg.shards)), cfg.balance.sizes_index)
        self.indexes = indexes
        self._items: list[WorkItem] = []
        ordinal = 0  # a sample's place in the plan: what a record of trained samples names it by
        for idx in self.indexes:
            for first in range(0, len(idx.samples), cfg.samples_per_item):
                chunk = tuple(idx.samples[first:first + cfg.samples_per_item])
                self._items.append(WorkItem(idx.path, first, chunk,
                                            ordinals=tuple(range(ordinal + first, ordinal + first + len(chunk)))))
            ordinal += len(idx.samples)
        self.total_samples = sum(len(i.samples) for i in self.indexes)
        self._first_ordinal = np.cumsum([0] + [len(idx.samples) for idx in self.indexes])
        self.dataset = dataset_fingerprint([idx.path for idx in self.indexes])
        """The shard files this plan was made over (``dataset_fingerprint``), for saved states."""
        self._blend = None  # cfg.blend's draw over self._items, built when an order is first asked for
        remainder = cfg.remainder or {}
        if remainder and cfg.blend:
            raise ValueError("a blend resumes at the data-parallel size it was saved at only")
        self.first_epoch = int(remainder.get("first_epoch", 0))
        """The stream's first epoch: 0, or where a resume at another DP size took up the remainder."""
        self._trained = TrainedSamples.from_state(remainder.get("trained"))
        self._left: dict[int, list] = {}  # an epoch under way's items, trained samples left out

    @property
    def samples_per_item(self) -> float:
        """Mean samples in a work item: fewer than ``cfg.samples_per_item`` where shards are small."""
        return self.total_samples / max(1, len(self._items))

    def items_per_epoch(self, rank: int, epoch: int | None = None) -> int:
        """How many work items this rank gets in ``epoch`` (default: a whole epoch)."""
        if epoch is not None and self.partly_trained(epoch):
            return len(self.items(epoch, rank))
        if self.cfg.blend:
            return self.blend.items_per_epoch(rank)
        return len(range(rank, len(self._items), self.cfg.dp_size))

    @property
    def blend(self):
        """The blend's sources over this plan's items (``datasvc.read.blend.BlendedItems``): per-source
        shares, and ``source_of(item)`` for accounting by source."""
        from datasvc.read.blend import blended_items

        if self._blend is None:
            self._blend = blended_items(self.cfg.blend, self._items, self.cfg.seed, self.cfg.dp_size)
        return self._blend

    def items(self, epoch: int, rank: int) -> list:
        """This rank's work items for the epoch, in delivery order."""
        if self.cfg.blend:
            return [replace(item, epoch=epoch) for item in self.blend.items(epoch, rank)]
        order = np.random.default_rng([self.cfg.seed, epoch]).permutation(len(self._items))
        if self.partly_trained(epoch):
            return self._untrained(epoch, order)[rank::self.cfg.dp_size]
        return [replace(self._items[i], epoch=epoch) for i in order[rank::self.cfg.dp_size]]

    def sample_item(self, epoch: int, ordinal: int):
        """The work item of the one sample at ``ordinal`` (drawn for ``epoch``)."""
        from datasvc.wire import WorkItem

        i = int(np.searchsorted(self._first_ordinal, ordinal, side="right")) - 1
        idx, j = self.indexes[i], ordinal - int(self._first_ordinal[i])
        return WorkItem(idx.path, j, (idx.samples[j],), epoch=epoch, ordinals=(ordinal,))

    def partly_trained(self, epoch: int) -> bool:
        """Whether the remainder this stream started from had trained some of ``epoch``."""
        return epoch in self._trained.epochs()

    def _untrained(self, epoch: int, order: np.ndarray) -> list:
        """The epoch's items in order, each without the samples the remainder has trained."""
        if epoch not in self._left:
            left = []
            for i in order:
                item = self._items[i]
                keep = [j for j, o in enumerate(item.ordinals) if not self._trained.trained(epoch, o)]
                if keep:
                    left.append(replace(item, samples=tuple(item.samples[j] for j in keep),
                                        ordinals=tuple(item.ordinals[j] for j in keep), epoch=epoch))
            self._left = {epoch: left}  # one epoch under way at a time
        return self._left[epoch]

    def blocks(self, epoch: int, rank: int) -> list[list]:
        """This rank's work items for the epoch, grouped into blocks, in delivery order."""
        mine = self.items(epoch, rank)
        n = self.cfg.items_per_block
        return [mine[i:i + n] for i in range(0, len(mine), n)]

    def spanning_blocks(self, rank: int, start_block: int = 0):
        """(epoch, block, items) from ``start_block`` on, cut from this rank's items of the stream's
        epochs laid end to end, so a block may run past the end of an epoch into the next; ``epoch``
        is the epoch of the block's first item. Every epoch still holds each item once. An epoch then
        ends without a part-empty block of its own, which matters when an epoch is only a few blocks."""
        n = self.cfg.items_per_block
        last = self.cfg.epochs  # the first epoch not streamed (None: none)
        tail = max(self._trained.epochs(), default=self.first_epoch - 1)  # epochs after it are whole
        lengths: dict[int, int] = {}

        def length(e: int) -> int:
            if e not in lengths:
                lengths[e] = self.items_per_epoch(rank, e)
            return lengths[e]

        def ended(e: int) -> bool:  # no epoch from e on holds an item for this rank
            return (last is not None and e >= last) or (e > tail and length(e) == 0)

        orders: dict[int, list] = {}  # each epoch's order is drawn once, not once per block
        epoch, before = self.first_epoch, 0  # the epoch holding item `before`, the first of that epoch
        block = start_block
        while True:
            first = block * n
            while first >= before + length(epoch):
                if ended(epoch):
                    return
                before += length(epoch)
                epoch += 1
            if ended(epoch):
                return
            items, e, e_start = [], epoch, before
            while len(items) < n and not ended(e):
                if e not in orders:
                    orders[e] = self.items(e, rank)
                at = first + len(items) - e_start
                items += orders[e][at:at + n - len(items)]
                if first + len(items) - e_start >= length(e):
                    e_start += length(e)
                    e += 1
            if not items:
                return
            yield epoch, block, items
            for done in [d for d in orders if d < epoch]:
                del orders[done]
            block += 1

    def pack_block(self, samples: list[EncodedSample], epoch: int, rank: int, block: int, pad_id: int,
                   patch_dim: int, hold: bool = False
                   ) -> tuple[list[PackedBatch], list[EncodedSample], list[EncodedSample]]:
        """(micro-batches, samples too long for a row, samples held for the next block of the chain:
        only with ``hold``, those of the rows beyond a whole number of micro-batches and of the rows
        below the fill floor). A sample that waited ``MAX_WAITS`` blocks trains in this one."""
        rng = np.random.default_rng([self.cfg.seed, epoch, rank, block, 1])
        shuffled = [samples[i] for i in rng.permutation(len(samples))]
        cfg = PackingConfig(seq_len=self.cfg.seq_len, micro_batch_size=self.cfg.micro_batch_size, pad_id=pad_id,
                            pack=self.cfg.pack)
        fits, rows, too_long = plan_block(shuffled, cfg)
        must_go = {j for j, s in enumerate(fits) if s.waited >= MAX_WAITS}
        rows, held = (hold_partial(fits, rows, cfg.micro_batch_size, cfg.seq_len, MIN_ROW_FILL, must_go) if hold
                      else (rows, []))
        for s in held:
            s.waited += 1
        batches = micro_batches(fits, rows, cfg, patch_dim)
        # Packing groups rows by length; shuffle the micro-batches so steps do not trend.
        return [batches[i] for i in rng.permutation(len(batches))], too_long, held


MAX_WAITS = 2
"""Blocks a sample waits for a fuller row at most (a restore reads the count from ``Position.carry``),
so a row that cannot fill never holds a sample back for long."""

MIN_ROW_FILL = 0.95
"""Rows emptier than this are held and packed with the next block's samples (up to half a block's
rows, ``packing.HELD_SHARE``; ``MAX_WAITS`` blocks at most for any sample)."""

LISTED_FILES = 1000
"""A fingerprint lists each file (so a refused restore can say which changed) up to this many."""


def dataset_fingerprint(paths: list[str]) -> dict:
    """What a saved loader state records of the shard files: their number, a digest of every
    (path, size, mtime), and each file's [size, mtime_ns] when there are at most ``LISTED_FILES``."""
    files = {}
    for p in paths:
        st = os.stat(p)
        files[p] = [st.st_size, st.st_mtime_ns]
    digest = hashlib.sha1(json.dumps(sorted(files.items())).encode()).hexdigest()[:16]
    out: dict = {"files": len(files), "digest": digest}
    if len(files) <= LISTED_FILES:
        out["listing"] = files
    return out


def dataset_changes(saved: dict, now: dict) -> str:
    """'' when the shard files are as ``saved`` recorded them; else what changed, in words."""
    if saved.get("digest") == now.get("digest"):
        return ""
    old, new = saved.get("listing"), now.get("listing")
    if old is None or new is None:
        return f"{saved.get('files')} shard files then, {now.get('files')} now, and their sizes or times differ"
    parts = []
    for what, names in (("added", sorted(set(new) - set(old))), ("removed", sorted(set(old) - set(new))),
                        ("rewritten", sorted(p for p in set(old) & set(new) if list(old[p]) != list(new[p])))):
        if names:
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            parts.append(f"{len(names)} {what} ({shown})")
    return "; ".join(parts)


@dataclass(frozen=True, slots=True)
class BlockSizing:
    """How ``size_blocks`` chose ``items_per_block``, for logs and run summaries."""

    items_per_block: int
    tokens_per_sample: float | None  # mean over the probed samples; None when none could be encoded
    probed_samples: int
    samples_per_item: float
    target_micro_batches: int

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}


def size_blocks(cfg: ServiceConfig, target_micro_batches: int = 8, probe_samples: int = 256,
                probe_shards: int = 8, max_probe_shards: int = 64,
                indexes: list[ShardIndex] | None = None) -> tuple[ServiceConfig, BlockSizing]:
    """``cfg`` with ``items_per_block`` set so that a block packs into about ``target_micro_batches``
    full micro-batches.

    A block packs on its own, so its last micro-batch is part empty: about half a micro-batch of
    padding rows per block, whatever its size. With a fixed item count, blocks of small shards hold
    few rows and lose much (measured on the H200 at MBS 2, seq 4096, same run: 0.71 real tokens a
    slot with the earlier 4-item blocks, 0.89 sized; docs/benchmarks/how-full-are-packed-rows.md). The cost is memory:
    a feeder holds up to three blocks, about ``3 x target x MBS x seq_len`` tokens of samples.

    Samples per item and tokens per sample come from shards drawn with the data seed (all of
    ``indexes`` when given): at least ``probe_shards``, and more until they hold ``probe_samples``
    usable samples, at most ``max_probe_shards``, so the driver's cost does not grow with the
    dataset. Up to ``probe_samples`` of their samples are read. On the bundled photo crops (six
    samples a shard, captions and two-image conversations) the mean over 64 samples strayed 20%
    (one s.d. over 8 seeds, worst 37%) from the whole set's; over 256, 4% (worst 11%), in 0.5 s
    (``python -m datasvc.bench sizing``). Image headers give the patch grids and the pipeline's own
    encoder gives the token count, so no pixel is decoded. The choice is a pure
    function of the shards and the config, and it is part of ``cfg.fingerprint()``, so a resumed run
    that re-derives it continues exactly.
    """
    import dataclasses

    if target_micro_batches < 1:
        raise ValueError(f"target_micro_batches must be >= 1, got {target_micro_batches}")
    if indexes is None:
        paths = expand_shards(list(cfg.shards))
        probed: dict[int, ShardIndex] = {}
        usable = 0
        for i in np.random.default_rng([cfg.seed, 3]).permutation(len(paths))[:max_probe_shards]:
            if len(probed) >= probe_shards and usable >= probe_samples:
                break
            probed[int(i)] = index_shard(paths[i])
            usable += sum(not s.problem for s in probed[int(i)].samples)
        indexes = [probed[i] for i in sorted(probed)]
    plan = EpochPlan(cfg, indexes)
    per_item = plan.samples_per_item
    rows = target_micro_batches * cfg.micro_batch_size
    lengths = sample_token_counts(cfg, plan.indexes, probe_samples) if cfg.pack else []
    mean_tokens = float(np.mean(lengths)) if lengths else None
    # Padded rows hold one sample each; packed rows about seq_len / tokens-per-sample.
    samples_needed = rows if not cfg.pack or mean_tokens is None else rows * cfg.seq_len / mean_tokens
    items = max(1, int(np.ceil(samples_needed / per_item)))
    sizing = BlockSizing(items, None if mean_tokens is None else round(mean_tokens, 1), len(lengths),
                         round(per_item, 2), target_micro_batches)
    return dataclasses.replace(cfg, items_per_block=items), sizing


def sample_token_counts(cfg: ServiceConfig, indexes: list[ShardIndex], limit: int | None = None) -> list[int]:
    """Token counts (capped at seq_len) of up to ``limit`` samples drawn with the data seed (all when
    None), from image headers and the pipeline's encoder, without decoding a pixel. Samples that the
    run would reject are left out here; the run counts them where it meets them."""
    from datasvc.pack.headers import encode_from_headers
    from datasvc.read.shards import ReadLimits, read_samples

    pipeline = cfg.build_pipeline()
    where = [(idx.path, s) for idx in indexes for s in idx.samples if not s.problem]
    chosen = np.random.default_rng([cfg.seed, 2]).permutation(len(where))[:limit]
    by_shard: dict[str, list] = {}
    for i in sorted(chosen):
        by_shard.setdefault(where[i][0], []).append(where[i][1])
    limits = ReadLimits.of(cfg.budget)
    lengths = []
    for path, samples in by_shard.items():
        for raw in read_samples(path, samples, limits):
            try:
                ids, _, _ = encode_from_headers(raw, pipeline)
            except ValueError:  # ImageRejected, SampleRejected
                continue
            lengths.append(min(len(ids), cfg.seq_len))
    return lengths
