"""A filter that no sample passes is named as the likely mistake, not reported as bad data."""
import pytest

from datasvc import BlockProducer, BudgetConfig, DataServiceError, for_training


def test_a_filter_no_sample_passes_is_named(photo_shards):
    cfg = for_training(photo_shards, items_per_block=2, filters=("similarity>=0.3",), budget=BudgetConfig(max_consecutive_rejections=10))
    with pytest.raises(DataServiceError, match=r"none of the first \d+ samples read passed the filters "
                                               r"\(filter:similarity>=0.3 x\d+\); check each rule's field"):
        next(BlockProducer(cfg).micro_batches())


def test_a_selective_filter_that_some_samples_pass_streams(photo_shards):
    cfg = for_training(photo_shards, items_per_block=2, filters=("image_min_side>=300",), budget=BudgetConfig(max_consecutive_rejections=10))
    producer = BlockProducer(cfg)
    batch, _ = next(producer.micro_batches())
    assert batch.sample_keys and producer.acct.n_skipped > 0
