"""Video decode frames/s on the same clips, decoder against decoder: ``vlmfeed bench video``.

The clips are real photos filmed by a virtual camera and encoded by FFmpeg's encoders
(``datasvc.tools.synth.videos``), one per codec and frame size, at a fixed length, rate, GOP and
bits per pixel. Each contender decodes them to RGB uint8 frames on one thread:

- ``dali_cpu``: DALI's CPU video decoder as the actors run it (``datasvc.media.videodecode``: whole
  containers in, the frame indices wanted; VP8, VP9 and MJPEG only);
- ``pyav``: PyAV (FFmpeg's libavcodec), packets decoded in order, frames converted to RGB;
- ``pyav_backend``: the actors' PyAV backend (``datasvc.media.videodecode``, for what no DALI backend
  takes): decode from the keyframe before the first wanted frame, RGB converted as DALI converts;
- ``torchvision``: its video decoder, where this torch build has one (0.22+ moved it to torchcodec);
- ``dali_gpu``: DALI's mixed backend (NVDEC), when a CUDA device is present.

Also ``resize``: the actors' resize of decoded frames of each clip size to the targets the
pipeline gives clips of 4, 10 and 30 seconds (``jpegscale.resize_uint8``, which halves frames of
4x the target first), against OpenCV's area resize alone, by process CPU time per frame in
alternated rounds, each with its distance from HF's resize (``vision.hf_resize``).

Two modes: ``all`` decodes every frame; ``sampled`` delivers only the frames the pipeline's processor
samples (2 a second, ``datasvc.media.video.sample_frame_indices``), as training does: DALI seeks to the
keyframe before each, PyAV decodes forward to the last. Rates are wall-clock frames/s delivered,
best of ``repeats`` passes, and frames per process CPU-second; ratios are against the fastest
contender of the same clip and mode, in the same run. Nothing here asserts a target.
"""
from __future__ import annotations

import io
import os
import platform
import time

import numpy as np


FORMATS = ("vp9/webm", "vp8/webm", "mjpeg/mkv", "h264/mp4", "hevc/mp4", "av1/mp4")
SIZES = ("640x360", "1280x720")
_BITS_PER_PIXEL = {"mjpeg": 1.0}  # intra-only: every frame a JPEG
_DEFAULT_BPP = 0.08  # web video: 720p30 at about 2.2 Mbit/s


def make_clips(formats=FORMATS, sizes=SIZES, seconds: float = 4.0, fps: float = 30.0, gop_seconds: float = 2.0,
               seed: int = 0) -> list[dict]:
    """One clip per format and size: ``{"fmt", "size", "data", "header"}``. The clips are encoded
    in parallel, one process per clip up to the host's cores (the AV1 encoder alone takes most of a
    minute); each clip's content depends only on its seed and place, not on the process count."""
    from datasvc.media.video import probe_video
    from datasvc.tools.synth.videos import VideoSpec
    from datasvc.tools.synth.write import spawned_map

    jobs = []
    for i, fmt in enumerate(formats):
        for j, size in enumerate(sizes):
            w, h = (int(v) for v in size.split("x"))
            codec = fmt.split("/")[0]
            spec = VideoSpec(fmt, w, h, fps, round(seconds * fps), _BITS_PER_PIXEL.get(codec, _DEFAULT_BPP) * w * h * fps,
                             max(1, round(gop_seconds * fps)))
            jobs.append((fmt, size, spec, (seed, i, j)))
    workers = max(1, min(len(jobs), os.cpu_count() or 1))
    encoded = list(spawned_map(_render, [(spec, key) for _, _, spec, key in jobs], workers))
    return [{"fmt": fmt, "size": size, "data": data, "header": probe_video(data)}
            for (fmt, size, _, _), data in zip(jobs, encoded)]


def _render(job) -> bytes:
    from datasvc.tools.synth.videos import render_video

    spec, key = job
    return render_video(spec, np.random.default_rng(list(key)))


def _frames(clip: dict, mode: str, spec) -> list[int]:
    from datasvc.media.video import sample_frame_indices

    h = clip["header"]
    if mode == "all":
        return list(range(h.frames))
    return [int(i) for i in sample_frame_indices(h.frames, h.fps, spec)]


def _pyav(clip: dict, wanted: list[int]) -> int:
    import av

    keep, last, got = set(wanted), max(wanted), 0
    with av.open(io.BytesIO(clip["data"])) as c:
        stream = c.streams.video[0]
        stream.thread_count = 1
        for k, frame in enumerate(c.decode(stream)):
            if k in keep:
                frame.to_ndarray(format="rgb24")
                got += 1
            if k >= last:
                break
    return got


