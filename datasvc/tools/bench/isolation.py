"""What the per-sample checks cost an actor: its whole work (read, probe, decode, resize, tokenize)
on real photos with the checks, against the same with them switched off, alternated in one run.

Two pairs: ``checks``, the header probe's whole-file check (end-of-image after the scan, IEND, RIFF
length), PIL opened with the decoded formats only, and the reader's JSON check (depth, lone
surrogates); and ``orientation``, reading the EXIF orientation and applying it (a fifth of the photos
carry one), against ignoring it. Switched off, those are swapped for what stood before them, inside
this process only, for the rounds that measure the baseline.

    python -m datasvc.tools.bench.isolation [--images 48] [--rounds 9] [--out DIR]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import tarfile
import tempfile

from datasvc.usage import HelpFormatter


@contextlib.contextmanager
def switched_off(what: str):
    """``checks``: whole-file check, opener formats, JSON check; ``orientation``: EXIF ignored."""
    import datasvc.media.imagefile as imagefile
    import datasvc.read.shards as shards

    saved = imagefile.check_whole, imagefile.read_orientation, imagefile.FORMATS, shards.parse_json
    if what == "checks":
        imagefile.check_whole = lambda data, fmt: None
        imagefile.FORMATS = None  # every PIL opener tried, as before
        shards.parse_json = json.loads
    else:
        imagefile.read_orientation = lambda img: 1
    try:
        yield
    finally:
        imagefile.check_whole, imagefile.read_orientation, imagefile.FORMATS, shards.parse_json = saved


def write_shard(path: str, images: int) -> None:
    """Real photos (0.3-4 MP JPEGs), half as captions and half as one-image conversations, a fifth
    of them with an EXIF orientation."""
    from PIL import Image

    from datasvc.tools.bench.photos import photo_set

    with tarfile.open(path, "w") as tar:
        for i, p in enumerate(photo_set(images)):
            data = p.data
            if i % 5 == 0:
                exif = Image.Exif()
                exif[0x0112] = 6
                b = io.BytesIO()
                Image.open(io.BytesIO(p.data)).save(b, "JPEG", quality=90, exif=exif.tobytes())
                data = b.getvalue()
            text = (json.dumps({"messages": [{"role": "user", "content": "<image>Describe the photo."},
                                             {"role": "assistant", "content": f"Photo {p.name}, number {i}."}]})
                    if i % 2 else f"Photo {p.name}, number {i}.")
            for name, blob in ((f"s{i:04d}.jpg", data), (f"s{i:04d}.{'json' if i % 2 else 'txt'}", text.encode())):
                info = tarfile.TarInfo(name)
                info.size = len(blob)
                tar.addfile(info, io.BytesIO(blob))


def bench_isolation(images: int = 48, rounds: int = 9, max_pixels: int = 1 << 20, work_dir: str | None = None) -> dict:
    from datasvc.media.decode import CpuDecoder
    from datasvc.read.shards import index_shard
    from datasvc.registry import get_pipeline
    from datasvc.stream.process import process_item
    from datasvc.tools.bench.timing import one_thread, paired_cpu_ratio
    from datasvc.wire import WorkItem

    with tempfile.TemporaryDirectory(dir=work_dir) as tmp:
        path = os.path.join(tmp, "photos.tar")
        write_shard(path, images)
        idx = index_shard(path)
        items = [WorkItem(path, f, tuple(idx.samples[f:f + 16])) for f in range(0, len(idx.samples), 16)]
        pipeline = get_pipeline("qwen3vl", max_pixels=max_pixels)
        decoder = CpuDecoder(num_threads=1)

        def run(batch):
            return sum(len(process_item(it, pipeline, decoder).samples) for it in batch)

        def baseline(what):
            def fn(batch):
                with switched_off(what):
                    return run(batch)
            return fn

        report = {"images": images, "max_pixels": max_pixels, "rounds": rounds}
        with one_thread():
            for what in ("checks", "orientation"):
                off = baseline(what)
                assert run(items) == off(items) == len(idx.samples), "every photo must be delivered both ways"
                paired = paired_cpu_ratio(off, run, items, rounds)
                # paired: CPU seconds with / without; throughput goes the other way.
                report[what] = {"without_cpu_s": paired["fast_cpu_s_median"], "with_cpu_s": paired["slow_cpu_s_median"],
                                "throughput_ratio_median": round(1 / paired["ratio_median"], 4),
                                "throughput_ratio_range": [round(1 / paired["ratio_max"], 4),
                                                           round(1 / paired["ratio_min"], 4)]}
        report["probe_us_per_image"] = _probe_cost(path, idx, items)
        per_image_s = report["checks"]["with_cpu_s"] / len(idx.samples)
        extra_s = (report["probe_us_per_image"]["checked"] - report["probe_us_per_image"]["unchecked"]) / 1e6
        # The checks' own time against an actor's whole time per image: steadier than the paired
        # ratio on a loaded machine, where a round's noise is larger than the checks.
        report["checks"]["throughput_ratio_from_probe_cost"] = round(per_image_s / (per_image_s + max(0.0, extra_s)), 5)
    return report


def _probe_cost(path: str, idx, items) -> dict:
    """Best-of-20 process CPU time of the header probe over the shard's images, with and without."""
    import time

    from datasvc.media.imagefile import probe
    from datasvc.read.shards import ReadLimits, read_samples

    blobs = [data for raw in read_samples(path, idx.samples, ReadLimits()) for _, data in raw.images]

    def best() -> float:
        t = float("inf")
        for _ in range(20):
            t0 = time.process_time()
            for b in blobs:
                probe(b, 64_000_000)
            t = min(t, time.process_time() - t0)
        return t / len(blobs) * 1e6

    checked = best()
    with switched_off("checks"):
        unchecked = best()
    return {"checked": round(checked, 2), "unchecked": round(unchecked, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=HelpFormatter)
    ap.add_argument("--images", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--max-pixels", type=int, default=1 << 20)
    ap.add_argument("--out", default=None, help="directory for isolation.json")
    args = ap.parse_args(argv)
    rep = bench_isolation(args.images, args.rounds, args.max_pixels)
    print(json.dumps(rep, indent=1))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "isolation.json"), "w") as f:
            json.dump(rep, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
