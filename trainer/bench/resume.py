"""``python -m trainer.bench.resume``: does a stopped and resumed run train what a straight run trains,
and what does a checkpoint cost? A straight run of N steps, then the same run stopped at N/2
(``--exit-interval``) and resumed (``--load``) to N: the samples of every step, the loss curves, the
checkpoint's size and its save time. Trainer flags after ``--`` go to every run. Writes resume.json
and resume.png under ``--out``."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from datasvc.usage import HelpFormatter

QUESTION = "Does a stopped and resumed run train the same samples and losses as a straight run, and what does a checkpoint cost?"


def run(argv: list[str], log_path: str) -> float:
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.run([sys.executable, "-m", "trainer.run", *argv], stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode:
        raise SystemExit(f"trainer.run failed ({proc.returncode}); see {log_path}")
    return time.perf_counter() - t0


def lines(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def size_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser(prog="python -m trainer.bench.resume", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("pipeline", nargs="?", default="qwen3vl")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--out", required=True, help="directory for the runs, their checkpoints and resume.json")
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    base = [args.pipeline, "--train-iters", str(args.steps), *extra]
    straight, split = os.path.join(out, "straight"), os.path.join(out, "split")
    walls = {"straight": run([*base, "--out", straight], os.path.join(out, "straight.log"))}
    half = args.steps // 2
    ck = os.path.join(split, "ckpt")
    walls["first_half"] = run([*base, "--out", split, "--save", ck, "--keep-last", "1", "--exit-interval", str(half)],
                              os.path.join(out, "first_half.log"))
    ckpt_bytes = size_bytes(ck)  # one checkpoint, with every DP rank's loader state
    walls["resumed_half"] = run([*base, "--out", split, "--save", ck, "--keep-last", "1", "--load", ck],
                                os.path.join(out, "resumed.log"))

    a, b = lines(os.path.join(straight, "metrics.jsonl")), lines(os.path.join(split, "metrics.jsonl"))
    sa, sb = lines(os.path.join(straight, "samples.jsonl")), lines(os.path.join(split, "samples.jsonl"))
    rel = [abs(x["loss"] - y["loss"]) / abs(x["loss"]) for x, y in zip(a, b) if x.get("loss") and y.get("loss")]
    saves = [r["checkpoint_s"] for r in a + b if r.get("checkpoint_s") is not None]
    rep = {
        "steps": args.steps, "resumed_at": half, "trainer_flags": extra,
        "steps_straight": [r["step"] for r in a], "steps_split": [r["step"] for r in b],
        "same_samples_every_step": [s["samples"] for s in sa] == [s["samples"] for s in sb],
        "steps_compared": len(rel),
        "loss_max_rel_diff": max(rel) if rel else None,
        "loss_max_rel_diff_before_resume": max(rel[:half]) if rel else None,
        "loss_max_rel_diff_after_resume": max(rel[half:]) if rel[half:] else None,
        "checkpoint_bytes": ckpt_bytes,
        "checkpoint_s": saves, "wall_s": {k: round(v, 1) for k, v in walls.items()},
        "loss_straight": [r.get("loss") for r in a], "loss_split": [r.get("loss") for r in b],
    }
    from datasvc.tools.bench.provenance import stamp
    from trainer.bench import trainer_defaults

    rep = stamp(rep, QUESTION, "python -m trainer.bench.resume " + " ".join(argv), trainer_defaults())
    with open(os.path.join(out, "resume.json"), "w") as f:
        json.dump(rep, f, indent=1)
    _plot(rep, os.path.join(out, "resume.png"))
    print(f"{'steps':>6} {'resumed at':>10} {'same samples':>13} {'max |dloss|/loss':>17} {'ckpt GiB':>9} {'save s':>8}")
    size = rep["checkpoint_bytes"]
    print(f"{args.steps:>6} {half:>10} {str(rep['same_samples_every_step']):>13} "
          f"{rep['loss_max_rel_diff'] or 0:>17.2e} {(size or 0) / 2**30:>9.2f} "
          f"{(sum(saves) / len(saves) if saves else 0):>8.1f}")
    print(f"wrote {os.path.join(out, 'resume.json')} and resume.png")
    import shutil

    shutil.rmtree(ck, ignore_errors=True)  # tens of GB: the figures above are what is kept
    return 0 if rep["same_samples_every_step"] else 1


def _plot(rep: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(1, len(rep["loss_straight"]) + 1), rep["loss_straight"], label="straight")
    ax.plot(range(1, len(rep["loss_split"]) + 1), rep["loss_split"], "--", label="stopped and resumed")
    ax.axvline(rep["resumed_at"] + 0.5, color="grey", ls=":")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
