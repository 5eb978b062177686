"""GPU decode paths, same 1-2 MP JPEGs (``python -m trainer.bench --gpu-decode-only``).

Bytes -> uint8 pixel rows in host memory (what the service ships) and -> bf16 ``pixel_values`` on
the GPU, for DALI GPU, DALI CPU on every host core and torchvision nvJPEG; decode alone for DALI and
torchvision, to see what resize, patch order and copies add. Result names say ``patches`` for the
rows shipped to the host, as the results in docs/results do.
"""
from __future__ import annotations

import json
import os
import time

import numpy as np


class _Timings:
    """Timed calls into ``results``: img/s and MP/s each, or the error of a path that failed."""

    def __init__(self, images: int, megapixels: float):
        self.images, self.megapixels = images, megapixels
        self.results: dict = {}

    def timed(self, name: str, fn, repeats: int = 5, images: int | None = None):
        images = images or self.images
        try:
            # Two warm-ups: pipeline build, CUDA context, nvJPEG handles, and enough pinned blocks in
            # torch's host cache that timed calls do not pay for pinning fresh pages.
            fn()
            fn()
            t0 = time.perf_counter()
            for _ in range(repeats):
                result = fn()
            dt = (time.perf_counter() - t0) / repeats
            self.results[name] = {"img_s": round(images / dt, 1),
                                  "mp_s": round(self.megapixels * images / self.images / dt, 1)}
        except Exception as exc:  # one failing path must not hide the others
            self.results[name], result = {"error": f"{type(exc).__name__}: {exc}"[:300]}, []
        print(f"[bench] {name}: {self.results[name]}", flush=True)
        return result

    def ratio(self, a: str, b: str) -> float | None:
        ra, rb = self.results.get(a, {}).get("img_s"), self.results.get(b, {}).get("img_s")
        return round(ra / rb, 3) if ra and rb else None


def _jobs(n_images: int):
    from datasvc.media.decode import DecodeJob, probe
    from datasvc.media.vision import VisionSpec
    from datasvc.tools.bench.photos import photo_set

    spec = VisionSpec(max_pixels=16777216)
    jobs = []
    for p in photo_set(n_images, min_mp=1.0, max_mp=2.0):
        h = probe(p.data, spec.max_decode_pixels)
        jobs.append(DecodeJob(p.data, h, spec.target_size(h.height, h.width)))
    return spec, jobs


def _synchronized(result):
    import torch

    torch.cuda.synchronize()
    return result


def _to_gpu_pixel_values(rows_per_image, grids, spec):
    import torch

    from datasvc.media.vision import to_pixel_values

    values = [to_pixel_values(r if torch.is_tensor(r) else torch.from_numpy(r).cuda(non_blocking=True),
                              spec, [grid], torch.bfloat16) for r, grid in zip(rows_per_image, grids)]
    return _synchronized(values)


def _torchvision_rows(data, jobs, spec, batch: int, host: bool):
    """nvJPEG batched decode and bicubic antialiased resize in torch, on the GPU, to pixel rows."""
    import torch
    import torch.nn.functional as F
    import torchvision

    from datasvc.media.vision import pixel_rows

    out = []
    for i in range(0, len(data), batch):
        images = torchvision.io.decode_jpeg(data[i:i + batch], device="cuda", mode=torchvision.io.ImageReadMode.RGB)
        for img, job in zip(images, jobs[i:i + batch]):
            x = F.interpolate(img[None].float(), size=job.target_hw, mode="bicubic", antialias=True)
            x = x.round_().clamp_(0, 255).to(torch.uint8)[0]  # [3, th, tw]
            out.append(pixel_rows(x.permute(1, 2, 0).contiguous(), spec))
    if host:
        out = [torch.empty(t.shape, dtype=torch.uint8, pin_memory=True).copy_(t, non_blocking=True) for t in out]
    return _synchronized(out)


# A stream is one DALI epoch, which fills and drains the pipeline once: 16 passes over the photos
# (64 chunks of 64) make that cost what it is on a rank's long stream, about 1/64 of the time.
ROUNDS = 16


