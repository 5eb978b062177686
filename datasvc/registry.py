"""Find a model pipeline by name without the data service importing any model module statically."""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from datasvc.media.video import VideoPlan, VideoSpec
from datasvc.media.vision import VisionSpec
from datasvc.read.shards import RawSample


class Pipeline(Protocol):
    """The model-specific contract the data service is driven by (see pipelines/).

    A pipeline module provides ``build(**options) -> Pipeline`` (used where samples are encoded)
    and ``layout(**options) -> PipelineLayout`` (used where only shapes and the pad id matter).
    """

    name: str
    vision: VisionSpec
    video: VideoSpec | None
    """How videos are sampled and cut into patches; None: the pipeline takes no video."""
    pad_id: int
    image_pad_id: int
    """The token an image's vision tokens are written as (one per merged patch)."""
    video_pad_id: int | None
    """The token of a video's vision tokens; None: the pipeline takes no video."""

    def encode(self, raw: RawSample, grids: list[tuple[int, int, int]],
               videos: list[VideoPlan] = ()) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and shifted labels for a sample whose images have these grids and whose videos
        these plans (grid and timestamps), in member order."""


def available() -> list[str]:
    import pipelines

    return sorted(m.name for m in pkgutil.iter_modules(pipelines.__path__) if not m.name.startswith("_"))


@dataclass(frozen=True, slots=True)
class PipelineLayout:
    """What the feeder and the clients need of a pipeline: no tokenizer, cheap to build."""

    vision: VisionSpec
    pad_id: int


def pipeline_module(name: str):
    """The pipeline package by name (for its model facts: ``flops_model``, presets)."""
    try:
        return importlib.import_module(f"pipelines.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"pipelines.{name}":
            raise
        raise ValueError(f"unknown pipeline {name!r}; available: {', '.join(available())}") from None


PARTS = ("data", "video", "arch", "flops", "cost", "megatron", "cpu_model")


def pipeline_part(name: str, part: str):
    """One module of the pipeline's fixed file set (``PARTS``), e.g. its ``arch`` presets or its
    ``cpu_model``, so the trainer and the tools reach a model's facts by the pipeline's name."""
    if part not in PARTS:
        raise ValueError(f"unknown pipeline part {part!r}; parts: {', '.join(PARTS)}")
    pipeline_module(name)  # an unknown name says which pipelines there are
    return importlib.import_module(f"pipelines.{name}.{part}")


def get_pipeline(name: str, **options) -> Pipeline:
    return pipeline_module(name).build(**options)


def get_layout(name: str, **options) -> PipelineLayout:
    """The pipeline's vision layout and pad id; raises on options the pipeline does not know."""
    return pipeline_module(name).layout(**options)
