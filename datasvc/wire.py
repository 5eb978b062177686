"""What travels between the stages: a work item (a range of one shard's samples) and its result."""
from __future__ import annotations

from dataclasses import dataclass

from datasvc.batch import EncodedSample
from datasvc.read.shards import SampleIndex
from datasvc.rejects import Accounting
from datasvc.stats import StageTimes


@dataclass(frozen=True, slots=True)
class WorkItem:
    """A contiguous range of samples of one shard; the unit an actor processes and may redo."""

    shard: str
    first: int  # index of the first sample within the shard
    samples: tuple[SampleIndex, ...]
    # Where the samples sit in the stream, for the record of what was trained (``datasvc.remainder``):
    # the epoch the item was drawn for, and each sample's ordinal in the plan (-1: not planned).
    epoch: int = 0
    ordinals: tuple[int, ...] = ()

    @property
    def item_id(self) -> str:
        return f"{self.shard}#{self.first}"


@dataclass(slots=True)
class ItemResult:
    item_id: str
    samples: list[EncodedSample]
    accounting: Accounting
    times: StageTimes
    images: int = 0
    megapixels: float = 0.0