def _streamed(decoder, jobs, spec, per_batch: int, rounds: int = ROUNDS) -> int:
    """What a rank sees: batches of ``per_batch`` images in one stream, each dropped once used."""
    batches = [jobs[i:i + per_batch] for i in range(0, len(jobs), per_batch)] * rounds
    n = 0
    for values in decoder.stream_pixel_values(batches, spec):
        n += len(values)
    return _synchronized(n)


def _stages(decoder, jobs, spec, finish, rounds: int = ROUNDS) -> int:
    """The decoder's own stream (its feed and DALI pipeline) with ``finish`` in place of what it does
    with each output: the stages measured one at a time."""
    batches = [jobs[i:i + decoder.max_batch] for i in range(0, len(jobs), decoder.max_batch)] * rounds
    n = 0
    for out in decoder._stream(batches, spec, finish, lambda rows, job: rows, None):
        n += len(out)
    return _synchronized(n)


def _stage_paths(t: "_Timings", gpu, jobs, spec) -> None:
    """Where the streamed path's time goes: DALI's decode + resize from the decoder's feed, + the
    copy out of DALI's buffer, + ``pixel_values`` by torch's kernels (one normalize per image and a
    frame copy) or by the fused Triton kernel (the decoder's own path, ``stream_pixel_values``)."""
    import torch

    from datasvc.media.vision import torch_pixel_values

    def torch_values(out, batch):
        rows, spans = gpu._device_rows(out, batch, spec)
        return [torch_pixel_values(rows, spec, [j.grid(spec) for j in batch], torch.bfloat16)] * len(batch)

    for name, finish in (("rows_pipeline", lambda out, batch: [None] * len(batch)),
                         ("rows_pipeline_copy", lambda out, batch: [gpu._pixels(out)] * len(batch)),
                         ("rows_pipeline_torch_pixel_values", torch_values),
                         ("rows_pipeline_fused_pixel_values",
                          lambda out, batch: gpu._values(out, batch, spec, torch.bfloat16))):
        t.timed(f"dali_gpu_stage_{name}", lambda: _stages(gpu, jobs, spec, finish), images=ROUNDS * len(jobs))


def _pixel_values_kernels(t: "_Timings", spec, grids, batch: int) -> None:
    """``pixel_values`` of one chunk's rows already on the GPU (random pixels, the photos' grids),
    by torch's kernels and by the fused Triton kernel: the last stage alone."""
    import torch

    from datasvc.media.vision import fused_pixel_values, torch_pixel_values

    chunk = grids[:batch]
    rows = torch.randint(0, 256, (sum(g[1] * g[2] for g in chunk), spec.patch_dim), dtype=torch.uint8, device="cuda")
    for name, fn in (("torch", torch_pixel_values), ("fused", fused_pixel_values)):
        t.timed(f"pixel_values_kernel_{name}", lambda: _synchronized(fn(rows, spec, chunk, torch.bfloat16)),
                repeats=50, images=len(chunk))


def _video_kernels(t: "_Timings", spec) -> None:
    """``pixel_values_videos`` of 4 videos (8 temporal groups of 384x672 frames) already on the GPU,
    by torch's kernels and by the fused kernel."""
    import torch

    from datasvc.media import video

    grids = [(8, 24, 42)] * 4
    rows = torch.randint(0, 256, (sum(g * spec.temporal_patch_size * h * w for g, h, w in grids), spec.patch_dim),
                         dtype=torch.uint8, device="cuda")

    for name, fn in (("torch", video.unfused_video_pixel_values), ("fused", video.to_video_pixel_values)):
        t.timed(f"video_pixel_values_kernel_{name}", lambda: _synchronized(fn(rows, spec, grids, torch.bfloat16)),
                repeats=20, images=len(grids))


