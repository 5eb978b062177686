"""The CPU decoder's resize paths against the HF processor: the default DALI path resizing straight
from DALI's buffer (halving large frames first), and the explicit libjpeg-turbo option that decodes
JPEGs at a reduced DCT scale, on photos large enough that the scale kicks in."""
import io

import numpy as np
import pytest
from PIL import Image

from datasvc.media import jpegscale
from datasvc.media.decode import CpuDecoder, DecodeJob, probe
from datasvc.media.vision import FrameRows, VisionSpec
from datasvc.samples import real_photos
from test_hf_equivalence import MAX_MAD, ours, reference

CAPS = (512 * 512, 1024 * 1024)


@pytest.fixture(scope="module")
def turbo_decoder():
    return CpuDecoder(num_threads=1, jpeg="libjpeg-turbo")


@pytest.fixture(scope="module", params=["dali", "libjpeg-turbo", "dali, resize on the rank",
                                        "libjpeg-turbo, resize on the rank"])
def any_decoder(request, cpu_decoder, turbo_decoder):
    if request.param.endswith("rank"):
        return CpuDecoder(num_threads=1, jpeg=request.param.split(",")[0], rank_resize=True)
    return cpu_decoder if request.param == "dali" else turbo_decoder


def _large(img: np.ndarray, width: int, seed: int = 0) -> np.ndarray:
    """A real photo enlarged to ``width`` (Lanczos) with sensor-like noise, so it keeps photo-like
    detail per pixel instead of turning smooth."""
    h, w = img.shape[:2]
    big = np.asarray(Image.fromarray(img).resize((width, round(width * h / w)), Image.LANCZOS), np.float32)
    big += np.random.default_rng(seed).normal(0.0, 2.5, big.shape).astype(np.float32)
    return np.clip(big + 0.5, 0, 255).astype(np.uint8)


def _jpeg(img, **kw) -> bytes:
    b = io.BytesIO()
    Image.fromarray(img).save(b, "JPEG", quality=90, **kw)
    return b.getvalue()


def _colour_photos(n: int):
    return [(name, img) for name, img, _ in real_photos() if img.ndim == 3 and img.shape[2] == 3][:n]


def _scale_of(data: bytes, spec: VisionSpec) -> int:
    h = probe(data, spec.max_decode_pixels)
    job = DecodeJob(data, h, spec.target_size(h.height, h.width))
    return jpegscale.dct_scale(h.stored_hw, job.decode_hw)


def _assert_matches_hf(data: bytes, spec: VisionSpec, decoder, what: str) -> float:
    pv, grid = ours(data, spec, decoder)
    ref_pv, ref_grid = reference(data, spec)
    assert tuple(grid) == tuple(ref_grid), what
    mad = float(np.abs(pv - ref_pv).mean())
    assert mad < MAX_MAD, f"{what}: mean abs diff {mad:.4f}"
    return mad


def test_dct_scale_is_the_smallest_that_covers_the_target():
    """The largest scale whose output covers the target on both sides: 1/2 just covering it, 1/4 and
    1/8 by 1.5x."""
    assert jpegscale.dct_scale((3000, 4000), (864, 1184)) == 2  # 1500x2000 covers it; 750x1000 is not 1.5x
    assert jpegscale.dct_scale((3000, 4000), (1472, 1984)) == 2  # 1500x2000 just covers it
    assert jpegscale.dct_scale((3000, 4000), (1504, 2016)) == 1  # over half the source
    assert jpegscale.dct_scale((3000, 4000), (352, 480)) == 4  # 375x500 is under 1.5x for 1/8
    assert jpegscale.dct_scale((3000, 4000), (240, 320)) == 8  # 375x500 is over 1.5x
    assert jpegscale.dct_scale((1001, 1001), (501, 501)) == 2  # ceil(1001/2) = 501
    assert jpegscale.dct_scale((1001, 999), (501, 501)) == 1  # 500 < 501
    assert jpegscale.dct_scale((1001, 1001), (167, 167)) == 4  # ceil(1001/4) = 251 >= 1.5 * 167 = 250.5
    assert jpegscale.dct_scale((1001, 999), (167, 167)) == 2  # 250 < 250.5 for 1/4
    assert jpegscale.scaled_hw((1001, 999), 4) == (251, 250)  # libjpeg rounds up


