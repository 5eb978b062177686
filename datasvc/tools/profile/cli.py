"""``vlmfeed profile`` (``python -m datasvc.tools.profile``): measure the data path on its own.

    vlmfeed profile SHARDS... [--mbs 1,2,4,8] [--actors 1,2] [--model qwen3vl-30b-a3b --gpus 8 | --step-time S]
    vlmfeed profile compare NAME=SHARDS ... [--repeat N]
    vlmfeed profile synth-check --out DIR

Blocks are sized and chained as ``trainer.run`` does (``--block-micro-batches 8``, ``--chain-blocks
4``), so the verdict is about training; ``--items-per-block N`` forces a fixed block size instead.
``compare`` profiles several sources side by side, with ratios against the first. ``synth-check``
writes real photo shards, calibrated synthetic shards and mock shards and compares them.
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import sys

import numpy as np

from datasvc.filters import add_filter_flags, filters_from_flags
from datasvc.tools.profile.sweep import TRAINING_BLOCK_MICRO_BATCHES, Settings, profile
from datasvc.tools.profile.verdict import Demand

MODES = ("compare", "synth-check")


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x]


def _shards(spec: str) -> list[str]:
    """A directory (its tars, plain or gzip; an Energon dataset directory as it is), a glob, brace
    pattern or s3:// URL, or a comma list of them."""
    out = []
    for part in spec.split(","):
        if os.path.isdir(part) and not os.path.isdir(os.path.join(part, ".nv-meta")):
            out.extend(sorted(p for ext in ("*.tar", "*.tar.gz", "*.tgz") for p in glob.glob(os.path.join(part, ext))))
        else:
            out.append(part)
    if not out:
        raise argparse.ArgumentTypeError(f"no shards in {spec!r}")
    return out


def _data_args(ap: argparse.ArgumentParser) -> None:
    from datasvc.plan import TRAINING_CHAIN_BLOCKS

    ap.add_argument("--pipeline", default="qwen3vl")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--mbs", type=_ints, default=[1, 2, 4, 8], help="micro-batch sizes, comma separated")
    ap.add_argument("--decode", choices=("cpu", "gpu"), default="cpu")
    ap.add_argument("--cpu-jpeg-decoder", choices=("dali", "libjpeg-turbo"), default="dali",
                    help="with --decode cpu: libjpeg-turbo decodes JPEGs at a reduced DCT scale")
    ap.add_argument("--actors", type=_ints, default=[1, 2], help="preprocessing actors per DP rank, comma separated")
    ap.add_argument("--threads", type=int, default=1, help="decode threads (CPUs) per actor")
    amount = ap.add_mutually_exclusive_group()
    amount.add_argument("--samples", type=int, help="samples to measure per setting (after a warm-up block); default 256")
    amount.add_argument("--seconds", type=float, help="seconds to measure per setting")
    ap.add_argument("--max-pixels", type=int, help="pipeline max_pixels (default: the pipeline's)")
    ap.add_argument("--video-fps", type=float, help="frames sampled a second of video (default: the pipeline's)")
    ap.add_argument("--video-max-pixels", type=int,
                    help="cap on frames x height x width of one video (default: the pipeline's)")
    ap.add_argument("--samples-per-item", type=int, default=16)
    blocks = ap.add_mutually_exclusive_group()
    blocks.add_argument("--block-micro-batches", type=int, default=None,
                        help=f"size blocks to fill this many micro-batches, as trainer.run does (default "
                             f"{TRAINING_BLOCK_MICRO_BATCHES}, trainer.run's); the window needs about three blocks "
                             "of --samples per setting")
    blocks.add_argument("--items-per-block", type=int, default=None,
                        help="force this many work items a block instead of sizing blocks")
    ap.add_argument("--chain-blocks", type=int, default=None,
                    help="blocks packed as a chain, a block's part-filled rows waiting for the next block "
                         f"(default {TRAINING_CHAIN_BLOCKS}, as trainer.run)")
    ap.add_argument("--num-cpus", type=int, help="CPUs of the local Ray cluster (default: all)")
    ap.add_argument("--blend", default="", help="datasets in fixed proportions: NAME=PATTERN:WEIGHT,... or a YAML file")
    add_filter_flags(ap)


