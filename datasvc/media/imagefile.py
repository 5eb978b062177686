"""Encoded image files before any pixel is decoded: the header probe, and the checks and transforms
every decode path shares.

``probe`` reads the header only: size, format, mode, EXIF orientation. It applies the pixel cap, and
checks that the file is whole (a JPEG's end-of-image marker after its scan, a PNG's IEND chunk, a
WebP's RIFF length), so that the CPU and GPU decoders deliver the same images: a GPU decoder fills a
cut JPEG with gray where the CPU decoder raises.

What every path delivers is what HF's ``load_image`` gives (PIL open and load, then
``ImageOps.exif_transpose``, then ``convert("RGB")``). The header says what that takes: the size and
orientation ``exif_transpose`` finds once PIL has loaded the file (a PNG's metadata chunks after its
pixel data count, as PIL reads them while loading; PIL's TIFF reader orients as it loads, leaving
nothing to transpose), and why an image goes to PIL rather than DALI
(``ImageHeader.pil_only``, ``decode._needs_pil``): an animation, whose image is PIL's first frame
(an APNG's default image even when it is not part of the animation), a 16-bit PNG, whose samples PIL
cuts to their high byte, a lossless WebP with EXIF, which DALI refuses; and a JPEG stored as RGB
rather than YCbCr, which the GPU decoder leaves to the CPU (``gpudecode.gpu_declines``).

Orientation, one policy on every path: by default the EXIF orientation is applied, as HF's
``load_image`` (``PIL.ImageOps.exif_transpose``) and PIL-based loaders do, and grids come from the
oriented size; with ``exif_orientation=False`` the stored pixels are used as they are (a TIFF's
excepted: PIL orients those itself). Decoders never orient by themselves: they decode the stored
frame, resize it to the target in that frame (``DecodeJob.decode_hw``) and then ``orient`` the small
result, which costs a copy of the resized image and only for images that carry an orientation.

PIL's own decompression-bomb limit (``Image.MAX_IMAGE_PIXELS``) is left as the process has it: the
header cap here is what protects memory, and only an image that passed it and is still over PIL's
limit is opened with PIL's limit lifted, under a lock, for that one call.
"""
from __future__ import annotations

import contextlib
import functools
import io
import threading
import warnings
from dataclasses import dataclass

import numpy as np
from PIL import Image

from datasvc.media.vision import ImageRejected

FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")
"""What PIL may parse here: fewer parsers exposed to hostile bytes. HF's processor reads these too.
(PIL's JPEG opener also gives MPO, the multi-picture JPEG of cameras: its first picture is decoded.)"""
_UNDECODED_MAGIC = ((b"8BPS", "PSD"), (b"\x00\x00\x01\x00", "ICO"), (b"%!PS", "EPS"), (b"\xff\x0a", "JPEG XL"),
                    (b"\x00\x00\x00\x0cJXL ", "JPEG XL"), (b"\x00\x00\x00\x0cjP  ", "JPEG 2000"), (b"<svg", "SVG"))
_FTYP_BRANDS = {b"heic": "HEIC", b"heix": "HEIC", b"mif1": "HEIF", b"avif": "AVIF", b"avis": "AVIF"}
# EXIF orientation -> (transpose, flip rows, flip columns), applied in that order; PIL's
# ImageOps.exif_transpose table (2 FLIP_LEFT_RIGHT ... 8 ROTATE_90) written as array operations.
ORIENTATIONS = {2: (False, False, True), 3: (False, True, True), 4: (False, True, False), 5: (True, False, False),
                6: (True, False, True), 7: (True, True, True), 8: (True, True, False)}
# Where PIL's getexif finds an orientation: the EXIF block, EXIF as PNG text, XMP.
_ORIENTATION_KEYS = frozenset({"exif", "xmp", "XML:com.adobe.xmp", "Raw profile type exif"})
_PNG_TEXT_CHUNKS = (b"eXIf", b"tEXt", b"zTXt", b"iTXt")  # what PIL reads after the pixel data, for load_image


