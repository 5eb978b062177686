"""Distributions and profiles: what a synthetic data set's images and text look like.

A :class:`Profile` is a set of :class:`Dist` distributions; seven are built in (:data:`PROFILES`)
and ``calibrate`` fits one to real shards. Both round-trip through JSON.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np


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


ENCODERS = {"h264": "libx264", "hevc": "libx265", "vp9": "libvpx-vp9", "vp8": "libvpx", "av1": "libsvtav1",
            "mjpeg": "mjpeg", "mpeg4": "mpeg4"}
"""The FFmpeg encoder that writes each codec ``datasvc.media.video`` reads."""
CONTAINERS = {"mp4": "mp4", "mov": "mov", "webm": "webm", "mkv": "matroska"}
"""Member extension -> the FFmpeg muxer that writes it."""


# What an image is made of and how it is stored. "photo" content is a composed natural scene,
# "document" content is a rendered page or UI screenshot with text.
KINDS = ("photo/jpeg", "photo/png", "document/png", "document/jpeg")


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
    media_per_sample: dict[str, float] | None = None
    """Images and videos of a sample together, as a mix of ``"images+videos"`` (``"1+0"``, ``"0+1"``):
    real sets mix image samples and video samples rather than drawing the two counts apart. None
    (every image-only profile): ``images_per_sample`` and no video."""
    video_formats: dict[str, float] = field(default_factory=lambda: {"vp9/webm": 1.0})  # codec/extension
    video_sizes: dict = field(default_factory=lambda: {"640x360": 1.0})
    """Frame sizes as a mix of ``WxH``, or one such mix per video format (``{"vp9/webm": {...}}``,
    as calibration fits them: a set's MJPEG clips need not share its VP9 clips' sizes)."""
    video_fps: Dist = field(default_factory=lambda: Dist.choice([24, 25, 30], [0.3, 0.2, 0.5]))
    video_seconds: Dist = field(default_factory=lambda: Dist.lognormal(8.0, 0.6, 1.0, 60.0))
    video_bits_per_pixel: Dist | dict = field(default_factory=lambda: Dist.lognormal(0.08, 0.5, 0.01, 1.0))
    """Video stream bits per pixel per frame: with size and fps it gives the bitrate, so a clip of
    another size keeps the data's compression rather than its absolute bitrate. One ``Dist``, or
    one per video format (calibration fits them so: MJPEG spends ten times H.264's bits)."""
    video_gop_seconds: Dist | dict = field(default_factory=lambda: Dist.lognormal(2.0, 0.5, 0.25, 10.0))
    """Seconds between keyframes (a sampled frame costs the decode from its keyframe to it); one
    ``Dist`` or one per video format, as ``video_bits_per_pixel``."""
    turns: Dist = field(default_factory=lambda: Dist.choice([1], [1.0]))
    """Question-answer turns of a conversation; its images and videos come with the first question."""

    _DISTS = ("megapixels", "aspect", "jpeg_quality", "images_per_sample", "caption_words",
              "question_words", "answer_words", "jpeg_bpp", "detail", "video_fps", "video_seconds",
              "video_bits_per_pixel", "video_gop_seconds", "turns")

    def to_dict(self) -> dict:
        d = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, dict) and any(isinstance(x, Dist) for x in v.values()):
                v = {k: x.to_dict() for k, x in v.items()}
            d[f.name] = v.to_dict() if isinstance(v, Dist) else v
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> "Profile":
        kw = dict(d)
        for k in cls._DISTS:
            v = kw.get(k)
            if isinstance(v, dict) and "kind" not in v:  # one Dist per video format
                kw[k] = {fmt: Dist.from_dict(x) for fmt, x in v.items()}
            elif v is not None:
                kw[k] = Dist.from_dict(v)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(kw) - known
        if unknown:
            raise ValueError(f"unknown profile fields: {sorted(unknown)}")
        odd = set(kw.get("kinds", {})) - set(KINDS)
        if odd:
            raise ValueError(f"unknown image kinds {sorted(odd)} in the profile; known: {', '.join(KINDS)}")
        _check_video_formats(kw.get("video_formats", {}))
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


def pick(rng: np.random.Generator, mix: dict[str, float]) -> str:
    """One key of a mix (weights need not sum to 1), by one uniform draw."""
    keys = sorted(mix)
    p = np.array([mix[k] for k in keys], float)
    return keys[min(int(np.searchsorted(np.cumsum(p / p.sum()), rng.random(), side="right")), len(keys) - 1)]


