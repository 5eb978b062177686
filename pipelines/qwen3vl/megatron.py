"""The Megatron-Bridge binding of Qwen3-VL: the Hugging Face config AutoBridge builds the model from.

Megatron-Bridge maps a ``Qwen3VLMoeConfig`` to its ``Qwen3VLMoEModelProvider``; building the config
here, from the architecture presets, sends random init through the same mapping as a checkpoint.
"""
from __future__ import annotations

from pipelines.qwen3vl.arch import Qwen3VLArch
from pipelines.qwen3vl.data import TOKENS, VIDEO_PAD
# Modules a GPU run imports beyond Megatron-Bridge (module -> what to install): none.
GPU_PACKAGES: dict[str, str] = {}


def hf_config(arch: Qwen3VLArch):
    """The Hugging Face ``Qwen3VLMoeConfig`` for an architecture, so random init goes through the same
    AutoBridge mapping (``Qwen3VLMoEBridge.provider_bridge``) as a real checkpoint would."""
    from transformers import Qwen3VLMoeConfig

    cfg = Qwen3VLMoeConfig(
        text_config=dict(
            hidden_size=arch.hidden_size, num_hidden_layers=arch.num_layers,
            num_attention_heads=arch.num_attention_heads, num_key_value_heads=arch.num_kv_heads,
            head_dim=arch.head_dim, num_experts=arch.num_experts, num_experts_per_tok=arch.moe_topk,
            moe_intermediate_size=arch.moe_ffn_hidden_size, intermediate_size=arch.dense_ffn_hidden_size,
            vocab_size=arch.vocab_size, max_position_embeddings=arch.max_position_embeddings,
            rms_norm_eps=1e-6, attention_bias=False,
            rope_parameters={"rope_type": "default", "rope_theta": arch.rope_theta,
                             "mrope_section": list(arch.mrope_section), "mrope_interleaved": True},
        ),
        vision_config=dict(
            depth=arch.vision_depth, hidden_size=arch.vision_hidden_size, num_heads=arch.vision_num_heads,
            intermediate_size=arch.vision_ffn_hidden_size, out_hidden_size=arch.vision_out_hidden_size,
            patch_size=arch.patch_size, temporal_patch_size=arch.temporal_patch_size,
            spatial_merge_size=arch.spatial_merge_size, in_channels=3, num_position_embeddings=2304,
            deepstack_visual_indexes=list(arch.deepstack_visual_indexes),
        ),
        image_token_id=TOKENS.image_pad, video_token_id=VIDEO_PAD,
        vision_start_token_id=TOKENS.vision_start, vision_end_token_id=TOKENS.vision_end,
        tie_word_embeddings=False,
    )
    # AutoBridge dispatches on the architecture name, which a freshly built config lacks.
    cfg.architectures = ["Qwen3VLMoeForConditionalGeneration"]
    return cfg
