"""``TrainBatch``: the micro-batch a rank trains on, one typed contract for both trainer backends and
the benches' peer data paths. Its fields, its dict form, its move to a device, the counts a step
record carries, and ``batch_tensors`` making it from a ``PackedBatch``."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from datasvc.batch import PackedBatch, TrainBatch
from datasvc.registry import get_layout
from datasvc.stream.tensors import batch_tensors

FIELDS = ["tokens", "labels", "loss_mask", "cu_seqlens", "num_samples", "pixel_values", "image_grid_thw",
          "sample_keys", "sample_epochs", "pixel_values_videos", "video_grid_thw"]
VIDEO_FIELDS = {"pixel_values_videos", "video_grid_thw"}


def known_batch(videos: bool) -> TrainBatch:
    """Two rows: two samples of 3 and 7 tokens, then one of 5; two images (4x6 and 2x2 patches) and,
    with ``videos``, one video of 3 temporal groups of 2x4 patches."""
    video = {"pixel_values_videos": torch.randn(24, 1536, dtype=torch.bfloat16),
             "video_grid_thw": torch.tensor([[3, 2, 4]])} if videos else {}
    return TrainBatch(tokens=torch.zeros((2, 10), dtype=torch.int64), labels=torch.full((2, 10), -100),
                      loss_mask=torch.zeros((2, 10)),
                      cu_seqlens=torch.tensor([[0, 3, 10], [0, 5, 5]], dtype=torch.int32),
                      num_samples=torch.tensor([2, 1], dtype=torch.int32), pixel_values=torch.randn(28, 1536),
                      image_grid_thw=torch.tensor([[1, 4, 6], [1, 2, 2]]), sample_keys=["s/a", "s/b", "s/c"],
                      sample_epochs=[0, 0, 1], **video)


def test_the_fields_in_order_and_what_is_optional():
    assert [f.name for f in dataclasses.fields(TrainBatch)] == FIELDS
    bare = TrainBatch(tokens=torch.zeros((1, 4)), labels=torch.zeros((1, 4)), loss_mask=torch.zeros((1, 4)),
                      cu_seqlens=torch.zeros((1, 2)), num_samples=torch.ones(1), pixel_values=torch.zeros((0, 1536)),
                      image_grid_thw=torch.zeros((0, 3)))
    assert bare.pixel_values_videos is None and bare.video_grid_thw is None and not bare.has_videos
    assert bare.sample_keys == [] and bare.sample_epochs == []
    other = TrainBatch(**{name: getattr(bare, name) for name in FIELDS[:7]})
    assert other.sample_keys is not bare.sample_keys  # each batch its own lists
    with pytest.raises(TypeError):  # keyword only: no field is ever taken by position
        TrainBatch(*[getattr(bare, f) for f in FIELDS])
    with pytest.raises(AttributeError):  # slots: a misspelt field is an error, not a new attribute
        bare.token = torch.zeros(1)


def test_as_dict_leaves_videos_out_when_absent_and_round_trips():
    still = known_batch(videos=False)
    d = still.as_dict()
    assert list(d) == [f for f in FIELDS if f not in VIDEO_FIELDS]
    assert all(d[f] is getattr(still, f) for f in d)
    again = TrainBatch(**d)
    assert again.video_grid_thw is None and all(getattr(again, f) is getattr(still, f) for f in FIELDS)

    moving = known_batch(videos=True)
    assert moving.has_videos and list(moving.as_dict()) == FIELDS
    assert TrainBatch(**moving.as_dict()).pixel_values_videos is moving.pixel_values_videos


def test_step_counts_per_image_per_temporal_group_and_per_sample():
    """What a step record carries for the cost fit: the tower attends within an image and within each
    temporal group of a video; the decoder within each sample of a row, never across rows' padding."""
    batch = known_batch(videos=True)
    assert batch.vision_patches == 24 + 4 + 24
    assert batch.vision_patches_sq == 24**2 + 4**2 + 3 * 8**2
    assert batch.sample_tokens_sq == 3**2 + 7**2 + 5**2
    assert known_batch(videos=False).vision_patches == 28

    # The grids and boundaries may be numpy arrays too, mixed with tensors; a grid may be empty.
    mixed = dataclasses.replace(batch, video_grid_thw=np.array([[3, 2, 4]]))
    assert (mixed.vision_patches, mixed.vision_patches_sq, mixed.sample_tokens_sq) == (52, 784, 83)
    text_only = dataclasses.replace(batch, image_grid_thw=np.zeros((0, 3), np.int64), video_grid_thw=None,
                                    cu_seqlens=np.array([[0, 4, 4]]), num_samples=np.array([1]))
    assert (text_only.vision_patches, text_only.vision_patches_sq, text_only.sample_tokens_sq) == (0, 0, 16)
    empty_video = dataclasses.replace(batch, video_grid_thw=torch.zeros((0, 3), dtype=torch.int64))
    assert not empty_video.has_videos and empty_video.vision_patches == 28


