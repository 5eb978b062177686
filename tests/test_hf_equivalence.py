"""Our CPU path (DALI decode, OpenCV resize, uint8 pixel rows, patch order and normalize late)
against transformers' own Qwen2VLImageProcessor at Qwen3-VL settings, on real photographs and odd
sizes."""
import io

import numpy as np
import pytest
import torch
from PIL import Image

from datasvc.media.vision import FrameRows, ImageRejected, VisionSpec, smart_resize, to_pixel_values
from datasvc.samples import real_photos
from datasvc.stream.process import preprocess_images

MAX_MAD = 0.02


@pytest.fixture(scope="module", params=["actor", "rank"])
def cpu_decoder(request):
    """The CPU decoder both ways: resizing in the actor, and leaving the last resize to the rank
    (whose client resizes torch tensors, as here)."""
    from datasvc.media.decode import CpuDecoder

    return CpuDecoder(num_threads=1, rank_resize=request.param == "rank")


def hf_processor(spec: VisionSpec):
    from transformers import Qwen2VLImageProcessor

    return Qwen2VLImageProcessor(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3,
                                 image_std=[0.5] * 3, min_pixels=spec.min_pixels, max_pixels=spec.max_pixels)


def ours(data: bytes, spec, decoder):
    (res,) = preprocess_images([data], spec, decoder)
    if isinstance(res, ImageRejected):
        raise res
    rows, grid = res
    if isinstance(rows, FrameRows):
        return to_pixel_values(torch.from_numpy(rows.rows), spec, [grid], frames_hw=[rows.hw]).numpy(), np.asarray(grid)
    return to_pixel_values(rows, spec, [grid]), np.asarray(grid)


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


