"""Resizes to the target size on the CPU, and JPEG decode at a reduced DCT scale.

Why OpenCV resizes: measured here on one core, DALI's CPU bicubic antialiased
resize runs at 11-12 img/s on 1.7 MP photos while its decode runs at ~100; OpenCV's SIMD cubic
(upscale) / area (downscale) resize takes ~4 ms and stays within 0.003 mean absolute difference of
the PIL bicubic resize that the HF processor uses.

DALI's decoders (``fn.decoders.image`` on CPU through nvImageCodec's libjpeg-turbo extension, which
takes only ``fancy_upsampling`` and ``fast_idct`` options) always decode the full frame. libjpeg-turbo
itself can run its inverse DCT at 1/2, 1/4 or 1/8 of the frame, which skips most of the IDCT,
upsampling and colour conversion of an image that is going to be shrunk anyway; OpenCV's
``imdecode`` (its bundled libjpeg-turbo) exposes that. So the reduced-scale path is this module's,
an explicit option of ``decode.CpuDecoder`` (``jpeg="libjpeg-turbo"``), not the default.

Exactness against the HF processor (an antialiased bicubic from the full frame): the scale stops
at the target for 1/2 and 1.5x above it for 1/4 and 1/8 (``dct_scale``), and the rest is
antialiased (``fit_uint8``), which keeps it as close to HF as the full-frame DALI path (mean |diff|
under 0.01 in normalized pixel_values units on large photos; the HF tests allow 0.02).
"""
from __future__ import annotations

import cv2
import numpy as np

# libjpeg's scaled output is ceil(side / d) (jdiv_round_up); larger d first.
_SCALES = (8, 4, 2)
_MARGINS = {8: (3, 2), 4: (3, 2), 2: (1, 1)}  # output / target each side must reach, as num / den
# Stored orientation (the header's is applied after the resize, as on every path), RGB order.
_FLAGS = cv2.IMREAD_COLOR_RGB | cv2.IMREAD_IGNORE_ORIENTATION
_REDUCED = {1: 0, 2: cv2.IMREAD_REDUCED_GRAYSCALE_2, 4: cv2.IMREAD_REDUCED_GRAYSCALE_4,
            8: cv2.IMREAD_REDUCED_GRAYSCALE_8}  # the scale bits only: colour comes from _FLAGS


def resize_uint8(image: np.ndarray, target_hw: tuple[int, int]) -> np.ndarray:
    """A video frame resized to ``target_hw``; a frame of 4x the target or more on both sides is
    first halved, while both its sides are even, so each halving keeps its geometry exactly. The
    exact-2x area average is several times faster per pixel than OpenCV's area resize at a ratio
    that is not whole, and the two steps stay as close to HF's antialiased bicubic as that resize
    alone: 1080p frames to 128x64 in 1.0 ms against 3.3 ms on one core, 0.0088 mean |diff| at most
    against 0.0092 (``vlmfeed bench video``, its ``resize`` rows)."""
    th, tw = target_hw
    while image.shape[0] >= 4 * th and image.shape[1] >= 4 * tw and not (image.shape[0] % 2 or image.shape[1] % 2):
        image = _halve(image)
    h, w = image.shape[:2]
    if (h, w) == (th, tw):
        return image
    # Area averaging stands in for PIL's antialiased bicubic when shrinking by more than a quarter;
    # cubic when growing or shrinking mildly (smart_resize rounding sides to multiples of 32):
    # there cubic is as close to PIL as area, and OpenCV's area path for non-integer ratios near 1
    # is ~5x slower (measured: 26 ms vs 4.6 ms for 1936x1291 -> 1920x1280 on one core).
    mild = min(th / h, tw / w) >= 0.75
    interp = cv2.INTER_AREA if th * tw < h * w and not mild else cv2.INTER_CUBIC
    return cv2.resize(image, (tw, th), interpolation=interp)