def _plan(clip: dict, wanted: list[int]):
    """A plan that asks for the ``wanted`` frames of the clip at their stored size."""
    from datasvc.media.video import VideoPlan

    h = clip["header"]
    return VideoPlan(clip["data"], h, tuple(wanted), (h.height, h.width), (1, 1, 1), ())


def _dali(decoder):
    from datasvc.media.vision import ImageRejected

    def run(clip: dict, wanted: list[int]) -> int:
        (frames,) = decoder.decode_frames([_plan(clip, wanted)])
        if isinstance(frames, ImageRejected):
            raise frames
        return int(frames.shape[0])

    return run


def _pyav_backend(clip: dict, wanted: list[int]) -> int:
    from datasvc.media.videodecode import _PyAVVideo
    from datasvc.media.vision import ImageRejected

    (frames,) = _PyAVVideo().decode([_plan(clip, wanted)])
    if isinstance(frames, ImageRejected):
        raise frames
    return int(frames.shape[0])


def _torchvision_reason() -> str | None:
    """None when torchvision can decode video here, else why not."""
    try:
        import torchvision.io as tio
    except ImportError as exc:
        return f"torchvision not installed ({exc})"
    if not hasattr(tio, "VideoReader"):
        import torchvision

        return f"torchvision {torchvision.__version__} has no video decoder (moved to torchcodec)"
    return None


def _torchvision(clip: dict, wanted: list[int]) -> int:  # pragma: no cover - builds with VideoReader only
    import torchvision.io as tio

    keep, last, got = set(wanted), max(wanted), 0
    with open(f"/tmp/_bench_video_{os.getpid()}", "wb") as f:
        f.write(clip["data"])
    try:
        reader = tio.VideoReader(f.name, "video", num_threads=1)
        for k, _frame in enumerate(reader):
            got += k in keep
            if k >= last:
                break
    finally:
        os.unlink(f.name)
    return got


def _contenders() -> tuple[dict, dict]:
    """(name -> (decode function, which headers it takes)), (name -> why it is absent)."""
    from datasvc.media.video import CPU_CODECS
    from datasvc.media.videodecode import VideoDecoder

    found = {"dali_cpu": (_dali(VideoDecoder(device_id=None, num_threads=1, max_batch=1)),
                          lambda h: h.codec in CPU_CODECS),
             "pyav": (_pyav, lambda h: True), "pyav_backend": (_pyav_backend, lambda h: True)}
    absent = {}
    reason = _torchvision_reason()
    if reason:
        absent["torchvision"] = reason
    else:
        found["torchvision"] = (_torchvision, lambda h: True)
    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    if cuda:
        gpu = VideoDecoder(device_id=0, num_threads=1, max_batch=1)
        # only what NVDEC itself decodes: the GPU decoder hands MJPEG and small clips to its CPU backend
        found["dali_gpu"] = (_dali(gpu), lambda h: gpu.route(h) == "gpu")
    else:
        absent["dali_gpu"] = "no CUDA device"
    return found, absent


def _time_row(found: dict, clip: dict, wanted: list[int], repeats: int) -> tuple[dict, dict]:
    """Each contender's best pass over the clip, and why the contenders that take the clip but
    failed on it did. Passes alternate between contenders (and which goes first alternates too), so
    load from elsewhere on a shared machine lands on all of them alike."""
    contenders, failed = {}, {}
    for name, (fn, takes) in found.items():
        if not takes(clip["header"]):
            continue
        try:
            fn(clip, wanted[:2])  # warm-up: first-use costs (pipeline build, codec open) are not decode
        except Exception as exc:
            failed[name] = f"{type(exc).__name__}: {exc}"[:200]
            continue
        if takes(clip["header"]):
            contenders[name] = fn
        else:  # the decoder handed the clip to another backend during the warm-up
            failed[name] = f"{clip['header'].codec}: refused, decoded elsewhere by the actors' decoder"
    best = {n: [float("inf"), float("inf"), 0] for n in contenders}
    names = list(contenders)
    for rep in range(max(1, repeats)):
        for name in (names if rep % 2 == 0 else names[::-1]):
            t0, c0 = time.perf_counter(), time.process_time()
            frames = contenders[name](clip, wanted)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            b = best[name]
            b[0], b[1], b[2] = min(b[0], wall), min(b[1], cpu), frames
    return {n: {"frames": f, "seconds": round(w, 5), "cpu_s": round(c, 5), "frames_per_s": round(f / w, 1),
                "frames_per_cpu_s": round(f / max(c, 1e-9), 1)} for n, (w, c, f) in best.items()}, failed


