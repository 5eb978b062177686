"""The benchmarks' photo set: real colour photos from installed wheels at sizes spread over a range,
and JPEGs of synthetic web-photo shards."""
from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
from PIL import Image

from datasvc.samples import cached_tars


@dataclass(frozen=True, slots=True)
class Photo:
    name: str
    data: bytes  # JPEG bytes
    width: int
    height: int

    @property
    def megapixels(self) -> float:
        return self.width * self.height / 1e6


def _colour_photos() -> list[tuple[str, np.ndarray]]:
    """The real colour photographs (3 channels, not grey in disguise) from installed wheels."""
    from datasvc.samples import real_photos

    out = []
    for name, img, _ in real_photos():
        if img.ndim != 3 or img.shape[2] < 3:
            continue
        rgb = img[..., :3]
        spread = np.abs(rgb.astype(np.int16) - rgb.mean(axis=2, keepdims=True).astype(np.int16)).mean()
        if spread < 2.0 or name in ("colorwheel", "logo"):  # grey images or graphics, not photos
            continue
        out.append((name, np.ascontiguousarray(rgb)))
    return out


def photo_set(n: int, seed: int = 0, min_mp: float = 0.3, max_mp: float = 4.0, quality: int = 90) -> list[Photo]:
    """``n`` JPEGs with sizes spread evenly (in log area) over [min_mp, max_mp].

    Each is a real colour photo cropped to a common aspect ratio, resized (Lanczos) to the target
    size, given mild sensor-like noise (sigma 2.5 levels) so upscaled ones keep photo-like entropy
    per pixel instead of turning smooth (which would flatter every decoder), and encoded at q90 4:2:0.
    """
    rng = np.random.default_rng(seed)
    bases = _colour_photos()
    aspects = [4 / 3, 3 / 2, 16 / 9, 1.0, 3 / 4, 2 / 3]
    mps = np.geomspace(min_mp, max_mp, n) if n > 1 else np.array([min_mp])
    rng.shuffle(mps)
    out = []
    for i, mp in enumerate(mps):
        name, img = bases[i % len(bases)]
        aspect = aspects[int(rng.integers(len(aspects)))]  # width / height
        h, w = img.shape[:2]
        # Largest crop of the source with this aspect, then resize to the target area.
        if w / h > aspect:
            cw, ch = int(h * aspect), h
        else:
            cw, ch = w, int(w / aspect)
        x0, y0 = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
        crop = Image.fromarray(img[y0:y0 + ch, x0:x0 + cw])
        tw = max(16, int(round(np.sqrt(mp * 1e6 * aspect))))
        th = max(16, int(round(tw / aspect)))
        arr = np.asarray(crop.resize((tw, th), Image.LANCZOS), dtype=np.float32)
        arr = arr + rng.normal(0.0, 2.5, arr.shape).astype(np.float32)
        arr = np.clip(arr + 0.5, 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, "JPEG", quality=quality, subsampling=2)
        out.append(Photo(f"{name}-{i:03d}", buf.getvalue(), tw, th))
    return out


def synth_photos(n: int, profile: str = "web-photos", seed: int = 1, min_mp: float = 0.3,
                 max_mp: float = 4.0) -> list[Photo]:
    """JPEG images of synthetic ``profile`` shards within [min_mp, max_mp] (cached on disk)."""
    from datasvc.read.shards import ReadLimits, index_shard, read_samples
    from datasvc.tools.synth import write_shards

    if n <= 0:
        return []
    shards = cached_tars(f"bench-{profile}-{n * 2}-s{seed}", lambda out: write_shards(
        out, n * 2, profile=profile, seed=seed, samples_per_shard=256, progress=False))
    photos: list[Photo] = []
    for path in shards:
        for raw in read_samples(path, index_shard(path).samples, ReadLimits()):
            for ext, data in raw.images:
                if ext.rsplit(".", 1)[-1] not in ("jpg", "jpeg"):
                    continue
                im = Image.open(io.BytesIO(data))
                if im.mode != "RGB" or not min_mp <= im.width * im.height / 1e6 <= max_mp:
                    continue
                photos.append(Photo(f"{profile}/{raw.key}", data, im.width, im.height))
                if len(photos) >= n:
                    return photos
    return photos
