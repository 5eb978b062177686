"""Qwen3.5-VL architectures: the released models and proxies of them.

Qwen3.5's decoder is hybrid: of every ``full_attention_interval`` layers, the last is gated softmax
attention (head_dim 256, a quarter of it rotary) and the others Gated DeltaNet linear attention; the
MoE models add a gated shared expert to the routed ones. The vision tower is Qwen3-VL's without
deepstack. Numbers: 35B-A3B from transformers' ``Qwen3_5MoeTextConfig`` defaults (documented as
Qwen/Qwen3.5-35B-A3B), 27B from Megatron-Bridge's ``Qwen35VLModelProvider`` notes; rope theta and
mrope sections from Megatron-Bridge's Qwen3.5-VL providers.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pipelines.qwen3vl.arch import BF16, FP32, Qwen3VLArch, selective_recompute
from pipelines.qwen35vl.data import VOCAB_SIZE


DELTA_RULE_CHUNK = 64  # tokens per chunk of the chunked Gated DeltaNet kernel


@dataclass(frozen=True, kw_only=True)
class Qwen35VLArch(Qwen3VLArch):
    """A Qwen3.5-VL model; the fields it shares with Qwen3-VL mean the same. ``num_experts`` 0: dense."""

    head_dim: int = 256
    num_experts: int = 256
    moe_ffn_hidden_size: int = 0
    dense_ffn_hidden_size: int = 0
    shared_expert_ffn_hidden_size: int = 0
    vocab_size: int = VOCAB_SIZE
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    mrope_section: tuple[int, int, int] = (11, 11, 10)
    deepstack_visual_indexes: tuple[int, ...] = ()
    full_attention_interval: int = 4
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_full_attention_layers(self) -> int:
        return self.num_layers // self.full_attention_interval

    def layer_types(self) -> list[str]:
        return ["full_attention" if (i + 1) % self.full_attention_interval == 0 else "linear_attention"
                for i in range(self.num_layers)]

    def _mean_over_layers(self, full: float, linear: float) -> float:
        n_full = self.num_full_attention_layers
        return (n_full * full + (self.num_layers - n_full) * linear) / self.num_layers

    @property
    def _key_width(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def _value_width(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    def decoder_layer_params(self) -> tuple[float, float]:
        """(dense, routed-expert) parameters of one decoder layer, the mean over the layer kinds.

        Gated attention: q projects to the heads and their output gate, k and v to the kv heads, o
        back. Gated DeltaNet: the q/k/v/z and b/a in-projections, the short convolution over q, k and
        v, the per-head decay and step, the out-projection. MLP: the router, the routed experts, the
        shared expert and its gate; or the dense MLP."""
        h, hd = self.hidden_size, self.head_dim
        full = 2 * h * self.num_attention_heads * hd + 2 * h * self.num_kv_heads * hd + self.num_attention_heads * hd * h
        kw, vw, vh = self._key_width, self._value_width, self.linear_num_value_heads
        linear = (h * (2 * kw + 2 * vw + 2 * vh) + (2 * kw + vw) * self.linear_conv_kernel_dim + 2 * vh
                  + vw * h)
        attention = self._mean_over_layers(full, linear)
        if not self.is_moe:
            return attention + 3 * h * self.dense_ffn_hidden_size, 0.0
        shared = 3 * h * self.shared_expert_ffn_hidden_size + h if self.shared_expert_ffn_hidden_size else 0
        routed = self.num_experts * 3 * h * self.moe_ffn_hidden_size
        return attention + h * self.num_experts + shared, routed

    def decoder_kept_bytes_per_token(self, granularity: str, modules: list[str]) -> dict[str, float]:
        """Bytes one decoder layer keeps for backward per token (before TP/CP), by module, the mean
        over the layer kinds. A DeltaNet layer keeps its projections, the convolution's outputs, its
        output and gated norm, and the chunked delta rule's per-token state (decay, step and the
        64-token chunk's triangular solve, fp32) instead of softmax attention's q/k/v. Modelled from
        the kernels' saved tensors, not yet checked against a measured peak."""
        h, hq, hkv = self.hidden_size, self.num_attention_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if granularity == "full":
            return {"input": BF16 * h}
        kw, vw, vh = self._key_width, self._value_width, self.linear_num_value_heads
        full = BF16 * (2 * h + 2 * hq + 2 * hkv + 2 * hq)  # norm inputs, q and its gate, k, v, gated output
        linear = (BF16 * (2 * h + 2 * kw + 2 * vw + 2 * vh + 2 * kw + vw + 2 * vw)
                  + FP32 * vh * (2 + DELTA_RULE_CHUNK))
        keep = {"layernorm": BF16 * 2 * h, "attention": self._mean_over_layers(full, linear)}
        if self.is_moe:
            k, f, sf = self.moe_topk, self.moe_ffn_hidden_size, self.shared_expert_ffn_hidden_size
            keep.update({"router": FP32 * 2 * self.num_experts,
                         "moe": BF16 * (k * (h + 2 * f + h) + (h + 2 * sf + h if sf else 0)),
                         "moe_act": BF16 * (k * f + sf)})
        else:
            f = self.dense_ffn_hidden_size
            keep.update({"mlp": BF16 * (h + 2 * f + h), "mlp_act": BF16 * f})
        return selective_recompute(keep, granularity, modules)


