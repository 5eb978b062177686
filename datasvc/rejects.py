"""Counted, recorded reasons for every sample that does not reach a trainer.

Accounting invariant (checked by tests): read == delivered + quarantined + skipped_by_rule.
Quarantined samples are bad input (corrupt image, missing text, ...); skipped-by-rule samples are
valid but excluded by configuration (longer than seq_len).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

# Reasons that are a rule of the run rather than a defect of the data.
RULE_REASONS = frozenset({"longer_than_seq_len"})
# What the reader counts that is not a member left out: a fact about samples that are still read.
NOTED_KEYS = frozenset({"repeated_key"})
# A user's filter (datasvc.read.filters): the reason is this prefix and the rule, e.g. "filter:similarity>=0.28".
RULE_PREFIX = "filter:"


class _Image:
    """The place of the next image in a message's content (see datasvc.read.formats)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "IMAGE"


IMAGE = _Image()


class _Video:
    """The place of the next video in a message's content."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "VIDEO"


VIDEO = _Video()


class SampleRejected(ValueError):
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass(slots=True)
class Rejection:
    shard: str
    key: str
    reason: str
    detail: str = ""


@dataclass(slots=True)
class Accounting:
    """Per-sample outcomes, mergeable across work items, actors and ranks."""

    read: int = 0
    delivered: int = 0
    quarantined: Counter = field(default_factory=Counter)
    skipped_by_rule: Counter = field(default_factory=Counter)
    ignored_members: Counter = field(default_factory=Counter)  # members that are not samples
    noted: Counter = field(default_factory=Counter)  # repeated_key: a key seen earlier in its shard
    log: list[Rejection] = field(default_factory=list)
    max_log: int = 1000

    def reject(self, shard: str, key: str, reason: str, detail: str = "") -> None:
        is_rule = reason in RULE_REASONS or reason.startswith(RULE_PREFIX)
        target = self.skipped_by_rule if is_rule else self.quarantined
        target[reason] += 1
        if len(self.log) < self.max_log:
            self.log.append(Rejection(shard, key, reason, detail[:300]))

    def count_read(self, counts: dict) -> None:
        """What ``shards.read_samples`` counted besides samples: ignored members and notes."""
        for name, n in counts.items():
            (self.noted if name in NOTED_KEYS else self.ignored_members)[name] += n

    def merge(self, other: "Accounting") -> None:
        self.read += other.read
        self.delivered += other.delivered
        self.quarantined.update(other.quarantined)
        self.skipped_by_rule.update(other.skipped_by_rule)
        self.ignored_members.update(other.ignored_members)
        self.noted.update(other.noted)
        room = self.max_log - len(self.log)
        if room > 0:
            self.log.extend(other.log[:room])

    @property
    def n_quarantined(self) -> int:
        return sum(self.quarantined.values())

    @property
    def n_skipped(self) -> int:
        return sum(self.skipped_by_rule.values())

    def balanced(self, in_flight: int = 0) -> bool:
        return self.read == self.delivered + self.n_quarantined + self.n_skipped + in_flight

    def as_dict(self) -> dict:
        return {
            "read": self.read,
            "delivered": self.delivered,
            "quarantined": dict(self.quarantined),
            "skipped_by_rule": dict(self.skipped_by_rule),
            "ignored_members": dict(self.ignored_members),
        } | ({"noted": dict(self.noted)} if self.noted else {})
