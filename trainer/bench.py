"""Evidence runs for a GPU machine: real photos vs calibrated synthetic vs image-free mock, MBS
sweep, frozen vision, packed vs padded rows. Each case is a real ``python -m trainer.run`` job
against one Ray head; results are read back from each job's summary.json.

    python -m trainer.bench --groups proof sources --out $OUT
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

PROXY = ["--num-layers", "4", "--seq-len", "4096"]
GROUPS = {
    # name: list of (case name, source, extra trainer.run args)
    "proof": [("fsdp-real-mbs2", "real", ["--strategy", "fsdp", "--mbs", "2", "--train-iters", "50"]),
              ("3d-real-mbs2", "real", ["--strategy", "3d", "--mbs", "2", "--train-iters", "50"])],
    "sources": [("3d-synthetic-mbs2", "synthetic", ["--strategy", "3d", "--mbs", "2", "--train-iters", "30"]),
                ("3d-mock-mbs2", "mock", ["--strategy", "3d", "--mbs", "2", "--train-iters", "30"])],
    "mbs": [("3d-real-mbs1", "real", ["--strategy", "3d", "--mbs", "1", "--train-iters", "25"]),
            ("3d-real-mbs4", "real", ["--strategy", "3d", "--mbs", "4", "--train-iters", "20"]),
            ("3d-real-mbs8-recompute", "real", ["--strategy", "3d", "--mbs", "8", "--train-iters", "15",
                                                "--recompute", "full"])],
    "variants": [("3d-real-mbs2-frozen-vision", "real", ["--strategy", "3d", "--mbs", "2", "--train-iters", "25",
                                                         "--freeze-vision-model"]),
                 ("3d-real-mbs2-padded", "real", ["--strategy", "3d", "--mbs", "2", "--train-iters", "25",
                                                  "--padded"])],
}


def gpu_decode_check(out: str, n_images: int = 128, batch: int = 64) -> dict:
    """DALI GPU decode+resize vs DALI CPU (all host cores) vs torchvision nvJPEG, same JPEGs."""
    import numpy as np
    import torch
    import torchvision

    from datasvc.bench import photo_set
    from datasvc.decode import CpuDecoder, DecodeJob, GpuDecoder, probe
    from datasvc.vision import VisionSpec

    spec = VisionSpec(max_pixels=16777216)
    photos = photo_set(n_images, min_mp=1.0, max_mp=2.0)
    blobs = [p.data for p in photos]
    jobs = []
    for b in blobs:
        h = probe(b, spec.max_decode_pixels)
        jobs.append(DecodeJob(b, h, spec.target_size(h.height, h.width)))
    mp = sum(j.header.pixels for j in jobs) / 1e6
    res = {"images": len(jobs), "megapixels": round(mp, 1)}

    def timed(name, fn, repeats=3):
        fn()  # warm-up (pipeline build, cuda context, nvjpeg handles)
        t0 = time.perf_counter()
        for _ in range(repeats):
            out = fn()
        dt = (time.perf_counter() - t0) / repeats
        res[name] = {"img_s": round(len(jobs) / dt, 1), "mp_s": round(mp / dt, 1)}
        return out

    gpu = GpuDecoder(device_id=0, num_threads=4, max_batch=batch)
    cpu = CpuDecoder(num_threads=os.cpu_count() or 16, max_batch=batch)
    g = timed("dali_gpu_decode_resize", lambda: gpu.decode(jobs))
    c = timed("dali_cpu_decode_resize", lambda: cpu.decode(jobs), repeats=1)
    data = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blobs]

    def tv():
        outs = []
        for i in range(0, len(data), batch):
            outs += torchvision.io.decode_jpeg(data[i:i + batch], device="cuda")
        torch.cuda.synchronize()
        return outs
    timed("torchvision_nvjpeg_decode", tv)
    mads = [float(np.abs(a.astype(np.float32) - b.astype(np.float32)).mean() / 127.5) for a, b in zip(g, c)
            if isinstance(a, np.ndarray) and isinstance(b, np.ndarray)]
    res["gpu_vs_cpu_mean_abs_diff_normalized"] = round(float(np.mean(mads)), 5)
    res["gpu_vs_torchvision"] = round(res["dali_gpu_decode_resize"]["img_s"] / res["torchvision_nvjpeg_decode"]["img_s"], 3)
    print("[bench] gpu decode:", json.dumps(res), flush=True)
    with open(os.path.join(out, "gpu_decode.json"), "w") as f:
        json.dump(res, f, indent=1)
    return res


def prepare_sources(root: str) -> dict[str, list[str]]:
    from datasvc.samples import default_shards
    from datasvc.shards import index_shard
    from datasvc.synth import calibrate, write_shards

    real = default_shards()
    n = sum(len(index_shard(p).samples) for p in real)
    profile = calibrate(real)
    synthetic = write_shards(os.path.join(root, "synthetic"), n, profile, seed=0, samples_per_shard=32, progress=False)
    mock = write_shards(os.path.join(root, "mock"), n, profile, seed=0, samples_per_shard=32, mock=True, progress=False)
    return {"real": real, "synthetic": synthetic, "mock": mock}


def run_case(name: str, shards: list[str], extra: list[str], address: str, out: str, timeout: int) -> dict:
    case_out = os.path.join(out, name)
    cmd = [sys.executable, "-m", "trainer.run", "qwen3vl", "--address", address, "--out", case_out,
           "--shards", *shards, "--data-actors", "2", "8", *PROXY, *extra]
    t0 = time.time()
    print(f"[bench] {name}: {' '.join(cmd[3:])}", flush=True)
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
    print(f"[bench] {name}: rc={rc} " + json.dumps({k: result.get(k) for k in (
        "steps", "step_time_s", "tokens_per_s", "tflops_per_gpu", "data_wait_share", "peak_mem_gib",
        "loss_first", "loss_last")}), flush=True)
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer.bench")
    ap.add_argument("--groups", nargs="+", default=list(GROUPS), choices=list(GROUPS))
    ap.add_argument("--out", default=os.environ.get("OUT", "out/bench"))
    ap.add_argument("--case-timeout", type=int, default=200)
    ap.add_argument("--gpu-decode", action="store_true", help="also compare DALI GPU decode (needs DALI + CUDA)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.gpu_decode:
        try:
            gpu_decode_check(args.out)
        except Exception as exc:  # report and go on to the training cases
            print(f"[bench] gpu decode check failed: {type(exc).__name__}: {exc}", flush=True)
    sources = prepare_sources(os.path.join(args.out, "shards"))
    address = "127.0.0.1:6390"
    subprocess.run(["ray", "start", "--head", "--node-ip-address=127.0.0.1", "--port=6390",
                    "--include-dashboard=false"], check=True)
    results = []
    try:
        for g in args.groups:
            for name, source, extra in GROUPS[g]:
                results.append(run_case(name, sources[source], extra, address, args.out, args.case_timeout))
                with open(os.path.join(args.out, "bench.json"), "w") as f:
                    json.dump(results, f, indent=1)
    finally:
        subprocess.run(["ray", "stop", "--force"])
        shutil.rmtree(os.path.join(args.out, "shards"), ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