def bench_video(formats=FORMATS, sizes=SIZES, seconds: float = 4.0, fps: float = 30.0, gop_seconds: float = 2.0,
                repeats: int = 3, modes=("all", "sampled"), pipeline: str = "qwen3vl") -> dict:
    """Every contender on every clip it can decode, in each mode; see the module's docstring."""
    from datasvc.registry import get_pipeline
    from datasvc.tools.bench.timing import one_thread

    spec = get_pipeline(pipeline).video  # the frames the pipeline's processor samples

    t0 = time.perf_counter()
    clips = make_clips(formats, sizes, seconds, fps, gop_seconds)
    build_s = time.perf_counter() - t0
    found, absent = _contenders()
    rows = []
    with one_thread():
        for clip in clips:
            for mode in modes:
                wanted = _frames(clip, mode, spec)
                row = {"format": clip["fmt"], "size": clip["size"], "mode": mode, "frames_wanted": len(wanted),
                       "results": {}}
                row["results"], row["failed"] = _time_row(found, clip, wanted, repeats)
                _ratios(row)
                rows.append(row)
        resize = bench_resize(clips, pipeline)
    return {"kind": "video-decode", "machine": _machine(), "threads": 1, "repeats": repeats,
            "sampling": {"pipeline": pipeline, "fps": spec.fps, "min_frames": spec.min_frames},
            "clips": [_clip_facts(c) for c in clips], "clip_build_seconds": round(build_s, 1),
            "absent": absent, "rows": rows, "summary": _summary(rows), "resize": resize}


def _decoded(clip: dict, frames: int) -> list[np.ndarray]:
    """The clip's first ``frames`` frames, decoded by the actors' PyAV backend; none where it
    cannot decode the clip."""
    from datasvc.media.videodecode import _PyAVVideo

    (decoded,) = _PyAVVideo().decode([_plan(clip, list(range(min(frames, clip["header"].frames))))])
    return list(decoded) if isinstance(decoded, np.ndarray) else []


def _area_resize(frame: np.ndarray, target_hw: tuple[int, int]) -> np.ndarray:
    """The baseline: OpenCV's area resize of the whole frame in one step."""
    import cv2

    return cv2.resize(frame, target_hw[::-1], interpolation=cv2.INTER_AREA)


def _hf_distance(frames: list[np.ndarray], resized: list[np.ndarray], target_hw, vision) -> float:
    """The largest mean |diff| over the frames from HF's resize, in normalized pixel units."""
    import torch

    from datasvc.media.vision import hf_resize

    scale = 255 * float(np.mean(vision.image_std))
    return max(float(np.abs(r.astype(np.float32) - hf_resize(torch.from_numpy(f), target_hw).numpy()).mean()) / scale
               for f, r in zip(frames, resized))


def bench_resize(clips: list[dict], pipeline: str = "qwen3vl", frames: int = 8, rounds: int = 5,
                 durations: tuple[float, ...] = (4.0, 10.0, 30.0)) -> list[dict]:
    """Per clip size and target: process CPU ms per frame of the actors' resize and of the area
    baseline (medians of alternated rounds), the baseline's time over ours, and each one's
    distance from HF."""
    from datasvc.media.jpegscale import resize_uint8
    from datasvc.media.video import video_target_size
    from datasvc.registry import get_layout, get_pipeline
    from datasvc.tools.bench.timing import paired_cpu_ratio

    vision, spec = get_layout(pipeline).vision, get_pipeline(pipeline).video
    rows, done = [], set()
    for clip in clips:  # one clip a size: the first PyAV decodes
        if clip["size"] in done:
            continue
        decoded = _decoded(clip, frames)
        if not decoded:  # a codec this FFmpeg build lacks: the next clip of the size
            continue
        done.add(size := clip["size"])
        h, w = decoded[0].shape[:2]
        for seconds in durations:
            target = video_target_size(max(spec.min_frames, round(seconds * spec.fps)), h, w, vision, spec)
            def ours(fs):
                return [resize_uint8(f, target) for f in fs]

            def area(fs):
                return [_area_resize(f, target) for f in fs]

            paired = paired_cpu_ratio(ours, area, decoded, rounds)
            rows.append({"size": size, "format": clip["fmt"], "clip_seconds": seconds, "target": list(target),
                         "frames": len(decoded), "rounds": rounds,
                         "ours_cpu_ms_per_frame": round(1e3 * paired["fast_cpu_s_median"] / len(decoded), 3),
                         "area_cpu_ms_per_frame": round(1e3 * paired["slow_cpu_s_median"] / len(decoded), 3),
                         "area_over_ours": paired["ratio_median"],
                         "ours_hf_mean_abs_diff_max": round(_hf_distance(decoded, ours(decoded), target, vision), 4),
                         "area_hf_mean_abs_diff_max": round(_hf_distance(decoded, area(decoded), target, vision), 4)})
    return rows


