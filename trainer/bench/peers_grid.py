"""The peers' training cases as a grid: ``vlmfeed bench peers train`` runs every (profile, cores, MBS,
repeat, path) case in a process of its own (``peers_train.train_one``), resumable: a case whose JSON is
written already is read, not rerun, and under ``--deadline`` no case starts that the deadline would cut
short."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

from trainer.bench.peers_measure import has_gpu
from trainer.bench.peers_report import pooled, ratios


def case_name(path: str, mbs: int, repeat: int) -> str:
    return f"{path}-mbs{mbs}-r{repeat}"


def train_all(args, setting, setting_args: list[str], setting_args_of) -> dict:
    """Every (profile, cores) grid of cases (``--profiles``, ``--cores-list``; else the one setting
    given), each grid under its own folder of ``--out``; ``setting_args_of(args)``: the setting's
    options for a grid's ``train-one`` processes."""
    if not has_gpu():
        return {"skipped": "no CUDA GPU here: run `vlmfeed bench peers train` on the GPU host"}
    import argparse

    profiles, cores_list = args.profiles or [args.profile], args.cores_list or [args.cores]
    if len(profiles) == len(cores_list) == 1:
        return train_grid(args, setting_args, time.time())
    out, start = {}, time.time()
    for profile in profiles:
        for cores in cores_list:
            name = f"{profile or 'photos'}-{cores or 'all'}-cores"
            sub = argparse.Namespace(**{**vars(args), "profile": profile, "cores": cores,
                                        "out": os.path.join(args.out, name)})
            out[name] = train_grid(sub, setting_args_of(sub), start)
    return out


def train_grid(args, setting_args: list[str], start: float) -> dict:
    """Every (MBS, repeat, path) case in its own process, repeats interleaved so that a drift of the
    host spreads over every path; a case whose JSON is in ``--out`` already is read, not rerun. Per
    MBS: each path's repeats pooled, and the ratios to vlmfeed's CPU path."""
    from trainer.bench.peers_data import PADDED

    os.makedirs(args.out, exist_ok=True)
    out: dict = {}
    walls: list[float] = []  # of the cases finished by this command: what the next one likely needs
    for mbs in args.mbs_list:
        runs: dict[str, list] = {p: [] for p in args.paths}
        for repeat in range(args.repeats):
            for path in args.paths:
                case_mbs = (args.padded_mbs or mbs) if path in PADDED else mbs
                name = case_name(path, case_mbs, repeat)
                done = os.path.join(args.out, name + ".json")
                if os.path.exists(done):
                    runs[path].append(json.load(open(done)))
                    continue
                timeout = args.case_timeout
                if args.deadline is not None:
                    timeout = min(timeout, int(args.deadline - (time.time() - start)))
                    needed = time_needed(args.min_case_s, walls)
                    if timeout < needed:
                        print(f"[peers] {name}: not started ({timeout} s to the deadline, a case here takes about "
                              f"{needed:.0f} s); rerun the command to go on", flush=True)
                        continue
                cmd = [sys.executable, "-m", "trainer.bench.peers", "train-one", "--path", path, "--json", done,
                       "--repeat", str(repeat), *_with_mbs(setting_args, case_mbs), *_case_args(args)]
                print(f"[peers] train: {name}", flush=True)
                t0 = time.time()
                rc = run_case(cmd, timeout)
                steps = os.path.join(args.out, name, "metrics.jsonl")
                if os.path.exists(steps):  # every step's record beside the case's summary, kept with it
                    shutil.copyfile(steps, os.path.join(args.out, name + ".steps.jsonl"))
                if rc == 0 and os.path.exists(done):
                    runs[path].append(json.load(open(done)))
                    walls.append(time.time() - t0)
                else:
                    runs[path].append(_partial(path, rc, os.path.join(args.out, name, "metrics.jsonl"), time.time() - t0))
                print(f"[peers] {name}: " + json.dumps({k: runs[path][-1].get(k) for k in (
                    "tokens_per_s", "tokens_per_step", "data_wait_share", "cpu_s_per_trained_sample", "rc")}),
                      flush=True)
        cases = {p: pooled(r) for p, r in runs.items() if r}
        ratios(cases)
        out[f"mbs{mbs}"] = cases
    return out


# A case started with less time than the longest finished one took, give or take this share, would be
# cut before its last step, and a case cut short is run again whole by the next command.
CASE_TIME_MARGIN = 1.15


def time_needed(min_case_s: float, walls: list[float]) -> float:
    """The time a case should have left before it starts: ``min_case_s``, or more where the cases
    this command finished took longer."""
    return max([min_case_s, *(CASE_TIME_MARGIN * w for w in walls)])


def _case_args(args) -> list[str]:
    out = ["--strategy", args.strategy, "--iters", str(args.iters), "--world-size", str(args.world_size),
           "--tp", str(args.tp), "--out", args.out, "--proxy", args.proxy, "--recompute", args.recompute]
    out += ["--workers", str(args.workers)] if args.workers else []
    out += ["--vlmfeed-actors", *map(str, args.vlmfeed_actors)] if args.vlmfeed_actors else []
    return out + (["--cores", str(args.cores)] if args.cores else [])


def run_case(cmd: list[str], timeout: int):
    """The case in its own process group, all of it (its Ray cluster too) killed at the timeout."""
    import signal

    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return "timeout"


def _partial(path: str, rc, metrics: str, wall_s: float) -> dict:
    """A case cut short or failed: the steady summary of the steps it finished, marked partial."""
    out = {"path": path, "rc": rc}
    if os.path.exists(metrics):
        from trainer.bench.training import partial_summary

        out.update(partial_summary(metrics, wall_s))
    return out


def _with_mbs(cmd: list[str], mbs: int) -> list[str]:
    i = cmd.index("--mbs")
    return cmd[:i + 1] + [str(mbs)] + cmd[i + 2:]
