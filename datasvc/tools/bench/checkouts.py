"""Does a change of structure cost speed? The same benches at two commits of this repository,
alternated round by round in one run (which commit goes first alternates too), each bench a fresh
process in its own checkout of the commit (a git worktree, removed afterwards):

    python -m datasvc.tools.bench.checkouts --base COMMIT [--head HEAD] [--rounds 3] [--out DIR]

``decode``: the preprocessing actors' work per core (``vlmfeed bench decode``'s
``ours_uint8_pixel_rows``, images/s on one thread). ``service``: the Ray service's steady samples/s
with one preprocessing actor (``vlmfeed bench service``), which runs the actors' own stages.
``train`` (not in the default set: it wants the GPU machine the question is about): the steady
tokens/s of ``python -m trainer.run qwen3vl --train-iters 20`` plus ``--train-args``, what the main
command trains on that machine. The answer is head over base per round, its mean and +-2 standard
errors, and the totals over totals.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from datasvc.tools.bench.provenance import stamp
from datasvc.usage import HelpFormatter, positive_int

@dataclass(frozen=True)
class Bench:
    argv: tuple[str, ...]  # after ``python -m``; ``--out`` is added
    figure: Callable[[str], float]  # the figure, read from what ``--out`` names
    unit: str
    out_is_dir: bool = False
    default: bool = True


def _read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


# Small settings, so that a round takes minutes on two cores; both commits run exactly these.
BENCHES = {
    "decode": Bench(("datasvc.tools.bench", "decode", "--images", "12", "--repeats", "3", "--pack-synth", "-1",
                     "--skip-hf-pil"),
                    lambda out: _read_json(out)["results"]["ours_uint8_pixel_rows"]["images_per_s"], "images/s"),
    "service": Bench(("datasvc.tools.bench", "service", "--max-actors", "1", "--samples", "96", "--epochs", "2",
                      "--max-pixels", "1048576"),
                     lambda out: _read_json(out)["ray"]["1"]["steady_samples_per_s"], "samples/s"),
    "train": Bench(("trainer.run", "qwen3vl", "--train-iters", "20"),
                   lambda out: _read_json(os.path.join(out, "summary.json"))["tokens_per_s"], "tokens/s",
                   out_is_dir=True, default=False),
}


def checkout(repo: str, commit: str, where: str) -> str:
    """A detached worktree of ``commit`` under ``where``; its full hash is the folder's name."""
    full = subprocess.run(["git", "-C", repo, "rev-parse", commit], capture_output=True, text=True, check=True)
    path = os.path.join(where, full.stdout.strip()[:12])
    if not os.path.isdir(path):
        subprocess.run(["git", "-C", repo, "worktree", "add", "--detach", path, commit], capture_output=True,
                       check=True)
    return path


def run_bench(tree: str, name: str, out_dir: str, tag: str, extra: list[str]) -> float:
    bench = BENCHES[name]
    out = os.path.join(out_dir, f"{name}-{tag}" + ("" if bench.out_is_dir else ".json"))
    env = {**os.environ, "PYTHONPATH": tree}  # this checkout's packages, not the installed ones
    proc = subprocess.run([sys.executable, "-m", *bench.argv, *extra, "--out", out], cwd=tree, env=env,
                          capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{name} at {tree} failed: {proc.stderr[-2000:]}")
    return float(bench.figure(out))


def compare(base: str, head: str, rounds: int, names: list[str], out_dir: str, repo: str,
            train_args: Sequence[str] = ()) -> dict:
    work = tempfile.mkdtemp(prefix="vlmfeed-checkouts-")
    trees = {"base": checkout(repo, base, work), "head": checkout(repo, head, work)}
    figures = {name: {"base": [], "head": []} for name in names}
    try:
        for r in range(rounds):
            order = ("base", "head") if r % 2 == 0 else ("head", "base")
            for name in names:
                for side in order:
                    t0 = time.monotonic()
                    value = run_bench(trees[side], name, out_dir, f"{side}-round{r + 1}",
                                      list(train_args) if name == "train" else [])
                    figures[name][side].append(value)
                    print(f"[checkouts] round {r + 1}/{rounds} {name} {side}: {value:.2f} {BENCHES[name].unit} "
                          f"({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)
    finally:
        for tree in trees.values():
            subprocess.run(["git", "-C", repo, "worktree", "remove", "--force", tree], capture_output=True)
        subprocess.run(["git", "-C", repo, "worktree", "prune"], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
    return {"base": base, "head": head, "rounds": rounds, "train_args": list(train_args),
            "benches": {name: summarize(v["base"], v["head"], BENCHES[name].unit) for name, v in figures.items()}}


def summarize(base: list[float], head: list[float], unit: str) -> dict:
    ratios = np.asarray(head) / np.asarray(base)
    se = float(ratios.std(ddof=1) / np.sqrt(len(ratios))) if len(ratios) > 1 else float("nan")
    return {"unit": unit, "base": base, "head": head, "ratio_per_round": [round(float(x), 4) for x in ratios],
            "ratio_mean": round(float(ratios.mean()), 4), "ratio_2se": round(2 * se, 4),
            "ratio_of_totals": round(sum(head) / sum(base), 4)}


def print_report(rep: dict) -> None:
    print(f"\nhead {rep['head']} over base {rep['base']}, {rep['rounds']} alternated rounds")
    print(f"{'bench':8} {'unit':10} {'base mean':>10} {'head mean':>10} {'head/base':>16} {'totals':>7}")
    for name, b in rep["benches"].items():
        print(f"{name:8} {b['unit']:10} {np.mean(b['base']):10.2f} {np.mean(b['head']):10.2f} "
              f"{b['ratio_mean']:>8.3f} +-{b['ratio_2se']:.3f} {b['ratio_of_totals']:7.3f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="vlmfeed bench checkouts", description=__doc__.split("\n\n")[0],
                                 formatter_class=HelpFormatter)
    ap.add_argument("--base", required=True, help="the commit measured against (a hash, tag or branch)")
    ap.add_argument("--head", default="HEAD", help="the commit measured")
    ap.add_argument("--rounds", type=positive_int, default=3)
    ap.add_argument("--benches", nargs="+", choices=sorted(BENCHES),
                    default=sorted(n for n, b in BENCHES.items() if b.default))
    ap.add_argument("--train-args", default="", help="more options of the train bench's trainer.run, quoted "
                    "(--train-args=\"--strategy 3d --mbs 2\")")
    ap.add_argument("--out", default="bench-checkouts", help="directory for each run's JSON and the summary")
    args = ap.parse_args(argv)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    os.makedirs(args.out, exist_ok=True)
    rep = stamp(compare(args.base, args.head, args.rounds, args.benches, os.path.abspath(args.out), repo,
                        shlex.split(args.train_args)),
                "Does a change of structure cost speed?", "vlmfeed bench checkouts " + " ".join(argv or sys.argv[1:]))
    print_report(rep)
    path = os.path.join(args.out, "checkouts.json")
    with open(path, "w") as f:
        json.dump(rep, f, indent=1)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
