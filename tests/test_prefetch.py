"""The rank's fetch-ahead loop without Ray: order, a bound on what waits, errors handed to the
reader, and a stop that holds (``datasvc.stream.prefetch``)."""
import threading
import time

import pytest

from datasvc.stream.prefetch import Prefetcher


def test_items_come_in_step_order_from_the_first_step():
    ahead = Prefetcher(lambda step: step * 10, first_step=3, depth=2, name="t")
    assert [ahead.get() for _ in range(5)] == [30, 40, 50, 60, 70]
    ahead.halt(join_s=5)


def test_at_most_depth_items_wait_plus_the_one_in_hand():
    fetched = []
    ahead = Prefetcher(lambda step: fetched.append(step) or step, first_step=0, depth=3, name="t")
    time.sleep(0.5)  # nobody reads: the thread fills the queue, fetches one more and blocks
    assert fetched == [0, 1, 2, 3] and ahead.next_step == 4
    assert ahead.get() == 0
    time.sleep(0.3)
    assert fetched == [0, 1, 2, 3, 4]
    ahead.halt(join_s=5)


def test_a_fetch_error_reaches_the_reader_after_the_items_before_it_named_by_name_error():
    def fetch(step):
        if step == 2:
            raise KeyError("gone")
        return step

    ahead = Prefetcher(fetch, first_step=0, depth=4, name="t",
                       name_error=lambda exc: RuntimeError(f"named: {exc!r}"))
    assert [ahead.get(), ahead.get()] == [0, 1]
    with pytest.raises(RuntimeError, match="named: KeyError"):
        ahead.get()


def test_a_halt_stops_the_thread_even_with_a_full_queue():
    ahead = Prefetcher(lambda step: step, first_step=0, depth=1, name="t-halt")
    time.sleep(0.2)
    ahead.halt(join_s=5)
    assert ahead.halted and not any(t.name == "t-halt" for t in threading.enumerate())


def test_an_error_after_a_halt_is_not_handed_over():
    release = threading.Event()

    def fetch(step):
        release.wait(5)
        raise ValueError("after the halt")

    ahead = Prefetcher(fetch, first_step=0, depth=1, name="t")
    ahead.halt()
    release.set()
    ahead.halt(join_s=5)
    assert ahead._ready.empty()
