"""Benchmarks, each answering one question: ``vlmfeed bench NAME`` (``python -m datasvc.tools.bench NAME``).

    vlmfeed bench decode  [--images N] [--max-pixels P] [--synth N] [--out results.json]
    vlmfeed bench service [--max-actors N] [--samples N] [--out results.json]
    vlmfeed bench soak    [--minutes M] [--kill-every S]
    vlmfeed bench sizing  [SHARDS ...] [--probe-samples 64 128 256] [--seeds 8]
    vlmfeed bench peers   data|train|all|duplication ...   against Bridge's loader, Energon, AutoModel, Ray Data
    vlmfeed bench video   [--formats vp9/webm h264/mp4 ...] [--sizes 640x360 1280x720] [--out results.json]
    vlmfeed bench allocator [--rounds 5] [--out DIR]   the actors' allocator settings against glibc's defaults
    vlmfeed bench text    [--profile llava-sft] [--samples 256] [--out FILE]   chat text's tokenizer paths

``decode``: per-core decode / preprocess throughput against raw decode and the HF processors, and
packing efficiency (``bench.decode``). ``service``: the Ray-streamed path with 1..N actors against
the in-process path (``bench.service``). ``soak``: stream good and hostile shards while killing
actors, and count what is lost (``bench.soak``). ``sizing``: block sizing's estimate against the
whole set, per probe size (``bench.sizing``). ``video``: video decode frames/s, DALI CPU against
PyAV (and DALI GPU where a device is) on the same clips (``bench.video``). Each subcommand imports
only what it runs.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from datasvc.tools.bench.provenance import stamp
from datasvc.usage import positive_float, positive_int


def _as_the_actors_allocate(wanted: bool) -> None:
    """Restart this process under the preprocessing actors' ``GLIBC_TUNABLES`` when ``wanted`` and
    not already under them (glibc reads them only at start)."""
    from datasvc.config import PoolConfig

    tunables = PoolConfig.actor_malloc_tunables
    if wanted and tunables and tunables not in os.environ.get("GLIBC_TUNABLES", ""):
        env = {**os.environ, "GLIBC_TUNABLES": ":".join(t for t in (tunables, os.environ.get("GLIBC_TUNABLES")) if t)}
        sys.stdout.flush()
        os.execve(sys.executable, sys.orig_argv, env)


# Benches with options of their own: given the rest of the command line as it is, by module name.
# ``peers`` feeds the trainer from the stock loaders too, so it lives with the trainer and is
# loaded only when chosen, as ``vlmfeed plan`` is.
OWN_OPTIONS = {
    "balance": ("datasvc.tools.bench.balance", "DP balance of the dealt micro-batches, simulated at DP 8-512"),
    "planning": ("datasvc.tools.bench.planning", "what planning a balanced step costs a feeder"),
    "isolation": ("datasvc.tools.bench.isolation", "what the integrity checks of a sample's isolation cost"),
    "allocator": ("datasvc.tools.bench.allocator", "the preprocessing actors' allocator settings against glibc's"),
    "text": ("datasvc.tools.bench.text", "chat text's tokens through tokenizers and through the exact tiktoken path"),
    "checkouts": ("datasvc.tools.bench.checkouts",
                  "the decode and service benches (and --benches train on a GPU machine) at two commits, alternated"),
    "peers": ("trainer.bench.peers",
              "vlmfeed beside Megatron-Bridge's own loader, Energon's and AutoModel's packing and Ray Data, same shards"),
}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="vlmfeed bench", description=__doc__.split("\n\n")[0],
                                 epilog="vlmfeed bench NAME --help shows a bench's options.",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="NAME")
    d = sub.add_parser("decode", help="per-core decode / preprocess throughput, and packing efficiency")
    d.add_argument("--images", type=int, default=40, help="real-photo JPEGs to build (0.3-4 MP)")
    d.add_argument("--synth", type=int, default=0, help="also this many synthetic web-photos JPEGs")
    d.add_argument("--max-pixels", type=positive_int, default=16777216)
    d.add_argument("--mp-range", type=positive_float, nargs=2, default=(0.3, 4.0), metavar=("MIN", "MAX"),
                   help="megapixel range of the photo set")
    d.add_argument("--min-pixels", type=positive_int, default=65536)
    d.add_argument("--repeats", type=positive_int, default=5, help="passes per contender, taken in turns (best is kept)")
    d.add_argument("--pack-synth", type=int, default=200,
                   help="synthetic web-photo samples added to the photo shards for packing (-1: no packing)")
    d.add_argument("--pack-copies", type=positive_int, default=2, help="copies of the real-photo shards for packing")
    d.add_argument("--skip-hf-pil", action="store_true", help="skip the slow PIL-backend HF processor")
    d.add_argument("--allocator", choices=("glibc", "actors"), default="glibc",
                   help="glibc allocator settings of the measuring process, for every contender: glibc's "
                        "defaults (as a user runs the HF processor), or the preprocessing actors' "
                        "(PoolConfig.actor_malloc_tunables), under which the HF processor ran 2.2x faster "
                        "on the 2-core VM")
    d.add_argument("--out", default="bench-decode.json", help="JSON; a PNG of the same name goes beside it")
    s = sub.add_parser("service", help="Ray-streamed throughput vs actors, and vs in-process")
    s.add_argument("--max-actors", type=positive_int, default=None, help="default: the CPU count")
    s.add_argument("--samples", type=positive_int, default=200)
    s.add_argument("--seq-len", type=positive_int, default=4096)
    s.add_argument("--max-pixels", type=positive_int, default=16777216)
    s.add_argument("--samples-per-item", type=positive_int, default=8)
    s.add_argument("--epochs", type=positive_int, default=2, help="epochs streamed per actor count (steady state)")
    s.add_argument("--out", default="bench-service.json")
    k = sub.add_parser("soak", help="stream good and hostile shards for N minutes while killing actors")
    k.add_argument("--minutes", type=positive_float, default=10.0)
    k.add_argument("--kill-every", type=positive_float, default=20.0, help="seconds between injected faults")
    k.add_argument("--out", default="bench-soak.json")
    z = sub.add_parser("sizing", help="how close block sizing's tokens-per-sample estimate comes, per probe size")
    z.add_argument("shards", nargs="*", help="default: the real-large photo crops")
    z.add_argument("--probe-samples", type=positive_int, nargs="+", default=[64, 128, 256])
    z.add_argument("--seeds", type=positive_int, default=8)
    z.add_argument("--mbs", type=positive_int, default=8)
    z.add_argument("--max-pixels", type=positive_int, default=1048576)
    z.add_argument("--out", default="bench-sizing.json")
    from datasvc.tools.bench.video import FORMATS, SIZES

    v = sub.add_parser("video", help="video decode frames/s per decoder on the same clips")
    v.add_argument("--formats", nargs="+", default=list(FORMATS), help="codec/extension of each clip")
    v.add_argument("--sizes", nargs="+", default=list(SIZES), help="WxH of each clip")
    v.add_argument("--seconds", type=positive_float, default=4.0)
    v.add_argument("--fps", type=positive_float, default=30.0)
    v.add_argument("--gop-seconds", type=positive_float, default=2.0, help="seconds between keyframes")
    v.add_argument("--repeats", type=positive_int, default=3, help="passes per contender and clip (best is kept)")
    v.add_argument("--out", default="bench-video.json")
    for name, (_, text) in OWN_OPTIONS.items():
        sub.add_parser(name, help=text, add_help=False)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] and argv[0] in OWN_OPTIONS:
        import importlib

        return int(importlib.import_module(OWN_OPTIONS[argv[0]][0]).main(argv[1:]) or 0)
    ap = _parser()
    args = ap.parse_args(argv)
    if args.cmd == "decode" and (args.images < 0 or args.synth < 0 or args.images + args.synth < 1):
        ap.error("decode: --images and --synth must be >= 0, at least one photo in all")
    command = "vlmfeed bench " + " ".join(argv)

    if args.cmd == "soak":
        from datasvc.tools.bench.soak import soak

        rep = soak(args.minutes, out=args.out, kill_every_s=args.kill_every)
        return 0 if rep["ok"] else 1

    if args.cmd == "video":
        from datasvc.tools.bench.video import bench_video, print_video

        rep = stamp(bench_video(tuple(args.formats), tuple(args.sizes), args.seconds, args.fps,
                                args.gop_seconds, args.repeats),
                    "How fast is video decode, per decoder?", command)
        print_video(rep)
    elif args.cmd == "sizing":
        from datasvc.samples import large_shards
        from datasvc.tools.bench.sizing import bench_sizing, print_sizing

        rep = bench_sizing(args.shards or large_shards(), tuple(args.probe_samples), args.seeds, args.max_pixels,
                           micro_batch_size=args.mbs)
        print_sizing(rep)
    elif args.cmd == "decode":
        from datasvc.tools.bench.decode import bench_decode
        from datasvc.tools.bench.decode_report import plot_decode, print_decode

        _as_the_actors_allocate(args.allocator == "actors")
        rep = stamp(bench_decode(images=args.images, max_pixels=args.max_pixels, min_pixels=args.min_pixels,
                                 synth=args.synth, repeats=args.repeats, pack_synth=args.pack_synth,
                                 skip_hf_pil=args.skip_hf_pil, mp_range=tuple(args.mp_range),
                                 pack_copies=args.pack_copies),
                    "What do the preprocessing actors cost per core, against raw decode and the HF processors?",
                    command)
        print_decode(rep)
        plot_decode(rep, os.path.splitext(args.out)[0] + ".png")
        print(f"wrote {os.path.splitext(args.out)[0]}.png")
    else:
        from datasvc.tools.bench.service import bench_service, print_service

        rep = bench_service(max_actors=args.max_actors, samples=args.samples, seq_len=args.seq_len,
                            max_pixels=args.max_pixels, samples_per_item=args.samples_per_item,
                            epochs=args.epochs)
        print_service(rep)
    with open(args.out, "w") as f:
        json.dump(rep, f, indent=1)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    from datasvc.tools.cli import main as vlmfeed

    sys.exit(vlmfeed(["bench", *sys.argv[1:]]))
