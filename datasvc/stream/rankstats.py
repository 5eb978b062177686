"""What one rank's stream reports: typed, mergeable, made a dict only at the JSON edge (``as_dict``).

``RankStats`` is a producer's report (``BlockProducer.stats()``); the service's feeder wraps it with its
queue and pool (``service.feeder.FeederStats``), and the service adds the ranks up
(``service.client.ServiceStats``)."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

from datasvc.pack.epoch import Position
from datasvc.read.blend import SourceTotals
from datasvc.rejects import Accounting
from datasvc.stats import StageTimes, StreamStats

REJECTIONS_SHOWN = 50
"""The rejection log a report carries: the rank's latest rejections (the full log stays with the rank)."""


@dataclass(slots=True)
class BalanceStats:
    """How the DP balancer dealt this rank's steps (``--balance-dp``)."""

    steps: int
    model: str
    cost_model: str
    sizes_built: int | None = None  # shards whose sizes index was built, None without an index
    sizes_loaded: int | None = None
    straggler_ratio: float | None = None  # mean slowest-rank cost over mean cost, as dealt
    straggler_ratio_unbalanced: float | None = None  # the same, had the steps been dealt in order

    def as_dict(self) -> dict:
        index = None if self.sizes_built is None else {"built": self.sizes_built, "loaded": self.sizes_loaded}
        return {"steps": self.steps, "model": self.model, "cost_model": self.cost_model, "sizes_index": index,
                "straggler_ratio": self.straggler_ratio, "straggler_ratio_unbalanced": self.straggler_ratio_unbalanced}


@dataclass(slots=True)
class RankStats:
    """One rank's stream: where it started and stands, what happened to every sample read, the time per
    stage, what it delivered. At any moment ``accounting.balanced(in_flight)`` holds: ``in_flight`` are
    samples read and packed but not handed out yet."""

    rank: int
    start: Position
    position: Position
    accounting: Accounting
    in_flight: int
    stages: StageTimes
    stream: StreamStats
    sources: SourceTotals | None = None  # per blend source, when the stream is a blend
    balance: BalanceStats | None = None

    @classmethod
    def snapshot(cls, rank: int, start: Position, position: Position, accounting: Accounting, in_flight: int,
                 stages: StageTimes, stream: StreamStats, sources: SourceTotals | None = None,
                 balance: BalanceStats | None = None) -> "RankStats":
        """A copy the producer's threads no longer touch, its rejection log cut to the latest
        (``sources`` and ``balance`` are taken as given: made for this report)."""
        acct = Accounting(max_log=0)
        acct.merge(accounting)
        acct.log = accounting.log[-REJECTIONS_SHOWN:]
        return cls(rank, start, position, acct, in_flight, copy.deepcopy(stages), copy.copy(stream), sources, balance)

    def as_dict(self) -> dict:
        return {
            "rank": self.rank,
            "start": self.start.as_dict(),
            "position": self.position.as_dict(),
            "accounting": {**self.accounting.as_dict(), "in_flight": self.in_flight},
            **({"sources": self.sources.as_dict()} if self.sources else {}),
            "stages": self.stages.as_dict(),
            **self.stream.as_dict(),
            "rejections": [{"shard": r.shard, "key": r.key, "reason": r.reason, "detail": r.detail}
                           for r in self.accounting.log],
            **({"balance": self.balance.as_dict()} if self.balance else {}),
        }


@dataclass(slots=True)
class StreamTotals:
    """Several ranks' ``RankStats`` added up: what a run summary reports of the data."""

    accounting: Accounting = field(default_factory=lambda: Accounting(max_log=0))
    in_flight: int = 0
    sources: SourceTotals | None = None

    def add(self, rank: RankStats) -> None:
        self.accounting.merge(rank.accounting)
        self.in_flight += rank.in_flight
        if rank.sources is not None:
            if self.sources is None:
                self.sources = SourceTotals({}, {})
            self.sources.merge(rank.sources)
