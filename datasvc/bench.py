"""Benchmarks: per-core image decode/preprocess throughput, packing, and the Ray-streamed service.

    python -m datasvc.bench decode  [--images N] [--max-pixels P] [--synth N] [--out results.json]
    python -m datasvc.bench service [--max-actors N] [--samples N] [--out results.json]
    python -m datasvc.bench sizing  [SHARDS ...] [--probe-samples 64 128 256] [--seeds 8]

``decode`` runs every contender on one thread (OpenCV, torch, DALI each pinned to one), on the
same set of realistic JPEG photos (0.3-4 MP, q90, built from the real photographs shipped in
installed wheels), and reports images/s and MP/s (source megapixels) for:

  (a) raw decode only: torchvision.io.decode_jpeg (libjpeg-turbo), PIL, DALI CPU;
  (b) the HF Qwen2-VL image processor at Qwen3-VL settings on PIL images decoded from the bytes
      (decode included), both the torchvision backend and the PIL backend of transformers 5.x;
  (c) our CPU path: ``preprocess_images`` to uint8 pixel rows (what the preprocessing actors do
      and what travels through the object store), and on to the model's float ``pixel_values``
      with ``to_pixel_values`` on the CPU (what a rank without a GPU adds); as a baseline in the
      same run, the actors' work when they also put the rows in patch order (before Session 7).

and a per-stage profile of (c) (probe, decode, resize, then the consumer's patch order and
normalize). It also reports packing efficiency against padding every sample to ``seq_len``.

``service`` measures the Ray-streamed path with 1..N preprocessing actors against the in-process
path (``process_item`` + ``pack`` in one process) on the same synthetic web-photo shards.

``sizing`` measures how far ``plan.size_blocks``' tokens-per-sample estimate strays from the whole
set's mean for each probe size, over several data seeds (default shards: the 384 photo crops the
GPU benchmarks call real-large).

Numbers are wall-clock on whatever machine runs them; nothing here asserts a target.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import platform
import sys
import time
from dataclasses import dataclass

# One thread everywhere: set before numpy/torch/cv2 start their pools.
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

GOAL_VS_DECODE = 0.6
GOAL_VS_HF = 5.0


def _pin_threads() -> None:
    import cv2
    import torch

    cv2.setNumThreads(1)
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set once in this process
        pass


def _cache_root() -> str:
    return os.environ.get("VLMFEED_CACHE", os.path.expanduser("~/.cache/vlmfeed"))


# ------------------------------------------------------------------------------------------------
# The photo set
# ------------------------------------------------------------------------------------------------

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
    from datasvc import synth
    from datasvc.shards import index_shard, read_samples, ReadLimits

    if n <= 0:
        return []
    out_dir = os.path.join(_cache_root(), f"bench-{profile}-{n * 2}-s{seed}")
    done = os.path.join(out_dir, ".complete")
    if not os.path.exists(done):
        synth.write_shards(out_dir, n * 2, profile=profile, seed=seed, samples_per_shard=256, progress=False)
        open(done, "w").close()
    photos: list[Photo] = []
    for path in sorted(os.path.join(out_dir, f) for f in os.listdir(out_dir) if f.endswith(".tar")):
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


# ------------------------------------------------------------------------------------------------
# Contenders
# ------------------------------------------------------------------------------------------------

def _time_passes(fn, photos: list[Photo], repeats: int) -> float:
    """Best wall time of ``repeats`` passes of ``fn`` over all photos (after a warm-up)."""
    fn(photos[:2])
    best = float("inf")
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        fn(photos)
        best = min(best, time.perf_counter() - t0)
    return best


def paired_cpu_ratio(fast, slow, photos: list[Photo], rounds: int = 7) -> dict:
    """Process CPU seconds of ``fast`` and ``slow`` over the photos, alternated for ``rounds`` rounds
    (which goes first alternates too), so load from elsewhere lands on both alike; per-round
    ``slow / fast`` ratios, their median and range."""
    fast(photos[:2])
    slow(photos[:2])
    secs: dict = {fast: [], slow: []}
    for r in range(rounds):
        for fn in ((fast, slow) if r % 2 == 0 else (slow, fast)):
            t0 = time.process_time()
            fn(photos)
            secs[fn].append(time.process_time() - t0)
    ratios = [b / a for a, b in zip(secs[fast], secs[slow])]
    return {"rounds": rounds, "fast_cpu_s_median": round(float(np.median(secs[fast])), 4),
            "slow_cpu_s_median": round(float(np.median(secs[slow])), 4),
            "ratio_median": round(float(np.median(ratios)), 3),
            "ratio_min": round(min(ratios), 3), "ratio_max": round(max(ratios), 3)}


def _torchvision_decode(photos):
    import torch
    from torchvision.io import decode_jpeg

    for p in photos:
        decode_jpeg(torch.frombuffer(bytearray(p.data), dtype=torch.uint8))


def _pil_decode(photos):
    for p in photos:
        im = Image.open(io.BytesIO(p.data))
        im.load()
        np.asarray(im)


class _DaliDecode:
    """DALI CPU decode, one thread, in batches like the service's CpuDecoder does."""

    def __init__(self, batch: int = 16):
        from datasvc.decode import CpuDecoder

        self.decoder = CpuDecoder(num_threads=1, max_batch=batch)
        self.batch = batch

    def __call__(self, photos):
        for i in range(0, len(photos), self.batch):
            self.decoder._dali([p.data for p in photos[i:i + self.batch]])


