"""The GPU decoder's batching, recovery and pixel layout, run with DALI's CPU operators
(``device_id=None``) so that they are checked on machines without a GPU. The GPU run itself is
measured by ``python -m trainer.bench --gpu-decode``."""
import io

import numpy as np
import pytest
import torch
from PIL import Image

from datasvc.media.decode import CpuDecoder, DecodeJob, probe
from datasvc.media.gpudecode import GpuDecoder
from datasvc.media.vision import ImageRejected, VisionSpec, to_pixel_values
from datasvc.samples import encode_image, real_photos
from datasvc.stream.process import preprocess_images

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


def rgba_png() -> bytes:
    b = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (120, 100, 4), dtype=np.uint8)).save(b, "PNG")
    return b.getvalue()


def jobs_for(blobs: list) -> list[DecodeJob]:
    """Jobs as ``preprocess_images`` makes them; a ``Cut`` passes the header checks (see ``Cut``)."""
    out = []
    for b in blobs:
        h = probe(b.whole if isinstance(b, Cut) else b, SPEC.max_decode_pixels)
        out.append(DecodeJob(b.data if isinstance(b, Cut) else b, h, SPEC.target_size(h.height, h.width)))
    return out


class Cut:
    """The first third of a JPEG, given to a decoder as if its header checks had passed: how the
    decoders' own failure handling is tested now that ``probe`` rejects cut files before any decode."""

    def __init__(self, whole: bytes):
        self.whole, self.data = whole, whole[: len(whole) // 3]


def normalized(rows: np.ndarray, job: DecodeJob, dtype=torch.bfloat16) -> torch.Tensor:
    return to_pixel_values(torch.from_numpy(rows), SPEC, [job.grid(SPEC)], dtype)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")
def test_gpu_decode_without_a_gpu_fails_at_construction_with_what_to_change():
    with pytest.raises(ValueError, match="use --decode cpu"):
        GpuDecoder(device_id=0)


def test_patches_match_cpu_backend(blobs, decoders):
    gpu, cpu = decoders
    ours, ref = preprocess_images(blobs, SPEC, gpu), preprocess_images(blobs, SPEC, cpu)
    assert len(ours) == len(blobs)
    for (p, grid), (q, ref_grid) in zip(ours, ref):
        assert grid == ref_grid and p.shape == q.shape and p.dtype == np.uint8
        # Different resize kernels (DALI cubic vs OpenCV area/cubic), same layout: another pixel
        # order would differ by tens of levels, not a few.
        assert np.abs(p.astype(np.float32) - q).mean() < 4.0


def test_bad_image_isolated_and_pipeline_reused(blobs, decoders):
    gpu, cpu = decoders
    jobs = jobs_for(blobs[:2] + [Cut(blobs[1]), cmyk_jpeg()] + blobs[2:7])
    out = gpu.to_pixel_rows(jobs, SPEC)
    assert isinstance(out[2], ImageRejected) and out[2].reason == "corrupt_image"
    assert all(not isinstance(o, ImageRejected) for i, o in enumerate(out) if i != 2)
    np.testing.assert_array_equal(out[3], cpu.to_pixel_rows([jobs[3]], SPEC)[0])  # CPU fallback
    # The pipeline keeps working after the failed batch, for calls of every size.
    for n in (1, 4, 5, 9):
        again = preprocess_images(blobs[:n], SPEC, gpu)
        assert len(again) == n and all(not isinstance(o, ImageRejected) for o in again)


def test_cut_files_rejected_before_either_decoder(blobs, decoders):
    """The GPU decoder would fill a cut JPEG with gray; the header checks stop it on both paths."""
    gpu, cpu = decoders
    png = io.BytesIO()
    Image.fromarray(np.zeros((64, 64, 3), np.uint8)).save(png, "PNG")
    cut = [blobs[1][:5000], blobs[2][: len(blobs[2]) // 2], png.getvalue()[:-12]]
    for decoder in (gpu, cpu):
        out = preprocess_images(cut + blobs[:2], SPEC, decoder)
        assert [o.reason for o in out[:3]] == ["truncated_image"] * 3
        assert all(not isinstance(o, ImageRejected) for o in out[3:])
    # Bytes after the end-of-image marker (camera trailers) are not a cut.
    (ok,) = preprocess_images([blobs[1] + b"trailer" * 100], SPEC, cpu)
    assert not isinstance(ok, ImageRejected)


def test_stage_times_reported(blobs, decoders):
    from datasvc.stats import StageTimes

    times = StageTimes()
    preprocess_images(blobs[:5], SPEC, decoders[0], times)
    assert times.counts["decode"] == 5 and times.seconds["decode"] > 0


def test_pixel_values_equal_normalized_pixel_rows(blobs, decoders):
    gpu, _ = decoders
    jobs = jobs_for(blobs[:6])  # a full batch and a partial one
    ours, rows = gpu.to_pixel_values(jobs, SPEC), gpu.to_pixel_rows(jobs, SPEC)
    assert len(ours) == len(jobs)
    for values, r, job in zip(ours, rows, jobs):
        assert values.dtype == torch.bfloat16 and values.device.type == "cpu"
        assert torch.equal(values, normalized(r, job))


def test_pixel_values_in_job_order_with_fallbacks(blobs, decoders):
    gpu, cpu = decoders
    jobs = jobs_for(blobs[:3] + [cmyk_jpeg(), Cut(blobs[1]), rgba_png()] + blobs[3:8])
    pil_needed, corrupt = (3, 5), 4
    ours = gpu.to_pixel_values(jobs, SPEC, torch.float32)
    assert len(ours) == len(jobs)
    assert isinstance(ours[corrupt], ImageRejected) and ours[corrupt].reason == "corrupt_image"
    assert ours[corrupt].detail
    for i in pil_needed:
        assert torch.equal(ours[i], normalized(cpu.to_pixel_rows([jobs[i]], SPEC)[0], jobs[i], torch.float32))
    rows = gpu.to_pixel_rows(jobs, SPEC)
    for i, job in enumerate(jobs):
        if i == corrupt:
            continue
        assert torch.equal(ours[i], normalized(rows[i], job, torch.float32))
        # Each image decoded alone cannot be misplaced. The corrupt image's batch-mates were redone by
        # the CPU decoder (another resize kernel): a few levels off, where another photo is tens off.
        alone = normalized(gpu.to_pixel_rows([job], SPEC)[0], job, torch.float32)
        assert ours[i].shape == alone.shape
        assert (ours[i] - alone).abs().mean() < 4 / 127.5


def test_stream_matches_per_call_results_and_recovers(blobs, decoders):
    gpu, _ = decoders
    batches = [jobs_for(blobs[:3]),
               jobs_for(blobs[3:6] + [cmyk_jpeg(), Cut(blobs[1])] + blobs[6:9]),  # over max_batch, a bad image
               [],
               jobs_for([rgba_png(), cmyk_jpeg()]),  # nothing for DALI at all
               jobs_for(blobs[:1])]
    streamed = list(gpu.stream_pixel_values(iter(batches), SPEC, torch.float32))
    assert [len(s) for s in streamed] == [len(b) for b in batches]
    for k, (got, jobs) in enumerate(zip(streamed, batches)):
        for g, want in zip(got, gpu.to_pixel_values(jobs, SPEC, torch.float32)):
            if isinstance(want, ImageRejected):
                assert isinstance(g, ImageRejected) and g.reason == want.reason
            elif k == 1:
                # Chunks of 4 are filled across batches, so the bad image's chunk-mates differ from
                # a call of this batch alone; those the CPU decoder redid are a few levels off.
                assert g.shape == want.shape and (g - want).abs().mean() < 4 / 127.5
            else:
                assert torch.equal(g, want)


def test_small_batches_decode_in_wide_chunks(blobs, decoders):
    gpu, _ = decoders
    jobs = jobs_for(blobs[:9])
    pulled = []

    def one_at_a_time():
        for job in jobs:
            pulled.append(job)
            yield [job]

    stream = gpu.stream_pixel_values(one_at_a_time(), SPEC, torch.float32)
    first = next(stream)
    assert len(pulled) >= gpu.max_batch  # the first chunk was filled from several batches
    streamed = first + [v for batch in stream for v in batch]
    assert len(streamed) == len(jobs)
    for got, want in zip(streamed, gpu.to_pixel_values(jobs, SPEC, torch.float32)):
        assert torch.equal(got, want)


def test_stream_pulls_lazily_and_can_be_abandoned(blobs, decoders):
    gpu, _ = decoders
    pulled = []

    def batches():
        for k in range(50):
            pulled.append(k)
            yield jobs_for(blobs[:2])

    stream = gpu.stream_pixel_values(batches(), SPEC)
    first = next(stream)
    assert len(first) == 2
    # the chunks DALI prefetches (2 images a batch, max_batch a chunk) and the one being filled, not all 50
    assert len(pulled) <= (gpu.prefetch + 2) * gpu.max_batch // 2
    stream.close()  # the pipeline held prefetched chunks of this stream: the next call must not see them
    jobs = jobs_for(blobs[4:7])
    again = gpu.to_pixel_values(jobs, SPEC)
    assert len(again) == 3
    for values, r, job in zip(again, gpu.to_pixel_rows(jobs, SPEC), jobs):
        assert torch.equal(values, normalized(r, job))


def oriented_jpeg(img: np.ndarray, orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    b = io.BytesIO()
    Image.fromarray(img).save(b, "JPEG", quality=92, exif=exif.tobytes())
    return b.getvalue()


@pytest.mark.parametrize("orientation", range(1, 9))
def test_orient_is_pils_exif_transpose(orientation):
    from PIL import ImageOps

    from datasvc.media.imagefile import orient

    img = np.random.default_rng(orientation).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    exif = Image.Exif()
    exif[0x0112] = orientation
    pil = Image.fromarray(img)
    pil.info["exif"] = exif.tobytes()
    want = np.asarray(ImageOps.exif_transpose(pil))
    np.testing.assert_array_equal(orient(img, orientation), want)
    np.testing.assert_array_equal(orient(torch.from_numpy(img), orientation).numpy(), want)


def test_header_says_the_oriented_size_and_what_to_apply(blobs):
    photo = real_photos()[1][1]  # 451 wide, 300 high
    for orientation in range(1, 9):
        data = oriented_jpeg(photo, orientation)
        h = probe(data, SPEC.max_decode_pixels)
        turned = orientation >= 5
        assert (h.width, h.height) == ((300, 451) if turned else (451, 300)) and h.orientation == orientation
        assert h.stored_hw == (300, 451)
        job = DecodeJob(data, h, SPEC.target_size(h.height, h.width))
        assert job.decode_hw == (job.target_hw[::-1] if turned else job.target_hw)
        ignored = probe(data, SPEC.max_decode_pixels, exif_orientation=False)
        assert (ignored.width, ignored.height, ignored.orientation) == (451, 300, 1)


def test_both_decoders_orient_the_same(decoders):
    gpu, cpu = decoders
    photo = real_photos()[1][1]
    blobs = [oriented_jpeg(photo, o) for o in range(1, 9)]
    ours, ref = preprocess_images(blobs, SPEC, gpu), preprocess_images(blobs, SPEC, cpu)
    upright = ref[0][0].reshape(ref[0][1][1] * 16, ref[0][1][2] * 16, 3).astype(np.float32)
    for o, (p, grid), (q, ref_grid) in zip(range(1, 9), ours, ref):
        assert grid == ref_grid and grid[1:] == ((ref[0][1][2], ref[0][1][1]) if o >= 5 else ref[0][1][1:])
        assert np.abs(p.astype(np.float32) - q).mean() < 4.0, o
        if o in (1, 2, 3, 4):  # the stored image flipped back is the upright one
            img = q.reshape(grid[1] * 16, grid[2] * 16, 3)
            back = {1: img, 2: img[:, ::-1], 3: img[::-1, ::-1], 4: img[::-1]}[o]
            assert np.abs(back.astype(np.float32) - upright).mean() < 2.0, o


def test_pixel_values_of_oriented_photos_equal_their_upright_rows(decoders):
    """DALI patches the stored frame; an image with an EXIF orientation is turned upright after."""
    gpu, _ = decoders
    photo = real_photos()[1][1]
    jobs = jobs_for([oriented_jpeg(photo, o) for o in range(1, 9)])
    for values, rows, job in zip(gpu.to_pixel_values(jobs, SPEC, torch.float32), gpu.to_pixel_rows(jobs, SPEC), jobs):
        assert values.shape[0] == job.grid(SPEC)[1] * job.grid(SPEC)[2]
        assert torch.equal(values, normalized(rows, job, torch.float32)), job.header.orientation


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (pytest -m gpu on a GPU box)")
def test_patch_layout_on_the_gpu_equals_normalized_rows(blobs):
    """NVJPEG + DALI's GPU transpose make the patch order; the rows path is the reference."""
    gpu = GpuDecoder(device_id=0, num_threads=2, max_batch=4)
    photo = real_photos()[1][1]
    jobs = jobs_for(blobs[:6] + [oriented_jpeg(photo, o) for o in range(1, 9)])
    streamed = [v for batch in gpu.stream_pixel_values(([j] for j in jobs), SPEC, torch.float32) for v in batch]
    for values, rows, job in zip(streamed, gpu.to_pixel_rows(jobs, SPEC), jobs):
        assert values.is_cuda
        # float32 on both devices; the GPU may fuse the multiply-add (one rounding fewer)
        torch.testing.assert_close(values.cpu(), normalized(rows, job, torch.float32), atol=1e-6, rtol=0)


def test_feed_keeps_what_dali_reads_in_place_until_its_output_is_out(blobs):
    """DALI reads the fed arrays where they lie (no copy): each chunk's arrays stay referenced by
    the feed until the pipeline hands over that chunk's output, and are released then."""
    import gc
    import weakref

    from datasvc.media.gpudecode import _Feed, _Slot

    jobs = jobs_for(blobs[:3])
    slot = _Slot(jobs, max_batch=2, room=2)
    chunks = [[(slot, idx)] for idx in slot.parts]
    feed = _Feed()
    feed.start(iter(chunks))
    pulled = iter(feed)
    first, second = next(pulled), next(pulled)
    assert [len(a) for a in first] == [2, 2] and [len(a) for a in second] == [1, 1]
    assert np.array_equal(first[1][0], np.array(jobs[0].decode_hw, np.float32))
    watch = weakref.ref(first[1][0])
    del first
    gc.collect()
    assert watch() is not None  # still fed, not yet out
    assert feed.out() is chunks[0]
    gc.collect()
    assert watch() is None
    assert feed.unfinished() == [chunks[1]]