@pytest.mark.parametrize("cap", CAPS)
def test_large_photos_match_hf_where_the_scale_kicks_in(any_decoder, cap):
    spec = VisionSpec(max_pixels=cap)
    scales = set()
    for i, (name, img) in enumerate(_colour_photos(4)):
        data = _jpeg(_large(img, 3200 + 600 * i, seed=i))
        scales.add(_scale_of(data, spec))
        _assert_matches_hf(data, spec, any_decoder, f"{name} at cap {cap}")
    assert scales & {2, 4, 8}, f"no reduced scale used: {scales}"


@pytest.mark.parametrize("odd", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_halving_keeps_the_geometry_of_odd_sided_frames(any_decoder, odd):
    """A frame 2.7x its target is halved first; an odd side must not stretch it. Dropping the odd
    row and column instead put this photo at 0.0206 mean |diff| from HF, past the bound."""
    name, img = next((n, i) for n, i in _colour_photos(10) if n == "china")
    h, w = 2266 + odd[0], 3400 + odd[1]
    big = np.asarray(Image.fromarray(img).resize((w, h), Image.LANCZOS), np.float32)
    big += np.random.default_rng(17).normal(0.0, 2.5, big.shape).astype(np.float32)
    data = _jpeg(np.clip(big + 0.5, 0, 255).astype(np.uint8))
    spec = VisionSpec(max_pixels=1024 * 1024)
    assert spec.target_size(h, w) == (832, 1248)
    assert _assert_matches_hf(data, spec, any_decoder, f"{name} {h}x{w}") < 0.01


def test_fit_maps_the_target_onto_the_extent_it_is_told():
    """A 1/2-scale decode of a 1001-row frame has 501 rows but spans 500.5: the target must sample
    the frame where HF's full-frame resize does. On a ramp whose value is the source row, each
    target row must read its own centre's row (told 501, the last ones would be a row off)."""
    src_rows = np.arange(1001, dtype=np.float32)
    half = np.append((src_rows[0:1000:2] + src_rows[1:1000:2]) / 2, src_rows[1000])  # 501 rows
    frame = np.repeat(np.repeat(half[:, None, None], 8, axis=1), 3, axis=2)
    out = jpegscale.fit_uint8(frame, (100, 4), (500.5, 8.0))[:, :, 0]
    centres = (np.arange(100) + 0.5) * 1001 / 100 - 0.5
    err = np.abs(out - centres[:, None])
    assert err[:-1].max() < 0.05 and err[-1].max() < 0.25  # the last row reads the frame's edge
    wrong = jpegscale.fit_uint8(frame, (100, 4))[:, :, 0]
    assert np.abs(wrong - centres[:, None])[:-1].max() > 0.5


@pytest.mark.parametrize("kind", ["grayscale", "progressive", "exif6", "exif3", "cmyk", "subsampling444"])
def test_turbo_option_keeps_every_jpeg_kind_exact(turbo_decoder, kind):
    img = _large(_colour_photos(1)[0][1], 2600)
    if kind == "grayscale":
        data = _jpeg(np.asarray(Image.fromarray(img).convert("L")))
    elif kind == "progressive":
        data = _jpeg(img, progressive=True)
    elif kind.startswith("exif"):
        exif = Image.Exif()
        exif[0x0112] = int(kind[-1])
        data = _jpeg(img, exif=exif.tobytes())
    elif kind == "cmyk":  # PIL's conversion on every path
        b = io.BytesIO()
        Image.fromarray(img).convert("CMYK").save(b, "JPEG", quality=90)
        data = b.getvalue()
    else:
        data = _jpeg(img, subsampling=0)
    spec = VisionSpec(max_pixels=512 * 512)
    assert _scale_of(data, spec) > 1
    if kind.startswith("exif"):
        from PIL import ImageOps

        # HF's load_image applies the EXIF orientation; so does our default policy.
        b = io.BytesIO()
        ImageOps.exif_transpose(Image.open(io.BytesIO(data))).save(b, "PNG")
        pv, grid = ours(data, spec, turbo_decoder)
        ref_pv, ref_grid = reference(b.getvalue(), spec)
        assert tuple(grid) == tuple(ref_grid)
        assert float(np.abs(pv - ref_pv).mean()) < MAX_MAD
    else:
        _assert_matches_hf(data, spec, turbo_decoder, kind)


def test_turbo_option_equals_dali_on_small_and_png(cpu_decoder, turbo_decoder):
    """Below half the source no scale applies; non-JPEGs go to DALI either way."""
    spec = VisionSpec()
    name, img = _colour_photos(1)[0]
    b = io.BytesIO()
    Image.fromarray(img).save(b, "PNG")
    for data in (_jpeg(img), b.getvalue()):
        a, _ = ours(data, spec, cpu_decoder)
        t, _ = ours(data, spec, turbo_decoder)
        assert float(np.abs(a - t).mean()) < 0.01


@pytest.mark.parametrize("jpeg", ["dali", "libjpeg-turbo"])
@pytest.mark.parametrize("rank_resize", [False, True])
def test_rows_do_not_alias_the_decoders_buffer(jpeg, rank_resize):
    """Images already at their target size, and frames left to the rank, come out of DALI's reused
    output buffer unresized: their rows must be copies, untouched by the next batch."""
    decoder = CpuDecoder(num_threads=1, max_batch=4, jpeg=jpeg, rank_resize=rank_resize)
    spec = VisionSpec(min_pixels=32 * 32)
    rng = np.random.default_rng(0)
    width = 100 if rank_resize else 96  # 100 rounds to a 96-pixel target: a frame for the rank

    def jobs(seed):
        out = []
        for k in range(3):
            img = rng.integers(0, 256, (64 * (k + 1), width, 3), dtype=np.uint8) if seed else \
                np.full((64 * (k + 1), width, 3), 10 * k, np.uint8)
            data = _jpeg(img)
            h = probe(data, spec.max_decode_pixels)
            out.append(DecodeJob(data, h, spec.target_size(h.height, h.width)))
            assert (out[-1].target_hw == h.stored_hw) != rank_resize
        return out

    out = decoder.to_pixel_rows(jobs(0), spec)
    assert all(isinstance(r, FrameRows) == rank_resize for r in out)
    first = [getattr(r, "rows", r) for r in out]
    kept = [r.copy() for r in first]
    decoder.to_pixel_rows(jobs(1), spec)
    for r, k in zip(first, kept):
        np.testing.assert_array_equal(r, k)


def test_bad_option_is_refused():
    with pytest.raises(ValueError, match="libjpeg-turbo"):
        CpuDecoder(jpeg="turbo")


def test_the_option_reaches_the_actors_from_the_config(photo_shards):
    from datasvc.config import DecodeConfig, ServiceConfig
    from datasvc.read.shards import index_shard
    from datasvc.stream.process import ItemProcessor
    from datasvc.wire import WorkItem

    idx = index_shard(photo_shards[0])
    item = WorkItem(idx.path, 0, tuple(idx.samples))
    out = {}
    for jpeg in ("dali", "libjpeg-turbo"):
        proc = ItemProcessor(ServiceConfig(shards=(photo_shards[0],), decode=DecodeConfig(cpu_jpeg_decoder=jpeg),
                                           pipeline_options={"max_pixels": 256 * 256}), device_id=None)
        assert proc.decoder.jpeg == jpeg
        out[jpeg] = {s.key: s for s in proc(item).samples}
    assert out["dali"].keys() == out["libjpeg-turbo"].keys() and out["dali"]
    for key, s in out["dali"].items():
        t = out["libjpeg-turbo"][key]
        assert np.array_equal(s.input_ids, t.input_ids) and np.array_equal(s.image_grid_thw, t.image_grid_thw)
        assert np.abs(s.pixels.astype(np.float32) - t.pixels).mean() / 255 < MAX_MAD
    with pytest.raises(ValueError, match="cpu_jpeg_decoder='turbo': use 'dali' or 'libjpeg-turbo'"):
        ServiceConfig(shards=(photo_shards[0],), decode=DecodeConfig(cpu_jpeg_decoder="turbo"))
