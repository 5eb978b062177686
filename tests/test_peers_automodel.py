"""The NeMo AutoModel peer: AutoModel 0.7.0's own VLM packer (its pretokenizing wrapper, its
``neat_pack_dataset_vlm`` plan by ``greedy_knapsack_vt_balanced``, its THD collater) runs in its own
environment and process on the bundled shards, and the rank reads packed micro-batches in the rank's
contract; the plan is AutoModel's: every sample in one pack, packs served in ascending vision work."""
import dataclasses
import os

import pytest
import torch

from pipelines.qwen3vl.data import TOKENS
from tests.test_peers import SETTING, SHARDS, check
from trainer.bench.automodel_packer import kept_indices, rank_contract
from trainer.bench.peers_data import shard_samples


def test_a_pack_names_the_samples_it_kept():
    # (raw index served, length after the shift). Of two samples of one length the earlier is the one
    # kept: had it overflowed the row, the later would have too.
    trace = [(3, 500), (7, 900), (9, 900), (4, 120)]
    assert kept_indices(trace, [500, 900, 120]) == [3, 7, 4]
    assert kept_indices(trace, [500, 120]) == [3, 4]
    assert kept_indices([(5, 300)], [0]) == []  # a padding-only row names no sample


def test_the_collated_batch_becomes_the_rank_contract():
    collated = {"input_ids": torch.arange(16).view(2, 8), "labels": torch.full((2, 8), -100),
                "seq_lens": torch.tensor([[3, 4, 1], [5, -1000, -1000]]),
                "pixel_values": torch.zeros(8, 1536, dtype=torch.bfloat16),
                "image_grid_thw": torch.tensor([[1, 2, 4]])}
    collated["labels"][0, 1] = 7
    out = rank_contract(collated, ["a", "b", "c", "d"])
    assert out.cu_seqlens.dtype == torch.int32
    assert out.cu_seqlens.tolist() == [[0, 3, 7, 8], [0, 5, 5, 5]]  # the unused tail repeats the row's end
    assert out.num_samples.tolist() == [3, 1]
    assert out.loss_mask.dtype == torch.float32 and out.loss_mask.sum() == 1 and out.loss_mask[0, 1] == 1
    assert out.sample_keys == ["a", "b", "c", "d"] and out.video_grid_thw is None


@pytest.fixture(scope="module")
def packed_batches(tmp_path_factory):
    from trainer.bench.peers_automodel import AutoModelPackedPath, automodel_python

    if automodel_python() is None:
        pytest.skip("no .venv-automodel (NeMo AutoModel 0.7.0's environment; .ci/bootstrap builds it)")
    work_dir = str(tmp_path_factory.mktemp("automodel"))
    path = AutoModelPackedPath(SETTING, work_dir, pad_id=TOKENS.pad, num_workers=2)
    try:
        batches = [next(path) for _ in range(3)]
        plan, log_path = path.plan, path.log_path
    finally:
        path.close()
    assert path.process.returncode is not None
    return {"batches": batches, "plan": plan, "log": log_path}


def test_automodel_packing_yields_packed_rows_in_the_rank_contract(packed_batches):
    batches = packed_batches["batches"]
    counts = [check_packed(b) for b in batches]
    assert all(c["rows"] == SETTING.mbs and c["width"] == SETTING.seq_len for c in counts)
    assert all(n > 1 for b in batches for n in b.num_samples.tolist())  # several samples a row
    assert all(len(b.sample_keys) == int(b.num_samples.sum()) for b in batches)
    # Two packs hold the 12 samples at 4096 tokens a row: one micro-batch is the whole first pass.
    everyone = sorted(s["key"] for s in shard_samples(SHARDS))
    assert sorted(batches[0].sample_keys) == everyone
    assert counts[0]["images"] == 15


def check_packed(batch):
    # AutoModel's collater hands pixel values over in bfloat16 (its model's dtype); the contract's
    # check takes any float, the test_peers helper float32 only.
    counts = check(dataclasses.replace(batch, pixel_values=batch.pixel_values.float()), SETTING)
    assert batch.pixel_values.dtype == torch.bfloat16
    return counts


def test_the_plan_is_automodels_vision_balanced_knapsack(packed_batches):
    plan, batches = packed_batches["plan"], packed_batches["batches"]
    keys = [k for b in plan for k in b]
    assert sorted(keys) == sorted(s["key"] for s in shard_samples(SHARDS))  # each sample in one pack
    # The rows are the plan's packs in its order, and each pass serves the same order (no shuffle:
    # consecutive packs go to the DP ranks of one step).
    rows = batches[0].sample_keys
    assert rows == keys[:len(rows)]
    assert batches[1].sample_keys == batches[0].sample_keys == batches[2].sample_keys
    # greedy_knapsack_vt_balanced serves packs in ascending vision tokens.
    vision = [int((row == TOKENS.image_pad).sum()) for b in batches[:1] for row in b.tokens]
    assert vision == sorted(vision) and vision[0] < vision[-1], vision
    assert os.path.exists(packed_batches["log"])
