"""Training FLOPs of a Qwen3.5-VL model per packed micro-batch: Qwen3-VL's count
(``pipelines.qwen3vl.flops``, forward + backward = 3x forward) with Qwen3.5's decoder.

* Gated attention layers (one in ``full_attention_interval``): q projects to twice the heads (query
  and output gate), k and v to the kv heads, o back; attention ``12 * heads * head_dim * n`` per token
  of a sample of length ``n``.
* Gated DeltaNet layers: in-projections to q, k (key heads x key dim), v and the output gate z (value
  heads x value dim), b and a (one each per value head), the out-projection; the recurrence costs
  ``6 * value_heads * key_dim * value_dim`` per token forward (state decay, delta update, read), linear
  in the sample length. The short convolution is left out (kernel 4: under 0.1%).
* MLP: top-k routed experts, the shared expert and its gate, the router; or the dense MLP.
* Vision: Qwen3-VL's tower with no deepstack mergers.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipelines.qwen3vl.flops import ModelSpec, VisionTower, batch_shape_flops
from pipelines.qwen35vl.arch import Qwen35VLArch, arch, preset_names

__all__ = ["Qwen35ModelSpec", "from_arch", "PRESETS", "load_model", "batch_shape_flops"]


@dataclass(frozen=True, kw_only=True)
class Qwen35ModelSpec(ModelSpec):
    full_attention_interval: int = 4
    linear_key_heads: int = 16
    linear_value_heads: int = 32
    linear_key_dim: int = 128
    linear_value_dim: int = 128
    shared_expert_intermediate: int = 0

    @property
    def attention_layers(self) -> int:
        return self.layers // self.full_attention_interval

    @property
    def attn_params_per_layer(self) -> int:
        """Mean over the layers: gated attention in one of ``full_attention_interval``, DeltaNet in the rest."""
        q = 2 * self.hidden * self.heads * self.head_dim
        kv = 2 * self.hidden * self.kv_heads * self.head_dim
        o = self.heads * self.head_dim * self.hidden
        k_width, v_width = self.linear_key_heads * self.linear_key_dim, self.linear_value_heads * self.linear_value_dim
        delta = self.hidden * (2 * k_width + 2 * v_width + 2 * self.linear_value_heads) + v_width * self.hidden
        full = self.attention_layers
        return ((q + kv + o) * full + delta * (self.layers - full)) // self.layers

    @property
    def mlp_active_params_per_layer(self) -> int:
        shared = 3 * self.hidden * self.shared_expert_intermediate + self.hidden if self.shared_expert_intermediate else 0
        return super().mlp_active_params_per_layer + (0 if self.dense_intermediate else shared)

    @property
    def mlp_total_params_per_layer(self) -> int:
        shared = 3 * self.hidden * self.shared_expert_intermediate + self.hidden if self.shared_expert_intermediate else 0
        return super().mlp_total_params_per_layer + (0 if self.dense_intermediate else shared)

    @property
    def attention_flops_per_token_sq(self) -> float:
        """Forward + backward FLOPs per sum(sample length^2): the softmax attention layers only."""
        return 12.0 * self.attention_layers * self.heads * self.head_dim

    @property
    def recurrence_flops_per_token(self) -> float:
        """Forward + backward FLOPs per token of the DeltaNet layers' recurrence."""
        return 3 * 6.0 * (self.layers - self.attention_layers) * self.linear_value_heads * (
            self.linear_key_dim * self.linear_value_dim)

    def text_flops(self, row_tokens: int, sample_lengths) -> float:
        lengths = np.asarray(sample_lengths, dtype=np.float64)
        linear = 6.0 * self.active_params * row_tokens
        return (linear + self.recurrence_flops_per_token * float(lengths.sum())
                + self.attention_flops_per_token_sq * float((lengths**2).sum()))


def from_arch(name: str, a: Qwen35VLArch) -> Qwen35ModelSpec:
    vision = VisionTower(depth=a.vision_depth, hidden=a.vision_hidden_size, heads=a.vision_num_heads,
                         mlp=a.vision_ffn_hidden_size, out_hidden=a.vision_out_hidden_size,
                         deepstack_layers=tuple(a.deepstack_visual_indexes))
    return Qwen35ModelSpec(
        name=name, hidden=a.hidden_size, layers=a.num_layers, heads=a.num_attention_heads, kv_heads=a.num_kv_heads,
        head_dim=a.head_dim, num_experts=a.num_experts, top_k=a.moe_topk, moe_intermediate=a.moe_ffn_hidden_size,
        vocab=a.vocab_size, dense_intermediate=0 if a.is_moe else a.dense_ffn_hidden_size, vision=vision,
        full_attention_interval=a.full_attention_interval, linear_key_heads=a.linear_num_key_heads,
        linear_value_heads=a.linear_num_value_heads, linear_key_dim=a.linear_key_head_dim,
        linear_value_dim=a.linear_value_head_dim, shared_expert_intermediate=a.shared_expert_ffn_hidden_size)


PRESETS: dict[str, Qwen35ModelSpec] = {name: from_arch(name, arch(name)) for name in preset_names()}


def load_model(name: str, custom_json: str | None = None) -> Qwen35ModelSpec:
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; presets: {', '.join(PRESETS)}")
    return PRESETS[name]
