"""Per-GPU memory planner for a training job: pure arithmetic from the pipeline's architecture numbers
(no torch, no Ray, no Megatron), so ``trainer.run`` can check a job before anything is built.

- ``plan_job(cfg, gpus, gpu_memory_gib) -> Plan``: memory by part at the peak, verdict, advice.
- ``fit_auto(cfg, gpus, gpu_memory_gib) -> (cfg, Plan, reason)``: the largest configuration that fits.
- ``nearest_fits(cfg, gpus, gpu_memory_gib) -> [(what changes, Plan)]``: the nearest settings that fit.
- ``python -m trainer.plan qwen3vl --gpus N [--gpu-memory-gib G] [trainer.run's flags] [--json]``.
"""
from trainer.plan.fit import fit_auto, nearest_fits
from trainer.plan.memory import Workload
from trainer.plan.planner import Advice, Plan, plan_job
from trainer.plan.report import format_plan, format_table

__all__ = ["Advice", "Plan", "Workload", "fit_auto", "format_plan", "format_table", "nearest_fits", "plan_job"]