def _demand_args(ap: argparse.ArgumentParser) -> None:
    dem = ap.add_mutually_exclusive_group()
    dem.add_argument("--step-time", type=_floats,
                     help="trainer seconds per --grad-accum micro-batches of one DP rank (one value, or one per MBS)")
    dem.add_argument("--model", help="an architecture preset of the pipeline (e.g. qwen3vl-30b-a3b, "
                                     "qwen3vl-235b-a22b) or custom (with --custom-json)")
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--dp", type=int, help="data-parallel ranks among --gpus (default: --gpus, i.e. FSDP/pure DP)")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="per-GPU dense bf16 peak (H100/H200: 989)")
    ap.add_argument("--mfu", type=float, default=0.4)
    ap.add_argument("--custom-json", help="architecture fields as JSON for --model custom")
    ap.add_argument("--vision-frozen", action="store_true", help="vision tower not trained (forward FLOPs only)")
    ap.add_argument("--balance", choices=("on", "off"), default="off",
                    help="predict the straggler ratio over --dp ranks with each step's micro-batches dealt "
                         "by datasvc.balance (on) or each rank keeping its own (off)")
    ap.add_argument("--gbs", type=int, help="global batch (rows) a step, for the straggler ratio: each rank "
                                            "trains GBS / (DP x MBS) micro-batches (default: --grad-accum, else 8)")
    ap.add_argument("--out", default="profile-out", help="directory for profile.json and profile.png")
    ap.add_argument("--no-progress", action="store_true")


def _parser(mode: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=f"vlmfeed profile{'' if mode == 'profile' else ' ' + mode}",
                                 description=__doc__.split("\n\n")[0])
    if mode == "profile":
        ap.add_argument("shards", nargs="*", help="shard paths, globs, brace patterns, s3:// URLs or directories "
                                                  "(none with --blend)")
    elif mode == "compare":
        ap.add_argument("sources", nargs="+", metavar="NAME=SHARDS",
                        help="sources to compare, the first is the reference (e.g. real=DIR synthetic=DIR mock=DIR)")
        ap.add_argument("--repeat", type=int, default=1, help="interleaved rounds; medians are reported")
    else:
        ap.add_argument("--copies", type=int, default=2, help="copies of the photo set in the real shards")
        ap.add_argument("--seed", type=int, default=0)
        ap.add_argument("--repeat", type=int, default=2)
    _data_args(ap)
    _demand_args(ap)
    return ap


def _settings(args, shards) -> Settings:
    return Settings(shards=shards, pipeline=args.pipeline, seq_len=args.seq_len, mbs=args.mbs, decode=args.decode,
                    cpu_jpeg_decoder=args.cpu_jpeg_decoder, actors=args.actors, threads=args.threads, samples=args.samples, seconds=args.seconds,
                    max_pixels=args.max_pixels, video_fps=args.video_fps, video_max_pixels=args.video_max_pixels,
                    samples_per_item=args.samples_per_item,
                    filters=filters_from_flags(args), blend=args.blend,
                    items_per_block=args.items_per_block,
                    block_micro_batches=args.block_micro_batches or TRAINING_BLOCK_MICRO_BATCHES,
                    chain_blocks=args.chain_blocks, dp=args.dp, balance=args.balance == "on", gbs=args.gbs,
                    micro_batches_per_rank=args.grad_accum if args.grad_accum > 1 else None,
                    cost_preset=args.model)


