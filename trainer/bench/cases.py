"""The training cases of ``python -m trainer.bench``, in groups named by what they measure.

A case is ``(name, source, trainer.run options)``; its name ``{strategy}-{source}-mbs{N}[-label]`` is
what ``trainer.bench.plots`` parses. Every case trains the 4-layer 30B-A3B proxy (``PROXY``) on one
GPU unless it says ``--world-size``.

Sources: ``real`` is the bundled photo set (96 samples an epoch); ``real-large`` the same photos as
384 distinct crops, so that blocks fill the rows of MBS 4 and 8; ``synthetic``/``mock`` are
calibrated from the real set of the same size and have as many samples. ``video-mix`` is the
``image-video-mix`` synthetic profile (photos and short VP9/H.264 clips, some samples both).
"""
from __future__ import annotations

PROXY = ["--num-layers", "4", "--seq-len", "4096"]
MEMORY = ["--recompute", "full", "--vision-chunk-patches", "32768"]  # what MBS 4-8 needs to fit
SOURCES = ("real-large", "synthetic-large", "mock-large")
VIDEO = ["--video-max-pixels", str(4 << 20)]  # about 2k tokens a clip: one video sample fits a 4k row
DEPTH_PROXY = ["--model-preset", "qwen3vl-30b-a3b-48layers-16experts", "--num-layers", "48", *MEMORY, "--expandable-segments"]
"""What ``trainer.run`` picks with no flags on one H200: all 48 decoder layers, 16 experts (docs/benchmarks/4-layer-proxy-and-depth-proxy.md)."""


def case(strategy: str, source: str, mbs: int, iters: int, *extra: str, label: str = "") -> tuple:
    name = f"{strategy}-{source}-mbs{mbs}{'-' + label if label else ''}"
    return name, source, ["--strategy", strategy, "--mbs", str(mbs), "--train-iters", str(iters), *extra]


def sources(strategy: str, mbs: int, iters: int, *extra: str, label: str = "") -> list[tuple]:
    """The same case on real-large photos and on the synthetic and mock sets calibrated from them."""
    return [case(strategy, src, mbs, iters, *extra, label=label) for src in SOURCES]


def _chains(mbs: int, iters: int, *extra: str) -> list[tuple]:
    return [case("3d", "real-large", mbs, iters, *MEMORY, *extra, "--chain-blocks", str(chain),
                 label=f"recompute-vchunk32k-chain{chain}") for chain in (4, 1)]


