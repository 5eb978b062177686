"""Resume at another data-parallel size: every remaining sample of the epoch trained exactly once."""
import dataclasses
from collections import Counter

import numpy as np
import pytest

from datasvc.config import BalanceConfig
from datasvc.remainder import TrainedSamples, remainder_after
from test_service import config, drain, expected_keys, service  # noqa: F401  (the service fixture)


def test_trained_samples_round_trip_and_union():
    a = TrainedSamples()
    a.add(np.array([0, 0, 1]), np.array([3, 17, 2]))
    a.add(np.array([0]), np.array([-1]))  # not planned: not recorded
    b = TrainedSamples.from_state(a.to_state())
    assert b.epochs() == [0, 1] and b.count(0) == 2 and b.trained(0, 17) and not b.trained(0, 2)
    c = b.union(TrainedSamples({0: np.array([True, False])}))
    assert c.count(0) == 3 and c.since(1).epochs() == [1]


def _consume(svc, dp, steps):
    """Each DP rank's first ``steps`` micro-batches, then every rank's saved state."""
    clients = [svc.client(r, output="numpy") for r in range(dp)]
    keys = [k for _ in range(steps) for c in clients for k in next(c).sample_keys]
    return keys, [c.save_state() for c in clients]


@pytest.mark.parametrize("before,after,balance", [(2, 1, False), (1, 2, False), (2, 1, True)])
def test_resume_at_another_dp_size_trains_each_remaining_sample_once(photo_shards, service, before, after, balance):
    base = dict(epochs=1, seed=11, micro_batch_size=1, samples_per_item=2, items_per_block=2, blocks_span_epochs=True,
                chain_blocks=2)
    if balance:
        base.update(balance=BalanceConfig(enabled=True, micro_batches_per_step=2))
    cfg = config(photo_shards, dp_size=before, **base)
    svc = service(cfg)
    trained, states = _consume(svc, before, 3)
    svc.shutdown()

    remainder = remainder_after(states)
    resumed = dataclasses.replace(cfg, dp_size=after, remainder=remainder)
    assert resumed.fingerprint() != dataclasses.replace(cfg, dp_size=after).fingerprint()
    svc = service(resumed)
    rest = [k for r in range(after) for b in drain(svc.client(r, output="numpy")) for k in b.sample_keys]
    svc.shutdown()
    assert not set(trained) & set(rest)  # nothing trained twice
    want = expected_keys(photo_shards)
    got = Counter(trained) + Counter(rest)
    if balance:  # a balanced stream ends at the last step every rank can fill: a few samples may wait
        assert max(got.values()) == 1 and sum(got.values()) >= sum(want.values()) - 6
    else:
        assert got == want  # every sample of the epoch, exactly once over both runs


def test_the_resume_fingerprint_is_the_fields_marked_for_it():
    """Every field marked RESUME changes the fingerprint, no other field does, and the value a
    checkpoint of an earlier release holds is unchanged (states saved then still restore)."""
    import dataclasses

    from datasvc.config import BalanceConfig, BudgetConfig, DecodeConfig, PoolConfig, ServiceConfig

    base = ServiceConfig(shards=("a.tar",))
    assert base.fingerprint() == "1d661681dfc65cc8"
    changed = {"shards": ("b.tar",), "pipeline_options": {"max_pixels": 65536}, "seq_len": 1024, "micro_batch_size": 2,
               "pack": False, "dp_size": 2, "seed": 1, "samples_per_item": 4, "items_per_block": 2,
               "blocks_span_epochs": True, "chain_blocks": 4, "filters": ("similarity>=0.2",),
               "remainder": {"first_epoch": 1, "trained": {}}}
    for name, value in changed.items():
        assert dataclasses.replace(base, **{name: value}).fingerprint() != base.fingerprint(), name
    marked = {f.name for f in dataclasses.fields(ServiceConfig) if f.metadata.get("resume")}
    assert marked == set(changed) | {"pipeline", "blend", "balance"}
    on = BalanceConfig(enabled=True, micro_batches_per_step=2)
    assert dataclasses.replace(base, balance=on).fingerprint() != base.fingerprint()
    for name, value in {"pool": PoolConfig(max_actors=8), "prefetch": 4, "decode": DecodeConfig(device="gpu"),
                        "replan_on_dataset_change": True, "budget": BudgetConfig(max_text_bytes=1024),
                        "balance": BalanceConfig(sizes_index="index")}.items():
        assert dataclasses.replace(base, **{name: value}).fingerprint() == base.fingerprint(), name


def test_a_loader_state_round_trips_its_checkpoint_form_and_reads_older_ones():
    from datasvc.pack.epoch import Position
    from datasvc.remainder import TrainedSamples
    from datasvc.stream.loaderstate import LoaderState

    trained = TrainedSamples()
    trained.add([0, 0, 1], [3, 5, 2])
    state = LoaderState("fp", 1, Position(1, 4, 2, 37, ((0, 9), (1, 2))), trained, {"files": 2}, {"first_epoch": 1})
    saved = state.as_dict()
    assert list(saved)[:7] == ["fingerprint", "dp_rank", "epoch", "block", "batch", "step", "carry"]
    back = LoaderState.from_dict(saved)
    assert back.as_dict() == saved and back.position == state.position
    assert back.last_delivered == {"epoch": 1, "block": 4, "batch": 1, "step": 36, "carry": [[0, 9], [1, 2]]}
    older = LoaderState.from_dict({"epoch": 0, "block": 2, "batch": 0, "step": 8})  # saved before the other fields
    assert (older.fingerprint, older.dp_rank, older.dataset, older.remainder) == ("", -1, None, None)
    assert older.position == Position(0, 2, 0, 8)


def test_the_state_after_a_micro_batch_resumes_at_the_next_one_and_keeps_recent_epochs():
    from datasvc.pack.epoch import Position
    from datasvc.remainder import KEPT_EPOCHS
    from datasvc.stream.loaderstate import LoaderState

    trained = TrainedSamples()
    trained.add(list(range(6)), [1] * 6)  # one sample trained in each of epochs 0-5
    delivered = {"epoch": 5, "block": 3, "batch": 1, "step": 40, "carry": [[0, 9]]}
    state = LoaderState.after(delivered, "fp", 2, trained, {"files": 1})
    assert state.position == Position(5, 3, 2, 41, ((0, 9),))
    assert state.trained.epochs() == list(range(5 - KEPT_EPOCHS, 6))
    assert state.last_delivered == delivered  # what the client reports after a restore
    fresh = LoaderState.after(None, "fp", 0, TrainedSamples())
    assert fresh.position == Position(0, 0, 0, 0) and fresh.dataset is None

    # A block spanning epochs, or a row that waited, keeps samples of older epochs in flight: the
    # state keeps their records, and a resume at another DP size deals anew from the oldest.
    waiting = {**delivered, "oldest": 1, "carry": [[0, 9, 2]]}
    state = LoaderState.after(waiting, "fp", 2, trained, {"files": 1})
    assert state.position == Position(5, 3, 2, 41, ((0, 9, 2),), oldest=1)
    assert state.trained.epochs() == list(range(max(0, 1 - KEPT_EPOCHS), 6))
    assert LoaderState.from_dict(state.as_dict()).position == state.position
    assert remainder_after([state.as_dict()])["first_epoch"] == 0
    assert remainder_after([LoaderState.after(delivered, "fp", 2, trained).as_dict()])["first_epoch"] == 4
