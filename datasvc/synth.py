"""Realistic synthetic image-text shards: ``python -m datasvc.synth``.

Why this exists: image-free mock data makes a VLM data path look about twice as fast as it is,
because decoding and resizing real photographs is where the CPU time goes. The shards written
here cost what real ones cost: real JPEG/PNG bytes whose content has natural-image statistics
(1/f spectra, occlusion boundaries, textures, sensor grain), photo-like bytes per pixel, realistic
resolutions, aspect ratios, formats, images per sample and caption lengths. ``--mock`` writes the
image-free variant with the identical text, so the two can be compared head to head.

A :class:`Profile` is a set of distributions. Three are built in (:data:`PROFILES`); ``calibrate``
fits one to real shards from headers and sizes only (no pixel decode, no model, nothing unpickled).

Output layout (WebDataset): ``DIR/synth-000000.tar``, ... Each sample has ``__key__``, its
image(s) as ``jpg``/``png`` (several images: ``0.jpg``, ``1.png``, ... in order) and either ``txt``
(a caption) or ``json`` (a single-turn conversation whose user turn holds one ``<image>`` marker per
image, images taken in key order). Output is byte-identical for identical arguments: every sample
draws from its own random stream seeded by ``(seed, sample index)``.
"""
from __future__ import annotations

import argparse
import dataclasses
import io
import json
import math
import os
import sys
import tarfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import cv2
import numpy as np
from PIL import Image, JpegImagePlugin

__all__ = [
    "Dist",
    "Profile",
    "PROFILES",
    "write_shards",
    "calibrate",
    "image_statistics",
    "estimate_jpeg_quality",
    "main",
]

IMAGE_EXTS = {"jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff", "ppm", "pgm"}
IMAGE_MARKER = "<image>"


# --------------------------------------------------------------------------------------------
# Distributions and profiles
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Dist:
    """A one-dimensional distribution that round-trips through JSON.

    kinds:
      - ``lognormal``: ``median``, ``sigma`` (of the log), clipped to [lo, hi].
      - ``uniform``: on [lo, hi].
      - ``choice``: ``values`` with ``weights`` (discrete, e.g. images per sample, aspect ratios).
      - ``quantiles``: an empirical inverse CDF; ``values`` are the quantiles at probabilities
        (i + 0.5) / n ("Hazen" plotting positions). Sampling interpolates between them, which
        keeps the mean of the data it was fitted to exactly when n equals the sample count.
    """

    kind: str
    median: float = 1.0
    sigma: float = 0.0
    lo: float | None = None
    hi: float | None = None
    values: tuple[float, ...] = ()
    weights: tuple[float, ...] = ()

    @staticmethod
    def lognormal(median: float, sigma: float, lo: float | None = None, hi: float | None = None) -> "Dist":
        return Dist("lognormal", median=median, sigma=sigma, lo=lo, hi=hi)

    @staticmethod
    def uniform(lo: float, hi: float) -> "Dist":
        return Dist("uniform", lo=lo, hi=hi)

    @staticmethod
    def choice(values: Sequence[float], weights: Sequence[float] | None = None) -> "Dist":
        w = np.ones(len(values)) if weights is None else np.asarray(weights, float)
        w = w / w.sum()
        return Dist("choice", values=tuple(float(v) for v in values), weights=tuple(float(x) for x in w))

    @staticmethod
    def fit_quantiles(samples: Iterable[float], n: int = 64) -> "Dist":
        """Empirical distribution of ``samples`` compressed to at most ``n`` quantiles."""
        x = np.sort(np.asarray(list(samples), float))
        if x.size == 0:
            raise ValueError("cannot fit a distribution to no samples")
        q = min(n, x.size)
        vals = np.quantile(x, (np.arange(q) + 0.5) / q, method="hazen")
        return Dist("quantiles", values=tuple(float(v) for v in vals))

    @staticmethod
    def fit_choice(samples: Iterable[float]) -> "Dist":
        vals, counts = np.unique(np.asarray(list(samples), float), return_counts=True)
        return Dist.choice(vals.tolist(), counts.tolist())

    def sample(self, rng: np.random.Generator, u: float | None = None) -> float:
        """Draw one value. ``u`` (uniform in [0, 1)) lets callers couple two distributions."""
        u = rng.random() if u is None else u
        if self.kind == "lognormal":
            z = _norm_ppf(u)  # inverse CDF rather than rng.normal, so one uniform can couple two draws
            x = self.median * math.exp(self.sigma * z)
        elif self.kind == "uniform":
            x = self.lo + (self.hi - self.lo) * u
        elif self.kind == "choice":
            idx = int(np.searchsorted(np.cumsum(self.weights), u * sum(self.weights), side="right"))
            x = self.values[min(idx, len(self.values) - 1)]
        elif self.kind == "quantiles":
            n = len(self.values)
            x = float(np.interp(u, (np.arange(n) + 0.5) / n, self.values))
        else:
            raise ValueError(f"unknown distribution kind {self.kind!r}")
        if self.lo is not None:
            x = max(x, self.lo)
        if self.hi is not None:
            x = min(x, self.hi)
        return float(x)

    def mean(self) -> float:
        """Expected value (numerically, on a fine grid of u, so clipping is accounted for)."""
        if self.kind == "choice":
            return float(np.dot(self.values, self.weights))
        u = (np.arange(20000) + 0.5) / 20000
        if self.kind == "lognormal":
            return float(np.mean([self.sample(None, ui) for ui in u]))
        return float(np.mean(self._vec(u)))

    def _vec(self, u: np.ndarray) -> np.ndarray:
        if self.kind == "uniform":
            x = self.lo + (self.hi - self.lo) * u
        else:  # quantiles
            n = len(self.values)
            x = np.interp(u, (np.arange(n) + 0.5) / n, self.values)
        return np.clip(x, self.lo if self.lo is not None else -np.inf, self.hi if self.hi is not None else np.inf)

    def to_dict(self) -> dict:
        d = {"kind": self.kind}
        if self.kind == "lognormal":
            d.update(median=self.median, sigma=self.sigma)
        if self.lo is not None:
            d["lo"] = self.lo
        if self.hi is not None:
            d["hi"] = self.hi
        if self.values:
            d["values"] = list(self.values)
        if self.weights:
            d["weights"] = list(self.weights)
        return d

    @staticmethod
    def from_dict(d: dict) -> "Dist":
        return Dist(
            kind=d["kind"],
            median=float(d.get("median", 1.0)),
            sigma=float(d.get("sigma", 0.0)),
            lo=d.get("lo"),
            hi=d.get("hi"),
            values=tuple(float(v) for v in d.get("values", ())),
            weights=tuple(float(v) for v in d.get("weights", ())),
        )


