"""Scale on paper: what the data path needs per node to keep N GPUs of a model fed, from a measured
profile and the planner.

    python -m trainer.scale [--profile trainer/data/profile-photos-cpu.json] [--gpus 8,64,512]
                            [--cores-per-node 112] [--gpus-per-node 8] [--mfu 0.4]

Per (model, GPUs, MBS): the planner picks the parallel layout that fits the GPUs (trainer.plan:
FSDP first, then 3D layouts, each with its memory knobs), which sets the DP ranks and the GPUs of one
replica. The trainer's demand per DP rank is the pipeline's FLOPs of the profiled micro-batches (the
same per-sample text and image shapes, at this MBS) over ``gpus_per_replica x peak x MFU``. The
profile gives the CPU cost of one sample in a preprocessing actor (core-ms, all stages but pack) and
the feeder's pack rate (one thread per DP rank). From those:

- cores per node: replicas per node x micro-batches/s x samples per micro-batch x core-s per sample;
  preprocessing actors per node at one decode thread each, at least one per feeder (``min_actors``);
- object-store bytes per node for one micro-batch per DP rank (uint8 pixel rows, tokens, labels,
  loss mask), what one training step moves per grad-accumulation micro-batch;
- headroom: the node's spare cores (all but one per GPU, the trainer ranks') over the cores needed,
  and a feeder's pack rate over its rank's demand; below 1 the data path, not the GPUs, sets the
  pace (the MFU it would cap at is printed then). The break-even cost: the core-ms per sample
  (heavier images, video) at which the spare cores would no longer keep up.
"""
from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass

from datasvc.usage import HelpFormatter, positive_float, positive_int, positive_ints

PRESETS = {"30B-A3B": "qwen3vl-30b-a3b", "235B-A22B": "qwen3vl-235b-a22b"}
# Layouts tried in order; the first whose plan fits is taken (with its memory knobs).
LAYOUTS = [{"strategy": "fsdp"}, {"strategy": "fsdp", "ep": 8},
           {"strategy": "3d", "tp": 2, "pp": 4, "ep": 8}, {"strategy": "3d", "tp": 4, "pp": 8, "ep": 8}]
BYTES_PER_TOKEN = 8 + 8 + 4  # tokens and labels int64, loss mask float32
DEFAULT_PROFILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "profile-photos-cpu.json")


@dataclass
class Measured:
    """One profiled MBS: per-sample shape and CPU cost, and the feeder's pack rate."""

    mbs: int
    seq_len: int
    samples_per_mb: float
    text_tokens: float
    vision_tokens: float
    images: float
    core_s_per_sample: float
    pack_mb_per_s: float


def measured(profile: dict) -> dict[int, Measured]:
    seq = profile["settings"]["seq_len"]
    out = {}
    for r in profile["runs"]:
        ps = r["per_sample"]
        out[r["micro_batch_size"]] = Measured(
            mbs=r["micro_batch_size"], seq_len=seq, samples_per_mb=r["samples_per_micro_batch"],
            text_tokens=ps["text_tokens"], vision_tokens=ps["vision_tokens"], images=ps["images"],
            core_s_per_sample=r["cpu"]["actor_cpu_ms_per_sample"] / 1e3,
            pack_mb_per_s=r["pack_micro_batches_per_s"])
    return out


def micro_batch(m: Measured, spec) -> tuple[list[float], list[float], int]:
    """(sample lengths, patches per image, bytes) of a typical profiled micro-batch."""
    n = max(1, round(m.samples_per_mb))
    merge2 = spec.merge_size ** 2
    lengths = [m.text_tokens + m.vision_tokens] * n
    n_images = max(1, round(m.images * n))
    patches = [m.vision_tokens * n * merge2 / n_images] * n_images
    row_bytes = 3 * spec.patch_size ** 2  # one uint8 pixel row per patch, one temporal frame
    nbytes = int(sum(patches) * row_bytes + m.mbs * m.seq_len * BYTES_PER_TOKEN)
    return lengths, patches, nbytes


def layout_that_fits(preset: str, gpus: int, mbs: int, seq_len: int, gpu_memory_gib: float):
    """(config, plan) of the first layout in LAYOUTS that fits, or None."""
    from trainer.config import ConfigError, ModelConfig, ParallelConfig, TrainConfig, TrainerConfig
    from trainer.plan.fit import memory_ladder, with_gbs
    from trainer.plan.planner import plan_job

    for lay in LAYOUTS:
        cfg = TrainerConfig(model=ModelConfig(preset=preset), parallel=ParallelConfig(**lay),
                            train=TrainConfig(mbs=mbs, gbs=mbs, seq_len=seq_len))
        for _, candidate in memory_ladder(cfg):
            candidate = with_gbs(candidate, gpus)
            try:
                candidate.validate(gpus)
            except ConfigError:
                break
            plan = plan_job(candidate, gpus, gpu_memory_gib, advise=False)
            if plan.fits:
                return candidate, plan
    return None


