"""A feeder's queue and autoscaler without Ray: back-pressure by count and bytes, the blocked and
waited seconds it measures, and what the autoscaler decides from them.

Time is a fake clock the test moves, so the seconds come out exact; threads stand in for the
producer and the consumers, and the only real waits are bounded guards against a hang."""
import threading
import time

import pytest

from datasvc.pack.epoch import Position
from datasvc.service.ready import WAKE_S, End, ReadyBatch, ReadyQueue
from datasvc.service.scaling import Autoscaler, ScaleDecision, ScalePolicy

HANG_S = 10.0  # a thread that should finish and has not by then never will
ROOMY = 1 << 30


class Clock:
    """Seconds that pass only when the test moves them."""

    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def in_background(call, *args):
    result = []
    thread = threading.Thread(target=lambda: result.append(call(*args)), daemon=True)
    thread.start()
    return thread, result


def finishes(thread: threading.Thread) -> bool:
    thread.join(timeout=HANG_S)
    return not thread.is_alive()


def stays_blocked(thread: threading.Thread) -> bool:
    # Past a wake-up: a waiter that may go would have re-checked and gone by then.
    thread.join(timeout=2 * WAKE_S)
    return thread.is_alive()


def wait_until(condition) -> None:
    deadline = time.monotonic() + HANG_S
    while not condition():
        assert time.monotonic() < deadline, "the thread never got there"
        time.sleep(0.005)


def fill(queue: ReadyQueue, steps, nbytes: int = 10) -> None:
    for step in steps:
        queue.put(step, f"ref-{step}", Position(0, 0, step, step), nbytes)


# ---- back-pressure -------------------------------------------------------------------------------
def test_a_full_queue_blocks_the_producer_until_every_consumer_took_a_batch():
    queue = ReadyQueue(max_batches=2, max_bytes=ROOMY, consumers=2)
    fill(queue, [0, 1])
    producer, room = in_background(queue.wait_for_room, 10)
    wait_until(lambda: queue.producer_blocked)

    assert isinstance(queue.take(consumer=0, step=0), ReadyBatch)
    assert stays_blocked(producer), "one consumer of two took step 0: it still holds its room"
    assert queue.take(consumer=0, step=0).ref == "ref-0"  # asking again does not count twice
    assert stays_blocked(producer)

    queue.take(consumer=1, step=0)
    assert finishes(producer) and room == [True]
    assert not queue.producer_blocked
    report = queue.report()
    assert (report.depth, report.bytes_ahead) == (1, 10)
    assert (report.occupancy["puts"], report.occupancy["gets"], report.occupancy["capacity"]) == (2, 1, 2)


def test_the_byte_budget_blocks_the_producer_and_an_empty_queue_admits_any_batch():
    queue = ReadyQueue(max_batches=10, max_bytes=100, consumers=1)
    producer, room = in_background(queue.wait_for_room, 500)
    assert finishes(producer) and room == [True], "a batch over the budget must not wait forever"
    fill(queue, [0], nbytes=60)

    producer, room = in_background(queue.wait_for_room, 40)  # exactly at the budget: room
    assert finishes(producer) and room == [True]

    producer, room = in_background(queue.wait_for_room, 41)
    wait_until(lambda: queue.producer_blocked)
    assert stays_blocked(producer)
    queue.take(consumer=0, step=0)
    assert finishes(producer) and room == [True]
    assert queue.report().bytes_ahead == 0


def test_stopping_releases_a_blocked_producer_for_good():
    queue = ReadyQueue(max_batches=1, max_bytes=ROOMY, consumers=1)
    fill(queue, [0])
    producer, room = in_background(queue.wait_for_room, 10)
    wait_until(lambda: queue.producer_blocked)
    queue.stop()
    assert finishes(producer) and room == [False]
    queue.take(consumer=0, step=0)
    assert queue.wait_for_room(10) is False


# ---- the seconds measured ------------------------------------------------------------------------
def test_blocked_seconds_count_a_block_under_way_and_after_it():
    clock = Clock(10.0)
    queue = ReadyQueue(max_batches=1, max_bytes=ROOMY, consumers=1, clock=clock)
    fill(queue, [0])
    producer, _ = in_background(queue.wait_for_room, 10)
    wait_until(lambda: queue.producer_blocked)

    clock.now = 12.0
    assert queue.blocked_total() == 2.0
    assert queue.report().producer_blocked_s == 2.0
    clock.now = 13.0
    queue.take(consumer=0, step=0)
    assert finishes(producer)
    clock.now = 20.0  # unblocked: no more seconds accrue
    assert queue.blocked_total() == 3.0

    assert queue.wait_for_room(10) is True  # room at once: nothing added
    assert queue.blocked_total() == 3.0