def test_pixel_rows_become_hf_pixel_values_on_numpy_and_torch():
    """The rows that travel are raster order; ``to_pixel_values`` alone puts them in the HF
    processor's patch order, the same on numpy (the CPU rank) and torch (the GPU rank)."""
    from datasvc.media.vision import pixel_rows

    spec = VisionSpec(min_pixels=32 * 32, max_pixels=512 * 512)
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, hw + (3,), dtype=np.uint8) for hw in [(64, 96), (128, 32), (32, 32)]]
    rows = np.concatenate([pixel_rows(img, spec) for img in images])
    grids = np.array([[1, h // 16, w // 16] for h, w, _ in (img.shape for img in images)])
    ref = hf_processor(spec)(images=[Image.fromarray(img) for img in images], return_tensors="np")
    assert np.array_equal(np.asarray(ref["image_grid_thw"]), grids)  # already at their target size

    ours_np = to_pixel_values(rows, spec, grids)
    assert ours_np.dtype == np.float32 and ours_np.shape == (len(rows), 1536)
    np.testing.assert_allclose(ours_np, np.asarray(ref["pixel_values"], np.float32), atol=1e-5)
    ours_torch = to_pixel_values(torch.from_numpy(rows), spec, grids, torch.float32)
    np.testing.assert_allclose(ours_torch.numpy(), ours_np, atol=1e-6)

    # Per-channel statistics take the per-channel lookup tables; both paths still agree.
    odd = VisionSpec(min_pixels=32 * 32, max_pixels=512 * 512, image_mean=(0.48, 0.45, 0.41),
                     image_std=(0.27, 0.26, 0.28))
    np.testing.assert_allclose(to_pixel_values(rows, odd, grids),
                               to_pixel_values(torch.from_numpy(rows), odd, grids, torch.float32).numpy(), atol=1e-5)
    with pytest.raises(ValueError, match="covers"):
        to_pixel_values(rows, spec, grids[:2])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (pytest -m gpu on a GPU box)")
def test_pixel_rows_become_the_same_pixel_values_on_cuda():
    """What every GPU rank runs on each micro-batch (``DataClient``): the CUDA path of
    ``to_pixel_values`` gives the CPU path's values (bfloat16 within one rounding step)."""
    from datasvc.media.vision import pixel_rows

    spec = VisionSpec(min_pixels=32 * 32, max_pixels=2048 * 2048)
    rng = np.random.default_rng(1)
    images = [rng.integers(0, 256, hw + (3,), dtype=np.uint8) for hw in [(1088, 1440), (64, 96), (2048, 32)]]
    rows = np.concatenate([pixel_rows(img, spec) for img in images])
    grids = np.array([[1, h // 16, w // 16] for h, w, _ in (img.shape for img in images)])
    want = to_pixel_values(rows, spec, grids)
    got = to_pixel_values(torch.from_numpy(rows).cuda(), spec, grids, torch.float32)
    np.testing.assert_allclose(got.cpu().numpy(), want, atol=1e-6)
    got16 = to_pixel_values(torch.from_numpy(rows).cuda(), spec, grids, torch.bfloat16)
    np.testing.assert_allclose(got16.float().cpu().numpy(), want, atol=1 / 128)


def rank_frames(spec: VisionSpec, photos) -> list:
    """(FrameRows, grid, HF's pixel_values) of each photo the rank-resizing decoder leaves a frame."""
    from datasvc.media.decode import CpuDecoder

    decoder, out = CpuDecoder(num_threads=1, rank_resize=True), []
    for data in photos:
        ((rows, grid),) = preprocess_images([data], spec, decoder)
        if isinstance(rows, FrameRows):
            out.append((rows, grid, reference(data, spec)[0]))
    return out


def test_the_rank_resizes_mild_frames_and_the_actor_large_shrinks():
    """The decoder leaves a frame to the rank only within 2x its target's pixels (after halving):
    a photo near the default cap's size comes back as its frame, one shrunk 12x at a small cap as
    its finished rows, both at HF's values."""
    from datasvc.media.decode import CpuDecoder

    rng = np.random.default_rng(3)
    base = (rng.random((12, 16, 3)) * 255).astype(np.uint8)
    mild, large = (jpeg(np.asarray(Image.fromarray(base).resize(wh, Image.BICUBIC))) for wh in [(1500, 1000), (4000, 3000)])
    decoder = CpuDecoder(num_threads=1, rank_resize=True)
    for data, spec, deferred in ((mild, VisionSpec(), True), (large, VisionSpec(max_pixels=512 * 512), False)):
        ((rows, grid),) = preprocess_images([data], spec, decoder)
        assert isinstance(rows, FrameRows) == deferred
        if deferred:
            assert rows.hw == (1000, 1500) and rows.rows.shape == (-(-1000 * 1500 * 3 // 768), 768)
            pv = to_pixel_values(rows.rows, spec, [grid], frames_hw=[rows.hw])
        else:
            pv = to_pixel_values(rows, spec, [grid])
        assert float(np.abs(pv - reference(data, spec)[0]).mean()) < MAX_MAD


def test_frames_left_to_the_rank_travel_uncopied_and_outlive_later_decodes():
    """A frame left to the rank is a view of DALI's output, not a copy, and it keeps its pixels
    while the decoder goes on decoding other batches (DALI's dynamic executor never reuses a
    buffer a view holds); packed, it holds the same rows as a fresh decode of its photo."""
    from datasvc.batch import EncodedSample
    from datasvc.media.decode import CpuDecoder
    from datasvc.pack.packing import PackingConfig, merge

    spec = VisionSpec()
    photos = [jpeg(img) for _, img, _ in real_photos() if img.ndim == 3 and img.shape[2] == 3][:6]
    decoder = CpuDecoder(num_threads=1, max_batch=3, rank_resize=True)
    first = preprocess_images(photos[:3], spec, decoder)
    frames = [rows for rows, _ in first if isinstance(rows, FrameRows)]
    assert frames, "no photo was left to the rank"
    assert all(not f.body.flags.owndata for f in frames)
    before = [f.rows.copy() for f in frames]
    for _ in range(4):
        preprocess_images(photos[3:], spec, decoder)
    assert all(np.array_equal(f.rows, b) for f, b in zip(frames, before))
    fresh = preprocess_images(photos[:3], spec, CpuDecoder(num_threads=1, rank_resize=True))
    samples = [EncodedSample(str(i), "s", np.zeros(1, np.int32), np.zeros(1, np.int32),
                             r.blocks if isinstance(r, FrameRows) else r, np.asarray([g]))
               for i, (r, g) in enumerate(first)]
    packed = merge([samples], PackingConfig(seq_len=16, micro_batch_size=1), spec.patch_dim)
    want = np.concatenate([r.rows if isinstance(r, FrameRows) else r for r, _ in fresh])
    assert np.array_equal(packed.pixels, want)


def test_hf_resize_gives_the_hf_processors_values():
    """``hf_resize`` (what a GPU rank runs on the frames it is left) is HF's own resize: on real
    photos it stays within a rounding step of the processor, far inside the equivalence bound."""
    from datasvc.media.vision import hf_resize, pixel_rows

    spec = VisionSpec(max_pixels=1 << 20)
    photos = [jpeg(img) for _, img, _ in real_photos() if img.ndim == 3 and img.shape[2] == 3][:8]
    checked = 0
    for rows, grid, ref in rank_frames(spec, photos):
        frame = torch.from_numpy(rows.rows).reshape(-1)[:rows.hw[0] * rows.hw[1] * 3].reshape(*rows.hw, 3)
        _, gh, gw = grid
        resized = hf_resize(frame, (gh * 16, gw * 16)).contiguous().numpy()
        pv = to_pixel_values(pixel_rows(resized, spec), spec, [grid])
        assert float(np.abs(pv - ref).mean()) < 0.002
        checked += 1
    assert checked >= 3


def test_frames_and_rows_mixed_become_the_same_pixel_values_on_numpy_and_torch():
    """A micro-batch mixing finished rows and frames (``image_frame_hw``) gives each image the
    values it gets alone, on numpy and on CPU tensors (the client's path on a CPU-only rank)."""
    from datasvc.media.jpegscale import fit_uint8
    from datasvc.media.vision import finish_resize, frame_rows, pixel_rows

    spec = VisionSpec(min_pixels=32 * 32, max_pixels=512 * 512)
    rng = np.random.default_rng(2)
    done = rng.integers(0, 256, (64, 96, 3), dtype=np.uint8)
    frame = rng.integers(0, 256, (70, 101, 3), dtype=np.uint8)
    left = frame_rows(frame, spec)
    rows = np.concatenate([pixel_rows(done, spec), left.rows, pixel_rows(done, spec)])
    grids = np.array([[1, 4, 6], [1, 4, 6], [1, 4, 6]])
    frames = [(64, 96), left.hw, (64, 96)]
    finished = finish_resize(rows, spec, grids, frames)
    assert finished.shape == (72, 768)
    np.testing.assert_array_equal(finished[24:48], pixel_rows(fit_uint8(frame, (64, 96)), spec))
    np.testing.assert_array_equal(finished[:24], finished[48:])
    want = to_pixel_values(finished, spec, grids)
    np.testing.assert_allclose(to_pixel_values(rows, spec, grids, frames_hw=frames), want, atol=1e-6)
    np.testing.assert_allclose(to_pixel_values(torch.from_numpy(rows), spec, grids, torch.float32,
                                               frames_hw=frames).numpy(), want, atol=1e-6)
    with pytest.raises(ValueError, match="cover"):
        finish_resize(rows[:-1], spec, grids, frames)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (pytest -m gpu on a GPU box)")
def test_frames_left_to_the_rank_become_hf_pixel_values_on_cuda():
    """The client's path on a GPU rank under the default ``resize_on="rank"``: frames and finished
    rows in one micro-batch, resized with HF's own resize on the GPU, match the HF processor."""
    spec = VisionSpec(max_pixels=1 << 20)
    photos = [jpeg(img) for _, img, _ in real_photos() if img.ndim == 3 and img.shape[2] == 3][:8]
    left = rank_frames(spec, photos)
    assert len(left) >= 3
    rows = torch.from_numpy(np.concatenate([r.rows for r, _, _ in left])).cuda()
    got = to_pixel_values(rows, spec, [g for _, g, _ in left], torch.float32, frames_hw=[r.hw for r, _, _ in left])
    want = np.concatenate([ref for _, _, ref in left])
    assert got.shape == want.shape
    assert float(np.abs(got.cpu().numpy() - want).mean()) < 0.002


def exif_with(orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return exif.tobytes()


def oriented(fmt: str, orientation: int) -> bytes:
    b = io.BytesIO()
    img = Image.fromarray(real_photos()[1][1])  # chelsea: landscape, 451x300
    img.save(b, fmt, exif=exif_with(orientation), **({"quality": 92} if fmt == "JPEG" else {}))
    return b.getvalue()


def reference_loaded(data: bytes, spec):
    """HF's own path from a file: ``load_image`` (EXIF transpose, RGB), then the processor."""
    from transformers.image_utils import load_image

    out = hf_processor(spec)(images=[load_image(Image.open(io.BytesIO(data)))], return_tensors="np")
    return np.asarray(out["pixel_values"], dtype=np.float32), np.asarray(out["image_grid_thw"])[0]


@pytest.mark.parametrize("fmt,orientation", [("JPEG", o) for o in range(1, 9)] + [("PNG", 6), ("WEBP", 8)])
def test_exif_orientation_matches_hf_load_image(cpu_decoder, fmt, orientation):
    spec = VisionSpec(max_pixels=512 * 512)
    data = oriented(fmt, orientation)
    pv, grid = ours(data, spec, cpu_decoder)
    ref_pv, ref_grid = reference_loaded(data, spec)
    assert tuple(grid) == tuple(ref_grid)  # portrait grids for 5-8: from the oriented size
    assert float(np.abs(pv - ref_pv).mean()) < MAX_MAD


def test_exif_orientation_can_be_ignored(cpu_decoder):
    spec = VisionSpec(max_pixels=512 * 512, exif_orientation=False)
    data = oriented("JPEG", 6)
    pv, grid = ours(data, spec, cpu_decoder)
    ref_pv, ref_grid = reference(data, spec)  # the processor on the stored pixels, no transpose
    assert tuple(grid) == tuple(ref_grid) and grid[1] < grid[2]  # stays landscape
    assert float(np.abs(pv - ref_pv).mean()) < MAX_MAD


def test_orientation_option_reaches_the_pipeline():
    from datasvc.registry import get_pipeline

    assert get_pipeline("qwen3vl").vision.exif_orientation is True
    assert get_pipeline("qwen3vl", exif_orientation=False).vision.exif_orientation is False


@pytest.mark.parametrize("fmt", ["GIF", "BMP", "TIFF"])
def test_gif_bmp_tiff_match_hf(cpu_decoder, fmt):
    img = Image.fromarray(real_photos()[0][1])  # astronaut
    b = io.BytesIO()
    if fmt == "GIF":  # animated: the first frame is the image, as PIL and HF read it
        img.save(b, "GIF", save_all=True, append_images=[img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)])
    else:
        img.save(b, fmt)
    spec = VisionSpec(max_pixels=512 * 512)
    pv, grid = ours(b.getvalue(), spec, cpu_decoder)
    ref_pv, ref_grid = reference_loaded(b.getvalue(), spec)
    assert tuple(grid) == tuple(ref_grid)
    assert float(np.abs(pv - ref_pv).mean()) < MAX_MAD


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (pytest -m gpu on a GPU box)")
@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_matches_hf_on_the_gpu_decoder(orientation):
    """``--decode gpu``: nvJPEG decodes the stored frame, the header's orientation is applied after
    the resize on the GPU; the result is HF's ``load_image`` + processor, as on the CPU path."""
    from datasvc.media.gpudecode import GpuDecoder

    spec = VisionSpec(max_pixels=512 * 512)
    data = oriented("JPEG", orientation)
    pv, grid = ours(data, spec, GpuDecoder(device_id=0, num_threads=2, max_batch=8))
    ref_pv, ref_grid = reference_loaded(data, spec)
    assert tuple(grid) == tuple(ref_grid)
    assert float(np.abs(pv - ref_pv).mean()) < MAX_MAD


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (pytest -m gpu on a GPU box)")
def test_cut_jpeg_rejected_on_the_gpu_decoder():
    """nvJPEG fills a cut JPEG with gray; the header probe rejects it before either decoder sees it."""
    from datasvc.media.gpudecode import GpuDecoder

    whole = oriented("JPEG", 1)
    out = preprocess_images([whole[:5000], whole], VisionSpec(max_pixels=512 * 512),
                            GpuDecoder(device_id=0, num_threads=2, max_batch=8))
    assert isinstance(out[0], ImageRejected) and out[0].reason == "truncated_image"
    assert not isinstance(out[1], ImageRejected)