def scaled_hw(stored_hw: tuple[int, int], d: int) -> tuple[int, int]:
    h, w = stored_hw
    return -(-h // d), -(-w // d)


def dct_scale(stored_hw: tuple[int, int], target_hw: tuple[int, int]) -> int:
    """The largest DCT scale denominator (8, 4, 2) whose output still covers the target on both
    sides by its margin, 1 when none does: 1/2 needs only to cover it, 1/4 and 1/8 to be 1.5x it.

    Why the margins differ: the 1/4 and 1/8 IDCTs filter coarsely, and with no margin (output just
    covering the target) that showed through, 0.021 mean |diff| from HF on a 2400-px coffee photo
    capped at 0.26 MP; with 1.5x left to the antialiased resize, 0.009, as the full-frame path. The
    1/2 IDCT stays as close to HF with no margin as with 1.5x (0.0090 against 0.0092 at most on
    20 photos of 4-16 MP under a 1 MP cap), and taking it on photos of 2-3x the target's sides
    cuts the option's CPU time there 1.32x
    (docs/results/cpu-preprocessing-per-core/cpu-2core-vm/decode-4x-cap-half-scale-paired.json)."""
    th, tw = target_hw
    for d in _SCALES:
        h, w = scaled_hw(stored_hw, d)
        num, den = _MARGINS[d]
        if den * h >= num * th and den * w >= num * tw:
            return d
    return 1


def decode_scaled(data: bytes, d: int) -> np.ndarray | None:
    """The stored frame of a JPEG at 1/d of its size, RGB (grayscale replicated, as PIL's
    ``convert("RGB")``); None if libjpeg-turbo refused it. OpenCV releases the GIL meanwhile.

    libjpeg's warnings (corrupt entropy data it decodes around) are not errors here: callers
    decode only files whose markers ``imagefile.probe`` checked."""
    try:
        return cv2.imdecode(np.frombuffer(data, dtype=np.uint8), _FLAGS | _REDUCED[d])
    except cv2.error:
        return None


def fit_uint8(image: np.ndarray, target_hw: tuple[int, int],
              extent_hw: tuple[float, float] | None = None) -> np.ndarray:
    """``image`` resized to ``target_hw``, the target spanning ``extent_hw`` of it as HF's resize
    spans the whole frame: the image's own size unless told (a decode at 1/d spans stored / d, which
    ends inside its last pixel when a side is not a multiple of d). The input itself when it is
    already at the target.

    Large frames are first halved while at least twice the target on both sides, an odd side padded
    by its last row or column: OpenCV's area average is fast only at exactly 2x (12 MP in 4.8 ms on
    one core here, against 20-27 ms at 3x or 4x and 55 ms at 3.38x). ``resize_rest`` does the rest,
    onto the extent the halved image spans. Dropping the odd row instead stretched the frame by up
    to a pixel: 0.0206 mean |diff| from HF on a photo at 2.7x its 1 MP target; with the geometry
    kept, 0.0092 at most over 20 photos of 4-16 MP at that cap."""
    return resize_rest(*halve_large(image, target_hw, extent_hw), target_hw)


def halve_large(image: np.ndarray, target_hw: tuple[int, int], extent_hw: tuple[float, float] | None = None
                ) -> tuple[np.ndarray, tuple[float, float]]:
    """``image`` halved while at least twice the target on both sides (``fit_uint8``'s first step),
    and the extent of it that the original extent spans."""
    th, tw = target_hw
    eh, ew = extent_hw or image.shape[:2]
    scale = 1
    while image.shape[0] >= 2 * th and image.shape[1] >= 2 * tw:
        image = _halve(image)
        scale *= 2
    return image, (eh / scale, ew / scale)


def resize_rest(image: np.ndarray, extent_hw: tuple[float, float] | None,
                target_hw: tuple[int, int]) -> np.ndarray:
    """The resize of a frame under twice the target, spanning ``extent_hw`` of it (its whole unless
    told): cubic when growing or shrinking by under a quarter (bilinear onto a partial extent, where
    OpenCV warps); past a quarter, bilinear to twice the target, then the exact-2x area average. A
    bilinear or cubic shrink alone aliases there (bilinear 0.0345 mean |diff| from HF on a native
    photo at 0.51x, cubic 0.023 on the Hubble deep field); the two steps stay at 0.013 where
    OpenCV's area average gives 0.011, in a half to two thirds of its time at ratios that are not
    whole. Torch's antialiased bicubic (HF's own resize) is faster still, but importing torch costs
    a CPU actor about 400 MB of resident memory, which a node's many actors cannot spare."""
    th, tw = target_hw
    whole = extent_hw is None or tuple(extent_hw) == image.shape[:2]
    eh, ew = image.shape[:2] if whole else extent_hw
    if whole and (eh, ew) == (th, tw):
        return image
    if min(th / eh, tw / ew) >= 0.75 or th * tw >= eh * ew:
        return _resample(image, target_hw, (eh, ew), cv2.INTER_CUBIC if whole else cv2.INTER_LINEAR)
    return _halve(_resample(image, (2 * th, 2 * tw), (eh, ew), cv2.INTER_LINEAR))


def _resample(image: np.ndarray, out_hw: tuple[int, int], extent_hw: tuple[float, float],
              interpolation: int) -> np.ndarray:
    """``image`` resampled to ``out_hw``, the output spanning ``extent_hw`` of it: OpenCV's resize
    where that is the whole image, else a warp with the same pixel-centre mapping."""
    oh, ow = out_hw
    eh, ew = extent_hw
    if (eh, ew) == image.shape[:2]:
        return cv2.resize(image, (ow, oh), interpolation=interpolation)
    # Output pixel i's centre lies at (i + 0.5) * extent / output in the image's own pixels: the
    # warp maps each output pixel to that point (WARP_INVERSE_MAP).
    ax, ay = ew / ow, eh / oh
    m = np.array([[ax, 0.0, 0.5 * ax - 0.5], [0.0, ay, 0.5 * ay - 0.5]])
    return cv2.warpAffine(image, m, (ow, oh), flags=interpolation | cv2.WARP_INVERSE_MAP,
                          borderMode=cv2.BORDER_REPLICATE)


def _halve(image: np.ndarray) -> np.ndarray:
    """The exact-2x area average; an odd side gets its last row or column once more, so each halved
    pixel j covers the frame's pixels 2j and 2j + 1 (the last one only the frame's last)."""
    h, w = image.shape[:2]
    if h % 2 or w % 2:
        image = cv2.copyMakeBorder(image, 0, h % 2, 0, w % 2, cv2.BORDER_REPLICATE)
    return cv2.resize(image, (image.shape[1] // 2, image.shape[0] // 2), interpolation=cv2.INTER_AREA)
