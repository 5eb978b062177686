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
            # inverse CDF of the normal via the erfinv-free Box-Muller would need two uniforms;
            # a normal draw keeps it simple when no coupling is asked for.
            z = _norm_ppf(u)
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
        return float(np.mean([self.sample(None, ui) for ui in u])) if self.kind == "lognormal" else float(
            np.mean(self._vec(u))
        )

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
        detail=Dist.lognormal(1.0, 0.35, 0.3, 3.0),
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
