"""Blocks sized in micro-batches: a block packs on its own, so a block of few rows leaves its last
micro-batch part empty. ``size_blocks`` chooses the item count that fills about N micro-batches."""
import numpy as np
import pytest

from datasvc.batch import EncodedSample
from datasvc.config import ServiceConfig
from datasvc.pack.packing import PackingConfig, pack
from datasvc.pack.epoch import EpochPlan, sample_token_counts, size_blocks
from datasvc.read.shards import expand_shards, index_shard

SEQ = 1024


def config(shards, mbs, **kw):
    return ServiceConfig(shards=tuple(shards), pipeline="qwen3vl", pipeline_options={"max_pixels": 256 * 256},
                         seq_len=SEQ, micro_batch_size=mbs, samples_per_item=4, **kw)


def fill(lengths: list[int], samples_per_block: int, mbs: int) -> float:
    """Real-token fraction of the micro-batches the packer makes from consecutive blocks."""
    real = slots = 0
    for b in range(0, len(lengths) - samples_per_block + 1, samples_per_block):
        samples = [EncodedSample(str(i), "s", np.zeros(n, np.int64), np.zeros(n, np.int64),
                                 np.zeros((0, 768), np.uint8), np.zeros((0, 3), np.int64))
                   for i, n in enumerate(lengths[b:b + samples_per_block])]
        for batch in pack(samples, PackingConfig(seq_len=SEQ, micro_batch_size=mbs), 768)[0]:
            real += int(batch.cu_seqlens[:, -1].sum())
            slots += batch.tokens.size
    return real / slots


@pytest.fixture(scope="module")
def token_counts(photo_shards):
    indexes = [index_shard(p) for p in expand_shards(photo_shards)]
    lengths = sample_token_counts(config(photo_shards, 1), indexes)
    assert len(lengths) == sum(len(i.samples) for i in indexes)  # every good sample, none decoded
    return np.random.default_rng(0).permutation(lengths * 20).tolist()  # enough for several blocks


@pytest.mark.parametrize("mbs", [1, 4, 8])
def test_sized_blocks_fill_their_micro_batches(photo_shards, token_counts, mbs):
    sized, sizing = size_blocks(config(photo_shards, mbs))
    assert sizing.items_per_block == sized.items_per_block and sizing.probed_samples > 0
    per_block = round(sized.items_per_block * sizing.samples_per_item)
    # About eight micro-batches of rows per block (the probe's mean is within 10% of the full one).
    rows_per_sample = np.mean(token_counts) / SEQ
    assert 8 * mbs <= 1.1 * per_block * rows_per_sample
    assert (per_block - sizing.samples_per_item) * rows_per_sample <= 1.1 * 8 * mbs
    # Half a micro-batch of padding rows per block is 1/16 at eight: at least 0.87 real tokens a slot.
    assert fill(token_counts, per_block, mbs) >= 0.87
    # A block of one micro-batch's worth loses far more to its part-empty last micro-batch.
    small = round(size_blocks(config(photo_shards, mbs), target_micro_batches=1)[0].items_per_block
                  * sizing.samples_per_item)
    assert fill(token_counts, small, mbs) < fill(token_counts, per_block, mbs) - 0.05


def test_sizing_is_deterministic_and_part_of_the_fingerprint(photo_shards):
    a, _ = size_blocks(config(photo_shards, 4))
    b, _ = size_blocks(config(photo_shards, 4))
    assert a == b and a.fingerprint() == b.fingerprint()
    c, _ = size_blocks(config(photo_shards, 4), target_micro_batches=2)
    assert c.items_per_block < a.items_per_block and c.fingerprint() != a.fingerprint()


def test_padded_rows_size_blocks_by_samples_without_probing(photo_shards):
    cfg = config(photo_shards, 2, pack=False)
    sized, sizing = size_blocks(cfg, target_micro_batches=3, probe_shards=len(photo_shards))
    assert sizing.samples_per_item == round(EpochPlan(cfg).samples_per_item, 2)  # every shard probed
    assert sizing.probed_samples == 0 and sizing.tokens_per_sample is None
    assert sized.items_per_block == int(np.ceil(3 * 2 / EpochPlan(cfg).samples_per_item))


