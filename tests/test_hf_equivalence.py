"""Our CPU path (DALI decode, OpenCV resize, uint8 patchify, late normalize) against transformers'
own Qwen2VLImageProcessor at Qwen3-VL settings, on real photographs and odd sizes."""
import io

import numpy as np
import pytest
from PIL import Image

from datasvc.process import preprocess_images
from datasvc.samples import real_photos
from datasvc.vision import ImageRejected, VisionSpec, smart_resize, to_pixel_values

MAX_MAD = 0.02


def hf_processor(spec: VisionSpec):
    from transformers import Qwen2VLImageProcessor

    return Qwen2VLImageProcessor(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3,
                                 image_std=[0.5] * 3, min_pixels=spec.min_pixels, max_pixels=spec.max_pixels)


def ours(data: bytes, spec, decoder):
    (res,) = preprocess_images([data], spec, decoder)
    if isinstance(res, ImageRejected):
        raise res
    patches, grid = res
    return to_pixel_values(patches, spec), np.asarray(grid)


def reference(data: bytes, spec):
    img = Image.open(io.BytesIO(data))
    out = hf_processor(spec)(images=[img], return_tensors="np")
    return np.asarray(out["pixel_values"], dtype=np.float32), np.asarray(out["image_grid_thw"])[0]


def jpeg(img: np.ndarray, quality=92) -> bytes:
    b = io.BytesIO()
    Image.fromarray(img).save(b, "JPEG", quality=quality)
    return b.getvalue()


def png(img: Image.Image) -> bytes:
    b = io.BytesIO()
    img.save(b, "PNG")
    return b.getvalue()


@pytest.mark.parametrize("max_pixels", [16777216, 512 * 512])
def test_real_photos_match_hf(cpu_decoder, max_pixels):
    spec = VisionSpec(max_pixels=max_pixels)
    checked = 0
    for name, img, _ in real_photos():
        data = png(Image.fromarray(img)) if img.ndim == 3 and img.shape[2] == 4 else jpeg(img)
        pv, grid = ours(data, spec, cpu_decoder)
        ref_pv, ref_grid = reference(data, spec)
        assert tuple(grid) == tuple(ref_grid), name
        assert pv.shape == ref_pv.shape == (int(np.prod(grid)), 1536), name
        mad = float(np.abs(pv - ref_pv).mean())
        assert mad < MAX_MAD, f"{name}: mean abs diff {mad:.4f}"
        checked += 1
    assert checked >= 18


@pytest.mark.parametrize("size", [(10, 10), (33, 47), (300, 7), (6400, 32), (32, 6000), (2900, 2100), (4000, 3000)])
def test_odd_sizes_match_hf(cpu_decoder, size):
    w, h = size
    rng = np.random.default_rng(w * 7 + h)
    base = np.asarray(Image.fromarray((rng.random((8, 8, 3)) * 255).astype(np.uint8)).resize((w, h), Image.BICUBIC))
    spec = VisionSpec(max_pixels=2 * 1024 * 1024)
    data = jpeg(base)
    pv, grid = ours(data, spec, cpu_decoder)
    ref_pv, ref_grid = reference(data, spec)
    assert tuple(grid) == tuple(ref_grid)
    assert float(np.abs(pv - ref_pv).mean()) < MAX_MAD


@pytest.mark.parametrize("mode", ["L", "P", "RGBA", "LA", "CMYK", "I;16"])
def test_color_modes_match_hf(cpu_decoder, mode):
    photo = real_photos()[0][1]  # astronaut
    img = Image.fromarray(photo)
    if mode == "I;16":
        arr = (np.asarray(img.convert("L")).astype(np.uint16) * 257)
        img = Image.fromarray(arr)  # uint16 -> mode I;16
        data = png(img)
    elif mode == "CMYK":
        b = io.BytesIO()
        img.convert("CMYK").save(b, "JPEG", quality=92)
        data = b.getvalue()
    else:
        data = png(img.convert(mode))
    spec = VisionSpec(max_pixels=512 * 512)
    pv, grid = ours(data, spec, cpu_decoder)
    ref_pv, ref_grid = reference(data, spec)
    assert tuple(grid) == tuple(ref_grid)
    assert float(np.abs(pv - ref_pv).mean()) < MAX_MAD, mode


def test_progressive_jpeg(cpu_decoder):
    b = io.BytesIO()
    Image.fromarray(real_photos()[2][1]).save(b, "JPEG", quality=90, progressive=True)
    spec = VisionSpec()
    pv, grid = ours(b.getvalue(), spec, cpu_decoder)
    ref_pv, ref_grid = reference(b.getvalue(), spec)
    assert tuple(grid) == tuple(ref_grid)
    assert float(np.abs(pv - ref_pv).mean()) < MAX_MAD


@pytest.mark.parametrize("hw", [(1, 1), (10, 10), (31, 33), (1080, 1440), (100, 20000), (5000, 5000), (17, 3400)])
@pytest.mark.parametrize("limits", [(65536, 16777216), (3136, 1003520), (256 * 256, 512 * 512)])
def test_smart_resize_matches_transformers(hw, limits):
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize as hf_smart_resize

    h, w = hw
    lo, hi = limits
    try:
        expected = hf_smart_resize(h, w, factor=32, min_pixels=lo, max_pixels=hi)
    except ValueError:
        with pytest.raises(ImageRejected):
            smart_resize(h, w, 32, lo, hi)
        return
    assert smart_resize(h, w, 32, lo, hi) == tuple(expected)


def test_aspect_ratio_over_200_rejected():
    with pytest.raises(ImageRejected) as e:
        VisionSpec().target_size(10, 2010)
    assert e.value.reason == "aspect_ratio"
