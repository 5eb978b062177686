"""Samples and shards: each sample drawn from its own random stream, shards written atomically."""
from __future__ import annotations

import functools
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import cv2
import numpy as np

from datasvc.tools.synth.dist import Profile, pick as _pick
from datasvc.tools.synth.documents import _document_image
from datasvc.tools.synth.images import _compose, _encode, _fit_detail, _photo_layers
from datasvc.tools.synth.text import IMAGE_MARKER, _prose, _question
from datasvc.tools.synth.videos import draw_video_spec, render_video

VIDEO_MARKER = "<video>"  # a video's place in a conversation's string content (datasvc.read.formats)


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


def _media_counts(rl: np.random.Generator, profile: Profile) -> tuple[int, int]:
    if profile.media_per_sample is None:  # image-only profiles draw exactly what they always did
        return max(0, int(round(profile.images_per_sample.sample(rl)))), 0
    n_img, n_vid = (int(v) for v in _pick(rl, profile.media_per_sample).split("+"))
    return n_img, n_vid


def spawned_map(fn: Callable, items: Iterable, processes: int) -> Iterator:
    """``fn`` over ``items`` in order, here or in ``processes`` spawned processes (not forked: the
    caller may already hold decoder threads), with a bounded number in flight so memory stays a few
    results per process however many items there are."""
    if processes <= 1:
        yield from map(fn, items)
        return
    import collections
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn")) as pool:
        pending: collections.deque = collections.deque()
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) >= 4 * processes:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def _make_sample(index: int, profile: Profile, seed: int, mock: bool) -> dict:
    """Sample ``index``; its randomness depends only on (seed, index), never on shard layout."""
    s_layout, s_text, s_img, s_vid = np.random.SeedSequence([seed, index]).spawn(4)
    rl = np.random.default_rng(s_layout)
    n_img, n_vid = _media_counts(rl, profile)
    specs = [_draw_image_spec(rl, profile) for _ in range(n_img)]
    vspecs = [draw_video_spec(rl, profile) for _ in range(n_vid)]

    rt = np.random.default_rng(s_text)
    conv = bool(rt.random() < profile.conversation_fraction)
    if conv:
        def turn():
            return (_question(rt, max(1, round(profile.question_words.sample(rt)))),
                    _prose(rt, max(1, round(profile.answer_words.sample(rt)))))

        turns = [turn()]  # drawn before the count, so a one-turn profile's text is as it always was
        turns += [turn() for _ in range(max(1, round(profile.turns.sample(rt))) - 1)]
    else:
        caption = _prose(rt, max(1, round(profile.caption_words.sample(rt))))

    sample: dict = {"__key__": f"{index:08d}"}
    if mock:
        # Same words as the real sample (the text stream does not depend on images), no pixels:
        # exactly what an image-free benchmark feeds.
        sample["txt"] = (" ".join(q + " " + a for q, a in turns) if conv else caption).encode()
        return sample
    for i, (spec, ss) in enumerate(zip(specs, s_img.spawn(n_img))):
        ext = "jpg" if spec.fmt == "jpeg" else "png"
        sample[ext if n_img == 1 else f"{i}.{ext}"] = _render(spec, np.random.default_rng(ss))
    for i, (spec, ss) in enumerate(zip(vspecs, s_vid.spawn(n_vid))):
        sample[spec.ext if n_vid == 1 else f"{i}.{spec.ext}"] = render_video(spec, np.random.default_rng(ss))
    if conv:
        user = "".join(IMAGE_MARKER + "\n" for _ in range(n_img)) + "".join(VIDEO_MARKER + "\n" for _ in range(n_vid))
        msgs = [m for i, (q, a) in enumerate(turns)
                for m in ({"role": "user", "content": (user if i == 0 else "") + q}, {"role": "assistant", "content": a})]
        sample["json"] = json.dumps({"messages": msgs}).encode()
    else:
        sample["txt"] = caption.encode()
    return sample


def write_shards(out_dir: str | os.PathLike, samples: int, profile: Profile | str = "web-photos",
                 seed: int = 0, samples_per_shard: int = 128, mock: bool = False,
                 progress: bool = True, processes: int = 1) -> list[str]:
    """Write ``samples`` samples as ``out_dir/synth-000000.tar``, ...; returns the shard paths.

    Each shard is written to a temporary name and renamed, so a reader never sees half a shard.
    Stale ``synth-*.tar`` from an earlier, larger run in the same directory are removed (they
    would silently mix into a benchmark). ``processes`` > 1 renders samples in that many spawned
    processes (worth it for video: a clip takes seconds to encode); the samples are the same for
    any count, since a sample depends only on (seed, index): byte for byte where the encoder is
    bitexact (not x264, whose rate control varies from run to run).
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
    made = spawned_map(functools.partial(_make_sample, profile=profile, seed=seed, mock=mock), range(samples), processes)
    with tqdm(total=samples, unit="sample", desc=desc, disable=not progress, file=sys.stderr) as bar:
        for s in range(n_shards):
            path = out / f"synth-{s:06d}.tar"
            tmp = out / f".synth-{s:06d}.tar.tmp"
            with open(tmp, "wb") as f, TarWriter(f, encoder=False, mtime=0, user="synth", group="synth") as tw:
                for _ in range(s * samples_per_shard, min(samples, (s + 1) * samples_per_shard)):
                    tw.write(next(made))
                    bar.update(1)
            os.replace(tmp, path)
            paths.append(str(path))
    made.close()
    for stale in out.glob("synth-*.tar"):
        if stale.name[6:12].isdigit() and int(stale.name[6:12]) >= n_shards:
            stale.unlink()
    return paths


def cached_profile_shards(profile: str, samples: int) -> list[str]:
    """``samples`` synthetic samples of ``profile`` (seed 0: the same bytes on every host), written
    once and kept (``datasvc.samples.cached_tars``), for the benches that read one profile's samples."""
    from datasvc.samples import cached_tars

    return cached_tars(f"synth-{profile}-{samples}", lambda d: write_shards(
        d, samples, profile, seed=0, processes=max(1, min(16, os.cpu_count() or 1))))
