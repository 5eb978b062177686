"""Plans as text: one job's memory by part with its verdict and advice, and tables of common cases."""
from __future__ import annotations

import copy

from trainer.plan.memory import Workload
from trainer.plan.planner import PART_NAMES, Plan, describe, plan_job

# (GPUs, GiB per GPU) the table covers: H100/H200 and GB200-class, one GPU to 64.
TABLE_GPUS = ((1, 80), (1, 141), (1, 186), (8, 80), (8, 141), (8, 186), (64, 80), (64, 141), (64, 186))


def format_plan(plan: Plan, nearest: list[tuple[str, Plan]] | None = None) -> str:
    """Memory by part at the peak, the verdict, the advice and (when given) the nearest settings that fit."""
    lines = [f"{describe(plan.cfg, plan.gpus)}",
             f"  {plan.params_b:.2f}B parameters on {plan.gpus} GPU(s) of {plan.gpu_memory_gib:g} GiB; "
             f"rows {plan.workload.fill:.0%} full, {plan.workload.image_share:.0%} image tokens",
             f"  per GPU ({'pipeline stage: ' + plan.stage if plan.stage != 'only' else 'every GPU alike'}), "
             f"at the peak ({plan.moment.replace('_', ' ')}):"]
    for key, name in PART_NAMES.items():
        if plan.parts.get(key, 0.0) >= 0.005:
            lines.append(f"    {name:<55} {plan.parts[key]:8.2f} GiB")
    lines.append(f"    {'peak allocated (torch.cuda.max_memory_allocated)':<55} {plan.peak_gib:8.2f} GiB")
    lines.append(f"    {'needed on the GPU':<55} {plan.need_gib:8.2f} GiB of {plan.usable_gib:.1f} usable")
    lines.append(f"  verdict: {plan.verdict()}")
    if nearest:
        lines.append("  nearest settings that fit:")
        for what, p in nearest:
            lines.append(f"    {what:<70} {p.need_gib:6.1f} GiB ({p.margin_gib:.0f} margin)")
    if plan.advice:
        lines.append("  recommendations:")
        for a in plan.advice:
            lines.append(f"    - {a.what}: {a.why}")
    return "\n".join(lines)


def _cell(plan: Plan) -> str:
    return f"{plan.need_gib:.0f} {'fits' if plan.fits else 'no'}"


def format_table(cfgs: list[tuple[str, object]], gpu_sets=TABLE_GPUS, workload: Workload | None = None) -> str:
    """A markdown table: per-GPU need (GiB) and verdict of each named config on each (GPUs, GiB)."""
    head = "| configuration | " + " | ".join(f"{n} x {g}" for n, g in gpu_sets) + " |"
    rule = "|---|" + "---|" * len(gpu_sets)
    rows = [head, rule]
    for name, cfg in cfgs:
        cells = []
        for n, g in gpu_sets:
            c = copy.deepcopy(cfg)
            dp = max(1, n // (c.parallel.tp * c.parallel.pp * c.parallel.cp))
            c.train.gbs = c.train.mbs * dp
            cells.append(_cell(plan_job(c, n, g, workload, advise=False)))
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def common_cases():
    """The configurations the README's table covers, as (name, config)."""
    from trainer.config import ModelConfig, ParallelConfig, RecomputeConfig, TrainConfig, TrainerConfig

    def job(preset, mbs=2, rc="full", strategy="fsdp", ep=1, **model):
        return TrainerConfig(model=ModelConfig(preset=preset, vision_chunk_patches=32768, **model),
                             parallel=ParallelConfig(strategy=strategy, ep=ep),
                             recompute=RecomputeConfig(granularity=rc),
                             train=TrainConfig(mbs=mbs, gbs=mbs, seq_len=4096, expandable_segments=True))

    return [
        ("30B-A3B, fsdp, MBS 1, no recompute", job("qwen3vl-30b-a3b", mbs=1, rc="none")),
        ("30B-A3B, fsdp, MBS 2, full recompute", job("qwen3vl-30b-a3b")),
        ("30B-A3B, fsdp, MBS 8, full recompute", job("qwen3vl-30b-a3b", mbs=8)),
        ("235B-A22B, fsdp, MBS 1, full recompute", job("qwen3vl-235b-a22b", mbs=1)),
        ("235B-A22B, fsdp, MBS 2, full recompute", job("qwen3vl-235b-a22b")),
        ("depth proxy (48 layers, 16 experts), 3d, MBS 2, full", job("qwen3vl-30b-a3b-48layers-16experts", strategy="3d")),
        ("depth proxy, 3d, MBS 4, full", job("qwen3vl-30b-a3b-48layers-16experts", mbs=4, strategy="3d")),
        ("4 layers, 128 experts, 3d, MBS 8, full", job("qwen3vl-30b-a3b", mbs=8, strategy="3d", num_layers=4)),
        ("4-layer proxy (16 experts), 3d, MBS 8, full", job("qwen3vl-30b-a3b-4layers-16experts", mbs=8, strategy="3d")),
    ]