def test_waited_seconds_count_consumers_waiting_on_an_empty_queue():
    clock = Clock(5.0)
    queue = ReadyQueue(max_batches=4, max_bytes=ROOMY, consumers=1, clock=clock)
    consumer, got = in_background(queue.take, 0, 0)
    wait_until(lambda: queue.consumers_waiting == 1)

    clock.now = 7.0
    assert queue.waited_total() == 2.0
    assert queue.report().consumer_wait_s == 0.0, "the report counts waits that ended"
    clock.now = 8.0
    fill(queue, [0, 1])
    assert finishes(consumer) and got[0].ref == "ref-0"
    assert queue.consumers_waiting == 0
    assert queue.waited_total() == queue.report().consumer_wait_s == 3.0

    queue.take(consumer=0, step=1)  # already there: no wait
    assert queue.waited_total() == 3.0


# ---- the end of the stream -----------------------------------------------------------------------
def test_consumers_get_the_end_after_the_last_step_and_an_error_for_a_released_one():
    queue = ReadyQueue(max_batches=4, max_bytes=ROOMY, consumers=1)
    fill(queue, [0, 1])
    queue.take(consumer=0, step=0)
    released = queue.take(consumer=0, step=0)
    assert isinstance(released, End) and "step 0 was already released" in released.error

    waiting, got = in_background(queue.take, 0, 2)
    wait_until(lambda: queue.consumers_waiting == 1)
    assert not queue.done
    queue.finish(End(steps=2))
    assert finishes(waiting) and got == [End(steps=2)]
    assert queue.done and queue.report().end == End(steps=2)
    assert queue.take(consumer=0, step=1).ref == "ref-1", "what was put before the end is still handed out"


# ---- the autoscaler over the queue's totals ------------------------------------------------------
def scaler(min_actors: int = 1, max_actors: int = 3) -> Autoscaler:
    return Autoscaler(ScalePolicy(min_actors=min_actors, max_actors=max_actors))


def test_autoscaler_grows_while_consumers_wait_on_an_empty_queue_up_to_max_actors():
    clock = Clock()
    queue = ReadyQueue(max_batches=4, max_bytes=ROOMY, consumers=1, clock=clock)
    consumer, _ = in_background(queue.take, 0, 0)
    wait_until(lambda: queue.consumers_waiting == 1)
    clock.now = 1.0

    decision = scaler().decide(1, queue.waited_total(), queue.blocked_total(), interval_s=2.0)
    assert decision == ScaleDecision("up", "consumers waited 1.00s of 2.00s for data")
    assert scaler(max_actors=3).decide(3, queue.waited_total(), queue.blocked_total(), interval_s=2.0) is None
    queue.finish(End())
    assert finishes(consumer)


def test_autoscaler_shrinks_while_the_producer_is_blocked_down_to_min_actors():
    clock = Clock()
    queue = ReadyQueue(max_batches=1, max_bytes=ROOMY, consumers=1, clock=clock)
    fill(queue, [0])
    producer, _ = in_background(queue.wait_for_room, 10)
    wait_until(lambda: queue.producer_blocked)
    clock.now = 1.5

    decision = scaler().decide(3, queue.waited_total(), queue.blocked_total(), interval_s=2.0)
    assert decision == ScaleDecision("down", "producer blocked 1.50s of 2.00s on a full queue")
    assert scaler(min_actors=2).decide(2, queue.waited_total(), queue.blocked_total(), interval_s=2.0) is None
    queue.stop()
    assert finishes(producer)


def test_autoscaler_holds_when_the_producer_blocked_but_consumers_also_waited():
    assert scaler().decide(2, waited_total_s=0.1, blocked_total_s=1.5, interval_s=2.0) is None


def test_autoscaler_judges_only_what_accrued_since_its_last_decision():
    autoscaler = scaler(max_actors=4)
    assert autoscaler.decide(1, waited_total_s=1.0, blocked_total_s=0.0, interval_s=2.0).action == "up"
    assert autoscaler.decide(2, waited_total_s=1.0, blocked_total_s=0.0, interval_s=2.0) is None
    assert autoscaler.decide(2, waited_total_s=1.1, blocked_total_s=0.0, interval_s=2.0) is None  # 0.1s of 2s
    again = autoscaler.decide(2, waited_total_s=1.5, blocked_total_s=0.0, interval_s=2.0)
    assert again == ScaleDecision("up", "consumers waited 0.40s of 2.00s for data")
    down = autoscaler.decide(3, waited_total_s=1.5, blocked_total_s=1.2, interval_s=2.0)
    assert down == ScaleDecision("down", "producer blocked 1.20s of 2.00s on a full queue")


def test_autoscaler_records_only_the_decisions_carried_out_in_the_stats_form():
    autoscaler = scaler()
    up = autoscaler.decide(1, waited_total_s=1.0, blocked_total_s=0.0, interval_s=2.0)
    assert autoscaler.decisions == [], "a decision the node's budget refuses leaves no record"
    record = autoscaler.carried_out(up, actors=2)
    assert autoscaler.decisions == [record]
    entry = record.as_dict()
    assert list(entry) == ["time", "action", "actors", "reason"]
    assert (entry["action"], entry["actors"], entry["reason"]) == ("up", 2, up.reason)
    assert entry["time"] == pytest.approx(time.time(), abs=3600)  # wall clock, not a monotonic count
