"""Per-core decode and preprocess throughput: ``vlmfeed bench decode`` (its table and plot:
``decode_report``).

Every contender runs on one thread (OpenCV, torch, DALI each pinned to one, for the measurement
only), on the same set of realistic JPEG photos (0.3-4 MP, q90, built from the real photographs
shipped in installed wheels), and reports images/s and MP/s (source megapixels) for:

  (a) raw decode only: torchvision.io.decode_jpeg (libjpeg-turbo), PIL, DALI CPU;
  (a+) the floor of any path that must resize: libjpeg-turbo decode of the full frame, then the
      resize our CPU path makes from it (``jpegscale.fit_uint8``: OpenCV, halving large frames
      first) to the pipeline's target size, nothing else;
  (b) the HF Qwen2-VL image processor at the pipeline's settings on PIL images decoded from the
      bytes (decode included), both the torchvision backend and the PIL backend of transformers 5.x;
  (c) our CPU path: ``preprocess_images`` to uint8 pixel rows (what the preprocessing actors do
      and what travels through the object store) with the service's default ``resize_on``, which
      leaves a frame's last resize to the rank; the same resizing every image in the actor; and on
      to the model's float ``pixel_values`` with ``to_pixel_values`` on the CPU (what a rank without
      a GPU adds); as a baseline in the same run (c-), the actors' work when they also put the
      rows in patch order;
  (r) the rank's share under that default on a CPU-only rank: the client's resize of the frames the
      actors left, as CPU tensors (OpenCV, ``vision.finish_resize``; a GPU rank's is in
      ``python -m trainer.bench --gpu-decode-only``).

and a per-stage profile of (c) (probe, decode, resize, then the consumer's patch order and
normalize), and packing efficiency against padding every sample to ``seq_len`` (``packing``).
Numbers are wall-clock on whatever machine runs them, the contenders taking turns pass by pass;
the CPU-time ratios come from alternated rounds. Nothing here asserts a target.
"""
from __future__ import annotations

import io
import os
import platform
import sys
import time

import numpy as np
from PIL import Image

from datasvc.tools.bench.packing import packing_bench
from datasvc.tools.bench.photos import Photo, photo_set, synth_photos
from datasvc.tools.bench.timing import by_round, one_thread, paired_cpu_ratio, time_interleaved

GOAL_VS_DECODE = 0.8
GOAL_VS_HF = 8.0
GOAL_PATH = "ours_uint8_pixel_rows"  # the actors' work: what the goals are about
OURS = ("ours_pixel_values", "ours_uint8_pixel_rows", "ours_uint8_pixel_rows_libjpeg_turbo",
        "ours_uint8_pixel_rows_resized_in_actor", "ours_uint8_pixel_rows_libjpeg_turbo_resized_in_actor",
        "baseline_uint8_patch_order")


def _libjpeg_turbo_decode(data: bytes):
    """torchvision's ``decode_jpeg`` (libjpeg-turbo): a [3, h, w] uint8 tensor."""
    import torch
    from torchvision.io import decode_jpeg

    return decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8))


def _torchvision_decode(photos):
    for p in photos:
        _libjpeg_turbo_decode(p.data)


def _torchvision_decode_and_copy(photos):
    """torchvision's decode, then one copy of the frame into a fresh buffer: what nvImageCodec's
    libjpeg-turbo extension does inside DALI (it decodes into its own buffer, then copies each row
    into DALI's output)."""
    for p in photos:
        frame = _libjpeg_turbo_decode(p.data).permute(1, 2, 0).numpy()  # HWC, as decoded
        np.copyto(np.empty_like(frame), frame)


def _opencv_decode(photos):
    import cv2

    for p in photos:
        cv2.imdecode(np.frombuffer(p.data, dtype=np.uint8), cv2.IMREAD_COLOR_RGB | cv2.IMREAD_IGNORE_ORIENTATION)


def _decode_and_resize(spec):
    """torchvision's libjpeg-turbo decode, then ``jpegscale.fit_uint8`` to the smart-resize target."""
    from datasvc.media.jpegscale import fit_uint8

    def run(photos):
        for p in photos:
            fit_uint8(_libjpeg_turbo_decode(p.data).permute(1, 2, 0).numpy(), spec.target_size(p.height, p.width))
    return run


def _pil_decode(photos):
    for p in photos:
        im = Image.open(io.BytesIO(p.data))
        im.load()
        np.asarray(im)