def _host_rows_alternated(t: "_Timings", jobs, spec, rounds: int = 6) -> None:
    """The one-call host path (``to_pixel_rows``) with the encoded bytes read in place and copied,
    in alternated rounds of 3 calls, once torch's pinned-block cache holds a call's blocks: the median
    of each. ``timed``'s two warm-ups leave that cache filling, so its host figures price pinning."""
    import statistics

    from datasvc.media.gpudecode import GpuDecoder

    decoders = {"in_place": GpuDecoder(device_id=0, num_threads=4, max_batch=64),
                "copied": GpuDecoder(device_id=0, num_threads=4, max_batch=64, copy_encoded=True)}
    rates: dict[str, list[float]] = {name: [] for name in decoders}
    try:
        for r in range(rounds + 1):  # the first round fills the caches and is dropped
            for name in (list(decoders) if r % 2 == 0 else list(decoders)[::-1]):
                t0 = time.perf_counter()
                for _ in range(3):
                    rows = decoders[name].to_pixel_rows(jobs, spec)
                if r:
                    rates[name].append(3 * len(jobs) / (time.perf_counter() - t0))
                del rows
    except Exception as exc:  # one failing path must not hide the others
        t.results["dali_gpu_to_host_patches_steady"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        return
    for name, values in rates.items():
        t.results[f"dali_gpu_to_host_patches_steady_{name}"] = {"img_s": round(statistics.median(values), 1),
                                                                "rounds": [round(v) for v in values]}
        print(f"[bench] dali_gpu_to_host_patches_steady_{name}: {t.results[f'dali_gpu_to_host_patches_steady_{name}']}",
              flush=True)


def _dali_decode_only(jobs, batch: int, gpu, resize: bool = False):
    """GpuDecoder's decode settings, pipelined over the same batches; outputs stay on the GPU. With
    ``resize``, GpuDecoder's resize too: the DALI pipeline alone, with none of the feeding, patch
    order or normalizing around it. The pipeline is built on the first call (a warm-up, inside ``timed``)."""
    from nvidia.dali import fn, pipeline_def, types

    encoded = [np.frombuffer(j.data, dtype=np.uint8) for j in jobs]
    hws = [np.array(j.decode_hw, dtype=np.float32) for j in jobs]
    built = []

    @pipeline_def(batch_size=batch, num_threads=gpu.num_threads, device_id=0, exec_async=True,
                  exec_pipelined=True, prefetch_queue_depth=gpu.prefetch)
    def decode_pipeline():
        blobs = fn.external_source(source=[encoded[i:i + batch] for i in range(0, len(encoded), batch)],
                                   cycle=True, dtype=types.UINT8)
        images = fn.decoders.image(blobs, device="mixed", output_type=types.RGB, hw_decoder_load=gpu.hw_decoder_load)
        if not resize:
            return images
        sizes = fn.external_source(source=[hws[i:i + batch] for i in range(0, len(hws), batch)], cycle=True,
                                   dtype=types.FLOAT)
        return fn.resize(images, size=sizes, interp_type=types.INTERP_CUBIC, antialias=True, dtype=types.UINT8)

    def run():
        if not built:
            pipe = decode_pipeline()
            pipe.build()
            built.append(pipe)
        for _ in range(0, len(jobs), batch):
            built[0].run()
        _synchronized(None)

    return run


def _gpu_paths(t: _Timings, gpu, jobs, spec, grids, batch: int):
    """DALI GPU to host rows, to GPU pixel_values, resident and streamed (with variants)."""
    from datasvc.media.gpudecode import GpuDecoder

    _pixel_values_kernels(t, spec, grids, batch)
    _video_kernels(t, spec)
    _stage_paths(t, gpu, jobs, spec)
    _host_rows_alternated(t, jobs, spec)
    host_rows = t.timed("dali_gpu_to_host_patches", lambda: gpu.to_pixel_rows(jobs, spec))
    t.timed("dali_gpu_to_gpu_pixel_values", lambda: _to_gpu_pixel_values(gpu.to_pixel_rows(jobs, spec), grids, spec))
    t.timed("dali_gpu_resident_pixel_values", lambda: _synchronized(gpu.to_pixel_values(jobs, spec)))
    t.timed("dali_gpu_stream_pixel_values", lambda: _streamed(gpu, jobs, spec, batch), images=ROUNDS * len(jobs))
    t.timed("dali_gpu_stream_pixel_values_1k_images", lambda: _streamed(gpu, jobs, spec, batch, rounds=4),
            images=4 * len(jobs))
    t.timed("dali_gpu_stream_pixel_values_per_batch8", lambda: _streamed(gpu, jobs, spec, 8), images=ROUNDS * len(jobs))
    for name, kwargs in (("batch128", dict(max_batch=2 * batch)), ("threads8", dict(num_threads=8)),
                         ("hw1.0", dict(hw_decoder_load=1.0)), ("prefetch2", dict(prefetch=2)),
                         ("copied_feed", dict(copy_encoded=True))):
        variant = GpuDecoder(device_id=0, **{"num_threads": 4, "max_batch": batch, **kwargs})
        t.timed(f"dali_gpu_stream_pixel_values_{name}", lambda: _streamed(variant, jobs, spec, variant.max_batch),
                images=ROUNDS * len(jobs))
        del variant
    return host_rows


def _rank_resize(t: _Timings, jobs, spec, batch: int) -> None:
    """What the rank pays for the CPU actors' default: micro-batches of host rows whose images hold
    their decoded frames (``DecodeConfig.resize_on="rank"``), made into bf16 ``pixel_values`` on the
    GPU with the resize, against the same images resized in the actors; the rank's CPU time per
    image for each (kernel launches: what the trainer's thread spends)."""
    import torch

    from datasvc.media.decode import CpuDecoder
    from datasvc.media.vision import FrameRows, image_blocks, to_pixel_values

    grids = [j.grid(spec) for j in jobs]
    for name, rank_resize in (("rank_resize", True), ("actor_resize", False)):
        parts = CpuDecoder(num_threads=os.cpu_count() or 16, max_batch=batch, rank_resize=rank_resize
                           ).to_pixel_rows(jobs, spec)
        batches = []
        for i in range(0, len(jobs), batch):
            blocks, frames = image_blocks(parts[i:i + batch], grids[i:i + batch], spec)
            batches.append((torch.from_numpy(np.concatenate(blocks)).pin_memory(), grids[i:i + batch], frames))
        deferred = sum(isinstance(p, FrameRows) for p in parts)
        cpu_s = []

        def run():
            c0 = time.process_time()
            for rows, g, frames in batches:
                to_pixel_values(rows.to("cuda", non_blocking=True), spec, g, torch.bfloat16, frames_hw=frames)
            torch.cuda.synchronize()
            cpu_s.append(time.process_time() - c0)
        t.timed(f"host_rows_{name}_to_gpu_pixel_values", run)
        t.results[f"host_rows_{name}_to_gpu_pixel_values"].update(
            deferred_images=deferred, rank_cpu_us_per_image=round(1e6 * float(np.median(cpu_s)) / len(jobs), 1))


def gpu_decode_check(out: str, n_images: int = 256, batch: int = 64) -> dict:
    """Every decode path over the same images; results printed and written to OUT/gpu_decode.json."""
    import torch
    import torchvision

    from datasvc.media.decode import CpuDecoder
    from datasvc.media.gpudecode import GpuDecoder
    from datasvc.tools.bench.provenance import commit

    spec, jobs = _jobs(n_images)
    mp = sum(j.header.pixels for j in jobs) / 1e6
    t = _Timings(len(jobs), mp)
    grids = [j.grid(spec) for j in jobs]
    data = [torch.frombuffer(bytearray(j.data), dtype=torch.uint8) for j in jobs]

    gpu = GpuDecoder(device_id=0, num_threads=4, max_batch=batch)
    cpu = CpuDecoder(num_threads=os.cpu_count() or 16, max_batch=batch)
    g = _gpu_paths(t, gpu, jobs, spec, grids, batch)
    c = t.timed("dali_cpu_all_cores_to_host_patches", lambda: cpu.to_pixel_rows(jobs, spec), repeats=2)
    _rank_resize(t, jobs, spec, batch)
    t.timed("torchvision_nvjpeg_to_host_patches", lambda: _torchvision_rows(data, jobs, spec, batch, host=True))
    t.timed("torchvision_nvjpeg_to_gpu_pixel_values",
            lambda: _to_gpu_pixel_values(_torchvision_rows(data, jobs, spec, batch, host=False), grids, spec))

    def decode_only():
        for i in range(0, len(data), batch):
            torchvision.io.decode_jpeg(data[i:i + batch], device="cuda")
        torch.cuda.synchronize()
    t.timed("torchvision_nvjpeg_decode_only", decode_only)
    t.timed("dali_gpu_decode_only", _dali_decode_only(jobs, batch, gpu))
    t.timed("dali_gpu_decode_resize_only", _dali_decode_only(jobs, batch, gpu, resize=True))

    res = {"question": "How fast is DALI GPU decode to pixel_values?", "command": "python -m trainer.bench --gpu-decode-only",
           "commit": commit(), "date": time.strftime("%Y-%m-%d", time.gmtime()),
           "hardware": f"{torch.cuda.get_device_name(0)}, {os.cpu_count()} host cores",
           "images": len(jobs), "megapixels": round(mp, 1), "batch": batch, **t.results}
    mads = [float(np.abs(a.astype(np.float32) - b.astype(np.float32)).mean() / 127.5) for a, b in zip(g, c)
            if isinstance(a, np.ndarray) and isinstance(b, np.ndarray)]
    res["gpu_vs_cpu_mean_abs_diff_normalized"] = round(float(np.mean(mads)), 5) if mads else None
    for name in ("to_host_patches", "to_gpu_pixel_values"):
        res[f"dali_gpu_vs_torchvision_{name}"] = t.ratio(f"dali_gpu_{name}", f"torchvision_nvjpeg_{name}")
    for path in ("resident", "stream"):
        res[f"dali_gpu_{path}_vs_torchvision_to_gpu_pixel_values"] = t.ratio(
            f"dali_gpu_{path}_pixel_values", "torchvision_nvjpeg_to_gpu_pixel_values")
    for path in ("stream_pixel_values", "stream_pixel_values_per_batch8"):  # the goal: >= 0.9x decode alone
        res[f"dali_gpu_{path}_vs_decode_only"] = t.ratio(f"dali_gpu_{path}", "dali_gpu_decode_only")
        res[f"dali_gpu_{path}_vs_decode_resize_only"] = t.ratio(f"dali_gpu_{path}", "dali_gpu_decode_resize_only")
    res["fused_vs_torch_pixel_values_kernel"] = t.ratio("pixel_values_kernel_fused", "pixel_values_kernel_torch")
    res["fused_vs_torch_video_pixel_values_kernel"] = t.ratio("video_pixel_values_kernel_fused",
                                                              "video_pixel_values_kernel_torch")
    res["in_place_vs_copied_feed_to_host_steady"] = t.ratio("dali_gpu_to_host_patches_steady_in_place",
                                                            "dali_gpu_to_host_patches_steady_copied")
    res["fused_vs_torch_pixel_values_stage"] = t.ratio("dali_gpu_stage_rows_pipeline_fused_pixel_values",
                                                       "dali_gpu_stage_rows_pipeline_torch_pixel_values")
    res["rank_resize_vs_actor_resize_to_gpu_pixel_values"] = t.ratio("host_rows_rank_resize_to_gpu_pixel_values",
                                                                     "host_rows_actor_resize_to_gpu_pixel_values")
    res["dali_gpu_vs_dali_cpu_to_host_patches"] = t.ratio("dali_gpu_to_host_patches",
                                                          "dali_cpu_all_cores_to_host_patches")
    print("[bench] gpu decode:", json.dumps(res), flush=True)
    with open(os.path.join(out, "gpu_decode.json"), "w") as f:
        json.dump(res, f, indent=1)
    return res

