"""Synthetic photographs with natural-image statistics, and their encoding at a target size.

Cost model: decode cost of a JPEG grows with pixels and with entropy-coded bytes; resize cost
with pixels. So what must be right is resolution and bytes per pixel at a realistic quality,
and the bytes must come from photo-like structure (smooth shading, sharp occlusion edges,
texture, grain), not uniform noise (which is far costlier) or flat colour (far cheaper).

Speed: everything at full resolution is a handful of OpenCV calls (LUT, resize, blur,
addWeighted); spectra are synthesised by FFT on small grids and upsampled. Scenes above
~2 MP are composed at 2 MP and upsampled, with fine detail added at full resolution, which is
also what camera images look like (optics and demosaicing soften them; grain stays sharp).
"""
from __future__ import annotations

import io
import math
from typing import Sequence

import cv2
import numpy as np
from PIL import Image

# How an encoder subsamples chroma, as Pillow's ``subsampling`` argument.
SUBSAMPLING = {"4:4:4": 0, "4:2:2": 1, "4:2:0": 2}

_SCENE_MAX_PIXELS = 2_000_000


def _uniform_noise(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """Zero-mean, unit-variance noise; from raw random bytes, ~10x faster than normal draws."""
    x = np.frombuffer(rng.bytes(h * w), np.uint8).reshape(h, w).astype(np.float32)
    x -= 127.5
    x *= 1.0 / 73.9
    return x


def _spectral_noise(rng: np.random.Generator, h: int, w: int, alpha: float, channels: int = 1) -> np.ndarray:
    """Gaussian noise with amplitude spectrum 1/f**alpha (power 1/f**(2 alpha)), [channels,h,w]."""
    fy = np.fft.fftfreq(h)[:, None]
    fx = np.fft.rfftfreq(w)[None, :]
    f = np.hypot(fx, fy)
    f[0, 0] = 1.0
    amp = f ** -alpha
    amp[0, 0] = 0.0
    shape = (channels, h, w // 2 + 1)
    spec = (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)) * amp
    n = np.fft.irfft2(spec, s=(h, w), axes=(-2, -1)).astype(np.float32)
    n -= n.mean(axis=(1, 2), keepdims=True)
    n /= n.std(axis=(1, 2), keepdims=True) + 1e-8
    return n


def _octave_noise(rng: np.random.Generator, h: int, w: int, cells: Sequence[tuple[float, float]],
                  gain: float) -> np.ndarray:
    """Sum of upsampled random grids, one per octave (cell sizes in pixels, (cy, cx)).

    Equal energy per octave gives a 1/f**2 power spectrum; ``gain`` > 1 weights coarse octaves
    more (steeper spectrum). Anisotropic cells (cy != cx) give oriented texture (grain, ripples).
    """
    out = np.zeros((h, w), np.float32)
    amp = 1.0
    for cy, cx in cells:
        gh, gw = max(2, int(math.ceil(h / cy)) + 1), max(2, int(math.ceil(w / cx)) + 1)
        g = _uniform_noise(rng, gh, gw)
        if (gh, gw) != (h, w):
            g = cv2.resize(g, (w, h), interpolation=cv2.INTER_CUBIC)
        cv2.scaleAdd(g, amp, out, dst=out)
        amp *= gain
    out *= 1.0 / (float(out[::4, ::4].std()) + 1e-6)
    return out


def _hsv_to_rgb(hsv: np.ndarray) -> np.ndarray:
    """[n,3] of (hue degrees, sat 0-1, value 0-1) -> [n,3] RGB 0-255 float32."""
    rgb = cv2.cvtColor(hsv.astype(np.float32).reshape(1, -1, 3), cv2.COLOR_HSV2RGB)
    return rgb.reshape(-1, 3) * 255.0


def _scene_palette(rng: np.random.Generator, n: int) -> np.ndarray:
    """Object colours with natural statistics: a few coherent hues, mostly muted, some vivid."""
    families = np.array([[100, 0.45, 0.45],   # foliage
                         [30, 0.45, 0.55],    # earth, wood, skin
                         [210, 0.35, 0.6],    # water, sky-lit surfaces
                         [0, 0.05, 0.6],      # grey: concrete, stone, asphalt
                         [10, 0.7, 0.7],      # red/orange man-made
                         [50, 0.6, 0.8]])     # yellow
    picks = rng.choice(len(families), size=int(rng.integers(2, 5)), replace=False)
    base = families[picks[rng.integers(0, len(picks), n)]]
    hsv = np.empty((n, 3))
    hsv[:, 0] = (base[:, 0] + rng.normal(0, 15, n)) % 360
    hsv[:, 1] = np.clip(base[:, 1] + rng.normal(0, 0.15, n), 0.0, 1.0)
    hsv[:, 2] = np.clip(base[:, 2] * np.exp(rng.normal(0, 0.35, n)), 0.05, 1.0)
    return _hsv_to_rgb(hsv)


def _draw_shape(rng: np.random.Generator, lab: np.ndarray, label: int, cx: float, cy: float, r: float) -> None:
    """One occluding object into the label map: ellipse, irregular blob, box or thin limb."""
    t = rng.random()
    if t < 0.3:
        axes = (max(1, int(r)), max(1, int(r * rng.uniform(0.3, 1.0))))
        cv2.ellipse(lab, (int(cx), int(cy)), axes, float(rng.uniform(0, 180)), 0, 360, label, -1)
    elif t < 0.7:
        k = int(rng.integers(7, 18))
        ang = np.sort(rng.uniform(0, 2 * np.pi, k))
        rad = r * np.exp(rng.normal(0, 0.25, k))
        pts = np.stack([cx + rad * np.cos(ang), cy + rad * np.sin(ang) * rng.uniform(0.5, 1.2)], 1)
        cv2.fillPoly(lab, [pts.astype(np.int32)], label)
    elif t < 0.9:
        box = cv2.boxPoints(((cx, cy), (2 * r, 2 * r * rng.uniform(0.2, 1.0)), float(rng.uniform(-20, 20))))
        cv2.fillPoly(lab, [box.astype(np.int32)], label)
    else:
        a = rng.uniform(0, np.pi)
        dx, dy = 2 * r * math.cos(a), 2 * r * math.sin(a)
        cv2.line(lab, (int(cx - dx), int(cy - dy)), (int(cx + dx), int(cy + dy)), label,
                 max(1, int(r * rng.uniform(0.03, 0.12))))


def _photo_layers(rng: np.random.Generator, w: int, h: int) -> tuple[np.ndarray, np.ndarray]:
    """A natural scene as (base [h,w,3] float32 0-255, detail [h,w] float32).

    The final image is ``base + k * detail``: ``k`` sets how much fine texture and grain the
    image has, and so its JPEG bytes per pixel, without changing the scene.

    Scene model: "dead leaves" (opaque objects with power-law sizes occluding each other, which
    gives natural images their ~1/f**2 power spectrum and sharp occlusion boundaries) in front of
    a sky/ground or wall/floor background; each object has a colour from a coherent palette, a
    shading gradient and its own texture strength; a smooth 1/f illumination field on top;
    slight optical blur.
    """
    scale = min(1.0, math.sqrt(_SCENE_MAX_PIXELS / (w * h)))
    sw, sh = max(8, round(w * scale)), max(8, round(h * scale))
    lab, n_lab = _label_map(rng, sw, sh)
    base, t_iso, t_dir = _base_layer(rng, lab, n_lab)
    if (sw, sh) != (w, h):
        base = cv2.resize(base, (w, h), interpolation=cv2.INTER_CUBIC)
        lab = cv2.resize(lab, (w, h), interpolation=cv2.INTER_NEAREST)
    return base, _detail_layer(rng, lab, base, t_iso, t_dir)


def _label_map(rng: np.random.Generator, sw: int, sh: int) -> tuple[np.ndarray, int]:
    """Background regions then occluding objects, far (large) to near (small); (labels, count)."""
    lab = np.zeros((sh, sw), np.uint8)
    horizon = sh * rng.uniform(0.25, 0.7)
    xs = np.linspace(0, sw, 65)
    ridge = _spectral_noise(rng, 1, 64, 1.0)[0, 0]
    ridge = np.concatenate([ridge, ridge[:1]])
    ys = horizon + ridge * sh * rng.uniform(0.01, 0.08)
    cv2.fillPoly(lab, [np.concatenate([np.stack([xs, ys], 1), [[sw, sh], [0, sh]]]).astype(np.int32)], 1)

    n_obj = int(rng.integers(120, 250))
    rmin, rmax = max(1.5, 0.008 * min(sw, sh)), 0.5 * min(sw, sh)
    radii = np.minimum(rmin * (1 - rng.random(n_obj)) ** (-1 / 1.1), rmax)  # Pareto sizes
    radii = np.sort(radii)[::-1]
    for i, r in enumerate(radii):
        cy = rng.uniform(horizon - 0.3 * sh, sh + 0.2 * r) if rng.random() < 0.75 else rng.uniform(0, sh)
        _draw_shape(rng, lab, 2 + i, rng.uniform(-0.1, 1.1) * sw, cy, float(r))
    return lab, 2 + n_obj


def _base_layer(rng: np.random.Generator, lab: np.ndarray, n_lab: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The shaded, lit, slightly blurred scene at label-map resolution, and each label's texture
    strengths (isotropic, oriented) for the detail layer.

    Per-label appearance is held in 256-entry lookup tables: cv2.LUT is ~30x faster than numpy
    fancy indexing at full resolution.
    """
    sh, sw = lab.shape
    col = np.zeros((256, 3), np.float32)
    indoor = rng.random() < 0.35
    if indoor:   # wall
        col[0] = _hsv_to_rgb(np.array([[rng.uniform(20, 60), rng.uniform(0.02, 0.25), rng.uniform(0.55, 0.95)]]))[0]
    else:        # sky: blue, overcast or dusk
        sky = [[rng.uniform(195, 225), rng.uniform(0.2, 0.6), rng.uniform(0.7, 1.0)],
               [0, 0.0, rng.uniform(0.6, 0.95)],
               [rng.uniform(15, 40), rng.uniform(0.3, 0.7), rng.uniform(0.6, 0.95)]][int(rng.choice(3, p=[0.6, 0.3, 0.1]))]
        col[0] = _hsv_to_rgb(np.array([sky]))[0]
    col[1:n_lab] = _scene_palette(rng, n_lab - 1)
    gx = rng.normal(0, 0.3, 256).astype(np.float32)
    gy = rng.normal(0, 0.3, 256).astype(np.float32)
    gy[0] = rng.uniform(0.2, 0.6) if not indoor else rng.normal(0, 0.2)
    t_iso = (rng.lognormal(np.log(20.0), 0.6, 256)).astype(np.float32)   # texture strength
    t_dir = np.where(rng.random(256) < 0.25, rng.uniform(4, 16, 256), 0).astype(np.float32)
    t_iso[0] = rng.uniform(0.3, 2.0)  # skies and walls are smooth
    t_dir[0] = 0.0

    base = cv2.LUT(cv2.merge([lab, lab, lab]), col.reshape(256, 1, 3))
    xr = np.linspace(-0.5, 0.5, sw, dtype=np.float32)[None, :]
    yr = np.linspace(-0.5, 0.5, sh, dtype=np.float32)[:, None]
    shade = 1.0 + cv2.LUT(lab, gx.reshape(256, 1)) * xr + cv2.LUT(lab, gy.reshape(256, 1)) * yr

    # illumination and colour variation: smooth 1/f**1.5 fields from a small grid
    gh, gw = (max(4, round(sh * 96 / max(sh, sw))), max(4, round(sw * 96 / max(sh, sw))))
    lf = _spectral_noise(rng, gh, gw, 1.5, channels=4)
    lf = cv2.resize(np.ascontiguousarray(lf.transpose(1, 2, 0)), (sw, sh), interpolation=cv2.INTER_LINEAR)
    light, tint = lf[:, :, 0].copy(), np.ascontiguousarray(lf[:, :, 1:4])  # contiguous: faster below
    cv2.scaleAdd(light, rng.uniform(0.05, 0.15), np.ones_like(light), dst=light)
    shade *= light
    base *= shade[:, :, None]
    cv2.scaleAdd(tint, rng.uniform(2, 6), base, dst=base)
    base = cv2.GaussianBlur(base, (0, 0), rng.uniform(0.4, 1.0))  # optics: edges are not ideal steps
    return base, t_iso, t_dir


def _detail_layer(rng: np.random.Generator, lab: np.ndarray, base: np.ndarray, t_iso: np.ndarray,
                  t_dir: np.ndarray) -> np.ndarray:
    """Detail at full resolution: object textures (isotropic + oriented) and sensor grain."""
    h, w = lab.shape
    iso = _octave_noise(rng, h, w, [(2, 2), (4, 4), (8, 8), (16, 16), (32, 32)], gain=rng.uniform(1.1, 1.5))
    if rng.random() < 0.5:
        ori = _octave_noise(rng, h, w, [(2, 24), (4, 64)], gain=1.3)
    else:
        ori = _octave_noise(rng, h, w, [(24, 2), (64, 4)], gain=1.3)
    detail = cv2.LUT(lab, t_iso.reshape(256, 1)) * iso
    cv2.scaleAdd(cv2.LUT(lab, t_dir.reshape(256, 1)) * ori, 1.0, detail, dst=detail)
    cv2.scaleAdd(_uniform_noise(rng, h, w), rng.uniform(2.0, 5.0), detail, dst=detail)
    # textures are reflectance: weaker in shadows than in highlights
    luma = cv2.cvtColor(base, cv2.COLOR_RGB2GRAY)
    detail *= 0.3 + luma * (0.7 / 160.0)
    return detail


def _compose(base: np.ndarray, detail: np.ndarray, k: float) -> np.ndarray:
    """uint8 RGB image base + k * detail (saturating)."""
    return cv2.addWeighted(base, 1.0, cv2.merge([detail, detail, detail]), float(k), 0.0, dtype=cv2.CV_8U)

# ---- encoding and bytes-per-pixel targeting

def _encode(arr: np.ndarray, fmt: str, quality: int = 90, subsampling: str = "4:2:0",
            progressive: bool = False) -> bytes:
    buf = io.BytesIO()
    im = Image.fromarray(arr)
    if fmt == "jpeg":
        im.save(buf, "JPEG", quality=int(quality), subsampling=SUBSAMPLING.get(subsampling, 2),
                progressive=bool(progressive), optimize=False)
    else:
        im.save(buf, "PNG", compress_level=6)
    return buf.getvalue()


def _fit_detail(rng: np.random.Generator, base: np.ndarray, detail: np.ndarray, target_bpp: float,
                quality: int, subsampling: str, progressive: bool, gray: bool) -> float:
    """The detail gain k at which the JPEG of base + k*detail has ``target_bpp`` bytes/pixel.

    Encodes a 256x256 mosaic of 16 tiles taken on a stratified grid (aligned to the 16-px MCU so
    each block is coded as in the full image) instead of the whole image: bisection then costs
    ~1 ms a step. Bytes per pixel grow monotonically with k.
    """
    h, w = detail.shape
    t = 64
    if h >= 4 * t and w >= 4 * t:
        ys = [(i * h // 4 + int(rng.integers(0, max(1, h // 4 - t)))) // 16 * 16 for i in range(4)]
        xs = [(j * w // 4 + int(rng.integers(0, max(1, w // 4 - t)))) // 16 * 16 for j in range(4)]
        mb = np.concatenate([np.concatenate([base[y:y + t, x:x + t] for x in xs], 1) for y in ys], 0)
        md = np.concatenate([np.concatenate([detail[y:y + t, x:x + t] for x in xs], 1) for y in ys], 0)
    else:
        mb, md = base, detail
    npx = md.shape[0] * md.shape[1]
    # fixed cost of headers and tables, which a small mosaic would otherwise count as pixels
    overhead = len(_encode(np.zeros((16, 16) if gray else (16, 16, 3), np.uint8), "jpeg", quality, subsampling, progressive))

    def bpp(k: float) -> float:
        img = _compose(mb, md, k)
        if gray:
            img = cv2.cvtColor(img, cv2.COLOR_RGB2GRAY)
        return (len(_encode(img, "jpeg", quality, subsampling, progressive)) - overhead) / npx

    target_bpp -= overhead / (h * w)  # the full image pays the same fixed cost once
    lo, hi = 0.0, 6.0
    if bpp(hi) <= target_bpp:
        return hi
    if bpp(lo) >= target_bpp:
        return lo
    for _ in range(9):
        mid = 0.5 * (lo + hi)
        if bpp(mid) < target_bpp:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