def hf_processors(spec) -> dict:
    import transformers

    kw = dict(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
              min_pixels=spec.min_pixels, max_pixels=spec.max_pixels)
    procs = {"hf_qwen2vl_torchvision": transformers.Qwen2VLImageProcessor(**kw)}
    pil_cls = getattr(transformers, "Qwen2VLImageProcessorPil", None)
    if pil_cls is not None and pil_cls is not transformers.Qwen2VLImageProcessor:
        procs["hf_qwen2vl_pil"] = pil_cls(**kw)
    return procs


def _hf_run(proc):
    def run(photos):
        for p in photos:
            im = Image.open(io.BytesIO(p.data))
            proc(images=[im], return_tensors="np")
    return run


def _ours(spec, decoder, chunk: int, finish=None):
    """Our path on ``chunk`` images at a time; ``finish(rows, grid)`` runs on each image's rows."""
    from datasvc.process import preprocess_images

    def run(photos):
        for i in range(0, len(photos), chunk):
            for res in preprocess_images([p.data for p in photos[i:i + chunk]], spec, decoder):
                if not isinstance(res, tuple):
                    raise RuntimeError(f"our path rejected a benchmark photo: {res}")
                if finish:
                    finish(*res)
    return run


def _patch_order(rows: np.ndarray, grid, spec) -> np.ndarray:
    from datasvc.vision import patchify

    _, gh, gw = grid
    return patchify(rows.reshape(gh * spec.patch_size, gw * spec.patch_size, 3), spec)


