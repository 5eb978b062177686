"""The planner in front of ``trainer.run``: a job that cannot fit stops before any rank starts, and
with no model flag (``--fit auto``) the run takes the largest configuration that fits its GPUs."""
from __future__ import annotations

import argparse
import logging

from datasvc.usage import positive_float

log = logging.getLogger("vlmfeed.run")
MODEL_FLAGS = ("--model-preset", "--num-layers", "--num-experts", "--vision-depth", "--hf-path")
# Memory of the GPUs Ray names in its ``accelerator_type:<name>`` resource, GiB.
GPU_MEMORY_GIB = {"A100": 80, "H100": 80, "H800": 80, "H20": 96, "H200": 141, "B200": 180, "GB200": 186}


def add_plan_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("memory plan")
    g.add_argument("--fit", choices=["auto", "off"], default="auto",
                   help="auto: check the job against the GPUs' memory before any rank starts; with no model flag, "
                        "take the largest configuration that fits (full model, depth-faithful proxy, 4-layer "
                        "proxy); off: no check")
    g.add_argument("--gpu-memory-gib", type=positive_float, default=None,
                   help="memory of one GPU (default: from the cluster's GPU type); with --world-size, the plan "
                        "is checked before Ray starts")


def gpu_memory_from_resources(resources: dict) -> float | None:
    """GiB of the cluster's GPUs from Ray's ``accelerator_type:<name>`` resource, if it names one we know."""
    for key in resources:
        if key.startswith("accelerator_type:"):
            name = key.split(":", 1)[1].upper()
            for gpu in sorted(GPU_MEMORY_GIB, key=len, reverse=True):
                if gpu in name:
                    return float(GPU_MEMORY_GIB[gpu])
    return None


def plan_gate(args: argparse.Namespace, gpus: int, gpu_memory_gib: float) -> None:
    """Check the job on ``gpus`` GPUs of ``gpu_memory_gib``: stop with the plan and the nearest settings
    that fit when it cannot fit; under ``--fit auto`` with no model flag, rewrite ``args`` to the
    largest configuration that fits (and say so)."""
    from trainer.config import ConfigError

    if getattr(args, "fit", "off") == "off":
        return
    try:
        _gate(args, gpus, gpu_memory_gib)
    except ConfigError as exc:
        raise SystemExit(str(exc)) from None


def _gate(args: argparse.Namespace, gpus: int, gpu_memory_gib: float) -> None:
    from trainer.config import from_args
    from trainer.plan.fit import fit_auto, nearest_fits, with_gbs
    from trainer.plan.planner import plan_job
    from trainer.plan.report import format_plan

    cfg = with_gbs(from_args(args), gpus)
    if not set(MODEL_FLAGS) & args._given:
        cfg, plan, reason = fit_auto(cfg, gpus, gpu_memory_gib)
        if not plan.fits:
            raise SystemExit(f"fit auto: {reason}\n{format_plan(plan)}")
        log.info("fit auto: %s", reason)
        _apply(cfg, args)
        return
    plan = plan_job(cfg, gpus, gpu_memory_gib)
    if plan.fits:
        log.info("memory plan: %s", plan.summary())
        return
    nearest = nearest_fits(cfg, gpus, gpu_memory_gib)
    raise SystemExit(f"the job does not fit its GPUs, stopping before any rank starts (--fit off skips this "
                     f"check):\n{format_plan(plan, nearest)}")


def plan_gate_declared(args: argparse.Namespace) -> None:
    """The gate before Ray starts, when the job declares its GPUs (``--world-size``, ``--gpu-memory-gib``)."""
    if args.backend != "cpu" and args.world_size and args.gpu_memory_gib:
        plan_gate(args, args.world_size, args.gpu_memory_gib)
        args.fit = "off"  # checked; the cluster's own answer would repeat it


def plan_gate_cluster(args: argparse.Namespace, backend: str, gpus: int) -> None:
    """The gate once the cluster is known (before the ranks start)."""
    if backend != "megatron" or getattr(args, "fit", "off") == "off":
        return
    import ray

    memory = args.gpu_memory_gib or gpu_memory_from_resources(ray.cluster_resources())
    if memory is None:
        log.warning("memory plan skipped: the cluster does not name its GPU type; pass --gpu-memory-gib")
        return
    plan_gate(args, args.world_size or gpus, memory)


def _apply(cfg, args: argparse.Namespace) -> None:
    """Write what fit auto chose back into the parsed options (what ``from_args`` reads later)."""
    m, rc, t = cfg.model, cfg.recompute, cfg.train
    args.model_preset, args.num_layers, args.num_experts, args.vision_depth = m.preset, m.num_layers, \
        m.num_experts, m.vision_depth
    args.vision_chunk_patches, args.expandable_segments = m.vision_chunk_patches, t.expandable_segments
    args.recompute, args.recompute_num_layers = rc.granularity, rc.num_layers