def test_probe_reads_a_bounded_seeded_subset_of_shards(photo_shards, monkeypatch):
    import datasvc.pack.epoch as epoch

    indexed = []
    real_index = epoch.index_shard
    monkeypatch.setattr(epoch, "index_shard", lambda p: indexed.append(p) or real_index(p))
    a, _ = size_blocks(config(photo_shards, 2), probe_shards=3, probe_samples=12)
    first = list(indexed)
    indexed.clear()
    b, _ = size_blocks(config(photo_shards, 2), probe_shards=3, probe_samples=12)
    assert len(first) == 3 and indexed == first and a == b  # bounded and deterministic
    indexed.clear()
    size_blocks(config(photo_shards, 2, seed=5), probe_shards=3, probe_samples=12)
    assert len(indexed) == 3 and indexed != first


def test_probe_reads_more_small_shards_until_it_has_its_samples(tmp_path, monkeypatch):
    """Four-sample shards: eight of them hold 32 samples, so the probe takes shards until its 64
    are in hand (16 of 24), and no more than ``max_probe_shards``."""
    import datasvc.pack.epoch as epoch
    from datasvc.samples import write_photo_shards

    shards = write_photo_shards(str(tmp_path), samples_per_shard=4, copies=4)
    assert len(shards) == 24
    indexed = []
    real_index = epoch.index_shard
    monkeypatch.setattr(epoch, "index_shard", lambda p: indexed.append(p) or real_index(p))
    _, sizing = size_blocks(config(shards, 2), probe_samples=64)
    assert len(indexed) == 16 and sizing.probed_samples == 64
    indexed.clear()
    _, sizing = size_blocks(config(shards, 2), probe_samples=64, max_probe_shards=9)
    assert len(indexed) == 9 and sizing.probed_samples == 36


def test_bad_target_fails_fast(photo_shards):
    with pytest.raises(ValueError, match="target_micro_batches"):
        size_blocks(config(photo_shards, 1), target_micro_batches=0)


def test_spanning_blocks_lay_epochs_end_to_end(photo_shards):
    cfg = config(photo_shards, 2, items_per_block=3, epochs=2, blocks_span_epochs=True)
    plan = EpochPlan(cfg)
    per_epoch = plan.items(0, 0)
    blocks = list(plan.spanning_blocks(0))
    assert [b for _, b, _ in blocks] == list(range(len(blocks)))
    assert [i for _, _, items in blocks for i in items] == per_epoch + plan.items(1, 0)  # each once per epoch
    assert all(len(items) == 3 for _, _, items in blocks[:-1])  # only the very last block is short
    k = len(per_epoch) // 3  # the block where epoch 0 ends
    assert len(per_epoch) % 3, "test shards must make a block straddle the epoch end"
    epoch, _, items = blocks[k]
    assert epoch == 0 and items == per_epoch[3 * k:] + plan.items(1, 0)[:3 * (k + 1) - len(per_epoch)]
    assert blocks[k + 1][0] == 1  # labelled by the epoch of its first item
    assert list(plan.spanning_blocks(0, start_block=4)) == blocks[4:]  # resume from any block
    endless = config(photo_shards, 2, items_per_block=3, epochs=None, blocks_span_epochs=True)
    first = [b for _, b in zip(range(3 * len(blocks)), EpochPlan(endless).spanning_blocks(0))]
    assert [e for e, _, _ in first][-1] >= 4  # streams on past the epochs a finite plan would stop at


def test_spanning_blocks_draw_each_epoch_order_once(photo_shards, monkeypatch):
    """A block's items come from the epoch orders it touches, each drawn once for the whole stream,
    so a feeder's work per block does not grow with the dataset."""
    cfg = config(photo_shards, 2, items_per_block=2, epochs=3, blocks_span_epochs=True)
    plan = EpochPlan(cfg)
    expected = list(plan.spanning_blocks(0))
    drawn = []
    real_items = EpochPlan.items
    monkeypatch.setattr(EpochPlan, "items", lambda self, epoch, rank: drawn.append(epoch) or real_items(self, epoch, rank))
    assert list(plan.spanning_blocks(0)) == expected
    assert len(expected) > 3 * 2 and drawn == [0, 1, 2]
    assert [i for _, _, items in expected for i in items] == [i for e in range(3) for i in real_items(plan, e, 0)]


def test_spanning_blocks_change_the_fingerprint_only_when_set(photo_shards):
    base = config(photo_shards, 2, items_per_block=3)
    assert config(photo_shards, 2, items_per_block=3, blocks_span_epochs=False).fingerprint() == base.fingerprint()
    assert config(photo_shards, 2, items_per_block=3, blocks_span_epochs=True).fingerprint() != base.fingerprint()
