"""The data service as a trainer runs it: the one definition of the training geometry.

``trainer.run``, ``vlmfeed inspect`` (which shows what a rank receives) and a user's own training
script build their ``ServiceConfig`` here, so the blocks, chains, pixel caps and sequence length a
rank sees are the same wherever the stream is made::

    cfg = for_training(["shards/{00000..00099}.tar"], device="gpu", micro_batch_size=2, dp_size=8)
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Literal

from datasvc.config import DecodeConfig, ServiceConfig
from datasvc.flags import section_arguments
from datasvc.usage import positive_float, positive_int


@dataclass(frozen=True)
class DeviceDefaults:
    """What a training run on this kind of device uses unless told otherwise."""

    seq_len: int
    max_pixels: int
    """The pipeline's pixel cap: 1 MP keeps a GPU's vision tower in budget; 64K pixels (256 vision
    tokens at most) keeps the CPU development model's steps to seconds on two cores."""


DEVICE_DEFAULTS = {"gpu": DeviceDefaults(seq_len=4096, max_pixels=1024 * 1024),
                   "cpu": DeviceDefaults(seq_len=1024, max_pixels=256 * 256)}
BLOCK_MICRO_BATCHES = 8
"""Micro-batches a block of work items packs into when blocks are sized from the shards
(``datasvc.pack.epoch.size_blocks``): about half a micro-batch of padding is lost per chain of blocks."""
CHAIN_BLOCKS = 4
"""Blocks packed as a chain: a packing simulation of the real-large photos at MBS 8, blocks of 8
micro-batches, gives rows 0.949 full with 1, 0.972 with 2, 0.982 with 4 and 0.987 with 8; a restore
re-reads at most 3 blocks."""


