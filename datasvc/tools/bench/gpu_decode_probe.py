"""Where DALI GPU decode time goes on one GPU: sync vs pipelined, with and without resize (cubic as
GpuDecoder does, or linear), against torchvision nvJPEG, on the same JPEGs.
``python -m datasvc.tools.bench.gpu_decode_probe --out DIR`` (needs CUDA)."""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from datasvc.usage import HelpFormatter

# (name, pipeline options, copy the output back to the host)
CASES = [("sync_decode", dict(pipelined=False, resize=False), False),
         ("pipelined_decode", dict(pipelined=True, resize=False), False),
         ("pipelined_decode_hw0.9", dict(pipelined=True, resize=False, hw_load=0.9), False),
         ("pipelined_decode_resize", dict(pipelined=True, resize=True), False),
         # At GpuDecoder's load: if cubic is well below linear, the resize limits it.
         ("pipelined_decode_resize_hw0.9", dict(pipelined=True, resize=True, hw_load=0.9), False),
         ("pipelined_decode_resize_linear_hw0.9", dict(pipelined=True, resize=True, hw_load=0.9, interp="linear"), False),
         ("pipelined_decode_resize_copyback", dict(pipelined=True, resize=True), True)]


def _inputs(n: int, batch: int, pipeline: str) -> tuple[list, list]:
    """(encoded JPEGs, batches of (encoded, target size)) of ``n`` 1-2 MP photos."""
    from datasvc.media.decode import probe
    from datasvc.registry import get_layout
    from datasvc.tools.bench.photos import photo_set

    spec = get_layout(pipeline).vision
    photos = photo_set(n, min_mp=1.0, max_mp=2.0)
    blobs = [np.frombuffer(p.data, dtype=np.uint8) for p in photos]
    sizes = []
    for p in photos:
        h = probe(p.data, spec.max_decode_pixels)
        sizes.append(np.array(spec.target_size(h.height, h.width), dtype=np.float32))
    return blobs, [(blobs[i:i + batch], sizes[i:i + batch]) for i in range(0, len(blobs), batch)]


def _build(batches: list, batch: int, pipelined: bool, resize: bool, threads: int = 4, hw_load: float = 0.65,
           interp: str = "cubic"):
    from nvidia.dali import fn, pipeline_def, types

    def source():
        i = 0
        while True:
            yield batches[i % len(batches)]
            i += 1

    src = source()
    interp_type = types.INTERP_CUBIC if interp == "cubic" else types.INTERP_LINEAR

    @pipeline_def(batch_size=batch, num_threads=threads, device_id=0, exec_async=pipelined,
                  exec_pipelined=pipelined, prefetch_queue_depth=2 if pipelined else 1)
    def pipe():
        enc, size = fn.external_source(source=lambda: next(src), num_outputs=2, batch=True,
                                       dtype=[types.UINT8, types.FLOAT])
        img = fn.decoders.image(enc, device="mixed", output_type=types.RGB, hw_decoder_load=hw_load)
        if resize:
            img = fn.resize(img, size=size, interp_type=interp_type, antialias=True, dtype=types.UINT8)
        return img

    p = pipe()
    p.build()
    return p


def _images_per_s(p, batch: int, runs: int = 12, copy_back: bool = False) -> float:
    for _ in range(2):
        p.run()
    t0 = time.perf_counter()
    for _ in range(runs):
        (out,) = p.run()
        if copy_back:
            out = out.as_cpu()
    return round(runs * batch / (time.perf_counter() - t0), 1)


def _torchvision_nvjpeg(blobs: list, batch: int) -> float:
    import torch
    import torchvision

    data = [torch.from_numpy(b.copy()) for b in blobs]
    torchvision.io.decode_jpeg(data[:batch], device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        for i in range(0, len(data), batch):
            torchvision.io.decode_jpeg(data[i:i + batch], device="cuda")
    torch.cuda.synchronize()
    return round(3 * len(data) / (time.perf_counter() - t0), 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m datasvc.tools.bench.gpu_decode_probe", description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--images", type=int, default=128)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--pipeline", default="qwen3vl", help="whose vision spec sets the resize targets")
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    blobs, batches = _inputs(args.images, args.batch, args.pipeline)
    res: dict = {"images": len(blobs)}
    for name, kw, copy_back in CASES:
        try:
            res[name] = _images_per_s(_build(batches, args.batch, **kw), args.batch, copy_back=copy_back)
            print(name, res[name], "img/s", flush=True)
        except Exception as exc:  # one case failing (no hardware decoder, ...) leaves the others to run
            res[name] = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
            print(name, res[name], flush=True)
    res["torchvision_nvjpeg"] = _torchvision_nvjpeg(blobs, args.batch)
    print(json.dumps(res), flush=True)
    with open(os.path.join(args.out, "gpu_decode_probe.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
