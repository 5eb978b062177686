"""Deterministic order: which work items each DP rank gets in each epoch, and how a block becomes
micro-batches. Pure functions of (config, epoch, rank, block): that is what makes resume exact and
lets any actor redo any item.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from datasvc.batch import EncodedSample, PackedBatch
from datasvc.config import ServiceConfig
from datasvc.packing import PackingConfig, pack
from datasvc.shards import ShardIndex, expand_shards, index_shard


@dataclass(frozen=True, slots=True)
class Position:
    """Where a rank's stream stands: the next micro-batch to deliver."""

    epoch: int = 0
    block: int = 0
    batch: int = 0  # index within the block
    step: int = 0  # micro-batches delivered so far in total

    def as_dict(self) -> dict:
        return {"epoch": self.epoch, "block": self.block, "batch": self.batch, "step": self.step}


class EpochPlan:
    def __init__(self, cfg: ServiceConfig, indexes: list[ShardIndex] | None = None):
        from datasvc.process import WorkItem

        self.cfg = cfg
        self.indexes = indexes if indexes is not None else [index_shard(p) for p in expand_shards(list(cfg.shards))]
        self._items: list[WorkItem] = []
        for idx in self.indexes:
            for first in range(0, len(idx.samples), cfg.samples_per_item):
                self._items.append(WorkItem(idx.path, first, tuple(idx.samples[first:first + cfg.samples_per_item])))
        self.total_samples = sum(len(i.samples) for i in self.indexes)

    def blocks(self, epoch: int, rank: int) -> list[list]:
        """This rank's work items for the epoch, grouped into blocks, in delivery order."""
        rng = np.random.default_rng([self.cfg.seed, epoch])
        order = rng.permutation(len(self._items))
        mine = [self._items[i] for i in order[rank::self.cfg.dp_size]]
        n = self.cfg.items_per_block
        return [mine[i:i + n] for i in range(0, len(mine), n)]

    def pack_block(self, samples: list[EncodedSample], epoch: int, rank: int, block: int,
                   pad_id: int, patch_dim: int) -> tuple[list[PackedBatch], list[EncodedSample]]:
        rng = np.random.default_rng([self.cfg.seed, epoch, rank, block, 1])
        shuffled = [samples[i] for i in rng.permutation(len(samples))]
        cfg = PackingConfig(seq_len=self.cfg.seq_len, micro_batch_size=self.cfg.micro_batch_size, pad_id=pad_id,
                            pack=self.cfg.pack)
        batches, too_long = pack(shuffled, cfg, patch_dim)
        # Packing groups rows by length; shuffle the micro-batches so steps do not trend.
        return [batches[i] for i in rng.permutation(len(batches))], too_long
