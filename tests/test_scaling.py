"""The feeder's scaling policy alone: what one interval's waits and blocks decide."""
from datasvc.service.scaling import ScalePolicy

POLICY = ScalePolicy(min_actors=1, max_actors=4)


def test_starved_consumers_add_an_actor_up_to_the_maximum():
    decision = POLICY.decide(actors=2, waited_s=0.3, blocked_s=0.0, interval_s=2.0)
    assert decision.action == "up" and "waited 0.30s of 2.00s" in decision.reason
    assert POLICY.decide(actors=4, waited_s=0.3, blocked_s=0.0, interval_s=2.0) is None


def test_a_producer_blocked_on_a_full_queue_gives_an_actor_back_down_to_the_minimum():
    decision = POLICY.decide(actors=3, waited_s=0.0, blocked_s=1.5, interval_s=2.0)
    assert decision.action == "down" and "blocked 1.50s of 2.00s" in decision.reason
    assert POLICY.decide(actors=1, waited_s=0.0, blocked_s=1.5, interval_s=2.0) is None


def test_a_blocked_producer_keeps_its_actors_while_consumers_still_wait():
    # Blocked and waited in one interval: a burst drained the queue; shrinking would starve the next.
    assert POLICY.decide(actors=3, waited_s=0.1, blocked_s=1.5, interval_s=2.0) is None


def test_a_quiet_interval_changes_nothing():
    assert POLICY.decide(actors=2, waited_s=0.01, blocked_s=0.2, interval_s=2.0) is None


def test_each_threshold_is_a_strict_share_of_the_interval():
    # Of a 10 s interval: more than 1 s waited grows; more than 5 s blocked with under 0.2 s waited shrinks.
    assert POLICY.decide(actors=2, waited_s=1.0, blocked_s=0.0, interval_s=10.0) is None
    assert POLICY.decide(actors=2, waited_s=1.01, blocked_s=0.0, interval_s=10.0).action == "up"
    assert POLICY.decide(actors=2, waited_s=0.0, blocked_s=5.0, interval_s=10.0) is None
    assert POLICY.decide(actors=2, waited_s=0.19, blocked_s=5.01, interval_s=10.0).action == "down"
    assert POLICY.decide(actors=2, waited_s=0.2, blocked_s=5.01, interval_s=10.0) is None