GROUPS = {
    # Both strategies train on real photos from the Ray stream (50 steps each).
    "strategies": [case("fsdp", "real", 2, 50), case("3d", "real", 2, 50)],
    # Calibrated synthetic and image-free mock on the small set (their real twin is in "strategies").
    "sources-small": [case("3d", "synthetic", 2, 30), case("3d", "mock", 2, 30)],
    "mbs-small": [case("3d", "real", 1, 25), case("3d", "real", 4, 20),
                  case("3d", "real", 8, 15, "--recompute", "full", label="recompute")],
    # A frozen vision tower, and the stock qwen3_vl_step on padded rows, against packed rows.
    "frozen-vision-padded": [case("3d", "real", 2, 25, "--freeze-vision-model", label="frozen-vision"),
                             case("3d", "real", 2, 25, "--padded", label="padded")],
    "fsdp-sources-mbs1-2": [case("fsdp", "real-large", 1, 12), case("fsdp", "real-large", 2, 12),
                            case("fsdp", "synthetic-large", 2, 12), case("fsdp", "mock-large", 2, 12)],
    "3d-sources-mbs1-2": [case("3d", "real-large", 1, 20), case("3d", "real-large", 2, 20),
                          case("3d", "synthetic-large", 2, 20), case("3d", "mock-large", 2, 20)],
    # MBS 4 and 8 with full recompute under both strategies (the vision tower in one call).
    "large-mbs-recompute": [case("fsdp", "real-large", 4, 10, "--recompute", "full", label="recompute"),
                            case("fsdp", "real-large", 8, 8, "--recompute", "full", label="recompute"),
                            case("3d", "real-large", 4, 12, "--recompute", "full", label="recompute"),
                            case("3d", "real-large", 8, 10, "--recompute", "full", label="recompute")],
    "frozen-vision-mbs8": [case("3d", "real-large", 8, 10, "--recompute", "full", "--freeze-vision-model",
                                label="recompute-frozen-vision")],
    "gpu-decode-train": [case("3d", "real-large", 2, 20, "--decode", "gpu", label="gpu-decode")],
    # The vision tower over at most 16k patches at a time (whole images), against one call per
    # micro-batch at MBS 4 (same run), and at MBS 8 where one call runs out of memory.
    "vision-chunks-16k": [case("3d", "real-large", 4, 12, "--recompute", "full", label="recompute"),
                          case("3d", "real-large", 4, 12, "--recompute", "full", "--vision-chunk-patches", "16384",
                               label="recompute-vchunk"),
                          case("3d", "real-large", 8, 10, "--recompute", "full", "--vision-chunk-patches", "16384",
                               label="recompute-vchunk"),
                          case("fsdp", "real-large", 8, 8, "--recompute", "full", "--vision-chunk-patches", "16384",
                               label="recompute-vchunk")],
    # Fewer, larger chunks (16k costs 19% at MBS 4), and expandable allocator segments, since 3d MBS 8
    # fails on an 18.55 GiB logits buffer with 18 GiB reserved but unused without them.
    "vision-chunks-32k": [case("3d", "real-large", 4, 12, *MEMORY, label="recompute-vchunk32k"),
                          case("3d", "real-large", 8, 10, *MEMORY, "--expandable-segments",
                               label="recompute-vchunk32k-expseg"),
                          case("fsdp", "real-large", 8, 8, *MEMORY, "--expandable-segments",
                               label="recompute-vchunk32k-expseg")],
    # Two GPUs against one GPU in the same run: EP2 under 3d (experts split, data-parallel otherwise)
    # and Megatron-FSDP sharding across both. Per-GPU tokens/s over the 1-GPU case is the scaling.
    "two-gpus": [case("3d", "real-large", 2, 12, "--world-size", "2", "--ep", "2", label="ep2-2gpu"),
                 case("3d", "real-large", 2, 12, label="1gpu"),
                 case("fsdp", "real-large", 2, 10, "--world-size", "2", label="2gpu"),
                 case("fsdp", "real-large", 2, 10, label="1gpu")],
    # The same on four GPUs (EP 4 under 3d; FSDP across four), 1-GPU baselines in the run.
    "four-gpus": [case("3d", "real-large", 2, 12, "--world-size", "4", "--ep", "4", label="ep4-4gpu"),
                  case("3d", "real-large", 2, 12, label="1gpu"),
                  case("fsdp", "real-large", 2, 10, "--world-size", "4", label="4gpu"),
                  case("fsdp", "real-large", 2, 10, label="1gpu")],
    # Real vs calibrated synthetic vs image-free mock, by strategy and MBS, each real case re-measured
    # beside its twins so the ratios are same-run. MBS 8 is where the vision tower's share of the
    # step is largest.
    "sources-3d-mbs1-4": [*sources("3d", 1, 20), *sources("3d", 4, 12, *MEMORY, label="recompute-vchunk32k")],
    "sources-3d-mbs2": sources("3d", 2, 15),
    "sources-3d-mbs8": sources("3d", 8, 10, *MEMORY, "--expandable-segments", label="recompute-vchunk32k-expseg"),
    "sources-fsdp-mbs1-4": [*sources("fsdp", 1, 16),
                            *sources("fsdp", 4, 10, *MEMORY, label="recompute-vchunk32k")],
    "sources-fsdp-mbs2": sources("fsdp", 2, 12),
    "sources-fsdp-mbs8": sources("fsdp", 8, 8, *MEMORY, "--expandable-segments",
                                 label="recompute-vchunk32k-expseg"),
    # Blocks sized in micro-batches (trainer.run's default) against fixed 4-item blocks.
    "block-sizing": [case("3d", "real-large", 2, 15, label="sized-blocks"),
                     case("3d", "real-large", 2, 15, "--items-per-block", "4", label="4-item-blocks")],
    # Blocks packed in chains of 4 (trainer.run's default) against each block on its own, same run.
    "chain-blocks": [*_chains(4, 20), *_chains(8, 16, "--expandable-segments")],
    # Photos and clips in one stream: video decode on the actors, video pads in packed rows.
    "video-mix-3d-mbs1-2-4": [case("3d", "video-mix", 1, 15, *VIDEO, label="vcap4m"),
                              case("3d", "video-mix", 2, 15, *VIDEO, label="vcap4m"),
                              case("3d", "video-mix", 4, 12, *VIDEO, *MEMORY, label="vcap4m-recompute-vchunk32k")],
    # The cost model's full-depth calibration: real photos and the image-free mock at MBS 1 and 2.
    "depth-proxy-fsdp-mbs1-2": [case("fsdp", src, mbs, 12, *DEPTH_PROXY, label="depth-proxy")
                                for mbs in (1, 2) for src in ("real-large", "mock-large")],
}
DEFAULT_GROUPS = ["strategies", "sources-small", "mbs-small", "frozen-vision-padded"]
