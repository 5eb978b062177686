"""Typed statistics of the data path: per stage, per queue, per feeder.

How to read them (after SPDL's ``TaskPerfStats`` and ``QueuePerfStats``):

- ``StageStats``: ``seconds`` is the time spent in the stage summed over every actor (so it can
  exceed the wall clock), ``count`` the samples (images, micro-batches) it handled, ``failures`` the
  samples it rejected. ``p50_s``/``p90_s``/``p99_s`` are per-sample times (each call's time over
  the samples it handled, so a batched call gives its mean to each): a p99 far above the p50 points
  at a few large or slow inputs rather than a slow stage.
- ``QueueStats``: ``occupancy_rate`` is the share of time the queue held at least one item. Close
  to 0, consumers wait for data (the producer is the bottleneck); close to 1 with
  ``full_rate`` close to 1, the producer waits for consumers (data is not the bottleneck).

Every statistic merges (actors -> feeder -> service) and serializes with ``as_dict``.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

STAGES = ("read", "decode", "preprocess", "tokenize", "pack", "transfer")
"""The stages, in data-flow order; every per-stage table uses this order."""

# Per-sample times land in log-spaced buckets, 10 a decade from 1 us to 1000 s: percentiles within
# about 12%, a fixed size whatever the run length, and merging is adding counts.
_BUCKETS_PER_DECADE = 10
_MIN_S = 1e-6
_N_BUCKETS = 9 * _BUCKETS_PER_DECADE + 1


def _bucket(seconds: float) -> int:
    if seconds <= _MIN_S:
        return 0
    return min(_N_BUCKETS - 1, int(math.log10(seconds / _MIN_S) * _BUCKETS_PER_DECADE) + 1)


def _bucket_upper(b: int) -> float:
    return _MIN_S * 10 ** (b / _BUCKETS_PER_DECADE)


@dataclass(slots=True)
class StageStats:
    """One stage: total time, samples handled, samples rejected, per-sample time percentiles."""

    seconds: float = 0.0
    count: int = 0
    failures: int = 0
    histogram: list[int] = field(default_factory=lambda: [0] * _N_BUCKETS)

    def add(self, seconds: float, count: int) -> None:
        self.seconds += seconds
        self.count += count
        if count > 0:  # a call that only adds time (e.g. header probes) has no per-sample time
            self.histogram[_bucket(seconds / count)] += count

    def merge(self, other: "StageStats") -> None:
        self.seconds += other.seconds
        self.count += other.count
        self.failures += other.failures
        for i, n in enumerate(other.histogram):
            self.histogram[i] += n

    def percentile(self, q: float) -> float | None:
        """Per-sample time at quantile ``q`` in [0, 1] (upper edge of its bucket); None when empty."""
        total = sum(self.histogram)
        if total == 0:
            return None
        rank, seen = q * total, 0
        for b, n in enumerate(self.histogram):
            seen += n
            if seen >= rank and n:
                return _bucket_upper(b)
        return _bucket_upper(_N_BUCKETS - 1)

    def as_dict(self) -> dict:
        def r(v):
            return None if v is None else float(f"{v:.3g}")

        return {"seconds": round(self.seconds, 4), "count": self.count, "failures": self.failures,
                "p50_s": r(self.percentile(0.5)), "p90_s": r(self.percentile(0.9)), "p99_s": r(self.percentile(0.99))}


class _Field:
    """``times.seconds["decode"]`` and ``times.counts["decode"]``: one field of every stage."""

    def __init__(self, stages: dict, name: str):
        self._stages, self._name = stages, name

    def __getitem__(self, stage: str):
        s = self._stages.get(stage)
        return getattr(s, self._name) if s is not None else 0

    def get(self, stage: str, default=0):
        s = self._stages.get(stage)
        return getattr(s, self._name) if s is not None else default

    def items(self):
        return [(k, getattr(s, self._name)) for k, s in self._stages.items()]

    def __contains__(self, stage: str) -> bool:
        return stage in self._stages


@dataclass(slots=True)
class StageTimes:
    """``StageStats`` of each stage, mergeable; what a work item's result and a feeder carry."""

    stages: dict = field(default_factory=dict)

    def stage(self, name: str) -> StageStats:
        if name not in self.stages:
            self.stages[name] = StageStats()
        return self.stages[name]

    def add(self, stage: str, seconds: float, count: int = 1) -> None:
        self.stage(stage).add(seconds, count)

    def fail(self, stage: str, n: int = 1) -> None:
        self.stage(stage).failures += n

    def merge(self, other: "StageTimes") -> None:
        for k, s in other.stages.items():
            self.stage(k).merge(s)

    @property
    def seconds(self) -> _Field:
        return _Field(self.stages, "seconds")

    @property
    def counts(self) -> _Field:
        return _Field(self.stages, "count")

    def as_dict(self) -> dict:
        """``{stage: StageStats.as_dict()}`` in ``STAGES`` order, for the stages that ran."""
        names = [s for s in STAGES if s in self.stages] + [s for s in self.stages if s not in STAGES]
        return {s: self.stages[s].as_dict() for s in names}


