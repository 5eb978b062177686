"""``python -m datasvc.tools.synth`` / ``vlmfeed synth``: write synthetic shards and compare them."""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Sequence

from datasvc.usage import HelpFormatter
from datasvc.tools.synth.calibrate import calibrate, image_statistics
from datasvc.tools.synth.dist import PROFILES, Profile
from datasvc.tools.synth.write import write_shards

_REPORT_ROWS = [
    ("samples", "samples", "{:.0f}"),
    ("images", "images", "{:.0f}"),
    ("images/sample", "images_per_sample", "{:.2f}"),
    ("mean MP", "mean_megapixels", "{:.3f}"),
    ("median MP", "median_megapixels", "{:.3f}"),
    ("mean aspect w/h", "mean_aspect", "{:.3f}"),
    ("bytes/px (all)", "bytes_per_pixel", "{:.3f}"),
    ("bytes/px (jpeg)", "jpeg_bytes_per_pixel", "{:.3f}"),
    ("jpeg quality", "jpeg_quality", "{:.1f}"),
    ("caption words", "caption_words", "{:.1f}"),
    ("conversations", "conversation_fraction", "{:.2f}"),
    ("videos", "videos", "{:.0f}"),
    ("video seconds", "video_seconds", "{:.2f}"),
    ("video fps", "video_fps", "{:.2f}"),
    ("video MP", "video_megapixels", "{:.3f}"),
    ("video kbps", "video_kbps", "{:.0f}"),
    ("video bits/px", "video_bits_per_pixel", "{:.3f}"),
    ("video GOP s", "video_gop_seconds", "{:.2f}"),
]


def _report(columns: dict[str, dict]) -> str:
    names = list(columns)
    lines = [f"{'':18s}" + "".join(f"{n:>14s}" for n in names)]
    for label, key, fmt in _REPORT_ROWS:
        cells = []
        for n in names:
            v = columns[n].get(key)
            cells.append(f"{fmt.format(v) if v is not None else '-':>14s}")
        lines.append(f"{label:18s}" + "".join(cells))
    mixes = {n: ", ".join(f"{k} {v:.2f}" for k, v in c.get("format_mix", {}).items()) or "-" for n, c in columns.items()}
    lines += [f"format mix {n}: {m}" for n, m in mixes.items()]
    lines += [f"video format mix {n}: " + ", ".join(f"{k} {v:.2f}" for k, v in c["video_format_mix"].items())
              for n, c in columns.items() if c.get("video_format_mix")]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="vlmfeed synth",
        description="Write realistic synthetic image-text and video-text WebDataset shards (or image-free mock ones).", formatter_class=HelpFormatter)
    ap.add_argument("--out", required=True, help="output directory for synth-NNNNNN.tar")
    ap.add_argument("--samples", type=int, required=True, help="number of samples")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--profile", default=None,
                     help=f"built-in profile ({', '.join(PROFILES)}) or a profile JSON file; default web-photos")
    src.add_argument("--calibrate-from", nargs="+", metavar="SHARD",
                     help="real shards (tar files or directories of them) to fit the profile to")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mock", action="store_true", help="image-free samples with the same text (naive benchmark data)")
    ap.add_argument("--samples-per-shard", type=int, default=128)
    ap.add_argument("--processes", type=int, default=1,
                    help="render samples in this many processes (video profiles: a clip takes seconds to encode); "
                         "the samples are the same for any count")
    ap.add_argument("--save-profile", metavar="PATH", help="write the profile used (e.g. the fitted one) as JSON")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--no-report", action="store_true", help="skip re-reading the output for the summary table")
    args = ap.parse_args(argv)
    if args.samples < 1 or args.samples_per_shard < 1 or args.seed < 0 or args.processes < 1:
        ap.error("--samples, --samples-per-shard and --processes must be >= 1, --seed >= 0")

    columns: dict[str, dict] = {}
    if args.calibrate_from:
        profile = calibrate(args.calibrate_from)
        columns["reference"] = image_statistics(args.calibrate_from)
    else:
        try:
            profile = Profile.load(args.profile or "web-photos")
        except ValueError as e:
            ap.error(str(e))
    if args.save_profile:
        profile.save(args.save_profile)
        print(f"profile saved to {args.save_profile}", file=sys.stderr)

    t0 = time.perf_counter()
    paths = write_shards(args.out, args.samples, profile, seed=args.seed,
                         samples_per_shard=args.samples_per_shard, mock=args.mock,
                         progress=not args.no_progress, processes=args.processes)
    dt = time.perf_counter() - t0
    size = sum(os.path.getsize(p) for p in paths)
    print(f"wrote {len(paths)} shard(s), {args.samples} samples, {size / 1e6:.1f} MB to {args.out} "
          f"in {dt:.1f} s ({args.samples / max(dt, 1e-9):.1f} samples/s)")
    if not args.no_report and paths:
        columns["mock" if args.mock else "synthetic"] = image_statistics(paths)
        print(_report(columns))
    return 0


if __name__ == "__main__":
    from datasvc.tools.cli import main as vlmfeed

    sys.exit(vlmfeed(["synth", *sys.argv[1:]]))

