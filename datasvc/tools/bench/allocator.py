"""Do the preprocessing actors' allocator settings cut their CPU per image? Process pairs, one under
``PoolConfig.actor_malloc_tunables`` and one under glibc's defaults, alternated round by round
(which goes first alternates too), each timing on one thread the actors' default work (DALI decode,
frames left to the rank) and torchvision's decode on the same photos. glibc reads its tunables only
when a process starts, so the pair is two processes, not two settings in one.

    python -m datasvc.tools.bench.allocator [--rounds 5] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np

from datasvc.tools.bench.provenance import stamp
from datasvc.usage import HelpFormatter

CASES = {"0.3-4 MP": (0.3, 4.0, 20), "8-16 MP": (8.0, 16.0, 6)}  # (min MP, max MP, photos)


def measure(min_mp: float, max_mp: float, images: int, max_pixels: int, passes: int = 3) -> dict[str, float]:
    """This process's CPU ms per image of the actors' work and of torchvision's decode, each the
    mean of ``passes`` passes over the photos after a warm-up."""
    import time

    from datasvc.config import DecodeConfig
    from datasvc.media.decode import CpuDecoder
    from datasvc.registry import get_layout
    from datasvc.tools.bench.decode import _ours, _torchvision_decode
    from datasvc.tools.bench.photos import photo_set
    from datasvc.tools.bench.timing import one_thread

    photos = photo_set(images, seed=0, min_mp=min_mp, max_mp=max_mp)
    spec = get_layout("qwen3vl", max_pixels=max_pixels).vision
    out = {}
    with one_thread():
        decoder = CpuDecoder(num_threads=1, rank_resize=DecodeConfig.resize_on == "rank")
        for name, run in (("actors", _ours(spec, decoder, 16)), ("torchvision", _torchvision_decode)):
            run(photos)
            t0 = time.process_time()
            for _ in range(passes):
                run(photos)
            out[name] = 1e3 * (time.process_time() - t0) / passes / len(photos)
    return out


def _child(tunables: str, case: tuple[float, float, int], max_pixels: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    if tunables:
        env["GLIBC_TUNABLES"] = tunables
    proc = subprocess.run([sys.executable, "-m", "datasvc.tools.bench.allocator", "--measure",
                           *(str(x) for x in case), str(max_pixels)], env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"measuring process failed: {proc.stderr[-1000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bench_allocator(rounds: int = 5, cases: dict = CASES, max_pixels: int = 16777216) -> dict:
    from datasvc.config import ACTOR_MALLOC_TUNABLES

    rows = {}
    for name, case in cases.items():
        per: dict[str, list] = {"defaults": [], "actors": []}
        for r in range(rounds):
            for which in (("defaults", "actors") if r % 2 == 0 else ("actors", "defaults")):
                per[which].append(_child(ACTOR_MALLOC_TUNABLES if which == "actors" else "", case, max_pixels))
                print(f"[allocator] {name} round {r + 1}/{rounds} {which}: {per[which][-1]}", flush=True)
        rows[name] = {"glibc_tunables_seen": {k: sorted({x["glibc_tunables"] for x in v}) for k, v in per.items()}}
        for what in ("actors", "torchvision"):
            ratios = [d[what] / a[what] for d, a in zip(per["defaults"], per["actors"])]
            rows[name][what] = {
                "cpu_ms_per_image_median": {k: round(float(np.median([x[what] for x in v])), 3)
                                            for k, v in per.items()},
                "defaults_over_actors_median": round(float(np.median(ratios)), 3),
                "range": [round(min(ratios), 3), round(max(ratios), 3)]}
    return {"tunables": ACTOR_MALLOC_TUNABLES, "rounds": rounds, "max_pixels": max_pixels,
            "photos": {k: {"min_mp": c[0], "max_mp": c[1], "count": c[2]} for k, c in cases.items()}, "cases": rows}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--measure"]:  # one side of a pair, in its own process
        lo, hi, n, cap = argv[1:5]
        print(json.dumps({**measure(float(lo), float(hi), int(n), int(cap)),
                          "glibc_tunables": os.environ.get("GLIBC_TUNABLES", "")}))
        return 0
    ap = argparse.ArgumentParser(prog="python -m datasvc.tools.bench.allocator", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--images", type=int, default=None, help="photos per case (default: 20 and 6)")
    ap.add_argument("--max-pixels", type=int, default=16777216)
    ap.add_argument("--out", default=None, help="directory for allocator.json")
    args = ap.parse_args(argv)
    cases = {k: (lo, hi, args.images or n) for k, (lo, hi, n) in CASES.items()}
    rep = stamp(bench_allocator(args.rounds, cases, args.max_pixels),
                "Do the preprocessing actors' allocator settings cut their CPU per image?",
                "python -m datasvc.tools.bench.allocator " + " ".join(argv))
    for name, row in rep["cases"].items():
        for what in ("actors", "torchvision"):
            r = row[what]
            print(f"{name:9} {what:12} CPU ms/image: defaults {r['cpu_ms_per_image_median']['defaults']:.2f}, "
                  f"actors' {r['cpu_ms_per_image_median']['actors']:.2f}; defaults / actors' "
                  f"{r['defaults_over_actors_median']:.3f} (range {r['range'][0]:.3f}-{r['range'][1]:.3f})")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "allocator.json"), "w") as f:
            json.dump(rep, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
