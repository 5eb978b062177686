"""Real photographs that ship inside installed wheels, written as WebDataset shards.

These are the embedded default data for the main job and the tests' real input: scikit-image's
sample photos, scikit-learn's and matplotlib's, each with a one-line caption from its loader's
docstring. Nothing is downloaded.
"""
from __future__ import annotations

import io
import json
import os
import shutil
from typing import Callable

import numpy as np
import psutil
from PIL import Image

# (loader, caption); grayscale and RGBA ones exercise the mode conversions.
_SKIMAGE = ["astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field", "retina",
            "immunohistochemistry", "camera", "moon", "coins", "brick", "grass", "gravel",
            "page", "text", "clock", "colorwheel", "logo"]


def real_photos() -> list[tuple[str, np.ndarray, str]]:
    """(name, uint8 image, caption) for every photo available offline."""
    import skimage.data as skd

    out = []
    for name in _SKIMAGE:
        loader = getattr(skd, name)
        img = loader()
        if img.dtype == bool:
            img = img.astype(np.uint8) * 255
        doc = (loader.__doc__ or name).strip().splitlines()[0].strip()
        out.append((name, img, doc))
    try:
        from sklearn.datasets import load_sample_images

        for fname, img in zip(("china", "flower"), load_sample_images().images):
            caption = {"china": "A Chinese temple roof against the sky.", "flower": "A close-up of a flower."}[fname]
            out.append((fname, img, caption))
    except ImportError:
        pass
    import matplotlib.cbook as cbook

    with cbook.get_sample_data("grace_hopper.jpg") as f:
        out.append(("grace_hopper", np.asarray(Image.open(f).convert("RGB")), "Portrait of Rear Admiral Grace Hopper."))
    return out


def encode_image(img: np.ndarray, fmt: str = "jpg", quality: int = 90) -> bytes:
    buf = io.BytesIO()
    pil = Image.fromarray(img)
    if fmt == "png":
        pil.save(buf, "PNG")
    else:
        pil.convert("RGB" if pil.mode not in ("L", "RGB") else pil.mode).save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def crop_variant(img: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A random crop (55-100% of each side) of a real photo, mirrored half the time."""
    h, w = img.shape[:2]
    ch, cw = (max(16, int(s * rng.uniform(0.55, 1.0))) for s in (h, w))
    y, x = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
    out = img[y:y + ch, x:x + cw]
    return np.ascontiguousarray(out[:, ::-1] if rng.random() < 0.5 else out)


def write_photo_shards(out_dir: str, samples_per_shard: int = 6, copies: int = 1,
                       conversations: bool = True, crops: bool = False) -> list[str]:
    """Write shards of real photos: caption samples, plus two-image conversations.

    With ``crops``, every copy after the first is a different random crop of each photo, so a larger
    set has distinct images (sizes and content) instead of repeats.
    """
    import webdataset as wds

    os.makedirs(out_dir, exist_ok=True)
    rng = np.random.default_rng(0)
    originals = real_photos()
    samples = []
    for c in range(copies):
        photos = [(name, crop_variant(img, rng), caption) for name, img, caption in originals] if crops and c \
            else originals
        for name, img, caption in photos:
            fmt = "png" if img.ndim == 3 and img.shape[2] == 4 else "jpg"
            samples.append({"__key__": f"{name}_{c:03d}", fmt: encode_image(img, fmt), "txt": caption})
        if conversations:
            for a, b in zip(photos[0:6:2], photos[1:6:2]):
                convo = {"messages": [
                    {"role": "user", "content": "<image>\n<image>\nWhat is different between these two pictures?"},
                    {"role": "assistant", "content": f"The first shows: {a[2]} The second shows: {b[2]}"}]}
                samples.append({"__key__": f"pair_{a[0]}_{b[0]}_{c:03d}", "0.jpg": encode_image(a[1][..., :3]),
                                "1.jpg": encode_image(b[1][..., :3]), "json": json.dumps(convo).encode()})
    paths = []
    for s in range(0, len(samples), samples_per_shard):
        path = os.path.join(out_dir, f"photos-{s // samples_per_shard:06d}.tar")
        with wds.TarWriter(path) as sink:
            for sample in samples[s:s + samples_per_shard]:
                sink.write(sample)
        paths.append(path)
    return paths


def default_shards() -> list[str]:
    """The bundled real-photo shards (96 samples), written once into the cache directory."""
    return _cached_shards("photos-v1", copies=4)


def large_shards(copies: int = 16) -> list[str]:
    """``copies`` x 24 samples of the same photos, each copy a different crop: for benchmarks whose
    blocks must fill many rows (large MBS)."""
    return _cached_shards(f"photos-v1-crops{copies}", copies=copies, crops=True)


def cache_dir(*parts: str) -> str:
    """A path under the one cache root: ``$VLMFEED_CACHE``, else ``~/.cache/vlmfeed``."""
    root = os.environ.get("VLMFEED_CACHE", os.path.expanduser("~/.cache/vlmfeed"))
    return os.path.join(root, *parts)


def cached_tars(name: str, write: Callable[[str], object]) -> list[str]:
    """The ``*.tar`` files of cache directory ``name``, written by ``write(directory)`` the first
    time, into a temporary directory renamed into place: a run cut short, or two processes at
    once, never leave a half-written set behind."""
    out = cache_dir(name)
    done = os.path.join(out, ".complete")
    _remove_dead_writers(out)
    if not os.path.exists(done):
        tmp = out + f".tmp{os.getpid()}"
        write(tmp)
        if os.path.exists(out):
            shutil.rmtree(out)
        os.replace(tmp, out)
        open(done, "w").close()
    return sorted(os.path.join(out, f) for f in os.listdir(out) if f.endswith(".tar"))


def _remove_dead_writers(out: str) -> None:
    """Delete the temporary directories beside ``out`` whose writing process is gone (killed mid-write)."""
    parent, base = os.path.split(out)
    if not os.path.isdir(parent):
        return
    for entry in os.listdir(parent):
        pid = entry[len(base) + 4:] if entry.startswith(base + ".tmp") else ""
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)


def _cached_shards(name: str, **opts) -> list[str]:
    return cached_tars(name, lambda directory: write_photo_shards(directory, **opts))
