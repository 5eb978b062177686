"""What becomes of a work item that failed, so that one bad sample costs only itself. No Ray: the
actor pool (``datasvc.service.pool``) reports what happened, this decides what to redo.

- An item that raises twice is redone sample by sample; a sample that raises twice on its own is
  quarantined ``worker_error``.
- An item whose actor dies twice while running it (killed, out of memory, a decoder crash) is cut
  in halves, and so on down to the sample that kills its actor, quarantined ``worker_died``.
- A death is charged only when it names its item: the actor held that item alone. An actor that
  dies holding several charges none of them; they are redone one at a time (``solo``), because
  the one it was running cannot be told from the others (the result of an item it finished may
  be lost with it, so an innocent item fails beside the guilty one).
- The pieces' results merge back into one result for the item the producer submitted.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from datasvc.stream.process import merge_results, quarantine_item, split_item
from datasvc.wire import ItemResult, WorkItem

log = logging.getLogger("vlmfeed.service")

TRIES = 2
"""Failures of one kind a task may have before it is redone in pieces (or, one sample, quarantined):
a second chance for what is not the item's fault (an actor killed from outside, a passing error)."""


@dataclass(eq=False)
class Task:
    """A work item to run: one the producer submitted (``key``), or a piece of one that failed."""

    key: object
    item: WorkItem
    parent: "Split | None" = None
    index: int = 0  # its place among the parent's pieces
    errors: int = 0  # times it raised
    deaths: int = 0  # times its actor died holding it alone
    solo: bool = False  # runs on an actor holding nothing else, so that a death names it


@dataclass(eq=False)
class Split:
    """A task redone in pieces; its result is theirs, merged, once all are in."""

    task: Task
    results: list
    left: int


class Recovery:
    """The backlog of tasks to (re)run, and the decisions on failed ones. ``done`` lists collect
    ``(key, ItemResult)`` of the producer's items as they complete."""

    def __init__(self, rank: int):
        self.rank = rank
        self.backlog: list[Task] = []
        self.splits = 0  # tasks redone in pieces

    def raised(self, task: Task, cause: str, done: list) -> None:
        task.errors += 1
        if task.errors < TRIES:
            self.backlog.append(task)
        elif len(task.item.samples) > 1:  # redo sample by sample before blaming any
            self._split(task, len(task.item.samples), f"raised {TRIES} times: {cause}")
        else:
            self.finish(task, quarantine_item(task.item, "worker_error", cause), done)

    def died(self, tasks: list[Task], cause: str, done: list) -> None:
        """The tasks an actor held when it died. One alone is charged with the death; several are
        not charged and go back solo (see the module doc)."""
        if len(tasks) > 1:
            for t in tasks:
                t.solo = True
            self.backlog.extend(tasks)
            return
        (task,) = tasks
        task.deaths += 1
        if task.deaths < TRIES:
            task.solo = True
            self.backlog.append(task)
        elif len(task.item.samples) > 1:
            self._split(task, 2, f"killed its actor {TRIES} times ({cause})", solo=True)
        else:
            detail = f"its preprocessing actor died {TRIES} times on this sample: {cause}"
            self.finish(task, quarantine_item(task.item, "worker_died", detail), done)

    def finish(self, task: Task, result: ItemResult, done: list) -> None:
        if task.parent is None:
            done.append((task.key, result))
            return
        split = task.parent
        split.results[task.index] = result
        split.left -= 1
        if split.left == 0:
            self.finish(split.task, merge_results(split.task.item, split.results), done)

    def _split(self, task: Task, parts: int, why: str, solo: bool = False) -> None:
        pieces = split_item(task.item, parts)
        self.splits += 1
        log.warning("rank %d: work item %s (%d samples) %s; redoing it in %d pieces", self.rank,
                    task.item.item_id, len(task.item.samples), why, len(pieces))
        split = Split(task, [None] * len(pieces), len(pieces))
        self.backlog.extend(Task(None, piece, split, i, solo=solo) for i, piece in enumerate(pieces))
