"""A run's checkpoints: where they live, what the driver reads of them before any rank starts, and
the CPU development path's own save and load.

One layout for both backends (Megatron-Bridge's), on a local or shared path or an ``s3://`` URL
(through fsspec; Bridge's own checkpoints need a filesystem path):

    DIR/latest_checkpointed_iteration.txt        the step of the newest complete checkpoint
    DIR/iter_0000015/                            one checkpoint
        model.pt optimizer.pt rng/rank0.pt ...   CPU path: model, optimizer and scheduler, each rank's RNG
        loader/dp000.json ...                    CPU path: each DP rank's loader state
        (Bridge's distributed checkpoint)        Megatron
    DIR/energon/iter_0000015/train_dataloader_dprank000.pt
                                                 Megatron: each DP rank's loader state, saved by Bridge

A loader state is ``DataClient.save_state()``: the rank's position, the dataset's fingerprint and the
samples it trained by epoch, so the driver can resume every rank exactly at the same DP size, or deal
what is left of the epoch over another (``datasvc.remainder``).
"""
from __future__ import annotations

import io
import json
import logging
import posixpath
import re

from dataclasses import dataclass, field

import fsspec

from datasvc.usage import positive_float
from trainer.flags import flag

log = logging.getLogger("vlmfeed.checkpoint")

LATEST = "latest_checkpointed_iteration.txt"
_ITER = re.compile(r"iter_(\d{7})$")


# ------------------------------------------------------------------------------------------------
# Options (both backends)
# ------------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class CheckpointingConfig:
    """Saving, resuming, stopping early and exporting (names as Megatron-Bridge's)."""

    save: str | None = field(default=None, metadata=flag(
        "save checkpoints here (a shared path; s3:// on the CPU path); also on SIGTERM and at the end", metavar="DIR"))
    save_interval: int | None = field(default=None, metadata=flag(
        "steps between checkpoints (default: end and exit only)"))
    load: str | None = field(default=None, metadata=flag(
        "resume from the newest checkpoint in DIR (none there: start afresh), also at another data-parallel size",
        metavar="DIR"))
    keep_last: int | None = field(default=None, metadata=flag("checkpoints kept, newest first (default: all)"))
    exit_interval: int | None = field(default=None, metadata=flag("save and stop once the step is a multiple of this"))
    exit_duration_in_mins: float | None = field(default=None, metadata=flag(
        "save and stop after this many minutes", type=positive_float))
    export_hf: str | None = field(default=None, metadata=flag(
        "write a Hugging Face checkpoint of the trained model here at the end", metavar="DIR"))
    export_hf_on_save: bool = field(default=False, metadata=flag(
        "also write a Hugging Face checkpoint into each checkpoint (DIR/iter_N/hf; on GPUs: --strategy 3d with "
        "--hf-path, Bridge's own export)", action="store_true"))


@dataclass(kw_only=True)
class EvalConfig:
    eval_interval: int | None = field(default=None, metadata=flag(
        "steps between validation passes over --valid-shards (default: none)"))
    eval_iters: int = field(default=4, metadata=flag("global batches per validation pass (default: %(default)s)"))


def check_long_run(cfg) -> list[str]:
    """Checkpoint, exit and evaluation options (both backends)."""
    c, e = cfg.checkpoint, cfg.eval
    out = [f"--{name.replace('_', '-')} must be >= 1 (got {v})" for name, v in (
        ("save_interval", c.save_interval), ("keep_last", c.keep_last), ("exit_interval", c.exit_interval),
        ("eval_interval", e.eval_interval)) if v is not None and v < 1]
    if e.eval_iters < 1:
        out.append(f"--eval-iters must be >= 1 (got {e.eval_iters})")
    if c.exit_duration_in_mins is not None and c.exit_duration_in_mins <= 0:
        out.append(f"--exit-duration-in-mins must be > 0 (got {c.exit_duration_in_mins})")
    if (c.save_interval or c.keep_last or c.export_hf_on_save) and not c.save:
        out.append("--save-interval, --keep-last and --export-hf-on-save need --save DIR (where checkpoints go)")
    return out


# ------------------------------------------------------------------------------------------------
# Reading a run's checkpoints
# ------------------------------------------------------------------------------------------------
def iter_name(step: int) -> str:
    return f"iter_{step:07d}"


def _fs(root: str):
    fs, path = fsspec.core.url_to_fs(root)
    return fs, path.rstrip("/")


def latest_step(root: str) -> int | None:
    """The newest complete checkpoint's step under ``root``, or None when there is none."""
    fs, path = _fs(root)
    try:
        with fs.open(posixpath.join(path, LATEST), "r") as f:
            text = f.read().strip()
    except FileNotFoundError:
        return None
    if not text.isdigit():
        raise SystemExit(f"{root}/{LATEST} holds {text!r}, not a step; point --load at a checkpoint directory")
    return int(text)