def profile_ours(photos: list[Photo], spec, decoder) -> dict:
    """Seconds per stage of our CPU path, summed over the photos (one pass, after a warm-up): the
    actors' probe, decode and resize, then ``to_pixel_values`` (patch order and normalize)."""
    from datasvc.decode import DecodeJob, probe, resize_uint8
    from datasvc.vision import pixel_rows, to_pixel_values

    secs = dict(probe=0.0, decode=0.0, resize=0.0, to_pixel_values=0.0)
    chunk = 16
    for timed, subset in ((False, photos[:2]), (True, photos)):
        for i in range(0, len(subset), chunk):
            part = subset[i:i + chunk]
            t0 = time.perf_counter()
            jobs = []
            for p in part:
                h = probe(p.data, spec.max_decode_pixels)
                jobs.append(DecodeJob(p.data, h, spec.target_size(h.height, h.width)))
            t1 = time.perf_counter()
            full = decoder._dali([j.data for j in jobs])
            t2 = time.perf_counter()
            rows = [pixel_rows(resize_uint8(img, j.target_hw), spec) for img, j in zip(full, jobs)]
            t3 = time.perf_counter()
            for r, j in zip(rows, jobs):
                to_pixel_values(r, spec, [j.grid(spec)])
            t4 = time.perf_counter()
            if timed:
                for k, dt in zip(secs, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                    secs[k] += dt
    total = sum(secs.values())
    return {k: {"seconds": round(v, 4), "share": round(v / total, 3) if total else 0.0} for k, v in secs.items()}


def _resize_stats(photos: list[Photo], spec) -> dict:
    up = down = same = 0
    for p in photos:
        th, tw = spec.target_size(p.height, p.width)
        if (th, tw) == (p.height, p.width):
            same += 1
        elif th * tw > p.height * p.width:
            up += 1
        else:
            down += 1
    return {"upscaled": up, "downscaled": down, "unchanged": same}


# ------------------------------------------------------------------------------------------------
# Packing efficiency
# ------------------------------------------------------------------------------------------------

def encoded_from_headers(shards: list[str], pipeline) -> tuple[list, dict]:
    """EncodedSamples with exact token rows, grids from the headers (no pixels: packing needs
    only lengths and patch counts, so patches are zero-width arrays of the right row count)."""
    from datasvc.batch import EncodedSample
    from datasvc.process import encode_from_headers
    from datasvc.rejects import Accounting
    from datasvc.shards import ReadLimits, index_shard, read_samples
    from datasvc.text import SampleRejected
    from datasvc.vision import ImageRejected

    acct = Accounting()
    out = []
    for path in shards:
        for raw in read_samples(path, index_shard(path).samples, ReadLimits()):
            acct.read += 1
            try:
                ids, labels, grids = encode_from_headers(raw, pipeline)
            except (ImageRejected, SampleRejected) as exc:
                acct.reject(raw.shard, raw.key, exc.reason, exc.detail)
                continue
            n_patches = sum(t * h * w for t, h, w in grids)
            out.append(EncodedSample(raw.key, raw.shard, ids, labels, np.zeros((n_patches, 0), np.uint8),
                                     np.asarray(grids, np.int64).reshape(-1, 3)))
    return out, acct.as_dict()


def packing_report(samples: list, seq_lens=(4096, 8192), micro_batch_size: int = 1, pad_id: int = 0) -> dict:
    from datasvc.packing import PackingConfig, pack, padding_efficiency

    report = {}
    lengths = np.array([s.num_tokens for s in samples])
    for seq_len in seq_lens:
        batches, too_long = pack(samples, PackingConfig(seq_len=seq_len, micro_batch_size=micro_batch_size,
                                                        pad_id=pad_id), 0)
        real = sum(b.real_tokens for b in batches)
        rows = sum(b.tokens.shape[0] for b in batches)
        report[str(seq_len)] = {
            "samples": len(samples), "too_long": len(too_long),
            "rows_packed": rows, "rows_padded": len(samples) - len(too_long),
            "packing_efficiency": round(real / max(1, rows * seq_len), 4),
            "padding_efficiency": round(padding_efficiency(samples, seq_len), 4),
        }
        report[str(seq_len)]["row_reduction"] = round(
            report[str(seq_len)]["rows_padded"] / max(1, rows), 2)
    report["tokens_per_sample"] = {"mean": float(lengths.mean()) if len(lengths) else 0.0,
                                   "p50": float(np.median(lengths)) if len(lengths) else 0.0,
                                   "max": int(lengths.max()) if len(lengths) else 0}
    return report


def packing_bench(synth_samples: int, max_pixels: int, seq_lens=(4096, 8192), tmp: str | None = None,
                  photo_copies: int = 2) -> dict:
    """Packing of the real-photo shards plus synthetic web-photo captions/conversations."""
    import tempfile

    from datasvc import synth
    from datasvc.registry import get_pipeline
    from datasvc.samples import write_photo_shards

    pipeline = get_pipeline("qwen3vl", max_pixels=max_pixels)
    with tempfile.TemporaryDirectory(dir=tmp) as d:
        shards = write_photo_shards(os.path.join(d, "photos"), samples_per_shard=32, copies=photo_copies)
        if synth_samples > 0:
            shards += synth.write_shards(os.path.join(d, "synth"), synth_samples, profile="web-photos", seed=3,
                                         samples_per_shard=256, progress=False)
        samples, acct = encoded_from_headers(shards, pipeline)
    rep = packing_report(samples, seq_lens, pad_id=pipeline.pad_id)
    rep["accounting"] = acct
    rep["max_pixels"] = max_pixels
    rep["sources"] = {"photo_shard_samples": acct["read"] - synth_samples, "synth_web_photos_samples": synth_samples}
    return rep


# ------------------------------------------------------------------------------------------------
# decode subcommand
# ------------------------------------------------------------------------------------------------

def bench_decode(images: int = 40, max_pixels: int = 16777216, min_pixels: int = 65536, synth: int = 0,
                 repeats: int = 2, pack_synth: int = 200, skip_hf_pil: bool = False, seed: int = 0,
                 mp_range: tuple[float, float] = (0.3, 4.0), pack_copies: int = 2) -> dict:
    _pin_threads()
    from datasvc.decode import CpuDecoder
    from datasvc.vision import VisionSpec, to_pixel_values

    spec = VisionSpec(min_pixels=min_pixels, max_pixels=max_pixels)
    t0 = time.perf_counter()
    photos = photo_set(images, seed=seed, min_mp=mp_range[0], max_mp=mp_range[1]) + \
        synth_photos(synth, min_mp=mp_range[0], max_mp=mp_range[1])
    build_s = time.perf_counter() - t0
    mp_total = sum(p.megapixels for p in photos)
    decoder = CpuDecoder(num_threads=1)

    runs: dict[str, tuple[str, object]] = {
        "torchvision_decode_jpeg": ("a", _torchvision_decode),
        "pil_decode": ("a", _pil_decode),
        "dali_cpu_decode": ("a", _DaliDecode()),
    }
    for name, proc in hf_processors(spec).items():
        if skip_hf_pil and name == "hf_qwen2vl_pil":
            continue
        runs[name] = ("b", _hf_run(proc))
    runs["ours_pixel_values"] = ("c", _ours(spec, decoder, 16, lambda rows, grid: to_pixel_values(rows, spec, [grid])))
    runs["ours_uint8_pixel_rows"] = ("c", _ours(spec, decoder, 16))
    runs["baseline_uint8_patch_order"] = ("c-", _ours(spec, decoder, 16, lambda rows, grid: _patch_order(rows, grid, spec)))

    results = {}
    for name, (group, fn) in runs.items():
        # The slow HF PIL processor gets one pass; the rest the best of ``repeats``.
        secs = _time_passes(fn, photos, 1 if name == "hf_qwen2vl_pil" else repeats)
        results[name] = {"group": group, "seconds": round(secs, 4),
                         "images_per_s": round(len(photos) / secs, 2), "mp_per_s": round(mp_total / secs, 2)}

    fastest_a = max((k for k, v in results.items() if v["group"] == "a"), key=lambda k: results[k]["images_per_s"])
    fastest_b = max((k for k, v in results.items() if v["group"] == "b"), key=lambda k: results[k]["images_per_s"])
    ratios = {}
    for c in ("ours_pixel_values", "ours_uint8_pixel_rows", "baseline_uint8_patch_order"):
        rc = results[c]["images_per_s"]
        ratios[c] = {
            "vs_fastest_decode": round(rc / results[fastest_a]["images_per_s"], 3),
            "vs_fastest_hf": round(rc / results[fastest_b]["images_per_s"], 3),
            **({"vs_hf_pil": round(rc / results["hf_qwen2vl_pil"]["images_per_s"], 2)}
               if "hf_qwen2vl_pil" in results else {}),
        }
    goals = {
        "vs_fastest_decode": GOAL_VS_DECODE, "vs_fastest_hf": GOAL_VS_HF,
        "met_vs_decode": ratios["ours_pixel_values"]["vs_fastest_decode"] >= GOAL_VS_DECODE,
        "met_vs_hf": ratios["ours_pixel_values"]["vs_fastest_hf"] >= GOAL_VS_HF,
    }
    prof = profile_ours(photos, spec, decoder)
    actors = paired_cpu_ratio(runs["ours_uint8_pixel_rows"][1], runs["baseline_uint8_patch_order"][1], photos)
    packing = packing_bench(pack_synth, max_pixels, photo_copies=pack_copies) if pack_synth >= 0 else {}
    mps = [p.megapixels for p in photos]
    return {
        "kind": "decode",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_avg_at_start": list(os.getloadavg())},
        "threads": 1,
        "vision": {"min_pixels": spec.min_pixels, "max_pixels": spec.max_pixels},
        "photos": {"count": len(photos), "from_real": images, "from_synth": len(photos) - images,
                   "megapixels_total": round(mp_total, 3), "megapixels_min": round(min(mps), 3),
                   "megapixels_mean": round(float(np.mean(mps)), 3), "megapixels_max": round(max(mps), 3),
                   "bytes_per_pixel": round(sum(len(p.data) for p in photos) / (mp_total * 1e6), 4),
                   "resize": _resize_stats(photos, spec), "build_seconds": round(build_s, 2)},
        "results": results,
        "fastest_decode": fastest_a,
        "fastest_hf": fastest_b,
        "ratios": ratios,
        "goals": goals,
        "profile_ours": prof,
        "actors_patch_order_over_pixel_rows": actors,
        "packing": packing,
    }


def plot_decode(rep: dict, path: str) -> None:
    """Images/s per contender against the goals, and where our path's time goes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"a": "tab:gray", "b": "tab:orange", "c": "tab:green", "c-": "tab:olive"}
    names = list(rep["results"])
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [2.2, 1]})
    ax.barh(names, [rep["results"][n]["images_per_s"] for n in names],
            color=[colours.get(rep["results"][n]["group"], "tab:blue") for n in names])
    ax.invert_yaxis()
    goals = rep["goals"]
    fastest_a = rep["results"][rep["fastest_decode"]]["images_per_s"]
    fastest_b = rep["results"][rep["fastest_hf"]]["images_per_s"]
    ax.axvline(goals["vs_fastest_decode"] * fastest_a, ls="--", c="k", lw=1,
               label=f"goal: {goals['vs_fastest_decode']}x fastest decode")
    ax.axvline(goals["vs_fastest_hf"] * fastest_b, ls=":", c="tab:red", lw=1,
               label=f"goal: {goals['vs_fastest_hf']:g}x fastest HF")
    ax.set_xlabel("images/s, one core")
    ax.set_title(f"{rep['photos']['count']} JPEGs, {rep['photos']['megapixels_min']}-"
                 f"{rep['photos']['megapixels_max']} MP: (a) decode, (b) HF, (c) ours", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    prof = rep["profile_ours"]
    left = 0.0
    for stage, v in prof.items():
        bx.barh(["ours to\npixel_values"], [v["seconds"]], left=left, label=stage)
        left += v["seconds"]
    bx.set_xlabel("seconds for all images, one core")
    bx.set_title("our path by stage (the rank does to_pixel_values)", fontsize=10)
    bx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_decode(rep: dict) -> None:
    ph = rep["photos"]
    print(f"\n{ph['count']} JPEG photos, {ph['megapixels_min']}-{ph['megapixels_max']} MP "
          f"(mean {ph['megapixels_mean']}), {ph['bytes_per_pixel']} B/px; one thread each; "
          f"max_pixels={rep['vision']['max_pixels']} (resize: {ph['resize']})")
    print(f"{'':3} {'method':28} {'img/s':>9} {'MP/s':>9} {'x fastest(a)':>13} {'ours(c) / this':>15}")
    fa = rep["results"][rep["fastest_decode"]]["images_per_s"]
    ours = rep["results"]["ours_pixel_values"]["images_per_s"]
    for name, r in rep["results"].items():
        print(f"({r['group']}) {name:28} {r['images_per_s']:9.2f} {r['mp_per_s']:9.1f} "
              f"{r['images_per_s'] / fa:13.3f} {ours / r['images_per_s']:15.2f}")
    g = rep["goals"]
    for c, rr in rep["ratios"].items():
        print(f"{c}: {rr['vs_fastest_decode']:.3f}x fastest decode ({rep['fastest_decode']}, goal >= "
              f"{g['vs_fastest_decode']}), {rr['vs_fastest_hf']:.2f}x fastest HF ({rep['fastest_hf']}, goal >= "
              f"{g['vs_fastest_hf']})" + (f", {rr['vs_hf_pil']:.1f}x HF PIL" if "vs_hf_pil" in rr else ""))
    print("profile of ours (pixel_values), share of time: " +
          ", ".join(f"{k} {v['share'] * 100:.0f}% ({v['seconds']:.3f}s)" for k, v in rep["profile_ours"].items()
              if "share" in v))
    a = rep["actors_patch_order_over_pixel_rows"]
    print(f"the actors' CPU time per image, patch order in the actor over pixel rows: {a['ratio_median']:.2f}x "
          f"(median of {a['rounds']} alternated rounds, range {a['ratio_min']:.2f}-{a['ratio_max']:.2f})")
    pk = rep.get("packing") or {}
    if pk:
        print(f"\npacking ({pk['sources']}, max_pixels={pk['max_pixels']}, "
              f"tokens/sample mean {pk['tokens_per_sample']['mean']:.0f}, max {pk['tokens_per_sample']['max']}):")
        print(f"  {'seq_len':>8} {'packed eff':>11} {'padded eff':>11} {'rows packed':>12} {'rows padded':>12} {'too long':>9}")
        for k, v in pk.items():
            if k.isdigit():
                print(f"  {k:>8} {v['packing_efficiency']:11.3f} {v['padding_efficiency']:11.3f} "
                      f"{v['rows_packed']:12d} {v['rows_padded']:12d} {v['too_long']:9d}")


# ------------------------------------------------------------------------------------------------
# service subcommand
# ------------------------------------------------------------------------------------------------

def service_shards(samples: int, seed: int = 0, samples_per_shard: int = 50) -> list[str]:
    from datasvc import synth

    out_dir = os.path.join(_cache_root(), f"bench-service-web-photos-{samples}-s{seed}-p{samples_per_shard}")
    done = os.path.join(out_dir, ".complete")
    if not os.path.exists(done):
        synth.write_shards(out_dir, samples, profile="web-photos", seed=seed, samples_per_shard=samples_per_shard,
                           progress=False)
        open(done, "w").close()
    return sorted(os.path.join(out_dir, f) for f in os.listdir(out_dir) if f.endswith(".tar"))


def _service_config(shards, actors: int, seq_len: int, max_pixels: int, samples_per_item: int, epochs: int = 1):
    from datasvc.config import ServiceConfig

    return ServiceConfig(shards=tuple(shards), seq_len=seq_len, micro_batch_size=1, epochs=epochs, seed=0,
                         samples_per_item=samples_per_item, items_per_block=2, decode="cpu", decode_threads=1,
                         min_actors=actors, max_actors=actors, autoscale_interval_s=3600.0,
                         max_batches_ahead=8, prefetch=2, pipeline_options={"max_pixels": max_pixels})


def run_in_process(cfg, max_items: int | None = None) -> dict:
    """The same work as the service (same plan, items, decode, packing), in this one process."""
    from datasvc.decode import make_decoder
    from datasvc.plan import EpochPlan
    from datasvc.process import process_item
    from datasvc.registry import get_pipeline
    from datasvc.shards import ReadLimits

    pipeline = get_pipeline(cfg.pipeline, **cfg.pipeline_options)
    decoder = make_decoder(cfg.decode, num_threads=cfg.decode_threads)
    limits = ReadLimits(max_images_per_sample=cfg.max_images_per_sample, max_text_bytes=cfg.max_text_bytes)
    plan = EpochPlan(cfg)
    samples = images = batches = 0
    mp = 0.0
    t0 = time.perf_counter()
    for rank in range(cfg.dp_size):
        for b, items in enumerate(plan.blocks(0, rank)):
            if max_items is not None:
                items = items[:max_items]
                max_items -= len(items)
                if not items:
                    break
            encoded = []
            for item in items:
                res = process_item(item, pipeline, decoder, limits)
                encoded.extend(res.samples)
                images += res.images
                mp += res.megapixels
            packed = plan.pack_block(encoded, 0, rank, b, pipeline.pad_id, pipeline.vision.patch_dim)[0]
            batches += len(packed)
            samples += sum(len(p.sample_keys) for p in packed)
    secs = time.perf_counter() - t0
    return {"seconds": round(secs, 3), "samples": samples, "images": images, "megapixels": round(mp, 2),
            "micro_batches": batches, "samples_per_s": round(samples / secs, 2),
            "images_per_s": round(images / secs, 2), "mp_per_s": round(mp / secs, 2)}


def run_service(cfg, run: str, skip: float = 0.25) -> dict:
    """Drain one epoch through Ray; rates over the whole run and from the first micro-batch on."""
    from datasvc.service import DataService, EndOfData

    t_start = time.perf_counter()
    svc = DataService(cfg, run=run)
    try:
        client = svc.client(0, output="numpy")
        n_samples, stamps = [], []
        while True:
            try:
                b = next(client)
            except EndOfData:
                break
            stamps.append(time.perf_counter())
            n_samples.append(len(b.sample_keys))
        t_end = time.perf_counter()
        stats = svc.stats()["ranks"][0]
    finally:
        svc.shutdown()
    total = t_end - t_start
    samples = sum(n_samples)
    images, mp = stats["images"], stats["megapixels"]
    # Steady state: actor start-up and the first blocks are excluded. Micro-batches come in bursts
    # (a block is packed at once), so the window opens at the end of a burst once ``skip`` of the
    # samples were delivered, and counts only what was delivered after that, up to the last one.
    i0 = 0
    if len(stamps) > 2:
        cum = np.cumsum(n_samples)
        gaps = np.diff(stamps)
        mean_gap = float(gaps.mean())
        cands = [i for i in range(len(stamps) - 1) if cum[i] >= skip * samples and gaps[i] > 0.5 * mean_gap]
        i0 = cands[0] if cands else 0
    if len(stamps) > 1 and stamps[-1] > stamps[i0]:
        steady_s, steady_samples = stamps[-1] - stamps[i0], samples - int(np.sum(n_samples[:i0 + 1]))
    else:  # too few micro-batches for a steady state: use the whole run
        steady_s, steady_samples = total, samples
    frac = steady_samples / max(1, samples)
    return {"seconds": round(total, 3), "startup_s": round(stamps[0] - t_start, 3) if stamps else None,
            "samples": samples, "images": images, "megapixels": round(mp, 2), "micro_batches": len(stamps),
            "samples_per_s": round(samples / total, 2), "images_per_s": round(images / total, 2),
            "mp_per_s": round(mp / total, 2), "steady_window_s": round(steady_s, 3),
            "steady_window_samples": steady_samples,
            "steady_samples_per_s": round(steady_samples / max(1e-9, steady_s), 2),
            "steady_images_per_s": round(images * frac / max(1e-9, steady_s), 2),
            "steady_mp_per_s": round(mp * frac / max(1e-9, steady_s), 2),
            "consumer_wait_s": stats["consumer_wait_s"], "producer_blocked_s": stats["producer_blocked_s"],
            "stages": stats["stages"], "accounting": stats["accounting"],
            "packing_efficiency": stats["packing_efficiency"]}


def bench_service(max_actors: int | None = None, samples: int = 200, seq_len: int = 4096,
                  max_pixels: int = 16777216, samples_per_item: int = 8, shards: list[str] | None = None,
                  epochs: int = 2) -> dict:
    import ray

    from datasvc.cluster import connect

    cpus = os.cpu_count() or 1
    max_actors = max_actors or cpus
    shards = shards or service_shards(samples)
    counts = []
    n = 1
    while n < max_actors:
        counts.append(n)
        n *= 2
    counts.append(max_actors)
    cfg1 = _service_config(shards, 1, seq_len, max_pixels, samples_per_item)
    run_in_process(cfg1, max_items=1)  # warm up (imports, DALI, page cache) outside the timed run
    in_proc = run_in_process(cfg1)
    started_ray = not ray.is_initialized()
    connect(num_cpus=cpus, object_store_memory=512 * 1024 * 1024)
    by_actors = {}
    try:
        for n in counts:
            by_actors[str(n)] = run_service(_service_config(shards, n, seq_len, max_pixels, samples_per_item, epochs),
                                            run=f"bench{n}-{os.getpid()}")
    finally:
        if started_ray:
            ray.shutdown()
    r1 = by_actors["1"]["steady_samples_per_s"]
    for n, r in by_actors.items():
        r["scaling_efficiency"] = round(r["steady_samples_per_s"] / max(1e-9, int(n) * r1), 3)
    return {
        "kind": "service",
        "machine": {"platform": platform.platform(), "cpus": cpus, "load_avg_at_start": list(os.getloadavg())},
        "shards": {"count": len(shards), "samples": samples, "profile": "web-photos", "paths": shards},
        "config": {"epochs_streamed": epochs, "steady_state": "after 25% of samples, to the last micro-batch",
                   "seq_len": seq_len, "micro_batch_size": 1, "max_pixels": max_pixels,
                   "samples_per_item": samples_per_item, "decode": "cpu", "decode_threads": 1},
        "in_process": in_proc,
        "ray": by_actors,
        "ray_vs_in_process_1_actor": round(r1 / max(1e-9, in_proc["samples_per_s"]), 3),
        "ray_vs_in_process_1_actor_total": round(by_actors["1"]["samples_per_s"] / max(1e-9, in_proc["samples_per_s"]), 3),
        "goal_ray_vs_in_process": 0.9,
    }


def print_service(rep: dict) -> None:
    ip = rep["in_process"]
    print(f"\n{rep['shards']['samples']} synthetic web-photo samples ({rep['config']['epochs_streamed']} epochs "
          f"streamed; steady state {rep['config']['steady_state']}), {rep['machine']['cpus']} CPUs, "
          f"seq_len {rep['config']['seq_len']}, max_pixels {rep['config']['max_pixels']}")
    print(f"{'path':16} {'samples/s':>10} {'images/s':>9} {'MP/s':>7} {'total s':>8} {'startup s':>10} "
          f"{'scaling':>8} {'wait s':>7}")
    print(f"{'in-process':16} {ip['samples_per_s']:10.2f} {ip['images_per_s']:9.2f} {ip['mp_per_s']:7.2f} "
          f"{ip['seconds']:8.2f} {'-':>10} {'-':>8} {'-':>7}")
    for n, r in rep["ray"].items():
        print(f"{'ray ' + n + ' actor(s)':16} {r['steady_samples_per_s']:10.2f} {r['steady_images_per_s']:9.2f} "
              f"{r['steady_mp_per_s']:7.2f} {r['seconds']:8.2f} {r['startup_s']:10.2f} "
              f"{r['scaling_efficiency']:8.3f} {r['consumer_wait_s']:7.2f}")
    print(f"ray (1 actor, steady state) / in-process: {rep['ray_vs_in_process_1_actor']:.3f} "
          f"(goal >= {rep['goal_ray_vs_in_process']}); including actor startup: "
          f"{rep['ray_vs_in_process_1_actor_total']:.3f}")


# ------------------------------------------------------------------------------------------------

def bench_sizing(shards: list[str], probe_samples=(64, 128, 256), seeds: int = 8, max_pixels: int = 1048576,
                 seq_len: int = 4096, micro_batch_size: int = 8) -> dict:
    """Per probe size: ``size_blocks``' tokens-per-sample estimate against the mean over every sample
    (both from headers, nothing decoded), over ``seeds`` data seeds, and the seconds a probe takes."""
    import dataclasses

    from datasvc.config import ServiceConfig
    from datasvc.plan import sample_token_counts, size_blocks
    from datasvc.shards import expand_shards, index_shard

    paths = expand_shards(list(shards))
    cfg = ServiceConfig(shards=tuple(paths), pipeline="qwen3vl", pipeline_options={"max_pixels": max_pixels},
                        seq_len=seq_len, micro_batch_size=micro_batch_size)
    lengths = sample_token_counts(cfg, [index_shard(p) for p in paths])
    full = float(np.mean(lengths))
    rows = []
    for n in probe_samples:
        estimates, items, seconds = [], [], []
        for seed in range(seeds):
            t0 = time.perf_counter()
            sized, sizing = size_blocks(dataclasses.replace(cfg, seed=seed), probe_samples=n)
            seconds.append(time.perf_counter() - t0)
            estimates.append(sizing.tokens_per_sample)
            items.append(sized.items_per_block)
        errors = [e / full - 1 for e in estimates]
        rows.append({"probe_samples": n, "probed": sizing.probed_samples, "estimates": estimates,
                     "rel_sd": float(np.std(errors)), "worst_rel_error": float(max(map(abs, errors))),
                     "items_per_block": [min(items), max(items)], "seconds_median": float(np.median(seconds))})
    return {"shards": len(paths), "samples": len(lengths), "full_mean_tokens": full,
            "seeds": seeds, "micro_batch_size": micro_batch_size, "seq_len": seq_len, "max_pixels": max_pixels,
            "rows": rows}


def print_sizing(rep: dict) -> None:
    print(f"\nblock sizing probe: {rep['samples']} samples in {rep['shards']} shards, mean "
          f"{rep['full_mean_tokens']:.1f} tokens a sample, {rep['seeds']} seeds, MBS {rep['micro_batch_size']}")
    print(f"{'probe':>6} {'read':>5} {'s.d.':>7} {'worst':>7} {'items/block':>12} {'s':>6}")
    for r in rep["rows"]:
        lo, hi = r["items_per_block"]
        print(f"{r['probe_samples']:>6} {r['probed']:>5} {100 * r['rel_sd']:>6.1f}% {100 * r['worst_rel_error']:>6.1f}% "
              f"{f'{lo}-{hi}':>12} {r['seconds_median']:>6.2f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m datasvc.bench", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("decode", help="per-core decode / preprocess throughput, and packing efficiency")
    d.add_argument("--images", type=int, default=40, help="real-photo JPEGs to build (0.3-4 MP)")
    d.add_argument("--synth", type=int, default=0, help="also this many synthetic web-photos JPEGs")
    d.add_argument("--max-pixels", type=int, default=16777216)
    d.add_argument("--mp-range", type=float, nargs=2, default=(0.3, 4.0), metavar=("MIN", "MAX"),
                   help="megapixel range of the photo set")
    d.add_argument("--min-pixels", type=int, default=65536)
    d.add_argument("--repeats", type=int, default=2, help="passes per contender (best is kept)")
    d.add_argument("--pack-synth", type=int, default=200,
                   help="synthetic web-photo samples added to the photo shards for packing (-1: no packing)")
    d.add_argument("--pack-copies", type=int, default=2, help="copies of the real-photo shards for packing")
    d.add_argument("--skip-hf-pil", action="store_true", help="skip the slow PIL-backend HF processor")
    d.add_argument("--out", default="bench-decode.json", help="JSON; a PNG of the same name goes beside it")
    s = sub.add_parser("service", help="Ray-streamed throughput vs actors, and vs in-process")
    s.add_argument("--max-actors", type=int, default=None, help="default: the CPU count")
    s.add_argument("--samples", type=int, default=200)
    s.add_argument("--seq-len", type=int, default=4096)
    s.add_argument("--max-pixels", type=int, default=16777216)
    s.add_argument("--samples-per-item", type=int, default=8)
    s.add_argument("--epochs", type=int, default=2, help="epochs streamed per actor count (steady state)")
    s.add_argument("--out", default="bench-service.json")
    k = sub.add_parser("soak", help="stream good and hostile shards for N minutes while killing actors")
    k.add_argument("--minutes", type=float, default=10.0)
    k.add_argument("--kill-every", type=float, default=20.0, help="seconds between injected faults")
    k.add_argument("--out", default="bench-soak.json")
    z = sub.add_parser("sizing", help="how close block sizing's tokens-per-sample estimate comes, per probe size")
    z.add_argument("shards", nargs="*", help="default: the real-large photo crops")
    z.add_argument("--probe-samples", type=int, nargs="+", default=[64, 128, 256])
    z.add_argument("--seeds", type=int, default=8)
    z.add_argument("--mbs", type=int, default=8)
    z.add_argument("--max-pixels", type=int, default=1048576)
    z.add_argument("--out", default="bench-sizing.json")
    args = ap.parse_args(argv)

    if args.cmd == "soak":
        from datasvc.soak import soak

        rep = soak(args.minutes, out=args.out, kill_every_s=args.kill_every)
        return 0 if rep["samples_lost"] == 0 and rep["samples_duplicated"] == 0 else 1

    if args.cmd == "sizing":
        from datasvc.samples import large_shards

        rep = bench_sizing(args.shards or large_shards(), tuple(args.probe_samples), args.seeds, args.max_pixels,
                           micro_batch_size=args.mbs)
        print_sizing(rep)
    elif args.cmd == "decode":
        rep = bench_decode(images=args.images, max_pixels=args.max_pixels, min_pixels=args.min_pixels,
                           synth=args.synth, repeats=args.repeats, pack_synth=args.pack_synth,
                           skip_hf_pil=args.skip_hf_pil, mp_range=tuple(args.mp_range), pack_copies=args.pack_copies)
        print_decode(rep)
        plot_decode(rep, os.path.splitext(args.out)[0] + ".png")
        print(f"wrote {os.path.splitext(args.out)[0]}.png")
    else:
        rep = bench_service(max_actors=args.max_actors, samples=args.samples, seq_len=args.seq_len,
                            max_pixels=args.max_pixels, samples_per_item=args.samples_per_item,
                            epochs=args.epochs)
        print_service(rep)
    with open(args.out, "w") as f:
        json.dump(rep, f, indent=1)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
