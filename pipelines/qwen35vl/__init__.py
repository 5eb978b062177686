"""Qwen3.5-VL: every model fact the data service, the tools and the trainer need, each once.

The same file set as ``pipelines.qwen3vl``; where a fact is Qwen3-VL's (the image and video
processors, the chat format) it is imported from there, not copied.

- ``tokenizer``: the Qwen3.5 vocabulary, offline, as a ``tokenizers`` file.
- ``data``: token ids and the pipeline (Qwen3-VL's processor over Qwen3.5's vocabulary).
- ``video``: Qwen3-VL's video facts, re-exported.
- ``arch``: the released 35B-A3B (MoE) and 27B (dense), and proxies.
- ``flops``: training FLOPs with the hybrid DeltaNet + attention decoder.
- ``cost``: predicted seconds per micro-batch, at rates fitted on Qwen3-VL (derived).
- ``megatron``: the Hugging Face config AutoBridge builds the Megatron model from.
- ``cpu_model``: the tiny real model the CPU development path trains.
"""
from pipelines.qwen35vl.data import TOKENS, VIDEO_PAD, VOCAB_SIZE, Qwen35VLOptions, Qwen35VLPipeline, build, layout

__all__ = ["TOKENS", "VIDEO_PAD", "VOCAB_SIZE", "Qwen35VLOptions", "Qwen35VLPipeline", "build", "layout",
           "flops_model", "cost_model"]


def flops_model(preset: str, custom_json: str | None = None):
    """The FLOP model of an architecture preset, for the profiler's demand side."""
    from pipelines.qwen35vl.flops import load_model

    return load_model(preset, custom_json)


def cost_model(preset: str | None = None, calibration: str | None = None, **overrides):
    """Predicted seconds of a packed micro-batch (``datasvc.pack.balance.CostModel``); see ``cost``."""
    from pipelines.qwen35vl.cost import cost_model as build_cost

    return build_cost(preset, calibration, **overrides)
