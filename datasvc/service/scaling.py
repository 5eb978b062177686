"""When a feeder's pool of preprocessing actors grows or shrinks: a plain policy over what the feeder
measured in one interval, and the autoscaler that applies it to the feeder's running totals, so both
are read and tested without Ray."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Literal


@dataclass(frozen=True, slots=True)
class ScaleDecision:
    """One actor more (``"up"``) or one fewer (``"down"``), and what was measured that called for it."""

    action: Literal["up", "down"]
    reason: str


@dataclass(frozen=True, slots=True)
class ScaleRecord:
    """A decision the feeder carried out; ``as_dict`` is its entry in ``FeederStats.autoscale_decisions``."""

    time: float  # wall clock, seconds since the epoch
    action: Literal["up", "down"]
    actors: int  # the pool's size after it
    reason: str

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class ScalePolicy:
    min_actors: int
    max_actors: int
    # Consumers waiting a tenth of an interval for data is starvation: one actor more.
    starved_share: float = 0.1
    # The producer blocked on a full queue half the interval while consumers hardly waited: one fewer.
    blocked_share: float = 0.5
    served_share: float = 0.02

    def decide(self, actors: int, waited_s: float, blocked_s: float, interval_s: float) -> ScaleDecision | None:
        """Grow, shrink, or None to keep ``actors`` as they are."""
        if waited_s > self.starved_share * interval_s and actors < self.max_actors:
            return ScaleDecision("up", f"consumers waited {waited_s:.2f}s of {interval_s:.2f}s for data")
        if (blocked_s > self.blocked_share * interval_s and waited_s < self.served_share * interval_s
                and actors > self.min_actors):
            return ScaleDecision("down", f"producer blocked {blocked_s:.2f}s of {interval_s:.2f}s on a full queue")
        return None


class Autoscaler:
    """``policy`` over a feeder's running totals of consumer wait and producer block: each ``decide``
    judges only what accrued since the one before. ``carried_out`` records a decision the pool acted on
    (a grow that the node's budget refused is not recorded)."""

    def __init__(self, policy: ScalePolicy):
        self.policy = policy
        self.decisions: list[ScaleRecord] = []
        self._waited_mark = 0.0
        self._blocked_mark = 0.0

    def decide(self, actors: int, waited_total_s: float, blocked_total_s: float,
               interval_s: float) -> ScaleDecision | None:
        waited, blocked = waited_total_s - self._waited_mark, blocked_total_s - self._blocked_mark
        self._waited_mark, self._blocked_mark = waited_total_s, blocked_total_s
        return self.policy.decide(actors, waited, blocked, interval_s)

    def carried_out(self, decision: ScaleDecision, actors: int) -> ScaleRecord:
        record = ScaleRecord(time.time(), decision.action, actors, decision.reason)
        self.decisions.append(record)
        return record