def _norm_ppf(u: float) -> float:
    """Inverse standard normal CDF (Acklam's rational approximation, |error| < 1.2e-9)."""
    u = min(max(u, 1e-12), 1 - 1e-12)
    a = (-3.969683028665376e01, 2.209460984245205e02, -2.759285104469687e02, 1.383577518672690e02,
         -3.066479806614716e01, 2.506628277459239e00)
    b = (-5.447609879822406e01, 1.615858368580409e02, -1.556989798598866e02, 6.680131188771972e01,
         -1.328068155288572e01)
    c = (-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e00, -2.549732539343734e00,
         4.374664141464968e00, 2.938163982698783e00)
    d = (7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e00, 3.754408661907416e00)
    if u < 0.02425:
        q = math.sqrt(-2 * math.log(u))
        return (((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) / (
            (((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1)
    if u > 1 - 0.02425:
        return -_norm_ppf(1 - u)
    q = u - 0.5
    r = q * q
    return (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5]) * q / (
        ((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1)


# What an image is made of and how it is stored. "photo" content is a composed natural scene,
# "document" content is a rendered page or UI screenshot with text.
KINDS = ("photo/jpeg", "photo/png", "document/png", "document/jpeg")
SUBSAMPLING = {"4:4:4": 0, "4:2:2": 1, "4:2:0": 2}


@dataclass
class Profile:
    """Distributions that describe a data set's images and text.

    ``jpeg_bpp`` (bytes per pixel of photographic JPEGs), when set, is a per-image target: the
    amount of fine detail in the image is tuned until the encoded JPEG hits it, drawn with the same
    uniform as the quality so high quality goes with high bytes per pixel, as in real data. When it
    is ``None`` the detail amount is drawn from ``detail`` and bytes per pixel follow from content
    and quality, as they do for a camera.
    """

    name: str
    megapixels: Dist
    aspect: Dist  # width / height
    jpeg_quality: Dist
    kinds: dict[str, float]
    images_per_sample: Dist
    caption_words: Dist
    conversation_fraction: float
    question_words: Dist
    answer_words: Dist
    jpeg_bpp: Dist | None = None
    detail: Dist = field(default_factory=lambda: Dist.lognormal(1.0, 0.35, 0.3, 3.0))
    progressive_fraction: float = 0.0
    gray_fraction: float = 0.0
    subsampling: dict[str, float] = field(default_factory=lambda: {"4:2:0": 1.0})
    description: str = ""

    _DISTS = ("megapixels", "aspect", "jpeg_quality", "images_per_sample", "caption_words",
              "question_words", "answer_words", "jpeg_bpp", "detail")

    def to_dict(self) -> dict:
        d = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            d[f.name] = v.to_dict() if isinstance(v, Dist) else v
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> "Profile":
        kw = dict(d)
        for k in cls._DISTS:
            if kw.get(k) is not None:
                kw[k] = Dist.from_dict(kw[k])
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(kw) - known
        if unknown:
            raise ValueError(f"unknown profile fields: {sorted(unknown)}")
        return cls(**kw)

    @classmethod
    def from_json(cls, text: str) -> "Profile":
        return cls.from_dict(json.loads(text))

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, name_or_path: str | os.PathLike) -> "Profile":
        """A built-in profile by name, or a profile JSON file."""
        if str(name_or_path) in PROFILES:
            return PROFILES[str(name_or_path)]
        p = Path(name_or_path)
        if p.is_file():
            return cls.from_json(p.read_text())
        raise ValueError(f"no profile named {name_or_path!r} (built in: {', '.join(PROFILES)}) and no such file")

    def mean_megapixels(self) -> float:
        return self.megapixels.mean()


PROFILES: dict[str, Profile] = {
    # Web-crawled image-text pairs (LAION/COYO/DataComp-like after filtering): mostly JPEG of
    # 0.2-2 MP in the common camera/web aspect ratios, alt-text or short recaptions.
    "web-photos": Profile(
        name="web-photos",
        description="web photos, 0.2-2 MP, mostly JPEG q75-95, short captions, some VQA",
        megapixels=Dist.lognormal(0.6, 0.55, 0.2, 2.0),
        aspect=Dist.choice([4 / 3, 3 / 2, 16 / 9, 1.0, 3 / 4, 2 / 3, 9 / 16, 2.0],
                           [0.25, 0.18, 0.12, 0.15, 0.12, 0.10, 0.05, 0.03]),
        jpeg_quality=Dist.choice([75, 80, 85, 90, 92, 95], [0.15, 0.2, 0.25, 0.2, 0.1, 0.1]),
        kinds={"photo/jpeg": 0.90, "photo/png": 0.06, "document/png": 0.04},
        images_per_sample=Dist.choice([1, 2, 3, 4], [0.88, 0.08, 0.03, 0.01]),
        caption_words=Dist.lognormal(16, 0.8, 2, 250),
        conversation_fraction=0.25,
        question_words=Dist.lognormal(9, 0.5, 2, 60),
        answer_words=Dist.lognormal(35, 0.9, 1, 400),
        detail=Dist.lognormal(1.2, 0.4, 0.3, 3.0),  # ~0.15-0.45 bytes/px at q85
        progressive_fraction=0.1,
        gray_fraction=0.03,
        subsampling={"4:2:0": 0.85, "4:4:4": 0.15},
    ),
    # Document / screenshot understanding (DocVQA, ChartQA, UI data): rendered pages and screens,
    # PNG-heavy, tall pages and phone screenshots, long conversations.
    "documents": Profile(
        name="documents",
        description="document pages and screenshots, PNG-heavy, tall aspect ratios, mostly QA",
        megapixels=Dist.lognormal(1.6, 0.5, 0.4, 6.0),
        aspect=Dist.choice([0.707, 0.773, 0.46, 16 / 9, 1.6, 0.3], [0.35, 0.15, 0.15, 0.15, 0.10, 0.10]),
        jpeg_quality=Dist.choice([85, 90, 95], [0.3, 0.4, 0.3]),
        kinds={"document/png": 0.65, "document/jpeg": 0.20, "photo/jpeg": 0.15},
        images_per_sample=Dist.choice([1, 2, 3, 4], [0.80, 0.12, 0.05, 0.03]),
        caption_words=Dist.lognormal(30, 0.7, 3, 400),
        conversation_fraction=0.7,
        question_words=Dist.lognormal(12, 0.5, 3, 80),
        answer_words=Dist.lognormal(45, 1.0, 1, 600),
        progressive_fraction=0.05,
        gray_fraction=0.1,
        subsampling={"4:2:0": 0.7, "4:4:4": 0.3},
    ),
    # Camera originals (phones, DSLRs): 8-16 MP, high quality, 4:2:2 or 4:2:0, dense captions.
    "camera-hires": Profile(
        name="camera-hires",
        description="camera originals, 8-16 MP JPEG q88-95, dense captions",
        megapixels=Dist.lognormal(12.0, 0.2, 8.0, 16.0),
        aspect=Dist.choice([4 / 3, 3 / 2, 16 / 9, 3 / 4, 2 / 3, 1.0], [0.40, 0.30, 0.10, 0.10, 0.08, 0.02]),
        jpeg_quality=Dist.choice([88, 92, 95], [0.3, 0.3, 0.4]),
        kinds={"photo/jpeg": 1.0},
        images_per_sample=Dist.choice([1], [1.0]),
        caption_words=Dist.lognormal(45, 0.6, 5, 400),
        conversation_fraction=0.3,
        question_words=Dist.lognormal(10, 0.5, 2, 60),
        answer_words=Dist.lognormal(60, 0.8, 1, 600),
        detail=Dist.lognormal(0.8, 0.3, 0.3, 2.0),
        progressive_fraction=0.0,
        gray_fraction=0.0,
        subsampling={"4:2:2": 0.5, "4:2:0": 0.5},
    ),
}


# --------------------------------------------------------------------------------------------
# Text: captions and conversations from a built-in vocabulary
# --------------------------------------------------------------------------------------------

# A small caption-flavoured vocabulary. Words within a class are drawn Zipf-like (earlier words
# more often), which gives text a realistic token-frequency skew for tokenizers.
_DET = "a the the a two three some several an one many".split()
_ADJ = ("small large old white black red blue green yellow wooden bright dark wet busy empty "
        "tall narrow open modern ancient quiet crowded sunny cloudy colorful metal glass stone "
        "young smiling happy tired round square soft rusty fresh golden silver distant").split()
_NOUN = ("man woman person dog cat car street building tree table window room city road water "
         "sky field house boat bridge train bus child group bicycle flower plate food sign wall "
         "door chair river mountain beach park shirt hat bag phone computer screen book paper "
         "page chart graph text logo kitchen desk light horse bird cup glass bottle fence grass "
         "snow rock forest lake cloud shadow market crowd truck player ball game team sofa bed "
         "lamp mirror painting garden path tower church station platform airplane field camera").split()
_VERB = ("is standing sitting walking holding looking riding showing lying parked running "
         "wearing carrying eating playing waiting crossing hanging covered surrounded displayed "
         "reading facing leaning floating flying growing shining reflecting").split()
_PREP = "on in near next to under behind beside with at along across above inside over".split()
_CONJ = "and while with where as".split()
_QSTART = [
    "What is", "What color is", "How many", "Where is", "Which", "Why is", "What does",
    "Describe", "Is there", "What kind of", "Who is", "Read the text on", "What is written on",
    "Summarize", "What is the value of", "Explain",
]


def _zipf_pick(rng: np.random.Generator, words: Sequence[str]) -> str:
    # P(rank r) ~ 1/(r+1): a cheap Zipf draw via the inverse CDF of a log-uniform.
    n = len(words)
    r = int(math.exp(rng.random() * math.log(n + 1))) - 1
    return words[min(max(r, 0), n - 1)]


def _sentence_words(rng: np.random.Generator) -> list[str]:
    w = [_zipf_pick(rng, _DET)]
    if rng.random() < 0.6:
        w.append(_zipf_pick(rng, _ADJ))
    w += [_zipf_pick(rng, _NOUN), _zipf_pick(rng, _VERB)]
    for _ in range(int(rng.integers(0, 3))):
        w += [_zipf_pick(rng, _PREP), _zipf_pick(rng, _DET)]
        if rng.random() < 0.4:
            w.append(_zipf_pick(rng, _ADJ))
        w.append(_zipf_pick(rng, _NOUN))
    if rng.random() < 0.3:
        w += [_zipf_pick(rng, _CONJ), _zipf_pick(rng, _DET), _zipf_pick(rng, _NOUN), _zipf_pick(rng, _VERB)]
    return w


def _prose(rng: np.random.Generator, n_words: int) -> str:
    """Exactly ``n_words`` whitespace-separated words in capitalised, full-stopped sentences."""
    out: list[str] = []
    while len(out) < n_words:
        s = _sentence_words(rng)[: n_words - len(out)]
        s[0] = s[0].capitalize()
        s[-1] += "."
        out += s
    return " ".join(out)


def _question(rng: np.random.Generator, n_words: int) -> str:
    start = _QSTART[int(rng.integers(len(_QSTART)))].split()
    words = start[:n_words]
    while len(words) < n_words:
        words += [_zipf_pick(rng, _DET), _zipf_pick(rng, _ADJ), _zipf_pick(rng, _NOUN),
                  _zipf_pick(rng, _PREP)][: n_words - len(words)]
    return " ".join(words) + "?"


def _count_words(text: str) -> int:
    return sum(1 for t in text.split() if t != IMAGE_MARKER)


# --------------------------------------------------------------------------------------------
# Images: natural scenes and documents
# --------------------------------------------------------------------------------------------
#
# Cost model: decode cost of a JPEG grows with pixels and with entropy-coded bytes; resize cost
# with pixels. So what must be right is resolution and bytes per pixel at a realistic quality,
# and the bytes must come from photo-like structure (smooth shading, sharp occlusion edges,
# texture, grain), not uniform noise (which is far costlier) or flat colour (far cheaper).
#
# Speed: everything at full resolution is a handful of OpenCV calls (LUT, resize, blur,
# addWeighted); spectra are synthesised by FFT on small grids and upsampled. Scenes above
# ~2 MP are composed at 2 MP and upsampled, with fine detail added at full resolution, which is
# also what camera images look like (optics and demosaicing soften them; grain stays sharp).

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

    # --- label map: background regions then occluding objects, far (large) to near (small)
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
    n_lab = 2 + n_obj

    # --- per-label appearance, as 256-entry lookup tables (cv2.LUT is ~30x faster than numpy
    # fancy indexing at full resolution)
    col = np.zeros((256, 3), np.float32)
    indoor = rng.random() < 0.35
    if indoor:   # wall
        col[0] = _hsv_to_rgb(np.array([[rng.uniform(20, 60), rng.uniform(0.02, 0.25), rng.uniform(0.55, 0.95)]]))[0]
    else:        # sky: blue, overcast or dusk
        sky = [[rng.uniform(195, 225), rng.uniform(0.2, 0.6), rng.uniform(0.7, 1.0)],
               [0, 0.0, rng.uniform(0.6, 0.95)],
               [rng.uniform(15, 40), rng.uniform(0.3, 0.7), rng.uniform(0.6, 0.95)]][int(rng.choice(3, p=[0.6, 0.3, 0.1]))]
        col[0] = _hsv_to_rgb(np.array([sky]))[0]
    pal = _scene_palette(rng, n_lab - 1)
    col[1:n_lab] = pal
    gx = rng.normal(0, 0.3, 256).astype(np.float32)
    gy = rng.normal(0, 0.3, 256).astype(np.float32)
    gy[0] = rng.uniform(0.2, 0.6) if not indoor else rng.normal(0, 0.2)
    t_iso = (rng.lognormal(np.log(20.0), 0.6, 256)).astype(np.float32)   # texture strength
    t_dir = np.where(rng.random(256) < 0.25, rng.uniform(4, 16, 256), 0).astype(np.float32)
    t_iso[0] = rng.uniform(0.3, 2.0)  # skies and walls are smooth
    t_dir[0] = 0.0

    lab3 = cv2.merge([lab, lab, lab])
    base = cv2.LUT(lab3, col.reshape(256, 1, 3))
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
    if (sw, sh) != (w, h):
        base = cv2.resize(base, (w, h), interpolation=cv2.INTER_CUBIC)
        lab = cv2.resize(lab, (w, h), interpolation=cv2.INTER_NEAREST)

    # --- detail at full resolution: object textures (isotropic + oriented) and sensor grain
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
    return base, detail


def _compose(base: np.ndarray, detail: np.ndarray, k: float) -> np.ndarray:
    """uint8 RGB image base + k * detail (saturating)."""
    return cv2.addWeighted(base, 1.0, cv2.merge([detail, detail, detail]), float(k), 0.0, dtype=cv2.CV_8U)


# ---- documents and screenshots

_FONTS = [cv2.FONT_HERSHEY_SIMPLEX, cv2.FONT_HERSHEY_DUPLEX, cv2.FONT_HERSHEY_COMPLEX,
          cv2.FONT_HERSHEY_TRIPLEX, cv2.FONT_HERSHEY_PLAIN]
_DOC_WORDS = _NOUN + _ADJ + _VERB + _PREP + _DET + _CONJ + ["of", "to", "for", "by", "from", "is", "are", "was"]


class _Font:
    """A Hershey font sized to a target line height in pixels."""

    def __init__(self, face: int, px: float, bold: bool = False):
        (_, h0), base0 = cv2.getTextSize("Hg", face, 1.0, 1)
        self.face = face
        self.scale = max(0.25, px / (h0 + base0))
        self.thick = max(1, int(round(self.scale * (1.6 if bold else 0.9))))
        (cw, ch), base = cv2.getTextSize("abcdefghijklmnopqrstuvwxyz", face, self.scale, self.thick)
        self.char_w = cw / 26.0
        self.asc = ch
        self.line_h = int((ch + base) * 1.45) + 1

    def put(self, img: np.ndarray, text: str, x: int, y: int, color) -> None:
        cv2.putText(img, text, (int(x), int(y)), self.face, self.scale, color, self.thick, cv2.LINE_AA)


def _text_line(rng: np.random.Generator, n_chars: int) -> str:
    words: list[str] = []
    length = 0
    while length < n_chars:
        r = rng.random()
        wd = (f"{rng.integers(0, 10000)}" if r < 0.06 else
              _zipf_pick(rng, _DOC_WORDS) + ("," if r > 0.95 else ""))
        if not words or rng.random() < 0.08:
            wd = wd.capitalize()
        words.append(wd)
        length += len(wd) + 1
    return " ".join(words)[: max(1, n_chars)]


def _paragraph(rng, img, font: _Font, x0: int, x1: int, y: int, y_max: int, n_lines: int, color) -> int:
    chars = max(4, int((x1 - x0) / font.char_w))
    for i in range(n_lines):
        if y + font.line_h > y_max:
            break
        last = i == n_lines - 1
        font.put(img, _text_line(rng, int(chars * (rng.uniform(0.3, 0.9) if last else rng.uniform(0.92, 1.0)))),
                 x0, y + font.asc, color)
        y += font.line_h
    return y


def _figure(rng, img, x0: int, y0: int, x1: int, y1: int) -> None:
    bw, bh = x1 - x0, y1 - y0
    if bw < 16 or bh < 16:
        return
    if rng.random() < 0.5:   # a photo
        base, det = _photo_layers(rng, bw, bh)
        img[y0:y1, x0:x1] = _compose(base, det, rng.uniform(0.5, 1.2))
    else:                    # a bar/line chart
        cv2.rectangle(img, (x0, y0), (x1 - 1, y1 - 1), (90, 90, 90), 1)
        n = int(rng.integers(4, 16))
        vals = rng.uniform(0.1, 0.95, n)
        colr = tuple(int(c) for c in _hsv_to_rgb(np.array([[rng.uniform(0, 360), 0.6, 0.8]]))[0])
        bar_w = bw / (n * 1.5)
        for i, v in enumerate(vals):
            bx = x0 + (i * 1.5 + 0.5) * bar_w
            cv2.rectangle(img, (int(bx), int(y1 - v * bh)), (int(bx + bar_w), y1 - 2), colr, -1)
        for gy in np.linspace(y0, y1, 5)[1:-1]:
            cv2.line(img, (x0, int(gy)), (x1, int(gy)), (200, 200, 200), 1)


def _table(rng, img, font: _Font, x0: int, x1: int, y: int, y_max: int, color) -> int:
    rows, cols = int(rng.integers(3, 10)), int(rng.integers(2, 6))
    row_h = font.line_h + 6
    rows = min(rows, max(0, (y_max - y) // row_h))
    if rows < 2:
        return y
    cw = (x1 - x0) / cols
    chars = max(2, int(cw / font.char_w) - 2)
    for r in range(rows + 1):
        cv2.line(img, (x0, y + r * row_h), (x1, y + r * row_h), (120, 120, 120), 1)
    for c in range(cols + 1):
        cv2.line(img, (int(x0 + c * cw), y), (int(x0 + c * cw), y + rows * row_h), (120, 120, 120), 1)
    for r in range(rows):
        for c in range(cols):
            txt = _text_line(rng, chars) if (c == 0 or r == 0) else f"{rng.uniform(0, 1000):.{int(rng.integers(0, 3))}f}"
            font.put(img, txt[:chars], x0 + c * cw + 4, y + r * row_h + 3 + font.asc, color)
    return y + rows * row_h + font.line_h


def _page(rng: np.random.Generator, w: int, h: int) -> np.ndarray:
    """A printed page: margins, headings, justified-ish paragraphs, tables, figures, lists."""
    paper = int(rng.integers(244, 256))
    img = np.full((h, w, 3), paper, np.uint8)
    ink = tuple(int(v) for v in rng.integers(0, 50, 3))
    mx, my = int(w * rng.uniform(0.06, 0.12)), int(h * rng.uniform(0.04, 0.08))
    face = _FONTS[int(rng.integers(len(_FONTS)))]
    body = _Font(face, float(np.clip(w * rng.uniform(0.011, 0.018), 8, 90)))
    head = _Font(face, body.line_h * rng.uniform(1.1, 1.7), bold=True)
    ncol = 2 if (w > 900 and rng.random() < 0.35) else 1
    gap = int(w * 0.04)
    col_w = (w - 2 * mx - (ncol - 1) * gap) // ncol
    for c in range(ncol):
        x0 = mx + c * (col_w + gap)
        x1 = x0 + col_w
        y = my
        while y < h - my - body.line_h:
            r = rng.random()
            if r < 0.12:
                head.put(img, _text_line(rng, int(rng.integers(10, 40)))[: int(col_w / head.char_w)], x0, y + head.asc, ink)
                y += int(head.line_h * 1.4)
            elif r < 0.20:
                y = _table(rng, img, body, x0, x1, y, h - my, ink)
            elif r < 0.27:
                fh = int(h * rng.uniform(0.1, 0.3))
                if y + fh < h - my:
                    _figure(rng, img, x0, y, x1, y + fh)
                y += fh + body.line_h
            elif r < 0.35:
                for _ in range(int(rng.integers(2, 7))):
                    if y + body.line_h > h - my:
                        break
                    cv2.circle(img, (x0 + body.line_h // 3, y + body.asc // 2), max(1, body.asc // 5), ink, -1, cv2.LINE_AA)
                    body.put(img, _text_line(rng, int(col_w / body.char_w * rng.uniform(0.3, 0.9))), x0 + body.line_h, y + body.asc, ink)
                    y += body.line_h
                y += body.line_h // 2
            else:
                y = _paragraph(rng, img, body, x0, x1, y, h - my, int(rng.integers(2, 14)), ink) + body.line_h // 2
    return img


def _screenshot(rng: np.random.Generator, w: int, h: int) -> np.ndarray:
    """An app/web UI: top bar, optional sidebar, cards with text, buttons and thumbnails."""
    dark = rng.random() < 0.3
    bg = int(rng.integers(28, 42)) if dark else int(rng.integers(238, 252))
    fg = (225, 225, 225) if dark else tuple(int(v) for v in rng.integers(20, 60, 3))
    card = bg + (12 if dark else 5)
    card = min(card, 255)
    accent = tuple(int(c) for c in _hsv_to_rgb(np.array([[rng.uniform(0, 360), rng.uniform(0.5, 0.9), rng.uniform(0.6, 0.9)]]))[0])
    img = np.full((h, w, 3), bg, np.uint8)
    face = _FONTS[int(rng.integers(0, 2))]  # UI text: sans faces
    body = _Font(face, float(np.clip(min(w, h) * rng.uniform(0.018, 0.03), 9, 80)))
    head = _Font(face, body.line_h * 1.3, bold=True)
    bar_h = int(h * rng.uniform(0.04, 0.08)) if h > w else int(h * rng.uniform(0.06, 0.1))
    cv2.rectangle(img, (0, 0), (w, bar_h), accent, -1)
    head.put(img, _text_line(rng, int(rng.integers(8, 24))), body.line_h, (bar_h + head.asc) // 2, (255, 255, 255))
    x0 = int(w * 0.03)
    if w > h and rng.random() < 0.6:
        sb = int(w * rng.uniform(0.15, 0.22))
        cv2.rectangle(img, (0, bar_h), (sb, h), (bg + 8 if dark else bg - 10,) * 3, -1)
        y = bar_h + body.line_h
        while y < h - body.line_h:
            cv2.circle(img, (body.line_h, y + body.asc // 2), max(2, body.asc // 2), accent, -1, cv2.LINE_AA)
            body.put(img, _text_line(rng, int(rng.integers(5, 16)))[: int((sb - 2 * body.line_h) / body.char_w)], 2 * body.line_h, y + body.asc, fg)
            y += int(body.line_h * rng.uniform(1.5, 2.2))
        x0 = sb + int(w * 0.02)
    x1 = w - int(w * 0.03)
    y = bar_h + int(h * 0.02)
    while y < h - 3 * body.line_h:
        ch = int(min(h - y - body.line_h, h * rng.uniform(0.08, 0.3)))
        cv2.rectangle(img, (x0, y), (x1, y + ch), (card,) * 3, -1)
        cv2.rectangle(img, (x0, y), (x1, y + ch), (bg - 25 if not dark else bg + 25,) * 3, 1)
        tx = x0 + body.line_h
        if ch > 4 * body.line_h and rng.random() < 0.4:   # thumbnail
            tw = int(min(ch - body.line_h, (x1 - x0) * 0.35))
            _figure(rng, img, tx, y + body.line_h // 2, tx + tw, y + body.line_h // 2 + tw if tw < ch - body.line_h else y + ch - body.line_h // 2)
            tx += tw + body.line_h
        yy = y + body.line_h // 2
        head.put(img, _text_line(rng, int(rng.integers(8, 30)))[: max(1, int((x1 - tx) / head.char_w) - 1)], tx, yy + head.asc, fg)
        yy += head.line_h
        yy = _paragraph(rng, img, body, tx, x1 - body.line_h, yy, y + ch - 2 * body.line_h, int(rng.integers(1, 6)), fg)
        if rng.random() < 0.5 and yy + body.line_h * 1.5 < y + ch:
            bw = int(body.char_w * rng.integers(6, 14)) + body.line_h
            cv2.rectangle(img, (tx, yy), (tx + bw, yy + int(body.line_h * 1.3)), accent, -1)
            body.put(img, _text_line(rng, int(rng.integers(3, 10))), tx + body.line_h // 2, yy + body.asc + body.line_h // 6, (255, 255, 255))
        y += ch + int(body.line_h * rng.uniform(0.5, 1.5))
    return img


def _document_image(rng: np.random.Generator, w: int, h: int, scanned: bool) -> np.ndarray:
    img = _page(rng, w, h) if rng.random() < 0.55 else _screenshot(rng, w, h)
    if scanned:  # a scan or phone photo of a page: soft, noisy, uneven paper
        img = cv2.GaussianBlur(img, (0, 0), rng.uniform(0.5, 1.0))
        noise = _uniform_noise(rng, h, w) * rng.uniform(2, 5)
        img = cv2.add(img.astype(np.float32), cv2.merge([noise, noise, noise]), dtype=cv2.CV_8U)
    return img


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


# --------------------------------------------------------------------------------------------
# Samples and shards
# --------------------------------------------------------------------------------------------


@dataclass
class _ImageSpec:
    content: str  # "photo" | "document"
    fmt: str  # "jpeg" | "png"
    w: int
    h: int
    quality: int
    bpp: float | None
    detail: float
    progressive: bool
    subsampling: str
    gray: bool


def _pick(rng: np.random.Generator, mix: dict[str, float]) -> str:
    keys = sorted(mix)
    p = np.array([mix[k] for k in keys], float)
    return keys[min(int(np.searchsorted(np.cumsum(p / p.sum()), rng.random(), side="right")), len(keys) - 1)]


def _draw_image_spec(rng: np.random.Generator, p: Profile) -> _ImageSpec:
    # Always the same number of draws in the same order, whatever the branch, so a change to one
    # field of a profile does not reshuffle every other field.
    content, fmt = _pick(rng, p.kinds).split("/")
    mp, ar = p.megapixels.sample(rng), p.aspect.sample(rng)
    w = max(16, round(math.sqrt(mp * 1e6 * ar)))
    h = max(16, round(mp * 1e6 / w))
    u = rng.random()  # quality and bytes/px share one uniform: high quality goes with many bytes
    quality = int(round(p.jpeg_quality.sample(rng, u)))
    bpp = p.jpeg_bpp.sample(rng, u) if p.jpeg_bpp is not None else None
    detail = p.detail.sample(rng)
    progressive = bool(rng.random() < p.progressive_fraction)
    subsampling = _pick(rng, p.subsampling)
    gray = bool(rng.random() < p.gray_fraction)
    return _ImageSpec(content, fmt, w, h, min(max(quality, 1), 100), bpp, detail, progressive, subsampling, gray)


def _render(spec: _ImageSpec, rng: np.random.Generator) -> bytes:
    if spec.content == "document":
        img = _document_image(rng, spec.w, spec.h, scanned=spec.fmt == "jpeg" and rng.random() < 0.5)
    else:
        base, detail = _photo_layers(rng, spec.w, spec.h)
        k = spec.detail
        if spec.fmt == "jpeg" and spec.bpp is not None:
            k = _fit_detail(rng, base, detail, spec.bpp, spec.quality, spec.subsampling, spec.progressive, spec.gray)
        img = _compose(base, detail, k)
        del base, detail
    if spec.gray:
        img = cv2.cvtColor(img, cv2.COLOR_RGB2GRAY)
    return _encode(img, spec.fmt, spec.quality, spec.subsampling, spec.progressive)


def _make_sample(index: int, profile: Profile, seed: int, mock: bool) -> dict:
    """Sample ``index``; its randomness depends only on (seed, index), never on shard layout."""
    s_layout, s_text, s_img = np.random.SeedSequence([seed, index]).spawn(3)
    rl = np.random.default_rng(s_layout)
    n_img = max(0, int(round(profile.images_per_sample.sample(rl))))
    specs = [_draw_image_spec(rl, profile) for _ in range(n_img)]

    rt = np.random.default_rng(s_text)
    conv = bool(rt.random() < profile.conversation_fraction)
    if conv:
        question = _question(rt, max(1, round(profile.question_words.sample(rt))))
        answer = _prose(rt, max(1, round(profile.answer_words.sample(rt))))
    else:
        caption = _prose(rt, max(1, round(profile.caption_words.sample(rt))))

    sample: dict = {"__key__": f"{index:08d}"}
    if mock:
        # Same words as the real sample (the text stream does not depend on images), no pixels:
        # exactly what an image-free benchmark feeds.
        sample["txt"] = (question + " " + answer if conv else caption).encode()
        return sample
    for i, (spec, ss) in enumerate(zip(specs, s_img.spawn(n_img))):
        ext = "jpg" if spec.fmt == "jpeg" else "png"
        sample[ext if n_img == 1 else f"{i}.{ext}"] = _render(spec, np.random.default_rng(ss))
    if conv:
        user = "".join(IMAGE_MARKER + "\n" for _ in range(n_img)) + question
        msgs = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        sample["json"] = json.dumps({"messages": msgs}).encode()
    else:
        sample["txt"] = caption.encode()
    return sample


def write_shards(out_dir: str | os.PathLike, samples: int, profile: Profile | str = "web-photos",
                 seed: int = 0, samples_per_shard: int = 128, mock: bool = False,
                 progress: bool = True) -> list[str]:
    """Write ``samples`` samples as ``out_dir/synth-000000.tar``, ...; returns the shard paths.

    Each shard is written to a temporary name and renamed, so a reader never sees half a shard.
    Stale ``synth-*.tar`` from an earlier, larger run in the same directory are removed (they
    would silently mix into a benchmark).
    """
    from tqdm import tqdm
    from webdataset import TarWriter

    if not isinstance(profile, Profile):
        profile = Profile.load(profile)
    if samples < 0 or samples_per_shard < 1:
        raise ValueError("samples must be >= 0 and samples_per_shard >= 1")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: list[str] = []
    n_shards = (samples + samples_per_shard - 1) // samples_per_shard
    desc = f"synth {profile.name}{' (mock)' if mock else ''}"
    with tqdm(total=samples, unit="sample", desc=desc, disable=not progress, file=sys.stderr) as bar:
        for s in range(n_shards):
            path = out / f"synth-{s:06d}.tar"
            tmp = out / f".synth-{s:06d}.tar.tmp"
            with open(tmp, "wb") as f, TarWriter(f, encoder=False, mtime=0, user="synth", group="synth") as tw:
                for i in range(s * samples_per_shard, min(samples, (s + 1) * samples_per_shard)):
                    tw.write(_make_sample(i, profile, seed, mock))
                    bar.update(1)
            os.replace(tmp, path)
            paths.append(str(path))
    for stale in out.glob("synth-*.tar"):
        if stale.name[6:12].isdigit() and int(stale.name[6:12]) >= n_shards:
            stale.unlink()
    return paths


# --------------------------------------------------------------------------------------------
# Reading real shards: headers and sizes only
# --------------------------------------------------------------------------------------------

# libjpeg's base luminance table (ITU T.81 Annex K), natural order, which Pillow also uses for
# ``Image.quantization``. Quality q scales it by 5000/q (q < 50) or 200 - 2q.
_STD_LUMA = np.array([
    16, 11, 10, 16, 24, 40, 51, 61, 12, 12, 14, 19, 26, 58, 60, 55,
    14, 13, 16, 24, 40, 57, 69, 56, 14, 17, 22, 29, 51, 87, 80, 62,
    18, 22, 37, 56, 68, 109, 103, 77, 24, 35, 55, 64, 81, 104, 113, 92,
    49, 64, 78, 87, 103, 121, 120, 101, 72, 92, 95, 98, 112, 100, 103, 99], float)
_Q = np.arange(1, 101)
_SCALES = np.where(_Q < 50, 5000.0 / _Q, 200.0 - 2.0 * _Q)
_STD_TABLES = np.clip(np.floor((_STD_LUMA[None, :] * _SCALES[:, None] + 50) / 100), 1, 255)


def estimate_jpeg_quality(im: Image.Image) -> int | None:
    """IJG-equivalent quality of an opened (not decoded) JPEG, from its luminance table.

    Encoders with their own tables (cameras, Photoshop) get the nearest IJG quality.
    """
    tables = getattr(im, "quantization", None)
    if not tables or 0 not in tables:
        return None
    t = np.asarray(list(tables[0]), float)
    if t.size != 64:
        return None
    return int(_Q[np.argmin(np.abs(np.log(_STD_TABLES) - np.log(t)[None, :]).sum(1))])


def _shard_list(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> list[Path]:
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out: list[Path] = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            out += sorted(x for x in p.iterdir() if x.suffix in (".tar", ".tgz", ".gz") and x.is_file())
        elif p.is_file():
            out.append(p)
        else:
            raise FileNotFoundError(p)
    if not out:
        raise ValueError(f"no shards in {paths}")
    return out


def _iter_tar_samples(path: Path) -> Iterator[tuple[str, dict[str, bytes]]]:
    """(key, {extension: bytes}) per sample, WebDataset grouping (key = path up to the first dot
    of the file name). Only image, txt and json members are read; anything else (including
    pickles) is skipped unread."""
    with tarfile.open(path, "r|*") as tf:
        key, members = None, {}
        for m in tf:
            if not m.isfile():
                continue
            d, base = os.path.split(m.name)
            if "." not in base or base.startswith("."):
                continue
            stem, ext = base.split(".", 1)
            k = f"{d}/{stem}" if d else stem
            if k != key:
                if key is not None:
                    yield key, members
                key, members = k, {}
            last = ext.lower().rsplit(".", 1)[-1]
            if last in IMAGE_EXTS or last in ("txt", "json"):
                members[ext.lower()] = tf.extractfile(m).read()
        if key is not None:
            yield key, members


def _image_record(data: bytes) -> dict | None:
    """Header facts of one encoded image. ``Image.open`` parses headers only; nothing is decoded."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            im = Image.open(io.BytesIO(data))
            w, h = im.size
            rec = {"w": w, "h": h, "format": (im.format or "unknown").lower(), "nbytes": len(data),
                   "mode": im.mode, "quality": None, "progressive": False, "subsampling": None}
            if rec["format"] == "jpeg":
                rec["quality"] = estimate_jpeg_quality(im)
                rec["progressive"] = bool(im.info.get("progressive") or im.info.get("progression"))
                rec["subsampling"] = {0: "4:4:4", 1: "4:2:2", 2: "4:2:0"}.get(JpegImagePlugin.get_sampling(im))
            im.close()
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError):
        return None
    if w <= 0 or h <= 0:
        return None
    return rec


def _conversation_words(obj) -> tuple[int, int] | None:
    """(user words, assistant words) of an OpenAI-style ``messages`` or LLaVA-style
    ``conversations`` JSON; None for other JSON (e.g. LAION metadata)."""
    msgs = obj.get("messages", obj.get("conversations")) if isinstance(obj, dict) else obj
    if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
        return None
    q = a = 0
    for m in msgs:
        role = m.get("role", m.get("from"))
        content = m.get("content", m.get("value", ""))
        if isinstance(content, list):
            content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
        if not isinstance(content, str):
            continue
        if role in ("assistant", "gpt", "model", "bot"):
            a += _count_words(content)
        elif role in ("user", "human"):
            q += _count_words(content)
    return q, a


def _scan(shard_paths) -> list[dict]:
    """One record per sample: its images' header facts and its text lengths in words."""
    records = []
    for path in _shard_list(shard_paths):
        for key, members in _iter_tar_samples(path):
            images = []
            for ext in sorted(members):   # "0.jpg" < "1.jpg" < ...: key order
                if ext.rsplit(".", 1)[-1] in IMAGE_EXTS:
                    rec = _image_record(members[ext])
                    if rec is not None:
                        images.append(rec)
            conv = None
            if "json" in members:
                try:
                    conv = _conversation_words(json.loads(members["json"]))
                except (ValueError, UnicodeDecodeError):
                    conv = None
            rec = {"key": key, "images": images, "conversation": conv is not None,
                   "caption_words": None, "question_words": None, "answer_words": None}
            if conv is not None:
                rec["question_words"], rec["answer_words"] = conv
                rec["text_words"] = conv[0] + conv[1]
            elif "txt" in members:
                rec["caption_words"] = _count_words(members["txt"].decode("utf-8", "replace"))
                rec["text_words"] = rec["caption_words"]
            else:
                rec["text_words"] = 0
            if images or rec["text_words"]:
                records.append(rec)
    return records


def image_statistics(shard_paths) -> dict:
    """Summary statistics of shards (files or directories of ``*.tar``), from headers and sizes."""
    recs = _scan(shard_paths)
    imgs = [im for r in recs for im in r["images"]]
    mp = np.array([im["w"] * im["h"] / 1e6 for im in imgs])
    ar = np.array([im["w"] / im["h"] for im in imgs])
    bpp = np.array([im["nbytes"] / (im["w"] * im["h"]) for im in imgs])
    fmts = [im["format"] for im in imgs]
    jpeg = np.array([f == "jpeg" for f in fmts], bool)
    q = [im["quality"] for im in imgs if im["quality"] is not None]

    def m(x):
        return float(np.mean(x)) if len(x) else None

    return {
        "samples": len(recs),
        "images": len(imgs),
        "images_per_sample": m([len(r["images"]) for r in recs]),
        "mean_megapixels": m(mp),
        "median_megapixels": float(np.median(mp)) if len(mp) else None,
        "total_megapixels": float(mp.sum()),
        "mean_aspect": m(ar),
        "median_aspect": float(np.median(ar)) if len(ar) else None,
        "portrait_fraction": m(ar < 1.0),
        "bytes_per_pixel": m(bpp),
        "jpeg_bytes_per_pixel": m(bpp[jpeg]),
        "png_bytes_per_pixel": m(bpp[np.array([f == "png" for f in fmts], bool)]),
        "total_image_bytes": int(sum(im["nbytes"] for im in imgs)),
        "format_mix": {f: fmts.count(f) / len(fmts) for f in sorted(set(fmts))},
        "jpeg_quality": m(q),
        "progressive_fraction": m([im["progressive"] for im in imgs if im["format"] == "jpeg"]),
        "gray_fraction": m([im["mode"] in ("L", "LA", "1", "I", "I;16") for im in imgs]),
        "caption_words": m([r["text_words"] for r in recs]),
        "conversation_fraction": m([r["conversation"] for r in recs]),
    }


def _is_document(im: dict) -> bool:
    # Lossless photos cost 1.5-3 bytes/px; rendered pages and UIs are mostly flat and compress to
    # well under 1. Palette images are graphics.
    return im["format"] != "jpeg" and (im["nbytes"] / (im["w"] * im["h"]) < 1.0 or im["mode"] in ("P", "1"))


def calibrate(shard_paths, name: str = "calibrated") -> Profile:
    """Fit a :class:`Profile` to real shards (headers, sizes and text only).

    Resolution (megapixels), aspect ratio, JPEG quality (from quantisation tables) and JPEG bytes
    per pixel become empirical quantile distributions; images per sample a discrete one; format
    and content mix, progressive, grey and chroma-subsampling fractions are counted. Fields the
    data says nothing about (e.g. no conversations) keep the ``web-photos`` defaults.
    """
    recs = _scan(shard_paths)
    if not recs:
        raise ValueError("no samples found in the given shards")
    d = PROFILES["web-photos"]
    imgs = [im for r in recs for im in r["images"]]
    jpegs = [im for im in imgs if im["format"] == "jpeg"]
    kinds: dict[str, float] = {}
    for im in imgs:
        k = "document/png" if _is_document(im) else ("photo/jpeg" if im["format"] == "jpeg" else "photo/png")
        kinds[k] = kinds.get(k, 0) + 1
    total = sum(kinds.values()) or 1
    sub: dict[str, float] = {}
    for im in jpegs:
        if im["subsampling"]:
            sub[im["subsampling"]] = sub.get(im["subsampling"], 0) + 1
    caps = [r["caption_words"] for r in recs if r["caption_words"] is not None]
    convs = [r for r in recs if r["conversation"]]
    qual = [im["quality"] for im in jpegs if im["quality"] is not None]
    return Profile(
        name=name,
        description=f"calibrated from {len(recs)} samples / {len(imgs)} images",
        megapixels=Dist.fit_quantiles(im["w"] * im["h"] / 1e6 for im in imgs) if imgs else d.megapixels,
        aspect=Dist.fit_quantiles(im["w"] / im["h"] for im in imgs) if imgs else d.aspect,
        jpeg_quality=Dist.fit_quantiles(qual) if qual else d.jpeg_quality,
        jpeg_bpp=Dist.fit_quantiles(im["nbytes"] / (im["w"] * im["h"]) for im in jpegs) if jpegs else None,
        kinds={k: v / total for k, v in sorted(kinds.items())} if imgs else dict(d.kinds),
        images_per_sample=Dist.fit_choice(len(r["images"]) for r in recs),
        caption_words=Dist.fit_quantiles(caps) if caps else d.caption_words,
        conversation_fraction=len(convs) / len(recs),
        question_words=Dist.fit_quantiles(r["question_words"] for r in convs) if convs else d.question_words,
        answer_words=Dist.fit_quantiles(r["answer_words"] for r in convs) if convs else d.answer_words,
        detail=d.detail,
        progressive_fraction=float(np.mean([im["progressive"] for im in jpegs])) if jpegs else 0.0,
        gray_fraction=float(np.mean([im["mode"] in ("L", "LA", "1") for im in imgs])) if imgs else 0.0,
        subsampling={k: v / sum(sub.values()) for k, v in sorted(sub.items())} if sub else {"4:2:0": 1.0},
    )


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------

_REPORT_ROWS = [
    ("samples", "samples", "{:.0f}"),
    ("images", "images", "{:.0f}"),
    ("images/sample", "images_per_sample", "{:.2f}"),
    ("mean MP", "mean_megapixels", "{:.3f}"),
    ("median MP", "median_megapixels", "{:.3f}"),
    ("mean aspect w/h", "mean_aspect", "{:.3f}"),
    ("bytes/px (all)", "bytes_per_pixel", "{:.3f}"),
    ("bytes/px (jpeg)", "jpeg_bytes_per_pixel", "{:.3f}"),
    ("jpeg quality", "jpeg_quality", "{:.1f}"),
    ("caption words", "caption_words", "{:.1f}"),
    ("conversations", "conversation_fraction", "{:.2f}"),
]


def _report(columns: dict[str, dict]) -> str:
    names = list(columns)
    lines = [f"{'':18s}" + "".join(f"{n:>14s}" for n in names)]
    for label, key, fmt in _REPORT_ROWS:
        cells = []
        for n in names:
            v = columns[n].get(key)
            cells.append(f"{fmt.format(v) if v is not None else '-':>14s}")
        lines.append(f"{label:18s}" + "".join(cells))
    mixes = {n: ", ".join(f"{k} {v:.2f}" for k, v in c.get("format_mix", {}).items()) or "-" for n, c in columns.items()}
    lines += [f"format mix {n}: {m}" for n, m in mixes.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m datasvc.synth",
        description="Write realistic synthetic image-text WebDataset shards (or image-free mock ones).")
    ap.add_argument("--out", required=True, help="output directory for synth-NNNNNN.tar")
    ap.add_argument("--samples", type=int, required=True, help="number of samples")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--profile", default=None,
                     help=f"built-in profile ({', '.join(PROFILES)}) or a profile JSON file; default web-photos")
    src.add_argument("--calibrate-from", nargs="+", metavar="SHARD",
                     help="real shards (tar files or directories of them) to fit the profile to")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mock", action="store_true", help="image-free samples with the same text (naive benchmark data)")
    ap.add_argument("--samples-per-shard", type=int, default=128)
    ap.add_argument("--save-profile", metavar="PATH", help="write the profile used (e.g. the fitted one) as JSON")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--no-report", action="store_true", help="skip re-reading the output for the summary table")
    args = ap.parse_args(argv)
    if args.samples < 0 or args.samples_per_shard < 1 or args.seed < 0:
        ap.error("--samples and --seed must be >= 0, --samples-per-shard >= 1")

    columns: dict[str, dict] = {}
    if args.calibrate_from:
        profile = calibrate(args.calibrate_from)
        columns["reference"] = image_statistics(args.calibrate_from)
    else:
        try:
            profile = Profile.load(args.profile or "web-photos")
        except ValueError as e:
            ap.error(str(e))
    if args.save_profile:
        profile.save(args.save_profile)
        print(f"profile saved to {args.save_profile}", file=sys.stderr)

    t0 = time.perf_counter()
    paths = write_shards(args.out, args.samples, profile, seed=args.seed,
                         samples_per_shard=args.samples_per_shard, mock=args.mock,
                         progress=not args.no_progress)
    dt = time.perf_counter() - t0
    size = sum(os.path.getsize(p) for p in paths)
    print(f"wrote {len(paths)} shard(s), {args.samples} samples, {size / 1e6:.1f} MB to {args.out} "
          f"in {dt:.1f} s ({args.samples / max(dt, 1e-9):.1f} samples/s)")
    if not args.no_report and paths:
        columns["mock" if args.mock else "synthetic"] = image_statistics(paths)
        print(_report(columns))
    return 0


if __name__ == "__main__":
    sys.exit(main())