def _demand(args, ap) -> Demand:
    if args.step_time:
        if len(args.step_time) not in (1, len(args.mbs)):
            ap.error("--step-time takes one value or one per --mbs value")
        return Demand(step_time_s=args.step_time, grad_accum=args.grad_accum)
    if args.model:
        from datasvc.registry import pipeline_module

        try:
            model = pipeline_module(args.pipeline).flops_model(args.model, args.custom_json)
        except AttributeError:
            ap.error(f"pipeline {args.pipeline!r} has no FLOP model (flops_model); pass --step-time instead")
        except (ValueError, OSError) as e:
            ap.error(str(e))
        if args.vision_frozen:
            model = dataclasses.replace(model, vision_trainable=False)
        if args.dp and args.gpus % args.dp:
            ap.error("--gpus must be a multiple of --dp")
        return Demand(model=model, gpus=args.gpus, dp=args.dp, peak_tflops=args.peak_tflops, mfu=args.mfu)
    return Demand()


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    return str(o)


def _write(out: str, report: dict | None, cmp: dict | None = None) -> tuple[str, str]:
    from datasvc.tools.profile.report import figure

    os.makedirs(out, exist_ok=True)
    jpath = os.path.join(out, "profile.json")
    with open(jpath, "w") as f:
        json.dump(cmp if cmp is not None else report, f, indent=2, default=_json_default)
    return jpath, figure(report, os.path.join(out, "profile.png"), compare=cmp)


def _print_comparison(cmp: dict) -> None:
    from datasvc.tools.profile.report import compare_table, image_cost_table, table

    for name, rep in cmp["reports"].items():
        print(f"== {name}")
        print(table(rep))
    print("== comparison (ratio vs " + cmp["reference"] + ")")
    print(compare_table(cmp))
    if "warning" in cmp:
        print("warning: " + cmp["warning"])
    if "image_cost" in cmp:
        print(image_cost_table(cmp["image_cost"]))
    if "video_cost" in cmp:
        from datasvc.tools.profile.videocost import video_cost_table

        print(video_cost_table(cmp["video_cost"]))
    if "claim" in cmp:
        print("claim: " + json.dumps(cmp["claim"], default=_json_default))


def _compare_sources(args, ap) -> dict[str, list[str]]:
    sources = {}
    for s in args.sources:
        if "=" not in s:
            ap.error(f"expected NAME=SHARDS, got {s!r}")
        name, spec = s.split("=", 1)
        sources[name] = _shards(spec)
    return sources


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    mode = argv.pop(0) if argv and argv[0] in MODES else "profile"
    ap = _parser(mode)
    args = ap.parse_args(argv)
    if mode == "profile" and not args.shards and not args.blend:
        ap.error("give shards (paths, globs, directories, s3:// URLs) or --blend")
    for flag in ("block_micro_batches", "chain_blocks", "items_per_block"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1")
    if mode == "synth-check" and "--mbs" not in argv:
        args.mbs = [1]
    if mode == "synth-check" and "--actors" not in argv:
        args.actors = [1]
    demand = _demand(args, ap)
    from datasvc.cluster import connect

    connect(num_cpus=args.num_cpus)
    progress = not args.no_progress
    if mode == "profile":
        from datasvc.tools.profile.report import table

        report = profile(_settings(args, [p for s in args.shards for p in _shards(s)]), demand, progress=progress)
        print(table(report))
        print(f"predicted straggler ratio over {args.dp or 1} DP rank(s), balance {args.balance}: "
              + ", ".join(f"{k}: {v:.3f}" if v is not None else f"{k}: n/a" for k, v in report["straggler_ratio"].items()))
        j, p = _write(args.out, report)
    else:
        if mode == "compare":
            from datasvc.tools.profile.compare import compare

            cmp = compare(_compare_sources(args, ap), _settings(args, []), demand, repeat=args.repeat,
                          progress=progress)
        else:
            from datasvc.tools.profile.cost import synth_check

            cmp = synth_check(args.out, _settings(args, []), copies=args.copies, seed=args.seed,
                              repeat=args.repeat, demand=demand, progress=progress)
        _print_comparison(cmp)
        j, p = _write(args.out, None, cmp)
    print(f"wrote {j} and {p}")
    return 0
