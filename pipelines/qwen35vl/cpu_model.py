"""The CPU development model: a real, tiny Qwen3.5-VL MoE from transformers (4 layers: 3 Gated
DeltaNet + 1 gated attention, 8 experts and a shared expert, a 2-layer vision tower).

transformers runs DeltaNet on CPU with its torch fallback (``torch_chunk_gated_delta_rule``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pipelines.qwen35vl.arch import QWEN35VL_35B_A3B
from pipelines.qwen35vl.data import MERGE_SIZE, PATCH_SIZE, TEMPORAL_PATCH_SIZE, TOKENS, VIDEO_PAD, VOCAB_SIZE

HF_CLASS = "Qwen3_5MoeForConditionalGeneration"


@dataclass(frozen=True, kw_only=True)
class CpuModelConfig:
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    linear_heads: int = 4
    linear_head_dim: int = 32
    num_experts: int = 8
    top_k: int = 2
    moe_intermediate: int = 128
    vision_depth: int = 2
    vision_hidden: int = 128
    vision_heads: int = 4
    vocab_size: int = VOCAB_SIZE


def build_model(cfg: CpuModelConfig, seed: int):
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    torch.manual_seed(seed)
    a = QWEN35VL_35B_A3B
    rotary_half = int(cfg.head_dim * a.partial_rotary_factor) // 2  # mrope splits it (t, h, w) as 11:11:10 of 32
    h = w = rotary_half * 11 // 32
    config = Qwen3_5MoeConfig(
        text_config=dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
                         num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                         linear_num_key_heads=cfg.linear_heads, linear_num_value_heads=cfg.linear_heads,
                         linear_key_head_dim=cfg.linear_head_dim, linear_value_head_dim=cfg.linear_head_dim,
                         num_experts=cfg.num_experts, num_experts_per_tok=cfg.top_k,
                         moe_intermediate_size=cfg.moe_intermediate, shared_expert_intermediate_size=cfg.moe_intermediate,
                         full_attention_interval=a.full_attention_interval,
                         rope_parameters={"rope_type": "default", "rope_theta": a.rope_theta,
                                          "partial_rotary_factor": a.partial_rotary_factor,
                                          "mrope_section": [rotary_half - h - w, h, w], "mrope_interleaved": True}),
        vision_config=dict(depth=cfg.vision_depth, hidden_size=cfg.vision_hidden, intermediate_size=cfg.vision_hidden * 2,
                           num_heads=cfg.vision_heads, out_hidden_size=cfg.hidden_size, patch_size=PATCH_SIZE,
                           temporal_patch_size=TEMPORAL_PATCH_SIZE, spatial_merge_size=MERGE_SIZE),
        image_token_id=TOKENS.image_pad, video_token_id=VIDEO_PAD, vision_start_token_id=TOKENS.vision_start,
        vision_end_token_id=TOKENS.vision_end, tie_word_embeddings=True,
    )
    config._attn_implementation = "sdpa"
    return Qwen3_5MoeForConditionalGeneration(config)