QWEN35VL_35B_A3B = Qwen35VLArch(
    hidden_size=2048, num_layers=40, num_attention_heads=16, num_kv_heads=2, num_experts=256, moe_topk=8,
    moe_ffn_hidden_size=512, shared_expert_ffn_hidden_size=512, linear_num_value_heads=32,
    vision_out_hidden_size=2048,
)
QWEN35VL_27B = Qwen35VLArch(
    hidden_size=5120, num_layers=64, num_attention_heads=24, num_kv_heads=4, num_experts=0, moe_topk=0,
    dense_ffn_hidden_size=17408, linear_num_value_heads=48, vision_out_hidden_size=5120,
)

PRESETS: dict[str, Qwen35VLArch] = {
    "qwen35vl-35b-a3b": QWEN35VL_35B_A3B,
    "qwen35vl-27b": QWEN35VL_27B,
}
# Proxies of 35B-A3B that one GPU holds: the full depth (40 layers, 10 of them softmax attention) with
# 16 experts instead of 256, and 4 layers (3 DeltaNet + 1 attention) with 16 experts.
PROXIES: dict[str, tuple[str, dict]] = {
    "qwen35vl-35b-a3b-40layers-16experts": ("qwen35vl-35b-a3b", {"num_experts": 16}),
    "qwen35vl-35b-a3b-4layers-16experts": ("qwen35vl-35b-a3b", {"num_layers": 4, "num_experts": 16}),
}
# Earlier names, refused in one line that gives the new one.
RENAMED = {"qwen35vl-35b-a3b-depth-proxy": "qwen35vl-35b-a3b-40layers-16experts",
           "qwen35vl-35b-a3b-4layer-proxy": "qwen35vl-35b-a3b-4layers-16experts"}
DEFAULT_PRESET = "qwen35vl-35b-a3b"
# From the largest: the order the trainer's memory planner (``--fit auto``) tries.
SIZE_ORDER = ("qwen35vl-35b-a3b", "qwen35vl-27b", "qwen35vl-35b-a3b-40layers-16experts", "qwen35vl-35b-a3b-4layers-16experts")


def arch(preset: str, **overrides) -> Qwen35VLArch:
    """A preset (or proxy) with overrides applied (None keeps the preset's value)."""
    if preset in PROXIES:
        base_name, proxy = PROXIES[preset]
        overrides = {**proxy, **{k: v for k, v in overrides.items() if v is not None}}
        preset = base_name
    if preset in RENAMED:
        raise ValueError(f"model preset {preset!r} is now named {RENAMED[preset]!r}")
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of {preset_names()}")
    changes = {k: v for k, v in overrides.items() if v is not None}
    if changes.get("num_experts") and not PRESETS[preset].is_moe:
        raise ValueError(f"{preset} is dense: it has no experts to override")
    return dataclasses.replace(PRESETS[preset], **changes)


def preset_names() -> list[str]:
    return sorted(PRESETS) + sorted(PROXIES)
