"""Evidence runs for a GPU machine: real photos vs calibrated synthetic vs image-free mock, MBS
sweep, frozen vision, packed vs padded rows. Each case is a real ``python -m trainer.run`` job
against one Ray head; results are read back from each job's summary.json.

    python -m trainer.bench --groups proof sources --out $OUT
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import time

PROXY = ["--num-layers", "4", "--seq-len", "4096"]


def _case(strategy: str, source: str, mbs: int, iters: int, *extra: str, label: str = "") -> tuple:
    name = f"{strategy}-{source}-mbs{mbs}{'-' + label if label else ''}"
    return name, source, ["--strategy", strategy, "--mbs", str(mbs), "--train-iters", str(iters), *extra]


def _sources(strategy: str, mbs: int, iters: int, *extra: str, label: str = "") -> list[tuple]:
    """The same case on real-large photos and on the synthetic and mock sets calibrated from them."""
    return [_case(strategy, src, mbs, iters, *extra, label=label)
            for src in ("real-large", "synthetic-large", "mock-large")]


# Sources: "real" is the bundled photo set (96 samples an epoch); "real-large" the same photos as 384
# distinct crops, so that blocks fill the rows of MBS 4 and 8; synthetic/mock are calibrated from
# the real set of the same name and have as many samples.
GROUPS = {
    "proof": [_case("fsdp", "real", 2, 50), _case("3d", "real", 2, 50)],
    "sources": [_case("3d", "synthetic", 2, 30), _case("3d", "mock", 2, 30)],
    "mbs": [_case("3d", "real", 1, 25), _case("3d", "real", 4, 20),
            _case("3d", "real", 8, 15, "--recompute", "full", label="recompute")],
    "variants": [_case("3d", "real", 2, 25, "--freeze-vision-model", label="frozen-vision"),
                 _case("3d", "real", 2, 25, "--padded", label="padded")],
    # Session 2: fsdp sweep and sources on the larger real set, MBS 4/8 under both strategies.
    "fsdp": [_case("fsdp", "real-large", 1, 12), _case("fsdp", "real-large", 2, 12),
             _case("fsdp", "synthetic-large", 2, 12), _case("fsdp", "mock-large", 2, 12)],
    "large-mbs": [_case("fsdp", "real-large", 4, 10, "--recompute", "full", label="recompute"),
                  _case("fsdp", "real-large", 8, 8, "--recompute", "full", label="recompute"),
                  _case("3d", "real-large", 4, 12, "--recompute", "full", label="recompute"),
                  _case("3d", "real-large", 8, 10, "--recompute", "full", label="recompute")],
    "3d-large": [_case("3d", "real-large", 1, 20), _case("3d", "real-large", 2, 20),
                 _case("3d", "synthetic-large", 2, 20), _case("3d", "mock-large", 2, 20),
                 _case("3d", "real-large", 8, 10, "--recompute", "full", "--freeze-vision-model",
                       label="recompute-frozen-vision")],
    "gpu-decode-train": [_case("3d", "real-large", 2, 20, "--decode", "gpu", label="gpu-decode")],
    # Session 3: the vision tower over at most 16k patches at a time (whole images), against one
    # call per micro-batch at MBS 4 (same run), and at MBS 8 where one call ran out of memory.
    "vision-chunks": [_case("3d", "real-large", 4, 12, "--recompute", "full", label="recompute"),
                      _case("3d", "real-large", 4, 12, "--recompute", "full", "--vision-chunk-patches", "16384",
                            label="recompute-vchunk"),
                      _case("3d", "real-large", 8, 10, "--recompute", "full", "--vision-chunk-patches", "16384",
                            label="recompute-vchunk"),
                      _case("fsdp", "real-large", 8, 8, "--recompute", "full", "--vision-chunk-patches", "16384",
                            label="recompute-vchunk")],
    # Then: fewer, larger chunks (16k cost 19% at MBS 4), and expandable allocator segments, since
    # 3d MBS 8 next failed on an 18.55 GiB logits buffer with 18 GiB reserved but unused.
    "vision-chunks-32k": [
        _case("3d", "real-large", 4, 12, "--recompute", "full", "--vision-chunk-patches", "32768",
              label="recompute-vchunk32k"),
        _case("3d", "real-large", 8, 10, "--recompute", "full", "--vision-chunk-patches", "32768",
              "--expandable-segments", label="recompute-vchunk32k-expseg"),
        _case("fsdp", "real-large", 8, 8, "--recompute", "full", "--vision-chunk-patches", "32768",
              "--expandable-segments", label="recompute-vchunk32k-expseg")],
    # Two GPUs against one GPU in the same run: EP2 under 3d (experts split, data-parallel otherwise)
    # and Megatron-FSDP sharding across both. Per-GPU tokens/s over the 1-GPU case is the scaling.
    "two-gpus": [_case("3d", "real-large", 2, 12, "--world-size", "2", "--ep", "2", label="ep2-2gpu"),
                 _case("3d", "real-large", 2, 12, label="1gpu"),
                 _case("fsdp", "real-large", 2, 10, "--world-size", "2", label="2gpu"),
                 _case("fsdp", "real-large", 2, 10, label="1gpu")],
    # Session 4: real vs calibrated synthetic vs image-free mock at MBS 8, where the vision tower's
    # share of the step is largest (Session 2 compared them at MBS 2).
    "sources-mbs8": _sources("3d", 8, 10, "--recompute", "full", "--vision-chunk-patches", "32768",
                             "--expandable-segments", label="recompute-vchunk32k-expseg"),
    # Session 4: blocks sized in micro-batches (the default now) against the old fixed 2 x MBS items.
    "block-sizing": [_case("3d", "real-large", 2, 15, label="sized-blocks"),
                     _case("3d", "real-large", 2, 15, "--items-per-block", "4", label="4-item-blocks")],
    # Session 5: the rest of the source x MBS matrix, with blocks sized in micro-batches and spanning
    # epochs (trainer.run's defaults now), real re-measured beside each so the ratios are same-run.
    "sources-fsdp-mbs8": _sources("fsdp", 8, 8, "--recompute", "full", "--vision-chunk-patches", "32768",
                                  "--expandable-segments", label="recompute-vchunk32k-expseg"),
    "sources-3d-mbs1-4": [*_sources("3d", 1, 20),
                          *_sources("3d", 4, 12, "--recompute", "full", "--vision-chunk-patches", "32768",
                                    label="recompute-vchunk32k")],
    "sources-3d-mbs2": _sources("3d", 2, 15),
    # Session 6: the fsdp cells still missing, chains of 4 (trainer.run's default) throughout.
    "sources-fsdp-mbs1-4": [*_sources("fsdp", 1, 16),
                            *_sources("fsdp", 4, 10, "--recompute", "full", "--vision-chunk-patches", "32768",
                                      label="recompute-vchunk32k")],
    "sources-fsdp-mbs2": _sources("fsdp", 2, 12),
    # Session 5: blocks packed in chains of 4 (trainer.run's default) against each block on its own,
    # same run; the data service alone showed rows 0.98 full against 0.92-0.94 (S5.2).
    "chain-blocks": [_case("3d", "real-large", mbs, iters, "--recompute", "full", "--vision-chunk-patches", "32768",
                           *extra, "--chain-blocks", str(chain), label=f"recompute-vchunk32k-chain{chain}")
                     for mbs, iters, extra in ((4, 20, ()), (8, 16, ("--expandable-segments",)))
                     for chain in (4, 1)],
    # Session 4: the same on four GPUs (EP 4 under 3d; FSDP across four), 1-GPU baselines in the run.
    "four-gpus": [_case("3d", "real-large", 2, 12, "--world-size", "4", "--ep", "4", label="ep4-4gpu"),
                  _case("3d", "real-large", 2, 12, label="1gpu"),
                  _case("fsdp", "real-large", 2, 10, "--world-size", "4", label="4gpu"),
                  _case("fsdp", "real-large", 2, 10, label="1gpu")],
}


def gpu_decode_check(out: str, n_images: int = 256, batch: int = 64) -> dict:
    """Bytes -> uint8 pixel rows in host memory (what the service ships) and -> bf16 ``pixel_values``
    on the GPU, for DALI GPU, DALI CPU on every host core and torchvision nvJPEG, same 1-2 MP JPEGs;
    decode alone for DALI and torchvision, to see what resize, patch order and copies add. (Result
    names say ``patches`` for the rows shipped to the host, as in the sessions 2-4 results.)"""
    import numpy as np
    import torch
    import torch.nn.functional as F
    import torchvision

    from datasvc.bench import photo_set
    from datasvc.decode import CpuDecoder, DecodeJob, GpuDecoder, probe
    from datasvc.vision import VisionSpec, pixel_rows, to_pixel_values

    spec = VisionSpec(max_pixels=16777216)
    photos = photo_set(n_images, min_mp=1.0, max_mp=2.0)
    jobs = []
    for p in photos:
        h = probe(p.data, spec.max_decode_pixels)
        jobs.append(DecodeJob(p.data, h, spec.target_size(h.height, h.width)))
    mp = sum(j.header.pixels for j in jobs) / 1e6
    res = {"images": len(jobs), "megapixels": round(mp, 1), "batch": batch}

    def timed(name, fn, repeats=5, images=len(jobs)):
        try:
            # Two warm-ups: pipeline build, CUDA context, nvJPEG handles, and enough pinned blocks in
            # torch's host cache that timed calls do not pay for pinning fresh pages.
            fn()
            fn()
            t0 = time.perf_counter()
            for _ in range(repeats):
                result = fn()
            dt = (time.perf_counter() - t0) / repeats
            res[name] = {"img_s": round(images / dt, 1), "mp_s": round(mp * images / len(jobs) / dt, 1)}
        except Exception as exc:  # one failing path must not hide the others
            res[name], result = {"error": f"{type(exc).__name__}: {exc}"[:300]}, []
        print(f"[bench] {name}: {res[name]}", flush=True)
        return result

    def ratio(a, b):
        ra, rb = res[a].get("img_s"), res[b].get("img_s")
        return round(ra / rb, 3) if ra and rb else None

    grids = [j.grid(spec) for j in jobs]

    def to_gpu_pixel_values(rows_per_image):
        values = [to_pixel_values(r if torch.is_tensor(r) else torch.from_numpy(r).cuda(non_blocking=True),
                                  spec, [grid], torch.bfloat16) for r, grid in zip(rows_per_image, grids)]
        torch.cuda.synchronize()
        return values

    def synchronized(result):
        torch.cuda.synchronize()
        return result

    data = [torch.frombuffer(bytearray(j.data), dtype=torch.uint8) for j in jobs]

    def torchvision_rows(host: bool):
        """nvJPEG batched decode and bicubic antialiased resize in torch, on the GPU, to pixel rows."""
        out = []
        for i in range(0, len(data), batch):
            images = torchvision.io.decode_jpeg(data[i:i + batch], device="cuda", mode=torchvision.io.ImageReadMode.RGB)
            for img, job in zip(images, jobs[i:i + batch]):
                x = F.interpolate(img[None].float(), size=job.target_hw, mode="bicubic", antialias=True)
                x = x.round_().clamp_(0, 255).to(torch.uint8)[0]  # [3, th, tw]
                out.append(pixel_rows(x.permute(1, 2, 0).contiguous(), spec))
        if host:
            out = [torch.empty(t.shape, dtype=torch.uint8, pin_memory=True).copy_(t, non_blocking=True) for t in out]
        torch.cuda.synchronize()
        return out

    gpu = GpuDecoder(device_id=0, num_threads=4, max_batch=batch)
    cpu = CpuDecoder(num_threads=os.cpu_count() or 16, max_batch=batch)
    g = timed("dali_gpu_to_host_patches", lambda: gpu.to_pixel_rows(jobs, spec))
    timed("dali_gpu_to_gpu_pixel_values", lambda: to_gpu_pixel_values(gpu.to_pixel_rows(jobs, spec)))
    timed("dali_gpu_resident_pixel_values", lambda: synchronized(gpu.to_pixel_values(jobs, spec)))

    def streamed(decoder, per_batch: int, rounds: int = 4):
        """What a rank sees: batches of ``per_batch`` images in one stream, each dropped once used."""
        batches = [jobs[i:i + per_batch] for i in range(0, len(jobs), per_batch)] * rounds
        n = 0
        for values in decoder.stream_pixel_values(batches, spec):
            n += len(values)
        return synchronized(n)

    timed("dali_gpu_stream_pixel_values", lambda: streamed(gpu, batch), images=4 * len(jobs))
    timed("dali_gpu_stream_pixel_values_per_batch8", lambda: streamed(gpu, 8), images=4 * len(jobs))
    for name, kwargs in (("batch128", dict(max_batch=2 * batch)), ("threads8", dict(num_threads=8)),
                         ("hw1.0", dict(hw_decoder_load=1.0))):
        variant = GpuDecoder(device_id=0, **{"num_threads": 4, "max_batch": batch, **kwargs})
        timed(f"dali_gpu_stream_pixel_values_{name}", lambda: streamed(variant, variant.max_batch),
              images=4 * len(jobs))
        del variant
    c = timed("dali_cpu_all_cores_to_host_patches", lambda: cpu.to_pixel_rows(jobs, spec), repeats=2)
    timed("torchvision_nvjpeg_to_host_patches", lambda: torchvision_rows(host=True))
    timed("torchvision_nvjpeg_to_gpu_pixel_values", lambda: to_gpu_pixel_values(torchvision_rows(host=False)))

    @functools.cache
    def dali_decode_pipeline():
        """GpuDecoder's decode settings, pipelined over the same batches; outputs stay on the GPU."""
        from nvidia.dali import fn, pipeline_def, types

        encoded = [np.frombuffer(j.data, dtype=np.uint8) for j in jobs]

        @pipeline_def(batch_size=batch, num_threads=gpu.num_threads, device_id=0, exec_async=True,
                      exec_pipelined=True, prefetch_queue_depth=2)
        def decode_pipeline():
            blobs = fn.external_source(source=[encoded[i:i + batch] for i in range(0, len(encoded), batch)],
                                       cycle=True, dtype=types.UINT8)
            return fn.decoders.image(blobs, device="mixed", output_type=types.RGB,
                                     hw_decoder_load=gpu.hw_decoder_load)

        pipe = decode_pipeline()
        pipe.build()
        return pipe

    def dali_decode_only():
        pipe = dali_decode_pipeline()  # built by the first warm-up, inside timed()
        for _ in range(0, len(jobs), batch):
            pipe.run()
        torch.cuda.synchronize()

    def decode_only():
        for i in range(0, len(data), batch):
            torchvision.io.decode_jpeg(data[i:i + batch], device="cuda")
        torch.cuda.synchronize()
    timed("torchvision_nvjpeg_decode_only", decode_only)
    timed("dali_gpu_decode_only", dali_decode_only)
    mads = [float(np.abs(a.astype(np.float32) - b.astype(np.float32)).mean() / 127.5) for a, b in zip(g, c)
            if isinstance(a, np.ndarray) and isinstance(b, np.ndarray)]
    res["gpu_vs_cpu_mean_abs_diff_normalized"] = round(float(np.mean(mads)), 5) if mads else None
    for name in ("to_host_patches", "to_gpu_pixel_values"):
        res[f"dali_gpu_vs_torchvision_{name}"] = ratio(f"dali_gpu_{name}", f"torchvision_nvjpeg_{name}")
    for path in ("resident", "stream"):
        res[f"dali_gpu_{path}_vs_torchvision_to_gpu_pixel_values"] = ratio(f"dali_gpu_{path}_pixel_values",
                                                                          "torchvision_nvjpeg_to_gpu_pixel_values")
    res["dali_gpu_vs_dali_cpu_to_host_patches"] = ratio("dali_gpu_to_host_patches", "dali_cpu_all_cores_to_host_patches")
    print("[bench] gpu decode:", json.dumps(res), flush=True)
    with open(os.path.join(out, "gpu_decode.json"), "w") as f:
        json.dump(res, f, indent=1)
    return res


