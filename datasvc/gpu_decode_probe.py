"""Where DALI GPU decode time goes on one GPU: sync vs pipelined, with and without resize (cubic as
GpuDecoder does, or linear), against torchvision nvJPEG, on the same JPEGs.
``python -m datasvc.gpu_decode_probe --out DIR``."""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=128)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    from nvidia.dali import fn, pipeline_def, types

    from datasvc.bench import photo_set
    from datasvc.decode import probe
    from datasvc.vision import VisionSpec

    spec = VisionSpec()
    photos = photo_set(args.images, min_mp=1.0, max_mp=2.0)
    blobs = [np.frombuffer(p.data, dtype=np.uint8) for p in photos]
    sizes = []
    for p in photos:
        h = probe(p.data, spec.max_decode_pixels)
        sizes.append(np.array(spec.target_size(h.height, h.width), dtype=np.float32))
    B = args.batch
    batches = [(blobs[i:i + B], sizes[i:i + B]) for i in range(0, len(blobs), B)]
    res = {"images": len(blobs)}

    def source():
        i = 0
        while True:
            yield batches[i % len(batches)]
            i += 1

    def build(pipelined: bool, resize: bool, threads: int = 4, hw_load: float = 0.65, interp=types.INTERP_CUBIC):
        src = source()

        @pipeline_def(batch_size=B, num_threads=threads, device_id=0, exec_async=pipelined,
                      exec_pipelined=pipelined, prefetch_queue_depth=2 if pipelined else 1)
        def pipe():
            enc, size = fn.external_source(source=lambda: next(src), num_outputs=2, batch=True,
                                           dtype=[types.UINT8, types.FLOAT])
            img = fn.decoders.image(enc, device="mixed", output_type=types.RGB, hw_decoder_load=hw_load)
            if resize:
                img = fn.resize(img, size=size, interp_type=interp, antialias=True, dtype=types.UINT8)
            return img

        p = pipe()
        p.build()
        return p

    def measure(name, p, runs=12, copy_back=False):
        for _ in range(2):
            p.run()
        t0 = time.perf_counter()
        for _ in range(runs):
            (out,) = p.run()
            if copy_back:
                out = out.as_cpu()
        dt = time.perf_counter() - t0
        res[name] = round(runs * B / dt, 1)
        print(name, res[name], "img/s", flush=True)

    for name, kw, cb in [("sync_decode", dict(pipelined=False, resize=False), False),
                         ("pipelined_decode", dict(pipelined=True, resize=False), False),
                         ("pipelined_decode_hw0.9", dict(pipelined=True, resize=False, hw_load=0.9), False),
                         ("pipelined_decode_resize", dict(pipelined=True, resize=True), False),
                         # At GpuDecoder's load: if cubic is well below linear, the resize limits it.
                         ("pipelined_decode_resize_hw0.9", dict(pipelined=True, resize=True, hw_load=0.9), False),
                         ("pipelined_decode_resize_linear_hw0.9",
                          dict(pipelined=True, resize=True, hw_load=0.9, interp=types.INTERP_LINEAR), False),
                         ("pipelined_decode_resize_copyback", dict(pipelined=True, resize=True), True)]:
        try:
            measure(name, build(**kw), copy_back=cb)
        except Exception as exc:
            res[name] = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
            print(name, res[name], flush=True)
    import torch
    import torchvision

    data = [torch.from_numpy(b.copy()) for b in blobs]
    torchvision.io.decode_jpeg(data[:B], device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        for i in range(0, len(data), B):
            torchvision.io.decode_jpeg(data[i:i + B], device="cuda")
    torch.cuda.synchronize()
    res["torchvision_nvjpeg"] = round(3 * len(data) / (time.perf_counter() - t0), 1)
    print(json.dumps(res), flush=True)
    with open(os.path.join(args.out, "gpu_decode_probe.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
