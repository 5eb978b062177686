"""The settings a profile sweeps (micro-batch sizes x actors) and the sweep itself.

By default blocks are sized and chained as ``trainer.run`` sizes and chains them, so rows are as
full as in training and micro-batches/s means what a trainer would get; ``items_per_block``
forces a fixed block size instead.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field

from datasvc.tools.profile.measure import measure
from datasvc.tools.profile.verdict import Demand, verdicts
from datasvc.training import BLOCK_MICRO_BATCHES, micro_batches_per_step
DEFAULT_MICRO_BATCHES_PER_RANK = 8
"""Micro-batches a DP rank trains a step when neither --gbs nor --grad-accum says (one would leave
nothing to balance: each rank's single micro-batch is its step)."""


@dataclass
class Settings:
    shards: list[str]
    pipeline: str = "qwen3vl"
    device: str = "gpu"
    """Whose training geometry (``datasvc.training.DEVICE_DEFAULTS``): the profile predicts a GPU
    trainer's demand, so its rows and pixel cap are a GPU run's unless told otherwise."""
    seq_len: int | None = None
    """Tokens per row (None: the device's)."""
    mbs: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    decode: str = "cpu"
    cpu_jpeg_decoder: str = "dali"
    actors: list[int] = field(default_factory=lambda: [1, 2])
    threads: int = 1
    samples: int | None = None
    seconds: float | None = None
    max_pixels: int | None = None
    """Per-image pixel cap (None: the device's)."""
    min_pixels: int | None = None
    video_fps: float | None = None
    """Frames the pipeline samples a second of video (None: the pipeline's)."""
    video_max_pixels: int | None = None
    """The pipeline's cap on frames x height x width of one video (None: the pipeline's)."""
    samples_per_item: int = 16
    items_per_block: int | None = None
    """Work items a block, fixed; None (the default) sizes blocks as ``trainer.run`` does."""
    block_micro_batches: int = BLOCK_MICRO_BATCHES
    """Micro-batches a sized block should fill (``plan.size_blocks``), as ``trainer.run``'s
    ``--block-micro-batches``; unused when ``items_per_block`` is set."""
    chain_blocks: int | None = None
    """Blocks packed as a chain (``ServiceConfig.chain_blocks``); default ``training.CHAIN_BLOCKS``,
    as ``trainer.run``. Blocks span epochs, as in ``trainer.run``: a block sized for 8 micro-batches
    of short samples can hold more than an epoch of a small set (image-free mock at MBS 8: 38 epochs
    of the 384-sample set), and cut at each epoch it would fill about a fifth of its rows."""
    seed: int = 0
    filters: tuple[str, ...] = ()
    """Rules a sample must pass (``ServiceConfig.filters``)."""
    blend: str = ""
    """Datasets in fixed proportions (``ServiceConfig.blend``); ``shards`` may then be empty."""
    dp: int | None = None
    """DP ranks the straggler ratio is predicted for (None: one rank, nothing to straggle)."""
    balance: bool = False
    """Predict with the step's micro-batches dealt by ``datasvc.pack.balance`` (``--balance on``)."""
    micro_batches_per_rank: int | None = None
    """Micro-batches a DP rank trains a step; None: GBS / (DP x MBS) from ``gbs``, else 8."""
    gbs: int | None = None
    cost_preset: str | None = None
    """The pipeline cost model's preset (default: its fitted proxy)."""

    def __post_init__(self):
        from datasvc.training import DEVICE_DEFAULTS

        if self.device not in DEVICE_DEFAULTS:
            raise ValueError(f"device {self.device!r}: use one of {', '.join(DEVICE_DEFAULTS)}")
        self.seq_len = self.seq_len or DEVICE_DEFAULTS[self.device].seq_len

    def straggler(self, shapes: list, mbs: int) -> dict:
        """Predicted straggler ratio (max / mean rank cost a step) over ``dp`` ranks from one
        rank's measured micro-batches (``balance.profile_straggler``)."""
        from datasvc.pack import balance

        dp = self.dp or 1
        if self.gbs and self.gbs < dp * mbs:
            raise ValueError(f"--gbs {self.gbs} is smaller than DP x MBS = {dp * mbs}")
        per_rank = self.micro_batches_per_rank or (micro_batches_per_step(self.gbs, mbs, dp) if self.gbs
                                                   else DEFAULT_MICRO_BATCHES_PER_RANK)
        try:
            model = balance.cost_model(self.pipeline, self.cost_preset)
        except ValueError:  # a custom model: the pipeline's fitted proxy
            model = balance.cost_model(self.pipeline)
        return balance.profile_straggler(shapes, dp, per_rank, model, self.balance)

    def pipeline_options(self) -> dict:
        """The pipeline options of these settings: the device's pixel cap unless given, and the
        video options given (``datasvc.training.device_pipeline_options``)."""
        from datasvc.training import device_pipeline_options

        return device_pipeline_options(self.pipeline, self.device, self.max_pixels, self.min_pixels,
                                       video_fps=self.video_fps, video_max_pixels=self.video_max_pixels)

    def config(self, mbs: int, actors: int):
        """The service config of one setting: ``trainer.run``'s stream (``datasvc.training``), with
        a fixed pool of ``actors`` per rank."""
        from datasvc.config import DecodeConfig
        from datasvc.training import CHAIN_BLOCKS, training_config

        cfg, _ = training_config(
            tuple(self.shards), device=self.device, pipeline=self.pipeline, seq_len=self.seq_len, micro_batch_size=mbs,
            max_pixels=self.max_pixels, min_pixels=self.min_pixels,
            pipeline_options={"video_fps": self.video_fps, "video_max_pixels": self.video_max_pixels},
            block_micro_batches=self.block_micro_batches, items_per_block=self.items_per_block,
            decode=DecodeConfig(device=self.decode, cpu_jpeg_decoder=self.cpu_jpeg_decoder, threads=self.threads),
            pool=fixed_pool(actors), samples_per_item=self.samples_per_item,
            seed=self.seed, chain_blocks=self.chain_blocks or CHAIN_BLOCKS, filters=tuple(self.filters), blend=self.blend)
        return cfg


def fixed_pool(actors: int):
    """``actors`` preprocessing actors per rank, never autoscaled: a measured setting holds still."""
    from datasvc.config import PoolConfig

    return PoolConfig(min_actors=actors, max_actors=actors, autoscale_interval_s=3600.0)


def profile(settings: Settings, demand: Demand | None = None, progress: bool = True, label: str = "") -> dict:
    """Measure every (MBS, actors) setting and judge each MBS against ``demand`` (a ``Demand``)."""
    demand = demand or Demand()
    runs = []
    for mbs in settings.mbs:
        sized = settings.config(mbs, settings.actors[0])  # block sizing reads shards: once per MBS
        for a in settings.actors:
            desc = f"{label + ' ' if label else ''}MBS {mbs}, {a} actor(s)"
            cfg = dataclasses.replace(sized, pool=fixed_pool(a))
            r = measure(cfg, samples=settings.samples, seconds=settings.seconds,
                        model=demand.model, progress=progress, desc=desc)
            r["items_per_block"] = cfg.items_per_block
            r["straggler"] = settings.straggler(r.pop("micro_batch_shapes", []), mbs)
            r["straggler_ratio"] = r["straggler"]["straggler_ratio"]
            r["chain_blocks"] = cfg.chain_blocks
            runs.append(r)
            print(f"  {desc}: {r['rates']['samples_per_s']:.1f} samples/s, "
                  f"{r['rates']['micro_batches_per_s']:.2f} micro-batches/s", file=sys.stderr, flush=True)
    return {
        "label": label,
        "settings": dict(settings.__dict__),
        "demand": demand.describe(),
        "runs": runs,
        "verdicts": verdicts(runs, settings.mbs, demand),
        # Predicted, per setting: max / mean rank cost of a step over settings.dp ranks.
        "straggler_ratio": {f"MBS {r['micro_batch_size']}, {r['actors']} actor(s)": r["straggler_ratio"] for r in runs},
        "balance": "on" if settings.balance else "off",
        "machine": {"cpus": os.cpu_count(), "load_avg": os.getloadavg()},
    }
