"""Items fetched ahead on a background thread, in order, at most ``depth`` waiting.

The rank's client (``datasvc.service.client.DataClient``) fetches micro-batch ``step``, ``step + 1``,
... from its feeder while the trainer computes; this is that loop without Ray, so its order,
back-pressure, error hand-over and stop are testable on their own. A fetch that raises ends the
loop: the error is handed to the reader in the item's place (after ``name_error`` has had a say),
and the reader raises it.
"""
from __future__ import annotations

import queue
import threading
from typing import Callable, Generic, TypeVar

Item = TypeVar("Item")


class Prefetcher(Generic[Item]):
    """``fetch(step)`` for ``first_step``, ``first_step + 1``, ... on a thread named ``name``."""

    def __init__(self, fetch: Callable[[int], Item], first_step: int, depth: int, name: str,
                 name_error: Callable[[BaseException], BaseException] = lambda exc: exc):
        self._fetch, self._name_error = fetch, name_error
        self._ready: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._halt = threading.Event()
        self.next_step = first_step  # the step the thread fetches next
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def get(self) -> Item:
        """The next item, in step order; raises what its fetch raised."""
        item = self._ready.get()
        if isinstance(item, BaseException):
            raise item
        return item

    @property
    def halted(self) -> bool:
        return self._halt.is_set()

    def halt(self, join_s: float | None = None) -> None:
        """Stop fetching (a fetch under way finishes first; its item is dropped); ``join_s``: wait
        that long for the thread."""
        self._halt.set()
        if join_s is not None:
            self._thread.join(timeout=join_s)

    def _loop(self) -> None:
        try:
            while not self._halt.is_set():
                item = self._fetch(self.next_step)
                self.next_step += 1
                while not self._halt.is_set():
                    try:
                        self._ready.put(item, timeout=0.5)  # short, so a halt is seen while the queue is full
                        break
                    except queue.Full:
                        continue
        except BaseException as exc:
            if not self._halt.is_set():  # a halted prefetcher has no reader left to take it
                self._ready.put(self._name_error(exc))