def _check_video_formats(formats: dict) -> None:
    for fmt in formats:
        codec, _, ext = fmt.partition("/")
        if codec not in ENCODERS or ext not in CONTAINERS:
            raise ValueError(f"video format {fmt!r}: need codec/extension with codec in {', '.join(ENCODERS)} "
                             f"and extension in {', '.join(CONTAINERS)}")


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
    # Instruction SFT as LLaVA-1.5's mix (Liu et al., "Improved Baselines with Visual Instruction
    # Tuning", 2023: 665k conversations, mostly over COCO images, whose long side is 640 px) is
    # trained: one photo, a multi-turn conversation with long answers, 1-3k tokens a sample.
    "llava-sft": Profile(
        name="llava-sft",
        description="instruction SFT: one COCO-sized photo, 2-8 question-answer turns, 1-3k tokens",
        megapixels=Dist.lognormal(0.28, 0.15, 0.15, 0.5),
        aspect=Dist.choice([4 / 3, 3 / 4, 3 / 2, 1.0, 16 / 9], [0.5, 0.2, 0.1, 0.1, 0.1]),
        jpeg_quality=Dist.choice([85, 90, 95], [0.4, 0.4, 0.2]),
        kinds={"photo/jpeg": 1.0},
        images_per_sample=Dist.choice([1], [1.0]),
        caption_words=Dist.lognormal(60, 0.5, 10, 300),
        conversation_fraction=1.0,
        question_words=Dist.lognormal(14, 0.5, 3, 80),
        answer_words=Dist.lognormal(140, 0.6, 5, 500),
        turns=Dist.choice([2, 3, 4, 5, 6, 8], [0.2, 0.25, 0.2, 0.15, 0.1, 0.1]),
    ),
    # Interleaved multi-image samples (MMC4 / OBELICS-like documents made conversations, and
    # multi-image instruction data): 4-8 web photos with short text around them.
    "interleaved": Profile(
        name="interleaved",
        description="4-8 web photos a sample, a question over all of them and a paragraph answer",
        megapixels=Dist.lognormal(0.4, 0.5, 0.1, 1.2),
        aspect=Dist.choice([4 / 3, 3 / 2, 16 / 9, 1.0, 3 / 4], [0.3, 0.2, 0.2, 0.15, 0.15]),
        jpeg_quality=Dist.choice([75, 85, 90, 95], [0.2, 0.35, 0.3, 0.15]),
        kinds={"photo/jpeg": 0.9, "photo/png": 0.1},
        images_per_sample=Dist.choice([4, 5, 6, 7, 8], [0.3, 0.25, 0.2, 0.15, 0.1]),
        caption_words=Dist.lognormal(80, 0.6, 10, 400),
        conversation_fraction=0.8,
        question_words=Dist.lognormal(20, 0.5, 5, 80),
        answer_words=Dist.lognormal(90, 0.6, 10, 400),
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
    # Photos and short clips in one stream, as a mixed Qwen3-VL pretraining blend sees them: most
    # samples a web photo, a third a clip of a few seconds (VP9 WebM or H.264 MP4, mostly 360p),
    # some both. Short clips keep a video sample inside one 4k-token row at a 4 MP video cap.
    "image-video-mix": Profile(
        name="image-video-mix",
        description="web photos and 2-20 s clips (VP9/H.264, 360p-720p) in one stream, some samples both",
        megapixels=Dist.lognormal(0.6, 0.55, 0.2, 2.0),
        aspect=Dist.choice([4 / 3, 3 / 2, 16 / 9, 1.0, 3 / 4], [0.3, 0.2, 0.2, 0.15, 0.15]),
        jpeg_quality=Dist.choice([80, 85, 90, 95], [0.25, 0.3, 0.3, 0.15]),
        kinds={"photo/jpeg": 1.0},
        images_per_sample=Dist.choice([1], [1.0]),
        caption_words=Dist.lognormal(20, 0.7, 3, 250),
        conversation_fraction=0.5,
        question_words=Dist.lognormal(10, 0.5, 2, 60),
        answer_words=Dist.lognormal(40, 0.8, 1, 400),
        media_per_sample={"1+0": 0.55, "2+0": 0.05, "0+1": 0.3, "1+1": 0.1},
        video_formats={"vp9/webm": 0.5, "h264/mp4": 0.5},
        video_sizes={"640x360": 0.6, "854x480": 0.3, "1280x720": 0.1},
        video_seconds=Dist.lognormal(6.0, 0.5, 2.0, 20.0),
    ),
    # Short video clips with a question (LLaVA-Video / ShareGPT4Video-like), some with a photo:
    # VP9 WebM and H.264 MP4 at 360p-720p, 24-30 fps, GOPs of a few seconds.
    "video-clips": Profile(
        name="video-clips",
        description="video clips 5-30 s, 360p-720p, VP9/H.264, mostly QA, some with a photo",
        megapixels=Dist.lognormal(0.6, 0.55, 0.2, 2.0),
        aspect=Dist.choice([4 / 3, 16 / 9, 1.0], [0.4, 0.4, 0.2]),
        jpeg_quality=Dist.choice([85, 90], [0.5, 0.5]),
        kinds={"photo/jpeg": 1.0},
        images_per_sample=Dist.choice([0], [1.0]),
        caption_words=Dist.lognormal(30, 0.6, 5, 300),
        conversation_fraction=0.8,
        question_words=Dist.lognormal(10, 0.5, 2, 60),
        answer_words=Dist.lognormal(50, 0.8, 1, 500),
        media_per_sample={"0+1": 0.85, "1+1": 0.1, "0+2": 0.05},
        video_formats={"vp9/webm": 0.5, "h264/mp4": 0.5},
        video_sizes={"640x360": 0.5, "854x480": 0.3, "1280x720": 0.2},
        video_seconds=Dist.lognormal(12.0, 0.5, 5.0, 30.0),
    ),
}
