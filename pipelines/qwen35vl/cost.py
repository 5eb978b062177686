"""Predicted seconds of a packed Qwen3.5-VL micro-batch, for DP balancing: no Qwen3.5-VL step has
been measured yet, so this model's FLOPs (``flops.py``) are priced at the effective rates fitted on
the Qwen3-VL 4-layer proxy (``pipelines.qwen3vl.cost``; same GPU, same Megatron-Bridge). Derived,
not measured: the DeltaNet recurrence is priced at the decoder's rate, as a linear term.
"""
from __future__ import annotations

import dataclasses

from datasvc.pack.balance import CostModel
from pipelines.qwen3vl.cost import CALIBRATIONS, from_rates
from pipelines.qwen3vl.cost import options_for_training as qwen3vl_options
from pipelines.qwen35vl.arch import DEFAULT_PRESET, arch
from pipelines.qwen35vl.flops import PRESETS, from_arch


def cost_model(preset: str | None = None, calibration: str | None = None, *, num_layers: int | None = None,
               num_experts: int | None = None, vision_trainable: bool = True) -> CostModel:
    name = calibration or "h200-3d"
    if name not in CALIBRATIONS:
        raise ValueError(f"unknown calibration {name!r}; fitted: {', '.join(sorted(CALIBRATIONS))}")
    preset = preset or DEFAULT_PRESET
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    model = PRESETS[preset]
    if num_layers or num_experts:
        model = from_arch(f"{preset}-{num_layers or 'all'}layers-{num_experts or 'all'}experts",
                          arch(preset, num_layers=num_layers, num_experts=num_experts))
    model = dataclasses.replace(model, vision_trainable=vision_trainable)
    c = CALIBRATIONS[name]
    base = from_rates(model, c, derived=True)
    text = c.text_tflops * 1e12
    return dataclasses.replace(base, decoder_per_token=(6.0 * model.active_params + model.recurrence_flops_per_token) / text,
                               decoder_per_token_sq=model.attention_flops_per_token_sq / text)


def options_for_training(preset: str, num_layers: int | None, num_experts: int | None, strategy: str,
                         recompute: bool, freeze_vision: bool) -> dict:
    """``cost_model`` options for a training setting: Qwen3-VL's choice of calibration."""
    return qwen3vl_options(preset, num_layers, num_experts, strategy, recompute, freeze_vision)
