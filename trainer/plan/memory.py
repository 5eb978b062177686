"""Per-GPU memory of a training job, by part, from the architecture numbers alone.

Pure arithmetic: no torch, no Ray, no Megatron. What Megatron-Core keeps, and when:

- Model states. 3d: bf16 weights and fp32 gradient buffers (``grad_reduce_in_fp32``) on every
  rank that holds the layer; fp32 main params and Adam's two moments sharded over data parallel by
  the distributed optimizer (experts over their own expert-data-parallel group). 16 B per parameter
  before the optimizer's shards, 18 B in all on one GPU. Megatron-FSDP (``optim_grads_params``):
  all of it sharded over data parallel, 16 B per parameter during forward/backward and 20 B at the
  optimizer step (fp32 gradients for the update), plus the layers it has all-gathered.
- Activations kept for backward, per token of a micro-batch, for the decoder (sequence parallel
  under TP, split by CP) and per patch for the vision tower; full recompute keeps only each
  recompute chunk's input. Pipeline stages hold up to PP micro-batches in flight.
- The loss: bf16 logits, their fp32 copy and the fp32 gradient over the (TP-split) vocabulary.
- Transients: a recomputed layer, MoE dispatch buffers, the vision tower's attention buffers, which
  grow with the square of the patches in one call (``--vision-chunk-patches`` bounds them).

The peak is the largest of four moments (the loss, a decoder layer's backward, the vision tower's
backward, the optimizer step). On top of it: allocator slack (a freed block of the logits' size
that a later request cannot reuse unless segments are expandable) and memory outside PyTorch's
allocator (CUDA context, cuBLAS/cuDNN workspaces, NCCL, the data actors' contexts).
Constants marked "fitted" come from the H200 runs in tests/data/recorded (tests/test_plan.py holds them).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

GIB = 2**30
BF16, FP32 = 2, 4
# fitted: cuDNN attention buffers of the vision tower, bytes per (patch, patch) pair of one call
# (54.75 GiB asked for at MBS 8 x 4,096-token image-heavy rows in one call, on one H200).
VISION_ATTENTION_BYTES_PER_PAIR = 4.2
# fitted: PyTorch allocations outside the peak model's parts (router state, small buffers, caching)
# are folded into the per-token constants below; what lies outside the allocator is this much.
OUTSIDE_ALLOCATOR_GIB = 4.0  # CUDA context, cuBLAS/cuDNN/TE workspaces (3.97 GiB in the MBS 8 OOM report)
PER_EXTRA_PROCESS_GIB = 0.52  # each data actor that opened a CUDA context on the GPU
EXPANDABLE_SLACK = 0.02  # share of activations lost to fragmentation with expandable segments
USABLE_SHARE = 0.9915  # what CUDA lets a process allocate of the nominal memory (139.8 of 141 GiB)


class Arch(Protocol):
    """What the planner reads of a model's architecture (each pipeline's ``arch`` presets): the vision
    tower's numbers, and the decoder's layer parameters and kept activations from the model itself,
    since they differ by layer kind (softmax attention, linear attention, MoE, dense)."""

    hidden_size: int
    num_layers: int
    num_experts: int
    moe_topk: int
    vocab_size: int
    vision_depth: int
    vision_hidden_size: int
    vision_ffn_hidden_size: int
    vision_out_hidden_size: int
    deepstack_visual_indexes: tuple[int, ...]
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int

    def decoder_layer_params(self) -> tuple[float, float]: ...

    def decoder_kept_bytes_per_token(self, granularity: str, modules: list[str]) -> dict[str, float]: ...


@dataclass(frozen=True)
class Workload:
    """What the rows hold at the fullest micro-batch (the peak follows it)."""

    image_share: float = 0.9  # image tokens / real tokens: captioned photos at 1 MP as in the bundled set
    fill: float = 1.0  # real tokens / row slots: packed rows are about full
    data_processes_on_gpu: int = 2  # data actors holding a CUDA context on each GPU
    sample_tokens: int = 280  # tokens of one sample (a 1 MP photo is ~250 image tokens, its caption ~30)


@dataclass(frozen=True)
class Layout:
    gpus: int
    tp: int
    pp: int
    cp: int
    ep: int
    etp: int
    vpp: int
    dp: int
    expert_dp: int
    micro_batches: int  # per optimizer step and DP rank

    @property
    def in_flight(self) -> float:
        """Micro-batches whose activations the first pipeline stage holds at once (1F1B schedule)."""
        if self.pp == 1:
            return 1.0
        n = min(self.pp, self.micro_batches)
        return n * (1 + (self.pp - 1) / (self.pp * self.vpp)) if self.vpp > 1 else float(n)


def layout(cfg, gpus: int) -> Layout:
    p, t = cfg.parallel, cfg.train
    dp = max(1, gpus // (p.tp * p.pp * p.cp))
    etp = p.etp or p.tp
    return Layout(gpus=gpus, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, etp=etp, vpp=p.vpp or 1, dp=dp,
                  expert_dp=max(1, gpus // (etp * p.ep * p.pp)),
                  micro_batches=t.grad_accum(dp))


@dataclass(frozen=True)
class StageParams:
    """Parameters one GPU of a pipeline stage holds (after TP, EP/ETP), split by how they are sharded."""

    dense: float  # attention, router, embedding/output layer, vision tower: optimizer over DP
    experts: float  # routed experts: optimizer over expert data parallel
    frozen_dense: float  # held without gradients or optimizer state
    frozen_experts: float
    layer: float  # one decoder layer (what Megatron-FSDP gathers at a time)


def _vision_params(a: Arch) -> tuple[int, int]:
    """(tower blocks and patch embedding, mergers) of the vision tower."""
    hv, merge_in = a.vision_hidden_size, a.vision_hidden_size * a.spatial_merge_size**2
    patch_in = 3 * a.temporal_patch_size * a.patch_size**2
    blocks = patch_in * hv + a.vision_depth * (4 * hv * hv + 2 * hv * a.vision_ffn_hidden_size)
    mergers = (1 + len(a.deepstack_visual_indexes)) * (merge_in * merge_in + merge_in * a.vision_out_hidden_size)
    return blocks, mergers


def total_params(a: Arch) -> int:
    lay = Layout(gpus=1, tp=1, pp=1, cp=1, ep=1, etp=1, vpp=1, dp=1, expert_dp=1, micro_batches=1)
    s = _stage_params(a, lay, None, True, True)
    return int(s.dense + s.experts)


def _stage_params(a: Arch, lay: Layout, m, first: bool, last: bool) -> StageParams:
    layers = a.num_layers // lay.pp
    dense, routed = a.decoder_layer_params()
    layer_dense, layer_experts = dense / lay.tp, routed / (lay.ep * lay.etp)
    ends = a.vocab_size * a.hidden_size * (int(first) + int(last)) / lay.tp
    blocks, mergers = (p / lay.tp if first else 0.0 for p in _vision_params(a))
    language, experts = layers * layer_dense + ends, layers * layer_experts
    frozen_dense = frozen_experts = 0.0
    if m is not None:
        if m.freeze_language_model:
            frozen_dense, frozen_experts = language, experts
        frozen_dense += (blocks if m.freeze_vision_model else 0.0) + (mergers if m.freeze_vision_projection else 0.0)
    return StageParams(dense=language + blocks + mergers, experts=experts, frozen_dense=frozen_dense,
                       frozen_experts=frozen_experts, layer=layer_dense + layer_experts)


def model_states(cfg, lay: Layout, first: bool, last: bool) -> dict[str, float]:
    """GiB of weights, gradients, fp32 main params and optimizer moments on one GPU of a stage."""
    s = _stage_params(cfg.model.arch(), lay, cfg.model, first, last)
    dense, experts = s.dense - s.frozen_dense, s.experts - s.frozen_experts  # trained
    frozen = s.frozen_dense + s.frozen_experts
    dp = lay.dp * lay.cp  # Megatron shards gradients and optimizer state over data x context parallel
    if cfg.parallel.strategy == "fsdp":
        shard = dense / dp + experts / lay.expert_dp
        gathered = 2 * s.layer if dp > 1 else 0.0  # the layer in use and the one prefetched
        return {"weights_bf16": BF16 * (frozen / dp + shard + gathered) / GIB,
                "grads": BF16 * shard / GIB,
                "main_params_fp32": FP32 * shard / GIB,
                "optimizer_states": 2 * FP32 * shard / GIB,
                "optimizer_step_extra": FP32 * shard / GIB}
    shard = dense / dp + experts / lay.expert_dp
    return {"weights_bf16": BF16 * (s.dense + s.experts) / GIB, "grads": FP32 * (dense + experts) / GIB,
            "main_params_fp32": FP32 * shard / GIB, "optimizer_states": 2 * FP32 * shard / GIB,
            "optimizer_step_extra": 0.0}


# ------------------------------------------------------------------------------------------------
# Activations
# ------------------------------------------------------------------------------------------------
# fitted: the bytes each architecture counts (``decoder_kept_bytes_per_token``) over-count what
# Transformer Engine keeps (shared buffers, views).
DECODER_KEPT_SHARE = 0.86


def vision_bytes_per_patch(a: Arch, full_recompute: bool) -> float:
    """Bytes the vision tower keeps for backward per patch: its blocks (only each block's input under
    full recompute) plus the patch embedding, the mergers and the features handed to the decoder."""
    hv, fv = a.vision_hidden_size, a.vision_ffn_hidden_size
    block = BF16 * hv if full_recompute else BF16 * (10 * hv + 2 * fv)
    patch_in = 3 * a.temporal_patch_size * a.patch_size**2
    merge = a.spatial_merge_size**2
    per_merger = BF16 * (4 * hv + a.vision_out_hidden_size / merge)
    mergers = (1 + len(a.deepstack_visual_indexes)) * per_merger
    return a.vision_depth * block + BF16 * (patch_in + 2 * hv) + mergers


def vision_block_bytes_per_patch(a: Arch) -> float:
    return BF16 * (10 * a.vision_hidden_size + 2 * a.vision_ffn_hidden_size)


@dataclass
class Moments:
    """GiB at each moment that can set the peak, with the parts that make up each."""

    parts: dict[str, dict[str, float]] = field(default_factory=dict)

    def total(self, moment: str) -> float:
        return sum(self.parts[moment].values())

    def peak(self) -> tuple[str, float]:
        name = max(self.parts, key=self.total)
        return name, self.total(name)


def moments(cfg, lay: Layout, work: Workload, first: bool, last: bool) -> Moments:
    """Memory of one GPU of a pipeline stage at each moment that can set its peak."""
    a, rc, t, m = cfg.model.arch(), cfg.recompute, cfg.train, cfg.model
    states = model_states(cfg, lay, first, last)
    static = {k: v for k, v in states.items() if k != "optimizer_step_extra"}
    full = rc.granularity == "full"
    tokens = t.mbs * t.seq_len / lay.cp  # one micro-batch on one CP rank
    seq_tokens = tokens / lay.tp  # sequence parallel splits the decoder's activations over TP
    layers = a.num_layers // lay.pp
    whole_layer = sum(a.decoder_kept_bytes_per_token("none", []).values()) * DECODER_KEPT_SHARE
    if full:
        kept_per_layer = BF16 * a.hidden_size / max(1, rc.num_layers)
    else:
        kept_per_layer = sum(a.decoder_kept_bytes_per_token(rc.granularity, rc.modules).values()) * DECODER_KEPT_SHARE
    one_mb = seq_tokens * (layers * kept_per_layer + (BF16 * a.hidden_size if first else 0.0))
    decoder = lay.in_flight * one_mb / GIB
    patches = t.mbs * t.seq_len * work.fill * work.image_share * a.spatial_merge_size**2 if first else 0.0
    if first and not m.freeze_vision_model:
        vision_mb = patches * vision_bytes_per_patch(a, full) / lay.tp
    elif first and not m.freeze_vision_projection:
        vision_mb = patches * BF16 * a.vision_hidden_size * (1 + len(a.deepstack_visual_indexes)) / lay.tp
    else:
        vision_mb = 0.0
    vision = lay.in_flight * vision_mb / GIB
    logits = (BF16 + 2 * FP32) * a.vocab_size / lay.tp * tokens / GIB if last else 0.0
    dispatch = 2 * BF16 * a.moe_topk * a.hidden_size * seq_tokens / GIB
    if cfg.moe.dispatcher == "flex":
        dispatch += 2.0  # DeepEP / HybridEP's registered communication buffers
    recomputed = (rc.num_layers * whole_layer * seq_tokens / GIB) if full else 0.0
    per_call = min(patches, m.vision_chunk_patches or patches)
    vision_transient = (VISION_ATTENTION_BYTES_PER_PAIR * per_call**2
                        + (per_call * vision_block_bytes_per_patch(a) if full else 0.0)) / lay.tp / GIB
    out = Moments()
    if last:
        out.parts["loss"] = {**static, "decoder_activations": decoder, "vision_activations": vision,
                             "logits_fp32": logits}
    out.parts["decoder_backward"] = {**static, "decoder_activations": decoder, "vision_activations": vision,
                                     "moe_dispatch": dispatch, "recompute": recomputed}
    if first and patches and not m.freeze_vision_model:
        others = (lay.in_flight - 1) * one_mb / GIB  # other micro-batches still in the pipeline
        out.parts["vision_backward"] = {**static, "decoder_activations": others, "vision_activations": vision,
                                        "vision_attention": vision_transient}
    out.parts["optimizer_step"] = {**static, "optimizer_step": states["optimizer_step_extra"]}
    return out
