"""``python -m trainer.plan qwen3vl --gpus N [--gpu-memory-gib G] [trainer.run's model/parallel/train flags]``

Per-GPU memory by part, the verdict (fits / does not fit, with margin), the nearest settings that fit
and the decision guide's recommendations, each with its reason. Pure arithmetic: no GPU, Ray or
Megatron. ``--json`` prints the same as data (``peak_gib`` and ``fits`` at the top level);
``--fit auto`` prints the configuration ``trainer.run`` would pick; ``--table`` the common cases.
"""
from __future__ import annotations

import argparse
import json
import sys

from datasvc.usage import HelpFormatter, UserError, positive_int
from trainer.plan.memory import Workload


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The planner's options, and every option of ``trainer.run`` (a job's command line plans as it
    is); an unknown option is an error, so that a typo never changes the plan."""
    from trainer.config import add_cli_args
    from trainer.job import add_job_args

    p = argparse.ArgumentParser(prog="vlmfeed plan", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("pipeline", help="model pipeline in pipelines/ (e.g. qwen3vl)")
    g = p.add_argument_group("machine and data")
    g.add_argument("--gpus", type=positive_int, default=None, help="GPUs of the job (default: --world-size, else 1)")
    d = Workload()
    g.add_argument("--image-share", type=float, default=d.image_share,
                   help="image tokens / real tokens at the fullest micro-batch (0 for text-only or mock data)")
    g.add_argument("--fill", type=float, default=d.fill, help="real tokens / row slots at the fullest micro-batch")
    g.add_argument("--data-actors-on-gpu", type=int, default=d.data_processes_on_gpu,
                   help="data actors with a CUDA context on each GPU")
    g = p.add_argument_group("output")
    g.add_argument("--json", action="store_true", help="the plan as JSON")
    g.add_argument("--table", action="store_true", help="a markdown table of common cases on 1/8/64 GPUs")
    add_cli_args(p)
    add_job_args(p)  # with trainer.run's --fit, which here plans what is given unless asked to fit
    p.set_defaults(fit="off", gpu_memory_gib=141.0)  # an H200 unless told; H100 80, GB200 186
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from trainer.config import ConfigError, from_args
    from trainer.plan.fit import fit_auto, nearest_fits
    from trainer.plan.planner import plan_job
    from trainer.plan.report import common_cases, format_plan, format_table

    args = parse_args(sys.argv[1:] if argv is None else argv)
    from datasvc.registry import available

    if args.pipeline not in available():
        raise SystemExit(f"unknown pipeline {args.pipeline!r}; available: {', '.join(available())}")
    work = Workload(image_share=args.image_share, fill=args.fill, data_processes_on_gpu=args.data_actors_on_gpu)
    if args.table:
        print(format_table(common_cases(), workload=work))
        return 0
    gpus = args.gpus or args.world_size or 1
    cfg = from_args(args)
    dp = max(1, gpus // (cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp))
    if "--gbs" not in argv_flags(argv):
        cfg.train.gbs = cfg.train.mbs * dp
    reason = None
    if args.fit == "auto":
        cfg, plan, reason = fit_auto(cfg, gpus, args.gpu_memory_gib, work)
    else:
        try:
            cfg.validate(gpus)
        except ConfigError as exc:
            raise SystemExit(str(exc))
        plan = plan_job(cfg, gpus, args.gpu_memory_gib, work)
    nearest = [] if plan.fits else nearest_fits(cfg, gpus, args.gpu_memory_gib, work)
    if args.json:
        out = plan.to_dict()
        out["nearest_fits"] = [{"change": what, **p.to_dict(), "recommendations": None} for what, p in nearest]
        if reason:
            out["fit_auto"] = reason
        print(json.dumps(out, indent=1))
    else:
        if reason:
            print(f"fit auto: {reason}")
        print(format_plan(plan, nearest))
    return 0 if plan.fits else 1


def argv_flags(argv: list[str] | None) -> set[str]:
    return {a.split("=")[0] for a in (sys.argv[1:] if argv is None else argv) if a.startswith("--")}


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UserError as exc:
        sys.exit(f"python -m trainer.plan: {exc}")
