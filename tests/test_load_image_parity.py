"""Every format and container the service reads becomes what HF's ``load_image`` gives (PIL open and
load, ``ImageOps.exif_transpose``, ``convert("RGB")``), on every decode path: the header's size is
the loaded image's (so grids and token counts are HF's), the decoded frame is its pixels, and
``pixel_values`` match transformers' Qwen2-VL image processor run on it.

One case per way a file can differ from its first stored picture: EXIF or XMP orientation (JPEG,
PNG before and after its pixel data, WebP, TIFF, which Pillow orients as it loads), animations (an
APNG whose default image is not part of its animation, animated WebP and GIF), multi-picture JPEGs,
multi-page TIFFs, colour modes and bit depths DALI would convert otherwise, JPEGs stored as RGB."""
import io
import struct
import zlib

import cv2
import numpy as np
import pytest
import torch
from PIL import Image
from transformers.image_utils import load_image

from datasvc.media.decode import CpuDecoder, _needs_pil
from datasvc.media.gpudecode import GpuDecoder, gpu_declines
from datasvc.media.imagefile import probe
from datasvc.media.vision import FrameRows, ImageRejected, VisionSpec, to_pixel_values
from datasvc.samples import real_photos
from datasvc.stream.process import preprocess_images

MAX_MAD = 0.02  # tests/test_hf_equivalence.py's bound for a resized image
EXACT = VisionSpec()  # 448x288 and 288x448 are their own smart-resize targets: no resize at all
RESIZED = VisionSpec(max_pixels=256 * 256)
LOSSY = ("jpeg", "webp_lossy", "webp_exif_6")  # two builds of one codec may round a level apart


def photo() -> Image.Image:
    return Image.fromarray(real_photos()[1][1]).crop((0, 0, 448, 288))  # chelsea, landscape


