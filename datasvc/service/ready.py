"""The micro-batches a feeder holds for its consumers, bounded by count and bytes: a plain thread-safe
queue that the ``Feeder`` actor wraps, so its back-pressure is read and tested without Ray.

The producer thread waits for room (``wait_for_room``), then ``put``s a micro-batch by step; every
consumer of the replica (TP/PP/CP) ``take``s that step, and the last of them frees its room. The
seconds consumers waited on an empty queue and the producer spent blocked on a full one are what the
autoscaler judges (``datasvc.service.scaling.Autoscaler``).
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from datasvc.pack.epoch import Position
from datasvc.stats import QueueStats

# Every change notifies the waiters; the timeout only bounds a wait whose wake-up was missed.
WAKE_S = 0.5


@dataclass(frozen=True, slots=True)
class End:
    """Sentinel returned by ``Feeder.next_batch`` after the last micro-batch (or on error)."""

    error: str = ""
    steps: int = 0


@dataclass(frozen=True, slots=True)
class Handout:
    """What ``Feeder.next_batch`` hands a consumer: the micro-batch's object ref (a ref inside an object
    stays a ref, so the consumer reads the arrays from the object store itself) and its position."""

    ref: object
    position: Position


@dataclass(slots=True)
class ReadyBatch:
    """A micro-batch in the object store (``ref``), held until every consumer of the replica took it."""

    ref: object
    position: Position
    nbytes: int
    taken_by: set[int] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class QueueReport:
    """The queue at one moment, read under its lock."""

    depth: int
    occupancy: dict  # QueueStats.as_dict(): occupancy and full rates
    bytes_ahead: int
    consumer_wait_s: float  # waits that ended; ``waited_total`` adds the ones under way
    producer_blocked_s: float  # a block under way included
    end: End | None


class ReadyQueue:
    """Micro-batches by step, at most ``max_batches`` and ``max_bytes`` ahead of ``consumers`` consumers.
    ``clock`` is what blocked and waited seconds are measured with."""

    def __init__(self, max_batches: int, max_bytes: int, consumers: int,
                 clock: Callable[[], float] = time.perf_counter):
        self.max_batches, self.max_bytes, self.consumers = max_batches, max_bytes, consumers
        self._clock = clock
        self._cond = threading.Condition()
        self._batches: OrderedDict[int, ReadyBatch] = OrderedDict()
        self._occupancy = QueueStats(max_batches)
        self._bytes_ahead = 0
        self._end: End | None = None
        self._stopped = False
        self._consumer_wait_s = 0.0
        self._waiting: dict[int, float] = {}  # consumer -> when its pending take started
        self._producer_blocked_s = 0.0
        self._blocked_since: float | None = None

    # ---- producer side -------------------------------------------------------------------------
    def wait_for_room(self, nbytes: int) -> bool:
        """Block while the queue is full by count, or ``nbytes`` more would pass its bytes; False when
        stopped meanwhile. An empty queue always has room, so one micro-batch over the bytes still flows."""
        t0 = self._clock()
        self._blocked_since = t0
        with self._cond:
            while (self._batches and (len(self._batches) >= self.max_batches
                                      or self._bytes_ahead + nbytes > self.max_bytes)
                   and not self._stopped):
                self._cond.wait(timeout=WAKE_S)
        self._blocked_since = None
        self._producer_blocked_s += self._clock() - t0
        return not self._stopped

    def put(self, step: int, ref: object, position: Position, nbytes: int) -> None:
        with self._cond:
            self._batches[step] = ReadyBatch(ref, position, nbytes)
            self._occupancy.put()
            self._bytes_ahead += nbytes
            self._cond.notify_all()

    def finish(self, end: End) -> None:
        """The stream is over: consumers past its last step get ``end``."""
        with self._cond:
            self._end = end
            self._cond.notify_all()

    def stop(self) -> None:
        """Release a producer waiting for room, for good (``wait_for_room`` answers False from now on)."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    # ---- consumer side -------------------------------------------------------------------------
    def take(self, consumer: int, step: int) -> ReadyBatch | End:
        """Micro-batch ``step`` for ``consumer``, waiting until it is put; the stream's ``End`` once it
        is over, or an ``End`` with an error for a step every consumer already took."""
        t0 = self._clock()
        with self._cond:
            if step not in self._batches:
                self._waiting[consumer] = t0
            while step not in self._batches and self._end is None:
                if self._batches and step < next(iter(self._batches)):
                    return End(error=f"step {step} was already released; restore from a saved state")
                self._cond.wait(timeout=WAKE_S)
            self._waiting.pop(consumer, None)
            self._consumer_wait_s += self._clock() - t0
            if step not in self._batches:
                return self._end
            ready = self._batches[step]
            ready.taken_by.add(consumer)
            if len(ready.taken_by) >= self.consumers:
                del self._batches[step]
                self._occupancy.get()
                self._bytes_ahead -= ready.nbytes
                self._cond.notify_all()
            return ready

    # ---- what it measured ----------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self._end is not None

    @property
    def depth(self) -> int:
        return len(self._batches)

    @property
    def producer_blocked(self) -> bool:
        return self._blocked_since is not None

    @property
    def consumers_waiting(self) -> int:
        return len(self._waiting)

    def waited_total(self) -> float:
        """Seconds consumers waited for data so far, waits under way included."""
        return self._consumer_wait_s + sum(self._clock() - t for t in list(self._waiting.values()))

    def blocked_total(self) -> float:
        """Seconds the producer was blocked on a full queue so far, a block under way included."""
        since = self._blocked_since
        return self._producer_blocked_s + (self._clock() - since if since is not None else 0.0)

    def report(self) -> QueueReport:
        with self._cond:
            return QueueReport(depth=len(self._batches), occupancy=self._occupancy.as_dict(),
                               bytes_ahead=self._bytes_ahead, consumer_wait_s=self._consumer_wait_s,
                               producer_blocked_s=self.blocked_total(), end=self._end)
