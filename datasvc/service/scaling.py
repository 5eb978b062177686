"""When a feeder's pool of preprocessing actors grows or shrinks: a plain policy over what the feeder
measured in one interval, so it is read and tested without Ray."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ScalePolicy:
    min_actors: int
    max_actors: int
    # Consumers waiting a tenth of an interval for data is starvation: one actor more.
    starved_share: float = 0.1
    # The producer blocked on a full queue half the interval while consumers hardly waited: one fewer.
    blocked_share: float = 0.5
    served_share: float = 0.02

    def decide(self, actors: int, waited_s: float, blocked_s: float, interval_s: float) -> tuple[str, str] | None:
        """``("up" | "down", reason)``, or None to keep ``actors`` as they are."""
        if waited_s > self.starved_share * interval_s and actors < self.max_actors:
            return "up", f"consumers waited {waited_s:.2f}s of {interval_s:.2f}s for data"
        if (blocked_s > self.blocked_share * interval_s and waited_s < self.served_share * interval_s
                and actors > self.min_actors):
            return "down", f"producer blocked {blocked_s:.2f}s of {interval_s:.2f}s on a full queue"
        return None