@dataclass(slots=True)
class QueueStats:
    """A bounded queue watched over time: how often it held something, how often it was full."""

    capacity: int
    puts: int = 0
    gets: int = 0
    _depth: int = 0
    _since: float = field(default_factory=time.perf_counter)
    _start: float = field(default_factory=time.perf_counter)
    _occupied_s: float = 0.0
    _full_s: float = 0.0
    _depth_s: float = 0.0  # integral of depth over time

    def _advance(self) -> None:
        now = time.perf_counter()
        dt = now - self._since
        self._since = now
        if self._depth > 0:
            self._occupied_s += dt
        if self._depth >= self.capacity:
            self._full_s += dt
        self._depth_s += self._depth * dt

    def put(self) -> None:
        self._advance()
        self._depth += 1
        self.puts += 1

    def get(self) -> None:
        self._advance()
        self._depth = max(0, self._depth - 1)
        self.gets += 1

    def as_dict(self) -> dict:
        self._advance()
        elapsed = max(1e-9, self._since - self._start)
        return {"capacity": self.capacity, "depth": self._depth, "puts": self.puts, "gets": self.gets,
                "occupancy_rate": round(self._occupied_s / elapsed, 4),
                "full_rate": round(self._full_s / elapsed, 4),
                "mean_depth": round(self._depth_s / elapsed, 3)}


@dataclass(slots=True)
class StreamStats:
    """What a producer has delivered: micro-batches, images, tokens, and how full its rows are."""

    micro_batches: int = 0
    images: int = 0
    megapixels: float = 0.0
    text_tokens: int = 0
    vision_tokens: int = 0
    real_tokens: int = 0
    row_tokens: int = 0

    @property
    def packing_efficiency(self) -> float:
        """Real tokens over row slots of the delivered micro-batches."""
        return self.real_tokens / max(1, self.row_tokens)

    def add_batch(self, batch, merge_size: int) -> None:
        """Count one delivered micro-batch (a ``PackedBatch``): its vision tokens are its images' and
        videos' patches over the merge window (``merge_size``**2 patches make one token)."""
        grids = [g for g in (batch.image_grid_thw, getattr(batch, "video_grid_thw", ())) if len(g)]
        vision = sum(int(g.prod(axis=1).sum()) for g in grids) // merge_size**2
        self.vision_tokens += vision
        self.text_tokens += batch.real_tokens - vision
        self.real_tokens += batch.real_tokens
        self.row_tokens += batch.tokens.size
        self.micro_batches += 1

    def as_dict(self) -> dict:
        return {"micro_batches": self.micro_batches, "images": self.images, "megapixels": round(self.megapixels, 3),
                "text_tokens": self.text_tokens, "vision_tokens": self.vision_tokens,
                "packing_efficiency": round(self.packing_efficiency, 4)}