@dataclass(frozen=True, slots=True)
class ImageHeader:
    width: int  # as the model sees it: after the orientation is applied
    height: int
    format: str
    mode: str
    progressive: bool = False
    orientation: int = 1  # the EXIF orientation decoders apply (1: none, or the policy ignores it)
    pil_only: str = ""  # why only PIL decodes this file to what load_image gives ("": DALI does too)
    stored_rgb: bool = False  # a JPEG whose three components are R, G, B, not YCbCr

    @property
    def pixels(self) -> int:
        return self.width * self.height

    @property
    def stored_hw(self) -> tuple[int, int]:
        """(height, width) of the pixels as stored in the file, before orientation."""
        return (self.width, self.height) if self.orientation >= 5 else (self.height, self.width)


_LIMIT_LOCK = threading.Lock()


@contextlib.contextmanager
def pil_limits(pixels: int):
    """PIL quiet, and its bomb limit out of the way of an image of ``pixels`` that our own cap
    already allowed. The process-wide limit is touched only when it would refuse such an image."""
    limit = Image.MAX_IMAGE_PIXELS
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if limit is None or pixels <= 2 * limit:
            yield
            return
        with _LIMIT_LOCK:
            Image.MAX_IMAGE_PIXELS = None
            try:
                yield
            finally:
                Image.MAX_IMAGE_PIXELS = limit


def _open(data: bytes, max_pixels: int):
    try:
        with pil_limits(0):
            return Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.DecompressionBombError:  # over PIL's limit: our cap decides
        limit = Image.MAX_IMAGE_PIXELS
        if limit is not None and max_pixels <= 2 * limit:
            raise ImageRejected("too_many_pixels", f"header declares over {2 * limit} pixels > cap {max_pixels}")
        with pil_limits(max_pixels):
            return Image.open(io.BytesIO(data), formats=FORMATS)


def _undecoded_format(data: bytes) -> str:
    if data[4:8] == b"ftyp" and data[8:12] in _FTYP_BRANDS:
        return _FTYP_BRANDS[data[8:12]]
    return next((name for magic, name in _UNDECODED_MAGIC if data.startswith(magic)), "")


def probe(data: bytes, max_pixels: int, exif_orientation: bool = True) -> ImageHeader:
    """Parse the header only; reject what must not be decoded, or is not whole."""
    if not data:
        raise ImageRejected("empty_image", "zero bytes")
    try:
        img = _open(data, max_pixels)
        width, height = img.size
        orientation = read_orientation(img) if exif_orientation else 1
        fmt = img.format or "?"
        progressive = bool(img.info.get("progressive") or img.info.get("progression"))
        mode = img.mode
        pil_only = _pil_only(img, data)
        stored_rgb = fmt in ("JPEG", "MPO") and _jpeg_stored_rgb(img)
    except ImageRejected:
        raise
    except Exception as exc:  # PIL raises many types for garbage bytes
        known = _undecoded_format(data)
        if known:
            raise ImageRejected("unsupported_format", known) from None
        raise ImageRejected("undecodable_image", f"{type(exc).__name__}: {exc}"[:200]) from None
    if width * height > max_pixels:
        raise ImageRejected("too_many_pixels", f"header declares {width}x{height} > cap {max_pixels}")
    if width * height == 0:
        raise ImageRejected("empty_image", f"{width}x{height}")
    check_whole(data, fmt)
    if orientation >= 5:
        width, height = height, width
    return ImageHeader(width, height, fmt, mode, progressive, orientation, pil_only, stored_rgb)


