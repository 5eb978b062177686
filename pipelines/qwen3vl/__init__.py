"""Qwen3-VL: every model fact the data service, the tools and the trainer need, each once.

- ``data``: token ids, the image processor's numbers, the chat format (what the data service runs).
- ``arch``: architecture presets of the released models and their proxies.
- ``flops``: training FLOPs per packed micro-batch, from an architecture.
- ``cost``: predicted seconds per packed micro-batch, fitted on the H200 (DP balancing).
- ``megatron``: the Hugging Face config that Megatron-Bridge's AutoBridge builds the model from.
- ``cpu_model``: the tiny real model the CPU development path trains.

The data service finds this package by name (``datasvc.registry``); ``build`` and ``layout`` are
the registry's contract.
"""
from pipelines.qwen3vl.data import (TOKENS, VIDEO_PAD, VOCAB_SIZE, Qwen3VLOptions, Qwen3VLPipeline, build,
                                    layout)

__all__ = ["TOKENS", "VIDEO_PAD", "VOCAB_SIZE", "Qwen3VLOptions", "Qwen3VLPipeline", "build", "layout",
           "flops_model", "cost_model"]


def flops_model(preset: str, custom_json: str | None = None):
    """The FLOP model of an architecture preset (or of a custom JSON), for the profiler's demand side."""
    from pipelines.qwen3vl.flops import load_model

    return load_model(preset, custom_json)


def cost_model(preset: str | None = None, calibration: str | None = None, **overrides):
    """Predicted seconds of a packed micro-batch (``datasvc.pack.balance.CostModel``) for a preset at a
    fitted calibration; see ``pipelines.qwen3vl.cost``."""
    from pipelines.qwen3vl.cost import cost_model as build

    return build(preset, calibration, **overrides)
