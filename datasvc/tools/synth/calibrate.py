"""Reading real shards, headers and sizes only: their statistics, and a profile fitted to them.

Shards are read through ``datasvc.read.shards`` (the service's reader, with its image extensions and
its limits): nothing is decoded, nothing is unpickled.
"""
from __future__ import annotations

import io
import os
import warnings
from typing import Iterable

import numpy as np
from PIL import Image, JpegImagePlugin

from datasvc.read.shards import ReadLimits, expand_shards, index_shard, read_samples
from datasvc.tools.synth.dist import PROFILES, Dist, Profile
from datasvc.tools.synth.text import _count_words
from datasvc.tools.synth.videos import fit_sizes, mean_or_none, video_record

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


def shard_paths(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> list[str]:
    """Shard files from paths, globs, brace patterns or directories (``datasvc.read.shards.expand_shards``)."""
    return expand_shards([str(paths)] if isinstance(paths, (str, os.PathLike)) else [str(p) for p in paths])


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


def _sample_record(raw) -> dict | None:
    """One sample's images' header facts and its text lengths in words (None: nothing to count)."""
    images = [rec for rec in (_image_record(data) for _ext, data in raw.images) if rec is not None]
    videos = []
    for ext, data in raw.videos:
        if (v := video_record(data)) is not None:
            videos.append(dict(v, ext=ext.rsplit(".", 1)[-1]))
    conv = _conversation_words(raw.conversation) if raw.conversation is not None else None
    rec = {"key": raw.key, "images": images, "videos": videos, "conversation": conv is not None,
           "caption_words": None, "question_words": None, "answer_words": None}
    if conv is not None:
        rec["question_words"], rec["answer_words"] = conv
        rec["text_words"] = conv[0] + conv[1]
    elif raw.text is not None:
        rec["caption_words"] = _count_words(raw.text)
        rec["text_words"] = rec["caption_words"]
    else:
        rec["text_words"] = 0
    return rec if images or videos or rec["text_words"] else None


def _scan(paths) -> list[dict]:
    """One record per readable sample, read as the service reads it (``datasvc.read.shards``): only
    image, video, txt and json members are read, anything else (pickles included) is skipped unread, and
    samples the service would reject unread (truncated, oversized, bad text) are left out."""
    records = []
    for path in shard_paths(paths):
        for raw in read_samples(path, index_shard(path).samples, ReadLimits()):
            rec = None if raw.problem else _sample_record(raw)
            if rec is not None:
                records.append(rec)
    return records


def image_statistics(paths) -> dict:
    """Summary statistics of shards (files or directories of ``*.tar``), from headers and sizes."""
    recs = _scan(paths)
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
        **video_statistics(recs),
    }


def video_statistics(recs: list[dict]) -> dict:
    """What the videos of the sample records are: count, length, rate, size, bitrate, codecs."""
    vids = [v for r in recs for v in r["videos"]]
    fmts = [f"{v['codec']}/{v['ext']}" for v in vids]
    return {
        "videos": len(vids),
        "videos_per_sample": mean_or_none(len(r["videos"]) for r in recs),
        "video_samples_fraction": mean_or_none(bool(r["videos"]) for r in recs),
        "video_seconds": mean_or_none(v["seconds"] for v in vids),
        "video_fps": mean_or_none(v["fps"] for v in vids),
        "video_frames": mean_or_none(v["frames"] for v in vids),
        "video_megapixels": mean_or_none(v["w"] * v["h"] / 1e6 for v in vids),
        "video_kbps": mean_or_none(v["bitrate"] / 1e3 for v in vids),
        "video_bits_per_pixel": mean_or_none(v["bits_per_pixel"] for v in vids),
        "video_gop_seconds": mean_or_none(v["gop_seconds"] for v in vids),
        "total_video_bytes": int(sum(v["nbytes"] for v in vids)),
        "video_format_mix": {f: fmts.count(f) / len(fmts) for f in sorted(set(fmts))},
    }


def _is_document(im: dict) -> bool:
    # Lossless photos cost 1.5-3 bytes/px; rendered pages and UIs are mostly flat and compress to
    # well under 1. Palette images are graphics.
    return im["format"] != "jpeg" and (im["nbytes"] / (im["w"] * im["h"]) < 1.0 or im["mode"] in ("P", "1"))


def calibrate(paths, name: str = "calibrated") -> Profile:
    """Fit a :class:`Profile` to real shards (headers, sizes and text only).

    Resolution (megapixels), aspect ratio, JPEG quality (from quantisation tables) and JPEG bytes
    per pixel become empirical quantile distributions; images per sample a discrete one; format
    and content mix, progressive, grey and chroma-subsampling fractions are counted. Fields the
    data says nothing about (e.g. no conversations) keep the ``web-photos`` defaults.
    """
    recs = _scan(paths)
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
    video = _video_fields(recs)
    convs = [r for r in recs if r["conversation"]]
    qual = [im["quality"] for im in jpegs if im["quality"] is not None]
    return Profile(
        name=name,
        description=f"calibrated from {len(recs)} samples / {len(imgs)} images"
                    + (f" / {sum(len(r['videos']) for r in recs)} videos" if video else ""),
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
        **video,
    )


def _video_fields(recs: list[dict]) -> dict:
    """The profile's video fields fitted to the records' videos; none (the defaults, unused) when
    the shards hold no video, so an image set calibrates exactly as before. Size, bits per pixel
    and keyframe interval are fitted per format: they go with the codec (MJPEG spends ten times
    VP9's bits, and a set's MJPEG clips need not share its VP9 clips' sizes)."""
    vids = [v for r in recs for v in r["videos"]]
    if not vids:
        return {}
    media: dict[str, float] = {}
    for r in recs:
        key = f"{len(r['images'])}+{len(r['videos'])}"
        media[key] = media.get(key, 0) + 1 / len(recs)
    by_format: dict[str, list[dict]] = {}
    for v in vids:
        by_format.setdefault(f"{v['codec']}/{v['ext']}", []).append(v)
    by_format = dict(sorted(by_format.items()))
    per_format = lambda key: {f: Dist.fit_quantiles(v[key] for v in vs) for f, vs in by_format.items()}  # noqa: E731
    return {"media_per_sample": dict(sorted(media.items())),
            "video_formats": {f: len(vs) / len(vids) for f, vs in by_format.items()},
            "video_sizes": {f: fit_sizes(vs) for f, vs in by_format.items()},
            "video_fps": Dist.fit_choice(round(v["fps"], 3) for v in vids),
            "video_seconds": Dist.fit_quantiles(v["seconds"] for v in vids),
            "video_bits_per_pixel": per_format("bits_per_pixel"), "video_gop_seconds": per_format("gop_seconds")}


