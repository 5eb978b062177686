"""The feeder's scaling policy alone: what one interval's waits and blocks decide."""
from datasvc.service.scaling import ScalePolicy

POLICY = ScalePolicy(min_actors=1, max_actors=4)


def test_starved_consumers_add_an_actor_up_to_the_maximum():
    action, reason = POLICY.decide(actors=2, waited_s=0.3, blocked_s=0.0, interval_s=2.0)
    assert action == "up" and "waited 0.30s of 2.00s" in reason
    assert POLICY.decide(actors=4, waited_s=0.3, blocked_s=0.0, interval_s=2.0) is None


def test_a_producer_blocked_on_a_full_queue_gives_an_actor_back_down_to_the_minimum():
    action, reason = POLICY.decide(actors=3, waited_s=0.0, blocked_s=1.5, interval_s=2.0)
    assert action == "down" and "blocked 1.50s of 2.00s" in reason
    assert POLICY.decide(actors=1, waited_s=0.0, blocked_s=1.5, interval_s=2.0) is None


def test_a_blocked_producer_keeps_its_actors_while_consumers_still_wait():
    # Blocked and waited in one interval: a burst drained the queue; shrinking would starve the next.
    assert POLICY.decide(actors=3, waited_s=0.1, blocked_s=1.5, interval_s=2.0) is None


def test_a_quiet_interval_changes_nothing():
    assert POLICY.decide(actors=2, waited_s=0.01, blocked_s=0.2, interval_s=2.0) is None
