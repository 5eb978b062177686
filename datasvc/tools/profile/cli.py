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
import json
import os
import sys

import numpy as np

from datasvc.read.filters import add_filter_flags, filters_from_flags
from datasvc.tools.profile.sweep import Settings, profile
from datasvc.tools.profile.verdict import Demand
from datasvc.training import add_data_flags
from datasvc.usage import HelpFormatter, positive_float, positive_floats, positive_int, positive_ints

MODES = ("compare", "synth-check")


def _shards(spec: str) -> list[str]:
    """A comma list of shard patterns (``datasvc.read.shards.expand_shards`` takes each: a path, glob, brace
    pattern, directory, Energon dataset or s3:// URL)."""
    out = [part for part in spec.split(",") if part]
    if not out:
        raise argparse.ArgumentTypeError(f"no shards in {spec!r}")
    return out


def _data_args(ap: argparse.ArgumentParser) -> None:
    add_data_flags(ap, "--pipeline")
    # a GPU trainer's demand is what the profile judges, so its rows and pixel cap by default
    add_data_flags(ap, "--device", "--seq-len", "--max-pixels", "--min-pixels", "--decode", device="gpu")
    ap.add_argument("--mbs", type=positive_ints, default=[1, 2, 4, 8], help="micro-batch sizes, comma separated")
    add_data_flags(ap, "--cpu-jpeg-decoder")
    ap.add_argument("--actors", type=positive_ints, default=[1, 2], help="preprocessing actors per DP rank, comma separated")
    add_data_flags(ap, "--decode-threads")
    amount = ap.add_mutually_exclusive_group()
    amount.add_argument("--samples", type=positive_int, help="samples to measure per setting (after a warm-up block); default 256")
    amount.add_argument("--seconds", type=positive_float, help="seconds to measure per setting")
    add_data_flags(ap, "--video-fps", "--video-max-pixels")
    ap.add_argument("--samples-per-item", type=positive_int, default=16)
    blocks = ap.add_mutually_exclusive_group()
    add_data_flags(blocks, "--block-micro-batches", "--items-per-block")  # the window needs ~3 blocks of --samples
    add_data_flags(ap, "--chain-blocks")
    ap.add_argument("--num-cpus", type=positive_int, help="CPUs of the local Ray cluster (default: all)")
    add_data_flags(ap, "--blend")
    add_filter_flags(ap)


def _demand_args(ap: argparse.ArgumentParser) -> None:
    dem = ap.add_mutually_exclusive_group()
    dem.add_argument("--step-time", type=positive_floats,
                     help="trainer seconds per --grad-accum micro-batches of one DP rank (one value, or one per MBS)")
    dem.add_argument("--model", help="an architecture preset of the pipeline (e.g. qwen3vl-30b-a3b, "
                                     "qwen3vl-235b-a22b) or custom (with --custom-json)")
    ap.add_argument("--grad-accum", type=positive_int, default=1)
    ap.add_argument("--gpus", type=positive_int, default=8)
    ap.add_argument("--dp", type=positive_int, help="data-parallel ranks among --gpus (default: --gpus, i.e. FSDP/pure DP)")
    ap.add_argument("--peak-tflops", type=positive_float, default=989.0, help="per-GPU dense bf16 peak (H100/H200: 989)")
    ap.add_argument("--mfu", type=positive_float, default=0.4)
    ap.add_argument("--custom-json", help="architecture fields as JSON for --model custom")
    ap.add_argument("--vision-frozen", action="store_true", help="vision tower not trained (forward FLOPs only)")
    ap.add_argument("--balance", choices=("on", "off"), default="off",
                    help="predict the straggler ratio over --dp ranks with each step's micro-batches dealt "
                         "by datasvc.pack.balance (on) or each rank keeping its own (off)")
    ap.add_argument("--gbs", type=positive_int, help="global batch (rows) a step, for the straggler ratio: each rank "
                                            "trains GBS / (DP x MBS) micro-batches (default: --grad-accum, else 8)")
    ap.add_argument("--out", default="profile-out", help="directory for profile.json and profile.png")
    ap.add_argument("--no-progress", action="store_true")


def _parser(mode: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=f"vlmfeed profile{'' if mode == 'profile' else ' ' + mode}",
                                 description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
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
    return Settings(shards=shards, pipeline=args.pipeline, device=args.device, seq_len=args.seq_len, mbs=args.mbs,
                    decode=args.decode, min_pixels=args.min_pixels,
                    cpu_jpeg_decoder=args.cpu_jpeg_decoder, actors=args.actors, threads=args.decode_threads, samples=args.samples, seconds=args.seconds,
                    max_pixels=args.max_pixels, video_fps=args.video_fps, video_max_pixels=args.video_max_pixels,
                    samples_per_item=args.samples_per_item,
                    filters=filters_from_flags(args), blend=args.blend,
                    items_per_block=args.items_per_block,
                    block_micro_batches=args.block_micro_batches,
                    chain_blocks=args.chain_blocks, dp=args.dp or args.gpus, balance=args.balance == "on", gbs=args.gbs,
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
    if mode == "synth-check" and "--mbs" not in argv:
        args.mbs = [1]
    if mode == "synth-check" and "--actors" not in argv:
        args.actors = [1]
    demand = _demand(args, ap)
    if mode == "profile" and args.shards:
        from datasvc.read.shards import expand_shards

        expand_shards([p for s in args.shards for p in _shards(s)])  # a wrong path stops here, before Ray starts
    from datasvc.service.cluster import connect

    connect(num_cpus=args.num_cpus)
    progress = not args.no_progress
    if mode == "profile":
        from datasvc.tools.profile.report import table

        report = profile(_settings(args, [p for s in args.shards for p in _shards(s)]), demand, progress=progress)
        print(table(report))
        print(f"predicted straggler ratio over {args.dp or args.gpus} DP rank(s), balance {args.balance}: "
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