def encoded(img: Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    img.save(out, fmt, **options)
    return out.getvalue()


def exif(orientation: int) -> Image.Exif:
    tags = Image.Exif()
    tags[0x0112] = orientation
    return tags


def xmp(orientation: int) -> bytes:
    return (b'<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#">'
            b'<rdf:Description xmlns:tiff="http://ns.adobe.com/tiff/1.0/" tiff:Orientation="%d"/></rdf:RDF>'
            b"</x:xmpmeta>" % orientation)


def png_chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def png_with_late_chunk(kind: bytes, payload: bytes) -> bytes:
    """A PNG with one more chunk after its pixel data, just before IEND."""
    plain = encoded(photo(), "PNG")
    end = plain.rindex(b"IEND") - 4
    return plain[:end] + png_chunk(kind, payload) + plain[end:]


def others() -> list[Image.Image]:
    inverted = Image.fromarray(255 - np.asarray(photo()))
    return [inverted, photo().transpose(Image.Transpose.FLIP_TOP_BOTTOM)]


def png_16bit() -> bytes:
    wide = np.asarray(photo()).astype(np.uint16) * 257 + np.random.default_rng(0).integers(0, 257, (288, 448, 3))
    ok, data = cv2.imencode(".png", wide.astype(np.uint16)[:, :, ::-1])
    assert ok
    return data.tobytes()


def raw_profile_exif(orientation: int) -> bytes:
    """EXIF as ImageMagick writes it into a PNG: hex text in a zTXt chunk."""
    tags = exif(orientation).tobytes()
    text = f"\nexif\n{len(tags):8}\n{tags.hex()}\n".encode("latin-1")
    return b"Raw profile type exif\x00\x00" + zlib.compress(text)


CASES = {
    "jpeg": lambda: encoded(photo(), "JPEG", quality=92),
    "jpeg_progressive": lambda: encoded(photo(), "JPEG", quality=92, progressive=True),
    "jpeg_gray": lambda: encoded(photo().convert("L"), "JPEG", quality=92),
    "jpeg_cmyk": lambda: encoded(photo().convert("CMYK"), "JPEG", quality=92),
    "jpeg_stored_rgb": lambda: encoded(photo(), "JPEG", quality=92, keep_rgb=True),
    "jpeg_exif_3": lambda: encoded(photo(), "JPEG", quality=92, exif=exif(3)),
    "jpeg_exif_6": lambda: encoded(photo(), "JPEG", quality=92, exif=exif(6)),
    "jpeg_exif_7": lambda: encoded(photo(), "JPEG", quality=92, exif=exif(7)),
    "jpeg_xmp_8": lambda: encoded(photo(), "JPEG", quality=92, xmp=xmp(8)),
    "mpo": lambda: encoded(photo(), "MPO", quality=92, save_all=True, append_images=others()[:1]),
    "png": lambda: encoded(photo(), "PNG"),
    "png_gray": lambda: encoded(photo().convert("L"), "PNG"),
    "png_palette": lambda: encoded(photo().convert("P"), "PNG"),
    "png_alpha": lambda: encoded(photo().convert("RGBA"), "PNG"),
    "png_16bit": png_16bit,
    "png_exif_6": lambda: encoded(photo(), "PNG", exif=exif(6)),
    "png_exif_after_pixels": lambda: png_with_late_chunk(b"eXIf", exif(6).tobytes()[6:]),
    "png_raw_profile_after_pixels": lambda: png_with_late_chunk(b"zTXt", raw_profile_exif(3)),
    "png_xmp_after_pixels": lambda: png_with_late_chunk(
        b"iTXt", b"XML:com.adobe.xmp\x00\x00\x00\x00\x00" + xmp(8)),
    "apng": lambda: encoded(photo(), "PNG", save_all=True, append_images=others()),
    "apng_default_image_apart": lambda: encoded(photo(), "PNG", save_all=True, append_images=others(),
                                                default_image=True),
    "webp_lossy": lambda: encoded(photo(), "WEBP", quality=90),
    "webp_lossless": lambda: encoded(photo(), "WEBP", lossless=True),
    "webp_alpha": lambda: encoded(photo().convert("RGBA"), "WEBP", lossless=True),
    "webp_exif_6": lambda: encoded(photo(), "WEBP", quality=90, exif=exif(6)),
    "webp_lossless_exif_8": lambda: encoded(photo(), "WEBP", lossless=True, exif=exif(8)),
    "webp_animated": lambda: encoded(photo(), "WEBP", lossless=True, save_all=True, append_images=others()),
    "gif_animated": lambda: encoded(photo(), "GIF", save_all=True, append_images=others()),
    "bmp": lambda: encoded(photo(), "BMP"),
    "tiff": lambda: encoded(photo(), "TIFF"),
    "tiff_pages": lambda: encoded(photo(), "TIFF", save_all=True, append_images=others()),
    **{f"tiff_exif_{o}": (lambda o=o: encoded(photo(), "TIFF", exif=exif(o))) for o in range(2, 9)},
    "tiff_lzw_exif_6": lambda: encoded(photo(), "TIFF", compression="tiff_lzw", exif=exif(6)),
}


def loaded(data: bytes) -> np.ndarray:
    """What HF's processor is given for these bytes."""
    return np.asarray(load_image(Image.open(io.BytesIO(data))))


def hf_pixel_values(data: bytes, spec: VisionSpec) -> tuple[np.ndarray, tuple]:
    from transformers import Qwen2VLImageProcessor

    processor = Qwen2VLImageProcessor(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3,
                                      image_std=[0.5] * 3, min_pixels=spec.min_pixels, max_pixels=spec.max_pixels)
    out = processor(images=[load_image(Image.open(io.BytesIO(data)))], return_tensors="np")
    return np.asarray(out["pixel_values"], np.float32), tuple(int(v) for v in out["image_grid_thw"][0])


def our_pixel_values(results: list, spec: VisionSpec) -> list[tuple[np.ndarray, tuple]]:
    out = []
    for res in results:
        if isinstance(res, ImageRejected):
            raise res
        rows, grid = res
        frames = None
        if isinstance(rows, FrameRows):
            rows, frames = rows.rows, [rows.hw]
        values = to_pixel_values(torch.as_tensor(np.asarray(rows)), spec, [grid], torch.float32, frames_hw=frames)
        out.append((values.cpu().numpy(), tuple(int(v) for v in grid)))
    return out


def frame_of(result, spec: VisionSpec) -> np.ndarray:
    """The HWC image a decoder delivered at its grid's size."""
    if isinstance(result, ImageRejected):
        raise result
    rows, (_, gh, gw) = result
    assert not isinstance(rows, FrameRows)
    return np.asarray(rows).reshape(gh * spec.patch_size, gw * spec.patch_size, 3)


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_header_gives_the_loaded_size(name):
    """Grids, token counts and ``vlmfeed info`` come from the header alone: its size is the one HF
    loads, orientation applied, without a pixel decoded."""
    data = CASES[name]()
    header = probe(data, EXACT.max_decode_pixels)
    height, width = loaded(data).shape[:2]
    assert (header.height, header.width) == (height, width)


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_cpu_decoder_delivers_the_loaded_pixels(name, cpu_decoder):
    """At a size that needs no resize, the CPU decoder's frame is ``load_image``'s pixels (within a
    level for the lossy codecs, whose decoders DALI and PIL each build)."""
    data = CASES[name]()
    (result,) = preprocess_images([data], EXACT, cpu_decoder)
    got, want = frame_of(result, EXACT).astype(int), loaded(data).astype(int)
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= (1 if name in LOSSY else 0), name


@pytest.mark.parametrize("rank_resize", [False, True])
def test_pixel_values_match_the_hf_processor_after_a_resize(rank_resize):
    decoder = CpuDecoder(num_threads=1, rank_resize=rank_resize)
    names = sorted(CASES)
    blobs = [CASES[n]() for n in names]
    for name, data, (values, grid) in zip(names, blobs, our_pixel_values(
            preprocess_images(blobs, RESIZED, decoder), RESIZED)):
        want, want_grid = hf_pixel_values(data, RESIZED)
        assert grid == want_grid, name
        assert float(np.abs(values - want).mean()) < MAX_MAD, name


def test_what_dali_cannot_match_goes_to_pil():
    """What routes an image: a mode DALI converts otherwise, an animation (DALI decodes an APNG's first
    animation frame, PIL its default image), 16-bit samples PIL cuts to their high byte, a lossless
    WebP with EXIF (DALI refuses it); on the GPU also a JPEG stored as RGB."""
    routed = {n for n in CASES if _needs_pil(probe(CASES[n](), EXACT.max_decode_pixels))}
    assert {"apng", "apng_default_image_apart", "webp_animated", "png_16bit", "webp_lossless_exif_8", "gif_animated",
            "bmp", "tiff", "png_palette", "png_alpha", "jpeg_cmyk"} <= routed
    assert not routed & {"jpeg", "jpeg_exif_6", "mpo", "png", "png_exif_after_pixels", "webp_lossy", "webp_exif_6"}
    assert gpu_declines(probe(CASES["jpeg_stored_rgb"](), EXACT.max_decode_pixels))
    assert not gpu_declines(probe(CASES["jpeg"](), EXACT.max_decode_pixels))


def test_a_file_dali_refuses_is_decoded_by_pil(cpu_decoder):
    """A file DALI's parser refuses and PIL reads whole is delivered as PIL reads it, as HF would train
    it; one both refuse is ``corrupt_image``. (The lossless WebP with EXIF, sent to DALI anyway.)"""
    from dataclasses import replace

    from datasvc.media.decode import DecodeJob

    data = CASES["webp_lossless_exif_8"]()
    header = replace(probe(data, EXACT.max_decode_pixels), pil_only="")
    target = EXACT.target_size(header.height, header.width)
    refused_by_both = DecodeJob(data[:40] + bytes(len(data) - 40), header, target)
    got, rejected = cpu_decoder.to_pixel_rows([DecodeJob(data, header, target), refused_by_both], EXACT)
    assert np.array_equal(np.asarray(got).reshape(loaded(data).shape), loaded(data))
    assert isinstance(rejected, ImageRejected) and rejected.reason == "corrupt_image" and "DALI" in rejected.detail


def test_the_gpu_decoders_routing_delivers_the_loaded_images_on_the_cpu():
    """The GPU decoder's pipeline run with DALI's CPU operators (``device_id=None``): the images it
    declines go to the CPU decoder inside one batch, and every image is HF's."""
    decoder = GpuDecoder(device_id=None, num_threads=2, max_batch=8)
    names = sorted(CASES)
    blobs = [CASES[n]() for n in names]
    for name, data, (values, grid) in zip(names, blobs, our_pixel_values(
            preprocess_images(blobs, RESIZED, decoder), RESIZED)):
        want, want_grid = hf_pixel_values(data, RESIZED)
        assert grid == want_grid, name
        assert float(np.abs(values - want).mean()) < MAX_MAD, name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (pytest -m gpu on a GPU box)")
@pytest.mark.parametrize("spec", [EXACT, RESIZED], ids=["no_resize", "resized"])
def test_the_gpu_decoder_matches_the_hf_processor(spec):
    """``--decode gpu``: nvJPEG and DALI's GPU resize for what the GPU takes, the CPU decoder for the
    rest, in one batch: grids are HF's and pixel_values within the equivalence bound, per format."""
    decoder = GpuDecoder(device_id=0, num_threads=2, max_batch=8)
    names = sorted(CASES)
    blobs = [CASES[n]() for n in names]
    for name, data, (values, grid) in zip(names, blobs, our_pixel_values(
            preprocess_images(blobs, spec, decoder), spec)):
        want, want_grid = hf_pixel_values(data, spec)
        assert grid == want_grid, name
        assert float(np.abs(values - want).mean()) < MAX_MAD, name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (pytest -m gpu on a GPU box)")
def test_the_gpu_decoders_pixel_values_on_the_gpu_match_the_hf_processor():
    """What a rank decoding on its own GPU trains on (``to_pixel_values``: nothing through the host
    but the encoded bytes), for every case in one call."""
    from datasvc.media.decode import DecodeJob

    decoder = GpuDecoder(device_id=0, num_threads=2, max_batch=8)
    names = sorted(CASES)
    blobs = [CASES[n]() for n in names]
    jobs = []
    for data in blobs:
        header = probe(data, RESIZED.max_decode_pixels)
        jobs.append(DecodeJob(data, header, RESIZED.target_size(header.height, header.width)))
    for name, data, job, values in zip(names, blobs, jobs, decoder.to_pixel_values(jobs, RESIZED, torch.float32)):
        want, want_grid = hf_pixel_values(data, RESIZED)
        assert job.grid(RESIZED) == want_grid, name
        assert float(np.abs(values.cpu().numpy() - want).mean()) < MAX_MAD, name
