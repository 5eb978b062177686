"""The arrays ``vlmfeed inspect`` writes: compressed, pixels kept as the uint8 images they are.

A rank's float ``pixel_values`` are a fixed function of uint8 pixels (patch order, both temporal
frames, normalized): as float32 they take 8x the bytes of those pixels and say nothing more. So the
files hold the uint8 images each micro-batch's pixel values are made from, at their grid's size,
with the normalization constants, and ``rank_fields`` rebuilds the rank's own arrays from them with
the rank's own functions (``vision.to_pixel_values``, ``video.to_video_pixel_values``).

Exactness: a CPU rank gets exactly ``rank_fields``' arrays. Images the actors hand over unresized
(``image_frame_hw`` differs from the grid's size) are resized here as a CPU rank resizes them
(OpenCV); a GPU rank resizes those with torch's antialiased bicubic, a level or two of 255 apart at
most, and usually casts ``pixel_values`` to bfloat16.
"""
from __future__ import annotations

import os

import numpy as np

from datasvc.batch import EncodedSample, PackedBatch
from datasvc.media.vision import VisionSpec, finish_resize, to_pixel_values

VISION_KEYS = ("image_mean", "image_std", "patch_size", "temporal_patch_size", "merge_size")


def vision_constants(spec: VisionSpec) -> dict[str, np.ndarray]:
    return {"image_mean": np.asarray(spec.image_mean, np.float32), "image_std": np.asarray(spec.image_std, np.float32),
            "patch_size": np.int64(spec.patch_size), "temporal_patch_size": np.int64(spec.temporal_patch_size),
            "merge_size": np.int64(spec.merge_size)}


def spec_from(arrays) -> VisionSpec:
    """The ``VisionSpec`` a file's pixels were made with (its pixel caps play no part in rebuilding)."""
    return VisionSpec(patch_size=int(arrays["patch_size"]), temporal_patch_size=int(arrays["temporal_patch_size"]),
                      merge_size=int(arrays["merge_size"]), image_mean=tuple(float(v) for v in arrays["image_mean"]),
                      image_std=tuple(float(v) for v in arrays["image_std"]))


def grid_sized_pixels(rows: np.ndarray, spec: VisionSpec, grid_thw, frames_hw) -> np.ndarray:
    """Every image's uint8 rows at its grid's size: where an image travels as a larger frame, the
    resize a CPU rank makes before its pixel values."""
    grids = np.asarray(grid_thw, np.int64).reshape(-1, 3)
    return np.ascontiguousarray(finish_resize(np.asarray(rows), spec, grids, frames_hw))


def packed_arrays(batch: PackedBatch, spec: VisionSpec, samples: list[dict],
                  position: tuple[int, int, int, int]) -> dict[str, np.ndarray]:
    """What ``packed-NNNNN.npz`` holds for one micro-batch (see ``datasvc.tools.inspect``);
    ``samples``: the table's row of each of its samples, in order."""
    grids = np.asarray(batch.image_grid_thw, np.int64).reshape(-1, 3)
    count = len(batch.sample_keys)
    frames_hw = (batch.image_frame_hw if batch.image_frame_hw is not None
                 else grids[:, 1:] * spec.patch_size)
    return {
        "tokens": batch.tokens, "labels": batch.labels, "loss_mask": batch.loss_mask,
        "cu_seqlens": batch.cu_seqlens, "num_samples": batch.num_samples,
        "image_grid_thw": grids, "image_pixels": grid_sized_pixels(batch.pixels, spec, grids, batch.image_frame_hw),
        "image_frame_hw": np.asarray(frames_hw, np.int64).reshape(-1, 2),
        "video_grid_thw": np.asarray(batch.video_grid_thw, np.int64).reshape(-1, 3),
        "video_pixels": np.asarray(batch.video_pixels, np.uint8).reshape(-1, spec.patch_dim),
        "sample_keys": np.array(batch.sample_keys, dtype=str),
        "sample_rows": _int_array(batch.sample_rows, count, np.int32),
        "sample_epochs": _int_array(batch.sample_epochs, count, np.int64),
        "sample_ordinals": _int_array(batch.sample_ordinals, count, np.int64),
        "sample_names": np.array([s["key"] for s in samples], dtype=str),
        "sample_images": np.asarray([len(s["grids"]) for s in samples], np.int64),
        "sample_videos": np.asarray([len(s["video_grids"]) for s in samples], np.int64),
        "position": np.asarray(position, np.int64), **vision_constants(spec),
    }


def sample_arrays(sample: EncodedSample, spec: VisionSpec) -> dict[str, np.ndarray]:
    """What a sample's ``samples/<key>.npz`` holds (``--no-pack``): the sample before packing."""
    grids = np.asarray(sample.image_grid_thw, np.int64).reshape(-1, 3)
    return {
        "input_ids": sample.input_ids, "labels": sample.labels, "image_grid_thw": grids,
        "image_pixels": grid_sized_pixels(sample.pixels, spec, grids, sample.image_frame_hw),
        "video_grid_thw": np.asarray(sample.video_grid_thw, np.int64).reshape(-1, 3),
        "video_pixels": np.asarray(sample.video_pixels, np.uint8).reshape(-1, spec.patch_dim),
        "key": np.array(sample.key), "shard": np.array(sample.shard), **vision_constants(spec),
    }


def _int_array(values, count: int, dtype) -> np.ndarray:
    return np.full(count, -1, dtype) if values is None else np.asarray(values, dtype)


def save(path: str, arrays: dict[str, np.ndarray]) -> None:
    np.savez_compressed(path, **arrays)


def rank_fields(path_or_arrays) -> dict:
    """The arrays the rank computes from a ``packed-NNNNN.npz`` (or a sample's ``.npz``): the file's
    own arrays plus float32 ``pixel_values`` [sum(t*h*w), 3*T*P*P] and, when it holds videos,
    ``pixel_values_videos``, as ``DataClient`` makes them."""
    from datasvc.media.video import to_video_pixel_values

    if isinstance(path_or_arrays, (str, os.PathLike)):
        with np.load(path_or_arrays) as stored:
            arrays = dict(stored)
    else:
        arrays = dict(path_or_arrays)
    spec = spec_from(arrays)
    arrays["pixel_values"] = to_pixel_values(arrays["image_pixels"], spec, arrays["image_grid_thw"])
    if len(arrays["video_grid_thw"]):
        arrays["pixel_values_videos"] = to_video_pixel_values(arrays["video_pixels"], spec, arrays["video_grid_thw"])
    return arrays


def rank_field_shapes(arrays: dict[str, np.ndarray], spec: VisionSpec) -> dict[str, list]:
    """(shape, dtype) of each array the rank receives for this micro-batch, the float pixel values
    included, without making them."""
    width = spec.pixel_values_dim
    shapes = {name: [list(arrays[name].shape), str(arrays[name].dtype)]
              for name in ("tokens", "labels", "loss_mask", "cu_seqlens", "num_samples", "image_grid_thw")}
    shapes["pixel_values"] = [[_patches(arrays["image_grid_thw"]), width], "float32"]
    if len(arrays["video_grid_thw"]):
        shapes["pixel_values_videos"] = [[_patches(arrays["video_grid_thw"]), width], "float32"]
        shapes["video_grid_thw"] = [list(arrays["video_grid_thw"].shape), "int64"]
    return shapes


def _patches(grids: np.ndarray) -> int:
    return int(np.prod(grids, axis=1).sum()) if len(grids) else 0
