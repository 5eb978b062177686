"""``python -m trainer.run qwen3vl [KEY=VALUE ...] [options]``: train a VLM on Ray, fed by the vlmfeed
data service.

Under ``ray job submit`` it joins that cluster; run directly it starts a local Ray on 127.0.0.1.
With GPUs in the cluster it trains with Megatron-Bridge (``trainer.megatron``); without, it runs
the CPU development path (``trainer.cpu_backend``) with the same orchestration and data.
On Megatron-Bridge, ``KEY=VALUE`` items after the pipeline (``optimizer.adam_beta2=0.95
logger.log_interval=5``) and ``--config-file YAML`` override its ConfigContainer, with Bridge's own
override machinery, after everything the flags set.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from datasvc.host import commit
from datasvc.usage import HelpFormatter, UserError
from trainer.config import add_cli_args
from trainer.job import add_job_args, build_job, launch
from trainer.megatron.overrides import add_override_args, check_override_args
from trainer.report import draw_run, written
from trainer.summary import summarize

log = logging.getLogger("vlmfeed.run")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m trainer.run", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("pipeline", help="model pipeline in pipelines/ (e.g. qwen3vl)")
    add_override_args(p)
    add_job_args(p)
    add_cli_args(p)
    args = p.parse_intermixed_args(argv)  # overrides may come before, between or after the options
    check_override_args(p, args)
    args._given = {a.split("=")[0] for a in argv if a.startswith("--")}  # flags the user set
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        job = build_job(args)
    except UserError as exc:
        raise SystemExit(f"python -m trainer.run: {exc}") from None
    records, data_stats, wall_s, machines = launch(job)
    summary = {**summarize(records, data_stats, job.backend, job.world, wall_s), **job.describe(),
               "commit": commit(), "machines": machines}
    with open(os.path.join(job.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    draw_run(job.metrics_path, os.path.join(job.out, "loss.png"))
    print(json.dumps({k: v for k, v in summary.items() if k not in ("data", "machines")}, indent=2))
    ck = job.cfg.checkpoint
    print("wrote:\n  " + "\n  ".join(os.path.abspath(p) if "://" not in p else p
                                     for p in written(job.out, ck.save, ck.export_hf)))
    if not summary["loss_finite"]:
        log.error("loss is not finite")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
