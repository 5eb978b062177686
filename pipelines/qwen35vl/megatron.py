"""The Megatron-Bridge binding of Qwen3.5-VL: the Hugging Face config AutoBridge builds the model from.

Megatron-Bridge 0.6.2 maps ``Qwen3_5MoeForConditionalGeneration`` to ``Qwen35VLMoEModelProvider`` and
``Qwen3_5ForConditionalGeneration`` to ``Qwen35VLModelProvider`` (``models/qwen_vl/qwen35_vl_bridge.py``),
both building its ``Qwen3VLModel`` with the hybrid DeltaNet + attention decoder.
"""
from __future__ import annotations

from pipelines.qwen35vl.arch import Qwen35VLArch
from pipelines.qwen35vl.data import TOKENS, VIDEO_PAD

# Modules a GPU run imports beyond Megatron-Bridge (module -> what to install), checked before any rank starts.
GPU_PACKAGES = {"fla": "flash-linear-attention (the Gated DeltaNet kernels Megatron-Core calls)"}


def hf_config(arch: Qwen35VLArch):
    """The Hugging Face ``Qwen3_5MoeConfig`` (or ``Qwen3_5Config`` for a dense size) of an architecture."""
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig

    text = dict(
        hidden_size=arch.hidden_size, num_hidden_layers=arch.num_layers, num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_kv_heads, head_dim=arch.head_dim, vocab_size=arch.vocab_size,
        max_position_embeddings=arch.max_position_embeddings, rms_norm_eps=1e-6, attention_bias=False,
        layer_types=arch.layer_types(), linear_conv_kernel_dim=arch.linear_conv_kernel_dim,
        linear_key_head_dim=arch.linear_key_head_dim, linear_value_head_dim=arch.linear_value_head_dim,
        linear_num_key_heads=arch.linear_num_key_heads, linear_num_value_heads=arch.linear_num_value_heads,
        rope_parameters={"rope_type": "default", "rope_theta": arch.rope_theta,
                         "partial_rotary_factor": arch.partial_rotary_factor,
                         "mrope_section": list(arch.mrope_section), "mrope_interleaved": True},
    )
    if arch.is_moe:
        text.update(num_experts=arch.num_experts, num_experts_per_tok=arch.moe_topk,
                    moe_intermediate_size=arch.moe_ffn_hidden_size,
                    shared_expert_intermediate_size=arch.shared_expert_ffn_hidden_size)
    else:
        text.update(intermediate_size=arch.dense_ffn_hidden_size)
    vision = dict(depth=arch.vision_depth, hidden_size=arch.vision_hidden_size, num_heads=arch.vision_num_heads,
                  intermediate_size=arch.vision_ffn_hidden_size, out_hidden_size=arch.vision_out_hidden_size,
                  patch_size=arch.patch_size, temporal_patch_size=arch.temporal_patch_size,
                  spatial_merge_size=arch.spatial_merge_size, in_channels=3, num_position_embeddings=2304)
    cls, name = ((Qwen3_5MoeConfig, "Qwen3_5MoeForConditionalGeneration") if arch.is_moe
                 else (Qwen3_5Config, "Qwen3_5ForConditionalGeneration"))
    cfg = cls(text_config=text, vision_config=vision, image_token_id=TOKENS.image_pad, video_token_id=VIDEO_PAD,
              vision_start_token_id=TOKENS.vision_start, vision_end_token_id=TOKENS.vision_end,
              tie_word_embeddings=False)
    cfg.architectures = [name]  # AutoBridge dispatches on the architecture name, which a fresh config lacks
    return cfg