def read_orientation(img) -> int:
    """The EXIF orientation PIL's ``exif_transpose`` applies after HF's ``load_image`` has loaded the
    image (EXIF, else XMP), 1 if none. No pixel is decoded: a PNG's chunks after its pixel data are
    read as PIL's ``load`` reads them (``_png_info_after_load``), and a TIFF PIL orients as it
    loads has nothing left to apply."""
    if img.format == "TIFF" and pil_orients_tiff():
        return 1
    info = _png_info_after_load(img) if img.format == "PNG" else img.info
    if not _ORIENTATION_KEYS & info.keys() and img.format != "TIFF":
        return 1
    source = img
    if info is not img.info:  # PIL's own EXIF and XMP parsing, over what the loaded image would hold
        source = Image.new("1", (1, 1))
        source.info = info
    try:
        value = Image.Image.getexif(source).get(0x0112, 1)
    except Exception:  # unreadable EXIF: the stored pixels, as PIL shows them
        return 1
    return value if isinstance(value, int) and value in ORIENTATIONS else 1


@functools.cache
def pil_orients_tiff() -> bool:
    """Whether this Pillow's TIFF reader applies the Orientation tag itself as it loads (Pillow 13
    does: it reports the oriented size at open and drops the tag at load, so ``exif_transpose``
    then finds none). Tried once, on a 2x1 image tagged as mirrored."""
    exif = Image.Exif()
    exif[0x0112] = 2
    out = io.BytesIO()
    Image.frombytes("L", (2, 1), b"\x00\xff").save(out, "TIFF", exif=exif)
    with Image.open(out) as img:
        img.load()
        return img.getpixel((0, 0)) == 255


def _png_chunks(fp):
    """(type, data offset, length) of each chunk of a PNG, from the headers alone, up to IEND."""
    pos = 8
    while True:
        fp.seek(pos)
        head = fp.read(8)
        if len(head) < 8:
            return
        length = int.from_bytes(head[:4], "big")
        yield head[4:], pos + 8, length
        if head[4:] == b"IEND":
            return
        pos += 12 + length


def _png_info_after_load(img) -> dict:
    """``img.info`` as PIL's ``load()`` leaves it: the text and eXIf chunks after the pixel data read
    by PIL's own chunk readers, as ``PngImageFile.load_end`` reads them (up to IEND; in an animation,
    up to the next frame's fcTL). A later eXIf chunk replaces an earlier one, as there. A chunk PIL
    fails on fails the probe, as it fails ``load_image``."""
    from PIL import PngImagePlugin

    fp, info = img.fp, dict(img.info)
    where = fp.tell()
    stream = PngImagePlugin.PngStream(fp)
    stream.im_info = info
    animated, after_pixels = getattr(img, "is_animated", False), False
    try:
        for cid, pos, length in _png_chunks(fp):
            if cid == b"IDAT":
                after_pixels = True
            elif after_pixels and (cid == b"IEND" or (cid == b"fcTL" and animated)):
                break
            elif after_pixels and cid in _PNG_TEXT_CHUNKS:
                fp.seek(pos)
                try:
                    stream.call(cid, pos, length)
                except UnicodeDecodeError:  # where PIL stops reading too
                    break
    finally:
        fp.seek(where)
    return info


def _pil_only(img, data: bytes) -> str:
    """Why DALI would not decode this PNG or WebP to what PIL loads, "" when it would. (A GIF's
    ``n_frames`` would seek through every frame: GIFs go to PIL whatever their frames.)"""
    if img.format not in ("PNG", "WEBP"):
        return ""
    if getattr(img, "n_frames", 1) > 1:
        return "an animation: PIL's first frame (an APNG's default image), where DALI may decode another"
    if img.format == "PNG" and data[12:16] == b"IHDR" and data[24] > 8:
        return f"{data[24]}-bit samples: PIL keeps the high byte, DALI rounds"
    if img.format == "WEBP" and {b"VP8L", b"EXIF"} <= _riff_chunk_types(data):
        return "a lossless WebP with an EXIF chunk, which DALI's WebP parser refuses"
    return ""


