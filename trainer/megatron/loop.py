"""The entry a trainer rank calls (``train``), and the glue to Megatron-Bridge's pretrain loop."""
from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass
from typing import Iterator

import torch
from megatron.bridge.training.callbacks import Callback
from megatron.bridge.training.config import ConfigContainer

from trainer.checkpoint import prune
from trainer.config import TrainerConfig
from trainer.megatron.container import build_bridge, build_config_container, check_runtime
from trainer.megatron.metrics import MetricsSink, TimedIterator
from trainer.megatron.overrides import TRAINER_RUN_KEEPS, BridgeOverrides, apply_overrides
from trainer.megatron.provider import VlmfeedFeed, pretrain
from trainer.megatron.step import to_stock_batch

log = logging.getLogger("vlmfeed.megatron")


@dataclass(kw_only=True)
class MegatronRank:
    """What one rank reports and where it learns that the run should stop."""

    metrics_sink: MetricsSink = None  # a JSON-lines path, or a callable taking each step's record
    samples_path: str | None = None  # each step's [sample key, epoch] pairs
    control: str | None = None  # the named actor a driver's stop request arrives through
    resume: bool = False  # the driver found a checkpoint in cfg.checkpoint.load to take up
    redealt: bool = False  # ... saved at another DP size: the data service dealt the rest anew
    out: str = "."


def train(cfg: TrainerConfig, data_iterator: Iterator[dict], me: MegatronRank | None = None,
          *, world_size: int | None = None, valid_iterator: Iterator[dict] | None = None,
          overrides: BridgeOverrides | None = None) -> list[dict]:
    """Train with Megatron-Bridge on this rank. Call on every rank, with RANK/WORLD_SIZE/LOCAL_RANK/
    MASTER_ADDR/MASTER_PORT set (Bridge initialises torch.distributed unless it already is).
    ``overrides``: Bridge-style ``key=value`` items (and YAML), applied to the container last.
    Returns this rank's per-step records; the last rank also writes them to ``me.metrics_sink``."""
    me = me or MegatronRank()
    world_size = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    cfg.validate(world_size)
    check_runtime(cfg)

    iterator = TimedIterator(data_iterator, adapt=to_stock_batch if cfg.train.padded else None)
    iterator.ignore_restore = me.redealt
    valid = TimedIterator(valid_iterator, adapt=to_stock_batch if cfg.train.padded else None) if valid_iterator else None
    bridge = build_bridge(cfg)
    container = build_config_container(cfg, world_size, iterator, valid_iterator=valid, bridge=bridge,
                                       resume=me.resume)
    if me.redealt:  # no loader state of the old DP size is restored: Bridge finds none here
        container.dataset.dataloader_load = os.path.join(me.out, "no-loader-state")
    # A Ray actor sees exactly its own GPU; Bridge would otherwise pick cuda:LOCAL_RANK.
    container.dist.external_gpu_device_mapping = torch.cuda.device_count() == 1
    apply_overrides(container, overrides or BridgeOverrides(), keeps=TRAINER_RUN_KEEPS)
    init_loopback_distributed(container)
    feed = VlmfeedFeed(container, padded=cfg.train.padded)
    callbacks = [*feed.callbacks(me.metrics_sink, samples_path=me.samples_path), StopOnRequest(me.control)]
    if cfg.checkpoint.export_hf:
        callbacks.append(ExportAtEnd(bridge, cfg.checkpoint.export_hf))
    if cfg.checkpoint.save and cfg.checkpoint.keep_last:
        callbacks.append(KeepLast(cfg.checkpoint.save, cfg.checkpoint.keep_last))
    log.info("Megatron-Bridge backend: %s, strategy %s, %s rows", cfg.model.preset, cfg.parallel.strategy,
             "padded (stock qwen3_vl_step)" if cfg.train.padded else "packed (THD)")
    stopped = run_bridge(container, feed.forward_step(), callbacks)
    feed.metrics.finish(stopped)
    return feed.records


class StopOnRequest(Callback):
    """Polls the driver's stop request once a step; on one, signals this rank as Slurm would, so
    Bridge's own exit handler saves a checkpoint at the step boundary and stops."""

    def __init__(self, control: str | None):
        self.control = control
        self.reason = ""

    def on_train_step_end(self, context) -> None:
        if not self.control or self.reason:
            return
        import ray

        try:
            self.reason = ray.get(ray.get_actor(self.control).stop_reason.remote(), timeout=10)
        except Exception:  # no driver to ask (a script of the user's): nothing was asked
            return
        if self.reason:
            os.kill(os.getpid(), signal.SIGTERM)


class KeepLast(Callback):
    """After each save, rank 0 drops all but the newest checkpoints with their loader states."""

    def __init__(self, root: str, keep: int):
        self.root, self.keep = root, keep

    def on_checkpoint_save(self, context) -> None:
        if torch.distributed.get_rank() == 0:
            prune(self.root, self.keep)


class ExportAtEnd(Callback):
    """Writes a Hugging Face checkpoint of the trained model when training ends (every rank takes part)."""

    def __init__(self, bridge, path: str):
        self.bridge, self.path = bridge, path

    def on_train_end(self, context) -> None:
        self.bridge.save_hf_pretrained(context.model, self.path)
        log.info("Hugging Face checkpoint written to %s", self.path)


def init_loopback_distributed(container: ConfigContainer) -> None:
    """In the embedded single-host job, torch.distributed on a rendezvous bound to 127.0.0.1
    (``trainer.rendezvous``), with NCCL's bootstrap on the loopback interface (NCCL_SOCKET_IFNAME=lo,
    set in the rank env). Bridge's own init would serve torch's store on every interface; it skips
    its init when torch.distributed is already initialized, so this does the steps it would."""
    import datetime

    from trainer.rendezvous import init_distributed, on_loopback

    if not on_loopback() or torch.distributed.is_initialized():
        return
    device = 0 if container.dist.external_gpu_device_mapping else int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(device)
    if "transformer_engine" in (getattr(container.model, "cuda_graph_impl", None),
                                getattr(container.model, "vision_cuda_graph_impl", None)):
        torch.cuda.set_stream(torch.cuda.Stream())  # as Bridge does: cudagraph capture needs a non-default stream
    init_distributed(container.dist.distributed_backend,
                     timeout=datetime.timedelta(minutes=container.dist.distributed_timeout_minutes))
    torch.distributed.barrier(device_ids=[device])


def run_bridge(container: ConfigContainer, forward_step, callbacks: list[Callback]) -> str | None:
    """Megatron-Bridge's pretrain loop; returns why it stopped early (a signal, --exit-interval,
    --exit-duration-in-mins: Bridge saves, then exits the process with status 0), or None."""
    try:
        pretrain(container, forward_step, callbacks)
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise
        stop = next((c.reason for c in callbacks if isinstance(c, StopOnRequest)), "")
        return stop or ("exit_interval" if container.train.exit_interval else "exit_duration_in_mins")
    return None