def prepare_sources(root: str, wanted: set[str]) -> dict[str, list[str]]:
    """Shards for the wanted sources; synthetic and mock are written once per root and reused."""
    from datasvc.samples import default_shards, large_shards
    from datasvc.shards import index_shard
    from datasvc.synth import calibrate, write_shards

    out = {}
    for suffix, real in (("", default_shards), ("-large", large_shards)):
        if not wanted & {f"real{suffix}", f"synthetic{suffix}", f"mock{suffix}"}:
            continue
        out[f"real{suffix}"] = paths = real()
        n = sum(len(index_shard(p).samples) for p in paths)
        profile = calibrate(paths)
        for kind in ("synthetic", "mock"):
            name = f"{kind}{suffix}"
            if name in wanted:
                target = os.path.join(root, name)
                done = os.path.join(target, ".complete")
                if not os.path.exists(done):
                    write_shards(target, n, profile, seed=0, samples_per_shard=32, mock=kind == "mock",
                                 progress=False)
                    open(done, "w").close()
                out[name] = sorted(os.path.join(target, f) for f in os.listdir(target) if f.endswith(".tar"))
    return out


def partial_summary(metrics_path: str, wall_s: float) -> dict:
    """The steady-state summary of the steps a case finished before it was cut short, marked partial."""
    from trainer.run import summarize

    with open(metrics_path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    if not records:
        return {}
    s = summarize(records, {}, "megatron", 0, wall_s)
    for key in ("data", "world_size", "backend", "data_accounting", "autoscale_decisions"):
        s.pop(key)
    return {**s, "partial": True}


def run_case(name: str, shards: list[str], extra: list[str], address: str, out: str, timeout: int) -> dict:
    case_out = os.path.join(out, name)
    world = [] if "--world-size" in extra else ["--world-size", "1"]
    cmd = [sys.executable, "-m", "trainer.run", "qwen3vl", "--address", address, "--out", case_out,
           "--shards", *shards, "--data-actors", "2", "8", *PROXY, *world, *extra]
    t0 = time.time()
    print(f"[bench] {name}: {len(shards)} shards, {' '.join(extra)}", flush=True)
    with open(os.path.join(out, f"{name}.log"), "w") as log:
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    result = {"case": name, "rc": rc, "wall_s": round(time.time() - t0, 1), "args": extra}
    summary = os.path.join(case_out, "summary.json")
    if os.path.exists(summary):
        s = json.load(open(summary))
        s.pop("data", None)
        result.update(s)
    metrics = os.path.join(case_out, "metrics.jsonl")
    if os.path.exists(metrics):
        shutil.copy(metrics, os.path.join(out, f"{name}.metrics.jsonl"))
        if "steps" not in result:  # cut short (deadline, crash): summarize the steps it did finish
            result.update(partial_summary(metrics, result["wall_s"]))
    print(f"[bench] {name}: rc={rc} " + json.dumps({k: result.get(k) for k in (
        "steps", "step_time_s", "tokens_per_s", "tflops_per_gpu", "data_wait_share", "peak_mem_gib",
        "loss_first", "loss_last")}), flush=True)
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer.bench")
    ap.add_argument("--groups", nargs="+", default=["proof", "sources", "mbs", "variants"], choices=list(GROUPS))
    ap.add_argument("--only", nargs="+", default=None, metavar="CASE",
                    help="run only these cases of the chosen groups (names as printed, e.g. 3d-real-mbs2)")
    ap.add_argument("--out", default=os.environ.get("OUT", "out/bench"))
    ap.add_argument("--shards-dir", default=None, help="where synthetic/mock shards are written and reused "
                                                       "(default: OUT/shards)")
    ap.add_argument("--case-timeout", type=int, default=200)
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds from start after which no case starts and a running one is cut short")
    ap.add_argument("--gpu-decode", action="store_true", help="also compare DALI GPU decode (needs DALI + CUDA)")
    ap.add_argument("--gpu-decode-only", action="store_true", help="only the GPU decode comparison")
    args = ap.parse_args(argv)
    start = time.time()
    os.makedirs(args.out, exist_ok=True)
    if args.gpu_decode or args.gpu_decode_only:
        try:
            gpu_decode_check(args.out)
        except Exception as exc:  # report and go on to the training cases
            print(f"[bench] gpu decode check failed: {type(exc).__name__}: {exc}", flush=True)
    if args.gpu_decode_only:
        return 0
    cases = [c for g in args.groups for c in GROUPS[g]]
    if args.only:
        unknown = set(args.only) - {name for name, _, _ in cases}
        if unknown:
            ap.error(f"--only {' '.join(sorted(unknown))}: not a case of --groups {' '.join(args.groups)}; "
                     f"choose from {', '.join(name for name, _, _ in cases)}")
        cases = [c for c in cases if c[0] in args.only]
    sources = prepare_sources(args.shards_dir or os.path.join(args.out, "shards"), {src for _, src, _ in cases})
    address = "127.0.0.1:6390"
    subprocess.run(["ray", "start", "--head", "--node-ip-address=127.0.0.1", "--port=6390",
                    "--include-dashboard=false"], check=True)
    results = []
    try:
        for name, source, extra in cases:
            timeout = args.case_timeout
            if args.deadline is not None:
                timeout = min(timeout, int(args.deadline - (time.time() - start)))
                if timeout < 60:
                    print(f"[bench] {name}: skipped, {timeout} s left before the deadline", flush=True)
                    results.append({"case": name, "rc": "skipped (deadline)", "args": extra})
                    continue
            results.append(run_case(name, sources[source], extra, address, args.out, timeout))
            with open(os.path.join(args.out, "bench.json"), "w") as f:
                json.dump(results, f, indent=1)
    finally:
        subprocess.run(["ray", "stop", "--force"])
        with open(os.path.join(args.out, "bench.json"), "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