def _riff_chunk_types(data: bytes) -> set[bytes]:
    types, pos = set(), 12
    while pos + 8 <= len(data):
        size = int.from_bytes(data[pos + 4:pos + 8], "little")
        types.add(data[pos:pos + 4])
        pos += 8 + size + (size & 1)
    return types


def _jpeg_stored_rgb(img) -> bool:
    """libjpeg's reading of a three-component JPEG (``jdapimin.c``): RGB, not YCbCr, when there is no
    JFIF marker and an Adobe marker says transform 0, or, with neither marker, the components are
    named R, G, B."""
    layers = getattr(img, "layer", None) or []
    if len(layers) != 3 or "jfif" in img.info:
        return False
    if "adobe" in img.info:
        return img.info.get("adobe_transform") == 0
    return [layer[0] for layer in layers] == [ord("R"), ord("G"), ord("B")]


def check_whole(data: bytes, fmt: str) -> None:
    """Reject a file cut short. Every decoder gets only whole files, so both paths agree."""
    if fmt in ("JPEG", "MPO"):
        why = _jpeg_cut(data)
    elif fmt == "PNG":
        why = "" if data.rfind(b"IEND\xaeB`\x82", 33) >= 0 else "no IEND chunk"
    elif fmt == "WEBP":
        declared = 8 + int.from_bytes(data[4:8], "little")
        why = "" if len(data) >= declared else f"RIFF declares {declared} bytes, file has {len(data)}"
    else:
        return  # GIF, BMP, TIFF: decoded by PIL on every path, which raises on a cut file
    if why:
        raise ImageRejected("truncated_image", why)


def _jpeg_cut(data: bytes) -> str:
    """Walk the markers to the first scan; an end-of-image marker must follow it (0xFF in scan data
    is stuffed, so FFD9 there is the real marker)."""
    i, n = 2, len(data)
    while i + 4 <= n:
        if data[i] != 0xFF:
            return f"no marker at byte {i} before the first scan"
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:
            i += 2
            continue
        length = int.from_bytes(data[i + 2:i + 4], "big")
        if marker == 0xDA:
            return "" if data.rfind(b"\xff\xd9", i + 2 + length) >= 0 else "no end-of-image marker after the scan"
        if marker == 0xD9:
            return "end-of-image before any scan"
        i += 2 + length
    return "cut before its first scan"


def pil_decode_rgb(data: bytes, pixels: int = 0) -> np.ndarray:
    """The HF processor's conversion: PIL ``convert("RGB")`` (alpha dropped, CMYK/palette mapped;
    an animated GIF or multi-page TIFF gives its first frame), stored orientation."""
    with pil_limits(pixels):
        img = Image.open(io.BytesIO(data), formats=FORMATS)
        img.load()
        return np.asarray(img.convert("RGB"))


def orient(image, orientation: int):
    """An HWC image (numpy array or torch tensor) with an EXIF orientation applied, as
    ``ImageOps.exif_transpose`` would; the input itself for orientation 1."""
    if orientation not in ORIENTATIONS:
        return image
    transpose, flip_rows, flip_cols = ORIENTATIONS[orientation]
    if isinstance(image, np.ndarray):
        import cv2  # its transposes and flips are SIMD: 0.1-0.8 ms for 0.8 MP against numpy's 4-8 ms

        x = np.ascontiguousarray(image)
        if orientation in (6, 8):  # a quarter turn in one pass
            return cv2.rotate(x, cv2.ROTATE_90_CLOCKWISE if orientation == 6 else cv2.ROTATE_90_COUNTERCLOCKWISE)
        x = cv2.transpose(x) if transpose else x
        if flip_rows or flip_cols:
            x = cv2.flip(x, -1 if flip_rows and flip_cols else (0 if flip_rows else 1))
        return x
    import torch

    x = image.permute(1, 0, 2) if transpose else image
    dims = [d for d, on in ((0, flip_rows), (1, flip_cols)) if on]
    return (torch.flip(x, dims) if dims else x).contiguous()