def test_to_moves_every_tensor_and_keeps_dtypes():
    batch = known_batch(videos=True)
    moved = batch.to("meta")  # a device every machine has, so the move is real without a GPU
    for name in FIELDS:
        before, after = getattr(batch, name), getattr(moved, name)
        if isinstance(before, torch.Tensor):
            assert after.device.type == "meta" and after.dtype == before.dtype and after.shape == before.shape, name
            assert before.device.type == "cpu", name  # the original stays where it was
        else:
            assert after == before, name
    assert moved.pixel_values_videos.dtype == torch.bfloat16
    assert known_batch(videos=False).to("meta").video_grid_thw is None


def packed(videos: bool) -> PackedBatch:
    rng = np.random.default_rng(0)
    video = {"video_pixels": rng.integers(0, 255, (8, 768), dtype=np.uint8),  # 1x2x2 patches, 2 frames each
             "video_grid_thw": np.array([[1, 2, 2]])} if videos else {}
    return PackedBatch(tokens=np.arange(8, dtype=np.int64)[None], labels=np.full((1, 8), -100, np.int64),
                       loss_mask=np.zeros((1, 8), np.float32), cu_seqlens=np.array([[0, 8]], np.int32),
                       num_samples=np.array([1], np.int32), pixels=rng.integers(0, 255, (4, 768), dtype=np.uint8),
                       image_grid_thw=np.array([[1, 2, 2]]), sample_keys=["s/a"], sample_epochs=np.array([3]), **video)


def test_batch_tensors_makes_a_train_batch():
    spec = get_layout("qwen3vl").vision
    batch = batch_tensors(packed(videos=False), spec, pixel_dtype="bfloat16")
    assert isinstance(batch, TrainBatch)
    assert (batch.tokens.dtype, batch.labels.dtype, batch.loss_mask.dtype) == (torch.int64, torch.int64, torch.float32)
    assert (batch.cu_seqlens.dtype, batch.num_samples.dtype, batch.image_grid_thw.dtype) == (
        torch.int32, torch.int32, torch.int64)
    assert batch.pixel_values.shape == (4, 1536) and batch.pixel_values.dtype == torch.bfloat16
    assert batch.sample_keys == ["s/a"] and batch.sample_epochs == [3]
    assert batch.pixel_values_videos is None and batch.video_grid_thw is None and not batch.has_videos

    with_video = batch_tensors(packed(videos=True), spec)
    assert with_video.has_videos and with_video.video_grid_thw.tolist() == [[1, 2, 2]]
    assert with_video.pixel_values_videos.shape == (4, 1536) and with_video.pixel_values_videos.dtype == torch.float32
    assert with_video.vision_patches == 8


def test_the_public_api_exports_it():
    import datasvc

    assert datasvc.TrainBatch is TrainBatch and "TrainBatch" in datasvc.__all__
