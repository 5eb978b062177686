"""The GPU decoder's batching, recovery and patch layout, run with DALI's CPU operators
(``device_id=None``) so that they are checked on machines without a GPU. The GPU run itself is
measured by ``python -m trainer.bench --gpu-decode``."""
import io

import numpy as np
import pytest
from PIL import Image

from datasvc.decode import CpuDecoder, GpuDecoder
from datasvc.process import preprocess_images
from datasvc.samples import encode_image, real_photos
from datasvc.vision import ImageRejected, VisionSpec

SPEC = VisionSpec(min_pixels=64 * 64, max_pixels=160 * 160)


@pytest.fixture(scope="module")
def blobs():
    return [encode_image(img[..., :3] if img.ndim == 3 else img) for _, img, _ in real_photos()[:10]]


@pytest.fixture(scope="module")
def decoders():
    return GpuDecoder(device_id=None, num_threads=2, max_batch=4), CpuDecoder(num_threads=2, max_batch=4)


def cmyk_jpeg() -> bytes:
    b = io.BytesIO()
    Image.fromarray(np.full((96, 80, 3), 120, np.uint8)).convert("CMYK").save(b, "JPEG")
    return b.getvalue()


def test_patches_match_cpu_backend(blobs, decoders):
    gpu, cpu = decoders
    ours, ref = preprocess_images(blobs, SPEC, gpu), preprocess_images(blobs, SPEC, cpu)
    assert len(ours) == len(blobs)
    for (p, grid), (q, ref_grid) in zip(ours, ref):
        assert grid == ref_grid and p.shape == q.shape and p.dtype == np.uint8
        # Different resize kernels (DALI cubic vs OpenCV area/cubic), same layout: a transposed
        # patch order would differ by tens of levels, not a few.
        assert np.abs(p.astype(np.float32) - q).mean() < 4.0


def test_bad_image_isolated_and_pipeline_reused(blobs, decoders):
    gpu, cpu = decoders
    truncated = blobs[1][: len(blobs[1]) // 3]
    batch = blobs[:2] + [truncated, cmyk_jpeg()] + blobs[2:7]
    out = preprocess_images(batch, SPEC, gpu)
    assert isinstance(out[2], ImageRejected) and out[2].reason == "corrupt_image"
    assert all(not isinstance(o, ImageRejected) for i, o in enumerate(out) if i != 2)
    cmyk = out[3][0]
    np.testing.assert_array_equal(cmyk, preprocess_images([batch[3]], SPEC, cpu)[0][0])  # CPU fallback
    # The pipeline keeps working after the failed batch, for calls of every size.
    for n in (1, 4, 5, 9):
        again = preprocess_images(blobs[:n], SPEC, gpu)
        assert len(again) == n and all(not isinstance(o, ImageRejected) for o in again)


def test_stage_times_reported(blobs, decoders):
    from datasvc.process import StageTimes

    times = StageTimes()
    preprocess_images(blobs[:5], SPEC, decoders[0], times)
    assert times.counts["decode"] == 5 and times.seconds["decode"] > 0
