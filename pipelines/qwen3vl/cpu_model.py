"""The CPU development model: a real, tiny Qwen3-VL MoE from transformers (2 layers, 8 experts).

It trains on gloo ranks so the whole job runs and is tested without GPUs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pipelines.qwen3vl.data import MERGE_SIZE, PATCH_SIZE, TEMPORAL_PATCH_SIZE, TOKENS, VIDEO_PAD, VOCAB_SIZE
from pipelines.qwen3vl.arch import QWEN3VL_30B_A3B


@dataclass(frozen=True, kw_only=True)
class CpuModelConfig:
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    num_experts: int = 8
    top_k: int = 2
    moe_intermediate: int = 128
    vision_depth: int = 2
    vision_hidden: int = 128
    vision_heads: int = 4
    vocab_size: int = VOCAB_SIZE


def _mrope_section(head_dim: int) -> list[int]:
    half = head_dim // 2
    t = half - 2 * (half * 5 // 16)
    return [t, half * 5 // 16, half * 5 // 16]


def build_model(cfg: CpuModelConfig, seed: int):
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    torch.manual_seed(seed)
    config = Qwen3VLMoeConfig(
        text_config=dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.hidden_size * 2,
                         num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                         num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.hidden_size // cfg.num_heads,
                         moe_intermediate_size=cfg.moe_intermediate, num_experts=cfg.num_experts,
                         num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.top_k, decoder_sparse_step=1,
                         # mrope sections split head_dim/2 over (t, h, w) like Qwen3-VL's [24, 20, 20] of 64
                         rope_parameters={"rope_type": "default", "rope_theta": QWEN3VL_30B_A3B.rope_theta,
                                          "mrope_section": _mrope_section(cfg.hidden_size // cfg.num_heads),
                                          "mrope_interleaved": True},
                         tie_word_embeddings=True),
        vision_config=dict(depth=cfg.vision_depth, hidden_size=cfg.vision_hidden, intermediate_size=cfg.vision_hidden * 2,
                           num_heads=cfg.vision_heads, out_hidden_size=cfg.hidden_size, patch_size=PATCH_SIZE,
                           temporal_patch_size=TEMPORAL_PATCH_SIZE, spatial_merge_size=MERGE_SIZE, deepstack_visual_indexes=[0]),
        image_token_id=TOKENS.image_pad, video_token_id=VIDEO_PAD, vision_start_token_id=TOKENS.vision_start,
        vision_end_token_id=TOKENS.vision_end,
    )
    config._attn_implementation = "sdpa"
    return Qwen3VLMoeForConditionalGeneration(config)