def _ratios(row: dict) -> None:
    if not row["results"]:
        return
    fastest = max(row["results"], key=lambda n: row["results"][n]["frames_per_s"])
    row["fastest"] = fastest
    top = row["results"][fastest]["frames_per_s"]
    for r in row["results"].values():
        r["vs_fastest"] = round(r["frames_per_s"] / top, 3)


def _summary(rows: list[dict]) -> dict:
    """Per mode and contender: the geometric mean over clips of its ratio to the fastest, and of
    DALI CPU's to PyAV on the clips both decode."""
    out: dict = {}
    for mode in sorted({r["mode"] for r in rows}):
        mine = [r for r in rows if r["mode"] == mode]
        names = sorted({n for r in mine for n in r["results"]})
        gm = lambda xs: round(float(np.exp(np.mean(np.log(xs)))), 3) if xs else None  # noqa: E731
        out[mode] = {"geomean_vs_fastest": {n: gm([r["results"][n]["vs_fastest"] for r in mine if n in r["results"]])
                                            for n in names}}
        both = [r for r in mine if {"dali_cpu", "pyav"} <= set(r["results"])]
        out[mode]["dali_cpu_over_pyav_geomean"] = gm([r["results"]["dali_cpu"]["frames_per_s"]
                                                      / r["results"]["pyav"]["frames_per_s"] for r in both])
    return out


def _clip_facts(c: dict) -> dict:
    h = c["header"]
    return {"format": c["fmt"], "size": c["size"], "frames": h.frames, "fps": h.fps, "keyframes": h.keyframes,
            "kbps": round(8 * h.stream_bytes / h.duration / 1e3, 1), "bytes": len(c["data"])}


def _machine() -> dict:
    return {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "load_avg_at_start": list(os.getloadavg()), "versions": _versions()}


def _versions() -> dict:
    out = {}
    for mod in ("av", "nvidia.dali", "torch", "torchvision"):
        try:
            out[mod] = __import__(mod, fromlist=["__version__"]).__version__
        except ImportError:
            out[mod] = None
    return out


def print_video(rep: dict) -> None:
    names = sorted({n for r in rep["rows"] for n in r["results"]})
    print(f"{'clip':22s} {'mode':8s} {'frames':>6s} " + " ".join(f"{n + ' fps':>18s}" for n in names))
    for r in rep["rows"]:
        cells = []
        for n in names:
            x = r["results"].get(n)
            cells.append(f"{'-':>18s}" if x is None else f"{x['frames_per_s']:>9.1f} ({x['vs_fastest']:.2f}x)".rjust(18))
        print(f"{r['format'] + ' ' + r['size']:22s} {r['mode']:8s} {r['frames_wanted']:>6d} " + " ".join(cells))
    for mode, s in rep["summary"].items():
        print(f"{mode}: geomean vs fastest " + ", ".join(f"{k} {v}" for k, v in s["geomean_vs_fastest"].items())
              + f"; DALI CPU / PyAV {s['dali_cpu_over_pyav_geomean']}")
    if rep.get("resize"):
        print(f"\nresize of decoded frames, CPU ms per frame (ours: halving first; area: OpenCV's area alone), "
              f"and the largest mean |diff| from HF's resize:")
        for r in rep["resize"]:
            print(f"  {r['size']:>9} -> {r['target'][1]}x{r['target'][0]} ({r['clip_seconds']:g} s clip): ours "
                  f"{r['ours_cpu_ms_per_frame']:.3f} ms ({r['ours_hf_mean_abs_diff_max']:.4f}), area "
                  f"{r['area_cpu_ms_per_frame']:.3f} ms ({r['area_hf_mean_abs_diff_max']:.4f}), area / ours "
                  f"{r['area_over_ours']:.2f}x")
    for name, why in rep["absent"].items():
        print(f"not run: {name}: {why}")
    for r in rep["rows"]:
        for name, why in r.get("failed", {}).items():
            print(f"failed: {name} on {r['format']} {r['size']} ({r['mode']}): {why}")


__all__ = ["bench_video", "make_clips", "print_video"]
