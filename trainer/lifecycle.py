"""What outlives a run and what ends it: where its outputs go, the checkpoint it takes up (at the
same data-parallel size or another), and a stop asked of it by a signal."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass

from datasvc.config import ServiceConfig
from trainer.config import TrainerConfig

log = logging.getLogger("vlmfeed.run")


def resolve_outputs(args: argparse.Namespace) -> None:
    """Where the run writes. Under ``ray job submit`` the working directory is Ray's temporary copy
    of the package, deleted with the cluster: a relative path there would vanish with the results, so
    the default goes to ~/vlmfeed-runs/<job> (printed) and a relative path given is refused."""
    in_job = bool(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")) or "runtime_resources" in os.getcwd()
    if args.out is None:
        if in_job:
            job = os.environ.get("RAY_SUBMISSION_ID") or time.strftime("%Y%m%d-%H%M%S")
            args.out = os.path.join(os.path.expanduser("~"), "vlmfeed-runs", job)
            log.info("outputs go to %s (a Ray job's working directory is deleted with the cluster)", args.out)
        else:
            args.out = os.path.join("out", "run")
    for flag in ("out", "save", "load", "export_hf"):
        path = getattr(args, flag)
        if in_job and path and "://" not in path and not os.path.isabs(path):
            raise SystemExit(f"--{flag.replace('_', '-')} {path} is relative, so under `ray job submit` it would land in "
                             "Ray's temporary copy of the package and be deleted with the cluster; give an absolute "
                             "path on shared storage (or an s3:// URL)")
        if flag != "load" and path and "://" not in path:
            try:  # made now, so that a path the run could never write stops it before Ray starts
                os.makedirs(path, exist_ok=True)
            except OSError as exc:
                raise SystemExit(f"--{flag.replace('_', '-')} {path}: cannot make this directory ({exc.strerror}); "
                                 "give a directory you can create and write to") from None
            if not os.access(path, os.W_OK | os.X_OK):
                raise SystemExit(f"--{flag.replace('_', '-')} {path}: not writable; give a directory you can write to")


@dataclass(frozen=True)
class Resume:
    """The checkpoint a run takes up: its step, and how the data streams continue from it."""

    root: str
    step: int
    saved_dp: int
    loader: dict[int, dict]  # each DP rank's saved state, when the DP size is unchanged (exact resume)
    redealt: bool  # the DP size changed: what was left of the epoch is dealt over the new ranks

    def describe(self) -> dict:
        return {"from": self.root, "step": self.step, "saved_dp": self.saved_dp, "redealt": self.redealt}



def resume_from(cfg: TrainerConfig, data_cfg: ServiceConfig) -> tuple[ServiceConfig, Resume | None]:
    """With ``--load``: the data config that continues the checkpoint's stream, and what is resumed.
    At the DP size it was saved at, every rank continues its own stream exactly; at another, what was
    left of the epoch is dealt over the new ranks (``datasvc.remainder``)."""
    from datasvc.remainder import remainder_after
    from datasvc.stream.loaderstate import LoaderState
    from datasvc.stream.producer import DataServiceError, check_dataset
    from trainer.checkpoint import read_saved_run

    load = cfg.checkpoint.load
    saved = read_saved_run(load) if load else None
    if saved is None:
        if load:
            log.info("no checkpoint in %s yet: starting afresh", load)
        return data_cfg, None
    if saved.step >= cfg.train.train_iters:
        raise SystemExit(f"the checkpoint in {load} is at step {saved.step}, which --train-iters "
                         f"{cfg.train.train_iters} has reached; raise --train-iters to train on")
    try:
        check_dataset(data_cfg, LoaderState.from_dict(next(iter(saved.loader.values()))).dataset)
    except DataServiceError as exc:
        raise SystemExit(str(exc)) from None
    if saved.dp_size == data_cfg.dp_size:
        data_cfg = dataclasses.replace(data_cfg, remainder=saved.remainder)
        if any(LoaderState.from_dict(st).fingerprint != data_cfg.fingerprint() for st in saved.loader.values()):
            raise SystemExit(f"the checkpoint in {load} was trained on other data settings (shards, seed, --seq-len, "
                             "--mbs, --max-pixels, blocks, --balance-dp...); resume with the settings it was saved with")
        return data_cfg, Resume(load, saved.step, saved.dp_size, saved.loader, redealt=False)
    try:
        remainder = remainder_after(list(saved.loader.values()), saved.remainder)
        data_cfg = dataclasses.replace(data_cfg, remainder=remainder)
        from datasvc.pack.epoch import EpochPlan

        EpochPlan(data_cfg)  # a blend cannot be dealt anew: say so now, not in a feeder
    except ValueError as exc:
        raise SystemExit(f"cannot resume {load} at DP {data_cfg.dp_size}: {exc}") from None
    log.info("resuming step %d at DP %d from a checkpoint saved at DP %d: the samples left of epoch %d on are dealt "
             "over the new ranks, each trained once", saved.step, data_cfg.dp_size, saved.dp_size,
             remainder["first_epoch"])
    return data_cfg, Resume(load, saved.step, saved.dp_size, {}, redealt=True)


class RunControl:
    """Carries a stop request from the driver to the ranks, which poll it once a step (a Ray actor:
    ``start_run_control``)."""

    def __init__(self):
        self.reason = ""

    def request_stop(self, reason: str) -> None:
        self.reason = self.reason or reason

    def stop_reason(self) -> str:
        return self.reason


def start_run_control(name: str):
    import ray

    # named: every rank and the driver find it by the run's name; num_cpus=0: it only holds a flag
    return ray.remote(num_cpus=0)(RunControl).options(name=name).remote()


@contextlib.contextmanager
def stop_on_sigterm(control):
    """While the ranks train, a SIGTERM asks them to save and stop at the next step boundary."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def ask(signum, frame):
        log.warning("SIGTERM: the ranks save at the next step boundary and stop")
        control.request_stop.remote("SIGTERM")

    before = signal.signal(signal.SIGTERM, ask)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)