@dataclass(frozen=True)
class SavedRun:
    """What the driver needs of a checkpoint: its step and every DP rank's loader state."""

    root: str
    step: int
    loader: dict[int, dict]

    @property
    def dp_size(self) -> int:
        return len(self.loader)

    @property
    def remainder(self) -> dict | None:
        """The remainder the saved stream started from (``datasvc.remainder``), if any."""
        return next(iter(self.loader.values()), {}).get("remainder")


def read_saved_run(root: str) -> SavedRun | None:
    step = latest_step(root)
    if step is None:
        return None
    fs, path = _fs(root)
    loader: dict[int, dict] = {}
    cpu_dir = posixpath.join(path, iter_name(step), "loader")
    bridge_dir = posixpath.join(path, "energon", iter_name(step))
    if fs.exists(cpu_dir):
        for p in sorted(fs.ls(cpu_dir, detail=False)):
            if m := re.search(r"dp(\d+)\.json$", p):
                with fs.open(p, "r") as f:
                    loader[int(m.group(1))] = json.load(f)
    elif fs.exists(bridge_dir):
        import torch

        for p in sorted(fs.ls(bridge_dir, detail=False)):
            if m := re.search(r"dprank(\d+)\.pt$", p):
                with fs.open(p, "rb") as f:
                    blob = torch.load(io.BytesIO(f.read()), weights_only=True)
                loader[int(m.group(1))] = blob["dataloader_state_dict"]
    if not loader:
        raise SystemExit(f"the checkpoint {root}/{iter_name(step)} holds no loader state; it was not written by "
                         "trainer.run (start without --load, or point it at a trainer.run --save directory)")
    return SavedRun(root, step, loader)


# ------------------------------------------------------------------------------------------------
# The CPU development path's checkpoints
# ------------------------------------------------------------------------------------------------
def _save(fs, path: str, obj) -> None:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    with fs.open(path, "wb") as f:
        f.write(buf.getvalue())


def _load(fs, path: str):
    import torch

    with fs.open(path, "rb") as f:
        return torch.load(io.BytesIO(f.read()), weights_only=False)  # our own files, never a shard's


def save_cpu(root: str, step: int, *, rank: int, dp_rank: int | None, model, optimizer, scheduler,
             loader_state: dict | None, export_hf: bool = False) -> None:
    """This rank's part of checkpoint ``step``: rank 0 the model, optimizer and scheduler (every
    rank holds the same, gradients being all-reduced), each rank its RNG, each DP rank's first
    consumer its loader state. ``commit`` makes it the latest once every rank has written."""
    import torch

    fs, path = _fs(root)
    d = posixpath.join(path, iter_name(step))
    fs.makedirs(posixpath.join(d, "rng"), exist_ok=True)
    if rank == 0:
        _save(fs, posixpath.join(d, "model.pt"), model.state_dict())
        _save(fs, posixpath.join(d, "optimizer.pt"), {"optimizer": optimizer.state_dict(),
                                                      "scheduler": scheduler.state_dict()})
    if rank == 0 and export_hf:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:  # transformers writes to a local folder
            model.save_pretrained(tmp)
            fs.put(tmp + "/", posixpath.join(d, "hf") + "/", recursive=True)
    _save(fs, posixpath.join(d, "rng", f"rank{rank}.pt"), torch.get_rng_state())
    if loader_state is not None:
        fs.makedirs(posixpath.join(d, "loader"), exist_ok=True)
        with fs.open(posixpath.join(d, "loader", f"dp{dp_rank:03d}.json"), "w") as f:
            json.dump(loader_state, f)


def commit(root: str, step: int, keep_last: int | None) -> None:
    """Mark ``step`` the latest (after every rank wrote its part) and drop all but the newest ``keep_last``."""
    fs, path = _fs(root)
    with fs.open(posixpath.join(path, LATEST), "w") as f:
        f.write(str(step))
    prune(root, keep_last)


def prune(root: str, keep_last: int | None) -> None:
    """Drop every checkpoint but the newest ``keep_last``, with its loader states. (Bridge's own
    ``most_recent_k`` counts ``energon/iter_*`` among the checkpoints, so it can keep a checkpoint
    and delete the loader states beside it.)"""
    if not keep_last:
        return
    fs, path = _fs(root)
    steps = sorted(int(m.group(1)) for p in fs.ls(path, detail=False) if (m := _ITER.search(p.rstrip("/"))))
    for old in steps[:-keep_last]:
        for d in (posixpath.join(path, iter_name(old)), posixpath.join(path, "energon", iter_name(old))):
            if fs.exists(d):
                fs.rm(d, recursive=True)


def load_cpu(root: str, step: int, *, rank: int, model, optimizer, scheduler) -> None:
    import torch

    fs, path = _fs(root)
    d = posixpath.join(path, iter_name(step))
    model.load_state_dict(_load(fs, posixpath.join(d, "model.pt")))
    state = _load(fs, posixpath.join(d, "optimizer.pt"))
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    rng = posixpath.join(d, "rng", f"rank{rank}.pt")
    if fs.exists(rng):
        torch.set_rng_state(_load(fs, rng))