def scale_rows(profile: dict, gpu_counts=(8, 64, 512), gpus_per_node: int = 8, cores_per_node: int = 112,
               peak_tflops: float = 989.0, mfu: float = 0.4, gpu_memory_gib: float = 141.0) -> list[dict]:
    from datasvc.config import PoolConfig, ServiceConfig
    from datasvc.registry import get_layout, pipeline_module
    from trainer.plan.planner import describe

    spec = get_layout("qwen3vl").vision
    rows = []
    for name, preset in PRESETS.items():
        model = pipeline_module("qwen3vl").flops_model(preset)
        for gpus in gpu_counts:
            for mbs, m in sorted(measured(profile).items()):
                row = {"model": name, "gpus": gpus, "mbs": mbs}
                chosen = layout_that_fits(preset, gpus, mbs, m.seq_len, gpu_memory_gib)
                if chosen is None:
                    rows.append({**row, "layout": f"does not fit {gpus} x {gpu_memory_gib:g} GiB"})
                    continue
                cfg, _ = chosen
                p = cfg.parallel
                per_replica = p.tp * p.pp * p.cp
                dp = gpus // per_replica
                lengths, patches, nbytes = micro_batch(m, spec)
                flops = model.batch_flops(m.mbs * m.seq_len, lengths, patches)["total"]
                mb_s = per_replica * peak_tflops * 1e12 * mfu / flops  # per DP rank
                # Replicas fed from one node: a replica spanning nodes (PP) is fed once, on one of them.
                replicas = max(1.0, gpus_per_node / per_replica) if gpus >= gpus_per_node else dp
                cores = replicas * mb_s * m.samples_per_mb * m.core_s_per_sample
                spare = cores_per_node - min(gpus, gpus_per_node)
                resident = PoolConfig.max_batches_ahead + ServiceConfig.prefetch
                rows.append({**row, "layout": short_layout(cfg), "job": describe(cfg, gpus), "dp": dp,
                             "mb_per_s_per_rank": mb_s, "tflop_per_mb": flops / 1e12, "cores_per_node": cores,
                             "actors_per_node": max(math.ceil(cores), math.ceil(replicas)), "bytes_per_mb": nbytes,
                             "store_bytes_per_node": replicas * nbytes,
                             "store_resident_bytes_per_node": resident * replicas * nbytes,
                             "headroom_cores": spare / cores, "headroom_pack": m.pack_mb_per_s / mb_s,
                             "break_even_core_ms_per_sample": 1e3 * m.core_s_per_sample * spare / cores})
    return rows


def short_layout(cfg) -> str:
    p = cfg.parallel
    out = p.strategy + (f" tp{p.tp} pp{p.pp}" if p.strategy == "3d" else "") + (f" ep{p.ep}" if p.ep > 1 else "")
    return out + (", full recompute" if cfg.recompute.granularity == "full" else "")


def markdown(rows: list[dict], mfu: float) -> str:
    out = ["| model | GPUs | MBS | layout (planner) | DP | micro-batches/s per rank | cores per node | "
           "actors per node | object store per node: per step / resident | headroom: cores, pack | "
           "data path limits once a sample costs |", "|" + "---|" * 11]
    for r in rows:
        if "dp" not in r:
            out.append(f"| {r['model']} | {r['gpus']} | {r['mbs']} | {r['layout']} | | | | | | | |")
            continue
        limit = mfu * min(r["headroom_cores"], r["headroom_pack"])
        out.append(f"| {r['model']} | {r['gpus']} | {r['mbs']} | {r['layout']} | {r['dp']} | "
                   f"{r['mb_per_s_per_rank']:.2f} | {r['cores_per_node']:.1f} | {r['actors_per_node']} | "
                   f"{r['store_bytes_per_node'] / 2**20:.0f} MiB / "
                   f"{r['store_resident_bytes_per_node'] / 2**30:.1f} GiB | "
                   f"{r['headroom_cores']:.0f}x, {r['headroom_pack']:.0f}x"
                   f"{'' if limit > 1 else f' (limits above MFU {limit:.2f})'} | "
                   f"{r['break_even_core_ms_per_sample']:.0f} core-ms |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer.scale", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    ap.add_argument("--profile", default=DEFAULT_PROFILE, help="profile.json from vlmfeed profile")
    ap.add_argument("--gpus", type=positive_ints, default=[8, 64, 512], help="cluster sizes, comma separated")
    ap.add_argument("--gpus-per-node", type=positive_int, default=8)
    ap.add_argument("--cores-per-node", type=positive_int, default=112, help="host cores of one node (H200 HGX: 2 x 56)")
    ap.add_argument("--peak-tflops", type=positive_float, default=989.0)
    ap.add_argument("--mfu", type=positive_float, default=0.4)
    ap.add_argument("--gpu-memory-gib", type=positive_float, default=141.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    with open(args.profile) as f:
        profile = json.load(f)
    rows = scale_rows(profile, tuple(args.gpus), args.gpus_per_node,
                      args.cores_per_node, args.peak_tflops, args.mfu, args.gpu_memory_gib)
    print(json.dumps(rows, indent=1) if args.json else markdown(rows, args.mfu))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
