"""A packed micro-batch as a model takes it: a ``TrainBatch`` of torch tensors, with ``pixel_values``
made from the uint8 pixel rows. No Ray: the service's client (``datasvc.service.client``) and an
in-process ``BlockProducer`` loop use the same function."""
from __future__ import annotations

import numpy as np

from datasvc.batch import PackedBatch, TrainBatch
from datasvc.media.vision import to_pixel_values


def batch_tensors(packed: PackedBatch, spec, device: str | None = None, pixel_dtype: str = "float32") -> TrainBatch:
    """The ``TrainBatch`` a rank trains on: torch tensors (pinned and moved to ``device`` when it is
    a GPU) with ``pixel_values`` (and ``pixel_values_videos``) made from the uint8 rows. ``spec``:
    the pipeline's vision spec, ``cfg.model_layout().vision``."""
    import torch

    cuda = device is not None and str(device).startswith("cuda")

    def tensor(a: np.ndarray):
        t = torch.from_numpy(np.array(a, copy=True))  # object-store arrays are read-only
        if cuda:
            t = t.pin_memory().to(device, non_blocking=True)
        return t

    dtype = getattr(torch, pixel_dtype)
    return TrainBatch(
        tokens=tensor(packed.tokens),
        labels=tensor(packed.labels),
        loss_mask=tensor(packed.loss_mask),
        cu_seqlens=tensor(packed.cu_seqlens),
        num_samples=tensor(packed.num_samples),
        pixel_values=to_pixel_values(tensor(packed.pixels), spec, packed.image_grid_thw, dtype=dtype,
                                     frames_hw=packed.image_frame_hw),
        image_grid_thw=tensor(packed.image_grid_thw),
        sample_keys=list(packed.sample_keys),
        sample_epochs=[] if packed.sample_epochs is None else packed.sample_epochs.tolist(),
        **_videos(packed, spec, tensor, dtype),
    )


def _videos(packed: PackedBatch, spec, tensor, dtype) -> dict:
    """``pixel_values_videos`` and ``video_grid_thw`` when the micro-batch holds videos."""
    if not len(packed.video_grid_thw):
        return {}
    from datasvc.media.video import to_video_pixel_values

    return {"pixel_values_videos": to_video_pixel_values(tensor(packed.video_pixels), spec,
                                                         packed.video_grid_thw, dtype=dtype),
            "video_grid_thw": tensor(packed.video_grid_thw)}
