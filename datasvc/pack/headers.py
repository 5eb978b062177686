"""A sample's token rows and patch grids from its image and video headers alone: what packing,
block sizing and the sizes index need, without decoding a pixel."""
from __future__ import annotations

import numpy as np

from datasvc.media.decode import probe
from datasvc.media.video import plan_video
from datasvc.media.vision import ImageRejected
from datasvc.registry import Pipeline


def encode_from_headers(raw, pipeline: Pipeline) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int, int]]]:
    """A sample's exact token rows and patch grids from its image headers alone, no pixel decoded
    (what packing and block sizing need). Raises ``ImageRejected`` or ``SampleRejected`` with the
    reason the run would count; a read problem comes back as an ``ImageRejected`` of that reason."""
    if raw.problem:
        raise ImageRejected(raw.problem, raw.detail)
    spec = pipeline.vision
    grids = []
    for _ext, data in raw.images:
        h = probe(data, spec.max_decode_pixels, spec.exif_orientation)
        grids.append(spec.grid(h.height, h.width))
    video = pipeline.video
    if raw.videos and video is None:
        raise ImageRejected("video_not_supported", "this pipeline takes no video")
    plans = [plan_video(data, spec, video) for _ext, data in raw.videos]
    ids, labels = pipeline.encode(raw, grids, plans)
    return ids, labels, grids
