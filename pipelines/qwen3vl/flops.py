"""Training FLOPs of a Qwen3-VL class MoE vision-language model, per packed micro-batch.

Used by the profiler for the demand side: how many micro-batches per second one
data-parallel rank of a trainer consumes, given GPUs, peak TFLOP/s and an MFU assumption.

The count is the standard one (Kaplan/Megatron/PaLM style), forward + backward = 3x forward:

* decoder linear layers: ``6 * active_params * tokens`` where active params are the attention
  projections, the router and the top-k routed experts of every layer, plus the LM head
  (embedding lookups cost no FLOPs). Linear layers run on every row position, padding included,
  because a packed row is one tensor.
* decoder attention: ``12 * layers * (heads * head_dim) * n`` per token of a sample of length
  ``n`` (PaLM's ``12 L H Q T``, no causal discount). Packed rows attend within each sample only
  (THD ``cu_seqlens``), so ``n`` is the sample length, not the row length.
* vision tower, on the patches of every image: patch embedding (``1536 -> hidden`` per patch),
  ``depth`` blocks (qkv + proj + 2-layer MLP per patch, and full bidirectional attention over the
  image's patches), then the 2x2 patch merger and the deepstack mergers
  (``4*hidden -> 4*hidden -> out_hidden`` per merged token each). ``vision_trainable=False``
  counts the tower forward only (a frozen tower at the input needs no backward).

Architectures come from ``pipelines.qwen3vl.arch``, the one place that holds them.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields

import numpy as np

from pipelines.qwen3vl.arch import QWEN3VL_30B_A3B, Qwen3VLArch, arch, preset_names
from pipelines.qwen3vl.data import MERGE_SIZE, PATCH_SIZE, TEMPORAL_PATCH_SIZE, VOCAB_SIZE


@dataclass(frozen=True, kw_only=True)
class VisionTower:
    """Defaults: the tower every released Qwen3-VL MoE shares (out_hidden follows the decoder)."""

    depth: int = QWEN3VL_30B_A3B.vision_depth
    hidden: int = QWEN3VL_30B_A3B.vision_hidden_size
    heads: int = QWEN3VL_30B_A3B.vision_num_heads
    mlp: int = QWEN3VL_30B_A3B.vision_ffn_hidden_size
    patch_in: int = 3 * TEMPORAL_PATCH_SIZE * PATCH_SIZE**2
    merge: int = MERGE_SIZE
    out_hidden: int = QWEN3VL_30B_A3B.vision_out_hidden_size
    deepstack_layers: tuple[int, ...] = QWEN3VL_30B_A3B.deepstack_visual_indexes

    @property
    def params(self) -> int:
        block = 4 * self.hidden**2 + 2 * self.hidden * self.mlp
        merger_in = self.hidden * self.merge**2
        merger = merger_in * merger_in + merger_in * self.out_hidden
        return (self.patch_in * self.hidden + self.depth * block
                + (1 + len(self.deepstack_layers)) * merger)


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    moe_intermediate: int
    vocab: int = VOCAB_SIZE
    dense_intermediate: int = 0  # > 0: a dense MLP instead of experts (num_experts ignored)
    vision: VisionTower = field(default_factory=VisionTower)
    vision_trainable: bool = True

    # ---- parameter counts -----------------------------------------------------------------
    @property
    def attn_params_per_layer(self) -> int:
        q = self.hidden * self.heads * self.head_dim
        kv = 2 * self.hidden * self.kv_heads * self.head_dim
        o = self.heads * self.head_dim * self.hidden
        return q + kv + o

    @property
    def mlp_active_params_per_layer(self) -> int:
        if self.dense_intermediate:
            return 3 * self.hidden * self.dense_intermediate
        return self.top_k * 3 * self.hidden * self.moe_intermediate + self.hidden * self.num_experts

    @property
    def mlp_total_params_per_layer(self) -> int:
        if self.dense_intermediate:
            return self.mlp_active_params_per_layer
        return self.num_experts * 3 * self.hidden * self.moe_intermediate + self.hidden * self.num_experts

    @property
    def active_params(self) -> int:
        """Active decoder parameters per token that do matmuls (layers + LM head; no embedding)."""
        return self.layers * (self.attn_params_per_layer + self.mlp_active_params_per_layer) + self.vocab * self.hidden

    @property
    def active_params_with_embedding(self) -> int:
        return self.active_params + self.vocab * self.hidden

    @property
    def total_params(self) -> int:
        return (self.layers * (self.attn_params_per_layer + self.mlp_total_params_per_layer)
                + 2 * self.vocab * self.hidden + self.vision.params)

    # ---- FLOPs ------------------------------------------------------------------------------
    def text_flops(self, row_tokens: int, sample_lengths) -> float:
        lengths = np.asarray(sample_lengths, dtype=np.float64)
        linear = 6.0 * self.active_params * row_tokens
        attention = 12.0 * self.layers * self.heads * self.head_dim * float((lengths**2).sum())
        return linear + attention

    def vision_flops(self, patches_per_image) -> float:
        v = self.vision
        n = np.asarray(patches_per_image, dtype=np.float64)
        mult = 6.0 if self.vision_trainable else 2.0
        per_patch = v.patch_in * v.hidden + v.depth * (4 * v.hidden**2 + 2 * v.hidden * v.mlp)
        merger_in = v.hidden * v.merge**2
        per_merged = (1 + len(v.deepstack_layers)) * (merger_in * merger_in + merger_in * v.out_hidden)
        linear = mult * (per_patch * n.sum() + per_merged * n.sum() / v.merge**2)
        # QK^T and AV over each image's own patches: 2 * 2 * n^2 * hidden forward per layer.
        attention = (mult / 2.0) * 4.0 * v.depth * v.hidden * float((n**2).sum())
        return linear + attention

    def batch_flops(self, row_tokens: int, sample_lengths, patches_per_image) -> dict:
        t = self.text_flops(row_tokens, sample_lengths)
        v = self.vision_flops(patches_per_image)
        return {"text": t, "vision": v, "total": t + v}

    def to_dict(self) -> dict:
        d = asdict(self)
        d["vision"]["deepstack_layers"] = list(self.vision.deepstack_layers)
        return d


def from_arch(name: str, a: Qwen3VLArch) -> ModelSpec:
    vision = VisionTower(depth=a.vision_depth, hidden=a.vision_hidden_size, heads=a.vision_num_heads,
                         mlp=a.vision_ffn_hidden_size, out_hidden=a.vision_out_hidden_size,
                         deepstack_layers=tuple(a.deepstack_visual_indexes))
    return ModelSpec(name=name, hidden=a.hidden_size, layers=a.num_layers, heads=a.num_attention_heads,
                     kv_heads=a.num_kv_heads, head_dim=a.head_dim, num_experts=a.num_experts, top_k=a.moe_topk,
                     moe_intermediate=a.moe_ffn_hidden_size, vocab=a.vocab_size, vision=vision)


PRESETS: dict[str, ModelSpec] = {name: from_arch(name, arch(name)) for name in preset_names()}


def model_from_dict(d: dict) -> ModelSpec:
    """A custom model: ModelSpec fields, ``vision`` an optional dict of VisionTower fields."""
    d = dict(d)
    known = {f.name for f in fields(ModelSpec)}
    unknown = set(d) - known
    if unknown:
        raise ValueError(f"unknown model fields {sorted(unknown)}; known: {sorted(known)}")
    vis = d.pop("vision", None) or {}
    vknown = {f.name for f in fields(VisionTower)}
    if set(vis) - vknown:
        raise ValueError(f"unknown vision fields {sorted(set(vis) - vknown)}; known: {sorted(vknown)}")
    if "deepstack_layers" in vis:
        vis["deepstack_layers"] = tuple(vis["deepstack_layers"])
    vis.setdefault("out_hidden", d.get("hidden", VisionTower.out_hidden))
    d.setdefault("name", "custom")
    return ModelSpec(vision=VisionTower(**vis), **d)


def load_model(name: str, custom_json: str | None = None) -> ModelSpec:
    if name == "custom":
        if not custom_json:
            raise ValueError("--model custom needs --custom-json PATH (ModelSpec fields as JSON)")
        with open(custom_json) as f:
            return model_from_dict(json.load(f))
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; presets: {', '.join(PRESETS)}, or 'custom'")
    return PRESETS[name]


def batch_shape_flops(model: ModelSpec, batch) -> dict:
    """FLOPs of one ``PackedBatch`` (rows incl. padding for linear layers; per-sample attention)."""
    lengths = []
    for r, n in enumerate(batch.num_samples.tolist()):
        cu = batch.cu_seqlens[r, : n + 1]
        lengths.extend(np.diff(cu).tolist())
    grids = np.asarray(batch.image_grid_thw).reshape(-1, 3)
    patches = grids.prod(axis=1) if len(grids) else np.zeros(0)
    return model.batch_flops(int(batch.tokens.size), lengths, patches)
