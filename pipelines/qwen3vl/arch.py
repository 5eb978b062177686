"""Qwen3-VL MoE architectures: the released models (public Hugging Face config.json) and proxies.

A proxy keeps what sets the per-token cost of a layer (hidden size, heads, top-k routing, expert
width, the whole vision tower) and cuts what only multiplies memory: layers or experts.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pipelines.qwen3vl.data import MERGE_SIZE, PATCH_SIZE, TEMPORAL_PATCH_SIZE, VOCAB_SIZE


BF16, FP32 = 2, 4


def selective_recompute(keep: dict[str, float], granularity: str, modules: list[str]) -> dict[str, float]:
    """What a layer still keeps when Megatron recomputes ``modules`` (``granularity`` "selective")."""
    keep = dict(keep)
    if granularity == "selective":
        if "layernorm" in modules:
            keep["layernorm"] = 0.0
        if "moe_act" in modules or "moe" in modules:
            keep["moe_act"] = 0.0
        if "moe" in modules:
            keep["moe"] = 0.0
        if "mlp" in modules:  # a dense MLP
            keep["mlp"] = keep["mlp_act"] = 0.0
        # core_attn: with flash attention the kept q/k/v/output are the recompute's inputs and
        # outputs anyway, so it saves almost nothing.
    return keep


@dataclass(frozen=True, kw_only=True)
class Qwen3VLArch:
    """The numbers that define a Qwen3-VL MoE model (language tower + vision tower)."""

    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int = 128
    num_experts: int = 128
    moe_topk: int = 8
    moe_ffn_hidden_size: int
    dense_ffn_hidden_size: int  # HF ``intermediate_size``; unused by all-MoE layers but part of the config
    vocab_size: int = VOCAB_SIZE
    rope_theta: float = 5_000_000.0
    mrope_section: tuple[int, int, int] = (24, 20, 20)
    max_position_embeddings: int = 262144
    # vision tower
    vision_depth: int = 27
    vision_hidden_size: int = 1152
    vision_num_heads: int = 16
    vision_ffn_hidden_size: int = 4304
    vision_out_hidden_size: int  # equals the language hidden size
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    patch_size: int = PATCH_SIZE
    temporal_patch_size: int = TEMPORAL_PATCH_SIZE
    spatial_merge_size: int = MERGE_SIZE

    def decoder_layer_params(self) -> tuple[float, float]:
        """(dense, routed-expert) parameters of one decoder layer: q/k/v/o and the router, the experts."""
        h, hd = self.hidden_size, self.head_dim
        attention = 2 * h * self.num_attention_heads * hd + 2 * h * self.num_kv_heads * hd
        return attention + h * self.num_experts, self.num_experts * 3 * h * self.moe_ffn_hidden_size

    def decoder_kept_bytes_per_token(self, granularity: str, modules: list[str]) -> dict[str, float]:
        """Bytes one decoder layer keeps for backward per token (before TP/CP), by module, as
        Megatron-Core with Transformer Engine keeps them; ``granularity`` and ``modules`` as
        Megatron's ``recompute_granularity`` and ``recompute_modules``."""
        h, hq, hkv = self.hidden_size, self.num_attention_heads * self.head_dim, self.num_kv_heads * self.head_dim
        k, f = self.moe_topk, self.moe_ffn_hidden_size
        if granularity == "full":
            return {"input": BF16 * h}
        keep = {
            "layernorm": BF16 * 2 * h,  # the normalized inputs of attention and the MLP
            "attention": BF16 * (2 * h + hq + 2 * hkv + hq),  # norm inputs, q/k/v after RoPE, output
            "router": FP32 * 2 * self.num_experts,
            "moe": BF16 * k * (h + 2 * f + h),  # permuted tokens, FC1 output, expert output
            "moe_act": BF16 * k * f,  # SwiGLU output (FC2 input)
        }
        return selective_recompute(keep, granularity, modules)


QWEN3VL_30B_A3B = Qwen3VLArch(
    hidden_size=2048, num_layers=48, num_attention_heads=32, num_kv_heads=4,
    moe_ffn_hidden_size=768, dense_ffn_hidden_size=6144, vision_out_hidden_size=2048,
)
QWEN3VL_235B_A22B = Qwen3VLArch(
    hidden_size=4096, num_layers=94, num_attention_heads=64, num_kv_heads=4,
    moe_ffn_hidden_size=1536, dense_ffn_hidden_size=12288, vision_out_hidden_size=4096,
)

PRESETS: dict[str, Qwen3VLArch] = {
    "qwen3vl-30b-a3b": QWEN3VL_30B_A3B,
    "qwen3vl-235b-a22b": QWEN3VL_235B_A22B,
}

# Proxies of 30B-A3B that one GPU holds, named by their decoder layers and experts. The 48-layer one
# (the docs' "depth proxy") keeps the full model's depth, its 27-layer vision tower and top-8 routing
# over 768-wide experts, with 16 experts instead of 128; the 4-layer ones are the short proxies.
PROXIES: dict[str, tuple[str, dict]] = {
    "qwen3vl-30b-a3b-48layers-16experts": ("qwen3vl-30b-a3b", {"num_experts": 16}),
    "qwen3vl-30b-a3b-4layers-16experts": ("qwen3vl-30b-a3b", {"num_layers": 4, "num_experts": 16}),
    # The model most single-H200 figures in docs/results were measured on (``--num-layers 4`` on the
    # full preset): all 128 experts in each layer, 3.65B parameters.
    "qwen3vl-30b-a3b-4layers-128experts": ("qwen3vl-30b-a3b", {"num_layers": 4}),
}
# Earlier names, refused in one line that gives the new one.
RENAMED = {"qwen3vl-30b-a3b-depth-proxy": "qwen3vl-30b-a3b-48layers-16experts",
           "qwen3vl-30b-a3b-4layer-proxy": "qwen3vl-30b-a3b-4layers-16experts",
           "qwen3vl-30b-a3b-4layer-all-experts-proxy": "qwen3vl-30b-a3b-4layers-128experts"}
DEFAULT_PRESET = "qwen3vl-30b-a3b"
# From the largest: the order in which the trainer's memory planner (``--fit auto``) looks for the
# largest model that fits; the depth-faithful proxy comes before the 4-layer one.
SIZE_ORDER = ("qwen3vl-235b-a22b", "qwen3vl-30b-a3b", "qwen3vl-30b-a3b-48layers-16experts", "qwen3vl-30b-a3b-4layers-16experts")


def arch(preset: str, **overrides) -> Qwen3VLArch:
    """A preset (or proxy) with overrides applied (None keeps the preset's value)."""
    if preset in PROXIES:
        base_name, proxy = PROXIES[preset]
        overrides = {**proxy, **{k: v for k, v in overrides.items() if v is not None}}
        preset = base_name
    if preset in RENAMED:
        raise ValueError(f"model preset {preset!r} is now named {RENAMED[preset]!r}")
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of {sorted(PRESETS) + sorted(PROXIES)}")
    changes = {k: v for k, v in overrides.items() if v is not None}
    return dataclasses.replace(PRESETS[preset], **changes)


def preset_names() -> list[str]:
    return sorted(PRESETS) + sorted(PROXIES)