class _DaliDecode:
    """DALI CPU decode, one thread, in batches like the service's CpuDecoder does, each image left
    in DALI's output buffer (the decoder resizes from there)."""

    def __init__(self, batch: int = 16):
        from datasvc.media.decode import CpuDecoder

        self.decoder = CpuDecoder(num_threads=1, max_batch=batch)
        self.batch = batch

    def __call__(self, photos):
        for i in range(0, len(photos), self.batch):
            self.decoder._dali([p.data for p in photos[i:i + self.batch]], lambda i, img: None)


def hf_processors(spec) -> dict:
    import transformers

    kw = dict(patch_size=spec.patch_size, temporal_patch_size=spec.temporal_patch_size, merge_size=spec.merge_size,
              image_mean=list(spec.image_mean), image_std=list(spec.image_std),
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
    """Our path on ``chunk`` images at a time; ``finish(rows, grid)`` runs on each image's rows
    (a ``vision.FrameRows`` where the decoder left the resize to the rank)."""
    from datasvc.stream.process import preprocess_images

    def run(photos):
        for i in range(0, len(photos), chunk):
            for res in preprocess_images([p.data for p in photos[i:i + chunk]], spec, decoder):
                if not isinstance(res, tuple):
                    raise RuntimeError(f"our path rejected a benchmark photo: {res}")
                if finish:
                    finish(*res)
    return run


def _rank_resize(spec, decoder, photos: list[Photo]):
    """The rank's resize on the CPU of the frames ``decoder`` leaves it, of CPU tensors as the
    client holds them (``rank_resize_torch_cpu``: torch tensors, OpenCV's resize); the photos
    decoded here, ahead of any timing."""
    import torch

    from datasvc.media.vision import FrameRows, finish_resize
    from datasvc.stream.process import preprocess_images

    frames: dict[int, tuple | None] = {}
    for p in photos:
        ((rows, grid),) = preprocess_images([p.data], spec, decoder)
        frames[id(p)] = (torch.from_numpy(rows.rows), grid, rows.hw) if isinstance(rows, FrameRows) else None

    def run(photos):
        for p in photos:
            if frames[id(p)] is not None:
                rows, grid, hw = frames[id(p)]
                finish_resize(rows, spec, [grid], [hw])
    return run


def _copy_rows(rows, grid):
    from datasvc.media.vision import FrameRows

    return rows.rows if isinstance(rows, FrameRows) else rows.copy()


def _patch_order(rows: np.ndarray, grid, spec) -> np.ndarray:
    from datasvc.media.vision import patchify

    _, gh, gw = grid
    return patchify(rows.reshape(gh * spec.patch_size, gw * spec.patch_size, 3), spec)


def profile_ours(photos: list[Photo], spec, decoder) -> dict:
    """Seconds per stage of our CPU path, summed over the photos (one pass, after a warm-up): the
    actors' probe, decode and resize (as the decoder's own stage timer splits them), then
    ``to_pixel_values`` (patch order and normalize)."""
    from datasvc.media.decode import DecodeJob, probe
    from datasvc.media.vision import to_pixel_values
    from datasvc.stats import StageTimes

    secs = dict(probe=0.0, decode=0.0, resize=0.0, to_pixel_values=0.0)
    chunk = 16
    for timed, subset in ((False, photos[:2]), (True, photos)):
        for i in range(0, len(subset), chunk):
            t0 = time.perf_counter()
            jobs = []
            for p in subset[i:i + chunk]:
                h = probe(p.data, spec.max_decode_pixels)
                jobs.append(DecodeJob(p.data, h, spec.target_size(h.height, h.width)))
            t1 = time.perf_counter()
            times = StageTimes()
            rows = decoder.to_pixel_rows(jobs, spec, times.add)
            t2 = time.perf_counter()
            for r, j in zip(rows, jobs):
                to_pixel_values(r, spec, [j.grid(spec)])
            t3 = time.perf_counter()
            if timed:
                stage = {k: v.seconds for k, v in times.stages.items()}
                resize = min(t2 - t1, stage.get("preprocess", 0.0))
                for k, dt in zip(secs, (t1 - t0, t2 - t1 - resize, resize, t3 - t2)):
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


def _contenders(spec, decoder, skip_hf_pil: bool, photos: list[Photo]) -> dict[str, tuple[str, object]]:
    """name -> (group, run over photos): (a) raw decode, (b) HF processors, (c) ours (the default
    path, and the explicit libjpeg-turbo reduced-scale option, each also resizing in the actor),
    (c-) the actors' work when they also put the rows in patch order, as a baseline, (r) the rank's
    resize of what the default leaves it, on one CPU thread. ``decoder``: the default path's."""
    from datasvc.media.decode import CpuDecoder
    from datasvc.media.vision import to_pixel_values

    runs: dict[str, tuple[str, object]] = {
        "torchvision_decode_jpeg": ("a", _torchvision_decode),
        "opencv_decode": ("a", _opencv_decode),
        "pil_decode": ("a", _pil_decode),
        "dali_cpu_decode": ("a", _DaliDecode()),
        "libjpeg_turbo_decode_opencv_resize": ("a+", _decode_and_resize(spec)),
    }
    for name, proc in hf_processors(spec).items():
        if skip_hf_pil and name == "hf_qwen2vl_pil":
            continue
        runs[name] = ("b", _hf_run(proc))
    in_actor = CpuDecoder(num_threads=1)
    turbo = dict(num_threads=1, jpeg="libjpeg-turbo")
    runs["ours_pixel_values"] = ("c", _ours(spec, in_actor, 16, lambda rows, grid: to_pixel_values(rows, spec, [grid])))
    runs["ours_uint8_pixel_rows"] = ("c", _ours(spec, decoder, 16))
    runs["ours_uint8_pixel_rows_libjpeg_turbo"] = ("c", _ours(spec, CpuDecoder(**turbo, rank_resize=decoder.rank_resize), 16))
    runs["ours_uint8_pixel_rows_resized_in_actor"] = ("c", _ours(spec, in_actor, 16))
    runs["ours_uint8_pixel_rows_libjpeg_turbo_resized_in_actor"] = ("c", _ours(spec, CpuDecoder(**turbo), 16))
    runs["baseline_uint8_patch_order"] = ("c-", _ours(spec, in_actor, 16, lambda rows, grid: _patch_order(rows, grid, spec)))
    if decoder.rank_resize:
        runs["rank_resize_torch_cpu"] = ("r", _rank_resize(spec, decoder, photos))
    return runs


def _ratios(results: dict) -> tuple[str, str, dict, dict]:
    """(fastest decode, fastest HF, our paths' ratios against them, the goals and whether met)."""
    fastest_a = max((k for k, v in results.items() if v["group"] == "a"), key=lambda k: results[k]["images_per_s"])
    fastest_b = max((k for k, v in results.items() if v["group"] == "b"), key=lambda k: results[k]["images_per_s"])
    floor = results.get("libjpeg_turbo_decode_opencv_resize")
    ratios = {}
    for c in OURS:
        rc = results[c]["images_per_s"]
        ratios[c] = {
            "vs_fastest_decode": round(rc / results[fastest_a]["images_per_s"], 3),
            "vs_fastest_hf": round(rc / results[fastest_b]["images_per_s"], 3),
            **({"vs_decode_and_resize": round(rc / floor["images_per_s"], 3)}
               if floor else {}),
            **({"vs_hf_pil": round(rc / results["hf_qwen2vl_pil"]["images_per_s"], 2)}
               if "hf_qwen2vl_pil" in results else {}),
        }
    goals = {
        "vs_fastest_decode": GOAL_VS_DECODE, "vs_fastest_hf": GOAL_VS_HF, "path": GOAL_PATH,
        "met_vs_decode": ratios[GOAL_PATH]["vs_fastest_decode"] >= GOAL_VS_DECODE,
        "met_vs_hf": ratios[GOAL_PATH]["vs_fastest_hf"] >= GOAL_VS_HF,
    }
    return fastest_a, fastest_b, ratios, goals


def _photo_summary(photos: list[Photo], images: int, spec, build_s: float) -> dict:
    mps = [p.megapixels for p in photos]
    mp_total = sum(mps)
    return {"count": len(photos), "from_real": images, "from_synth": len(photos) - images,
            "megapixels_total": round(mp_total, 3), "megapixels_min": round(min(mps), 3),
            "megapixels_mean": round(float(np.mean(mps)), 3), "megapixels_max": round(max(mps), 3),
            "bytes_per_pixel": round(sum(len(p.data) for p in photos) / (mp_total * 1e6), 4),
            "resize": _resize_stats(photos, spec), "build_seconds": round(build_s, 2)}


def _progress(what: str) -> None:
    print(f"bench decode: {what} ...", file=sys.stderr, flush=True)


def bench_decode(images: int = 40, max_pixels: int = 16777216, min_pixels: int = 65536, synth: int = 0,
                 repeats: int = 5, pack_synth: int = 200, skip_hf_pil: bool = False, seed: int = 0,
                 mp_range: tuple[float, float] = (0.3, 4.0), pack_copies: int = 2,
                 pipeline: str = "qwen3vl") -> dict:
    from datasvc.config import DecodeConfig
    from datasvc.media.decode import CpuDecoder
    from datasvc.registry import get_layout

    spec = get_layout(pipeline, min_pixels=min_pixels, max_pixels=max_pixels).vision
    t0 = time.perf_counter()
    _progress(f"building {images + synth} photos")
    photos = photo_set(images, seed=seed, min_mp=mp_range[0], max_mp=mp_range[1]) + \
        synth_photos(synth, min_mp=mp_range[0], max_mp=mp_range[1])
    build_s = time.perf_counter() - t0
    mp_total = sum(p.megapixels for p in photos)
    with one_thread():
        decoder = CpuDecoder(num_threads=1, rank_resize=DecodeConfig.resize_on == "rank")
        runs = _contenders(spec, decoder, skip_hf_pil, photos)
        _progress(f"timing {len(runs)} contenders, {repeats} passes each, on {len(photos)} photos")
        # The slow HF PIL processor gets one pass; the rest the best of ``repeats``.
        passes = time_interleaved({name: fn for name, (_, fn) in runs.items()}, photos, repeats,
                                  once=("hf_qwen2vl_pil",))
        best = {name: min(s) for name, s in passes.items()}
        results = {name: {"group": group, "seconds": round(best[name], 4),
                          "images_per_s": round(len(photos) / best[name], 2),
                          "mp_per_s": round(mp_total / best[name], 2),
                          "seconds_median": round(float(np.median(passes[name])), 4)}
                   for name, (group, _) in runs.items()}
        _progress("profiling the actors' stages and pairing CPU times")
        prof = profile_ours(photos, spec, CpuDecoder(num_threads=1))
        in_actor = runs["ours_uint8_pixel_rows_resized_in_actor"][1]
        actors = paired_cpu_ratio(in_actor, runs["baseline_uint8_patch_order"][1], photos)
        # The actors' own work by CPU time: against raw decode, and what leaving the resize saves.
        over_decode = paired_cpu_ratio(runs["torchvision_decode_jpeg"][1], runs[GOAL_PATH][1], photos)
        resize_left = paired_cpu_ratio(runs[GOAL_PATH][1], in_actor, photos)
        # What a copy of each image's rows out of the decoder's buffer costs (the actors made one
        # before frames travelled as views of DALI's output).
        copying = paired_cpu_ratio(runs[GOAL_PATH][1], _ours(spec, decoder, 16, _copy_rows), photos)
        # Where DALI's decode gap is: its process CPU time against libjpeg-turbo's on the same
        # bytes (a CPU-time ratio near the wall one means the gap is decode work, not waiting).
        dali_cpu = paired_cpu_ratio(runs["torchvision_decode_jpeg"][1], runs["dali_cpu_decode"][1], photos)
        # ... and against libjpeg-turbo plus the one copy DALI's CPU decoder makes (near 1: that
        # copy is the whole gap, and only DALI or nvImageCodec can remove it).
        dali_copy = paired_cpu_ratio(_torchvision_decode_and_copy, runs["dali_cpu_decode"][1], photos)
        # How far the actors are from the least work that resizes (>1: the actors take longer).
        floor = paired_cpu_ratio(runs["libjpeg_turbo_decode_opencv_resize"][1], in_actor, photos)
    fastest_a, fastest_b, ratios, goals = _ratios(results)
    # The same goal ratio round by round (the passes of one round run back to back): its spread
    # says how far one run's best-of figure can be trusted on the host.
    goals["vs_fastest_decode_by_round"] = by_round(passes, fastest_a, GOAL_PATH)
    goals["vs_fastest_hf_by_round"] = by_round(passes, fastest_b, GOAL_PATH)
    packing = {}
    if pack_synth >= 0:
        _progress("packing")
        packing = packing_bench(pack_synth, max_pixels, photo_copies=pack_copies)
    return {
        "kind": "decode",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_avg_at_start": list(os.getloadavg())},
        "threads": 1,
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
        "vision": {"min_pixels": spec.min_pixels, "max_pixels": spec.max_pixels},
        "photos": _photo_summary(photos, images, spec, build_s),
        "results": results,
        "fastest_decode": fastest_a,
        "fastest_hf": fastest_b,
        "ratios": ratios,
        "goals": goals,
        "profile_ours": prof,
        "resize_on": DecodeConfig.resize_on,
        "actors_cpu_over_raw_decode": over_decode,
        "actors_resizing_cpu_over_default": resize_left,
        "actors_copying_rows_cpu_over_default": copying,
        "actors_patch_order_over_pixel_rows": actors,
        "dali_decode_cpu_over_torchvision": dali_cpu,
        "dali_decode_cpu_over_torchvision_and_copy": dali_copy,
        "actors_cpu_over_decode_and_resize": floor,
        "packing": packing,
    }