def micro_batches_per_step(gbs: int, mbs: int, dp_size: int) -> int:
    """Micro-batches each DP rank trains per optimizer step (gradient accumulation): ``gbs`` rows over
    ``dp_size`` ranks of ``mbs`` rows; at least one."""
    return max(1, gbs // max(1, mbs * dp_size))


def device_pipeline_options(pipeline: str, device: Literal["cpu", "gpu"], max_pixels: int | None = None,
                     min_pixels: int | None = None, **options) -> dict:
    """The pipeline's options at the device's pixel cap; the pipeline's own minimum is lowered to the
    cap where the cap is below it. ``options`` (e.g. ``video_fps``, ``tokenizer``) pass through where set."""
    from datasvc.registry import get_layout

    opts = {"max_pixels": max_pixels or DEVICE_DEFAULTS[device].max_pixels}
    default_min = get_layout(pipeline).vision.min_pixels
    if min_pixels or opts["max_pixels"] < default_min:
        opts["min_pixels"] = min_pixels or min(default_min, opts["max_pixels"])
    return {**opts, **{k: v for k, v in options.items() if v is not None}}


def training_config(shards=(), *, device: Literal["cpu", "gpu"] = "cpu", pipeline: str = "qwen3vl",
                    seq_len: int | None = None, micro_batch_size: int = 1, dp_size: int = 1,
                    max_pixels: int | None = None, min_pixels: int | None = None, pipeline_options: dict | None = None,
                    block_micro_batches: int = BLOCK_MICRO_BATCHES, items_per_block: int | None = None,
                    **fields):
    """(``ServiceConfig``, ``BlockSizing`` or None): the stream a trainer on ``device`` trains from.

    Streams forever, blocks span epochs and pack in chains of ``CHAIN_BLOCKS``; blocks are sized
    from the shards to pack into about ``block_micro_batches`` micro-batches unless
    ``items_per_block`` is given (then the sizing is None). ``fields`` set any other
    ``ServiceConfig`` field or section (``seed``, ``consumers_per_replica``, ``decode=DecodeConfig(...)``,
    ``pool=PoolConfig(...)``, ``balance=BalanceConfig(...)``, ...).
    """
    from datasvc.pack.epoch import size_blocks
    from datasvc.samples import default_shards

    if device not in DEVICE_DEFAULTS:
        raise ValueError(f"device={device!r}: use 'cpu' or 'gpu'")
    if block_micro_batches < 1:
        raise ValueError(f"block_micro_batches must be >= 1, not {block_micro_batches}")
    options = device_pipeline_options(pipeline, device, max_pixels, min_pixels, **(pipeline_options or {}))
    shards = (shards,) if isinstance(shards, str) else tuple(shards)
    geometry = dict(epochs=None, blocks_span_epochs=True, chain_blocks=CHAIN_BLOCKS)
    cfg = ServiceConfig(shards=shards or (() if fields.get("blend") else tuple(default_shards())),
                        pipeline=pipeline, pipeline_options=options,
                        seq_len=seq_len or DEVICE_DEFAULTS[device].seq_len, micro_batch_size=micro_batch_size,
                        dp_size=dp_size, items_per_block=items_per_block or 1, **{**geometry, **fields})
    if items_per_block is not None:
        return cfg, None
    return size_blocks(cfg, target_micro_batches=block_micro_batches)


def for_training(shards=(), **kwargs) -> ServiceConfig:
    """The stream ``trainer.run`` trains from (``training_config`` without the sizing record)."""
    return training_config(shards, **kwargs)[0]


CPU_RANKS = 2
"""Trainer ranks ``trainer.run`` starts on a CPU box (data parallel): enough to show DP on two cores."""


def default_device() -> Literal["cpu", "gpu"]:
    """'gpu' where torch sees a CUDA GPU (``trainer.run`` then trains on GPUs), else 'cpu'."""
    try:
        import torch
    except ImportError:
        return "cpu"
    return "gpu" if torch.cuda.is_available() else "cpu"


_GPU, _CPU = DEVICE_DEFAULTS["gpu"], DEVICE_DEFAULTS["cpu"]
DATA_FLAGS: dict[str, dict] = {
    "--pipeline": dict(default="qwen3vl", help="the model pipeline (pipelines/NAME): its tokenizer, chat format and "
                                                "pixel limits"),
    "--device": dict(choices=tuple(DEVICE_DEFAULTS), default=None,
                     help="whose training geometry: sequence length and pixel cap (default: gpu where torch sees "
                          "a CUDA GPU, else cpu, as trainer.run picks)"),
    "--seq-len": dict(type=positive_int, default=None,
                      help=f"tokens per packed row (default: {_GPU.seq_len} on GPU, {_CPU.seq_len} on CPU)"),
    "--max-pixels": dict(type=positive_int, default=None,
                         help=f"per-image pixel cap (default: {_GPU.max_pixels:,} on GPU, {_CPU.max_pixels:,} on CPU)"),
    "--min-pixels": dict(type=positive_int, default=None,
                         help="per-image pixel floor (default: the pipeline's, lowered to the cap where the cap is below it)"),
    "--video-fps": dict(type=positive_float, default=None,
                        help="frames sampled a second of video (default: the pipeline's, 2)"),
    "--video-max-pixels": dict(type=positive_int, default=None,
                               help="cap on frames x height x width of one video (default: the pipeline's)"),
    "--data-seed": dict(type=int, default=ServiceConfig.seed,
                        help="the data seed: the order of work items and of the samples in them"),
    "--items-per-block": dict(type=positive_int, default=None,
                              help="work items packed together (default: sized from the shards to fill "
                                   "--block-micro-batches)"),
    "--block-micro-batches": dict(type=positive_int, default=BLOCK_MICRO_BATCHES,
                                  help="micro-batches a packing block should fill when --items-per-block is not "
                                       "given: about half a micro-batch of padding rows is lost per chain of "
                                       "--chain-blocks blocks; memory grows with it"),
    "--chain-blocks": dict(type=positive_int, default=CHAIN_BLOCKS,
                           help="blocks packed as a chain: a block's part-filled rows wait for the next block's "
                                "samples (1: each block on its own); a restore re-reads up to this many - 1 blocks"),
    **section_arguments(DecodeConfig),
    "--blend": dict(default="", help="datasets in fixed proportions: NAME=PATTERN:WEIGHT,... or a YAML file "
                                     "(instead of shards)"),
}
"""The data flags of a training run, defined once: every command that takes one takes it from here,
so a flag means the same and defaults to what a training run uses wherever it is given."""


def add_data_flags(parser, *flags: str, **defaults) -> None:
    """Add ``flags`` (names in ``DATA_FLAGS``) to ``parser`` (or an argument group); ``defaults`` (by dest, e.g.
    ``device="gpu"``) change a default where a command predicts another run, with its help saying so."""
    for flag in flags:
        spec = dict(DATA_FLAGS[flag])
        dest = flag[2:].replace("-", "_")
        if dest in defaults:
            spec["default"] = defaults.pop(dest)
            spec["help"] = spec["help"].split(" (default")[0] + " (default: %(default)s)"
        parser.add_argument(flag, **spec)
    if defaults:
        raise TypeError(f"no data flag for {sorted(defaults)}")


def geometry_from_flags(args: argparse.Namespace, pipeline: str = "qwen3vl") -> dict:
    """The resolved training geometry of parsed flags: device, seq_len and the pipeline's pixel
    options, the device's defaults filled in where a flag was left out."""
    device = getattr(args, "device", None) or default_device()
    seq_len = getattr(args, "seq_len", None) or DEVICE_DEFAULTS[device].seq_len
    options = device_pipeline_options(pipeline, device, getattr(args, "max_pixels", None),
                                      getattr(args, "min_pixels", None))
    return {"device": device, "seq_len": seq_len, "pipeline_options": options}
