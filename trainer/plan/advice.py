"""The Megatron-Bridge team's decision guide for MoE VLMs, applied to one plan: each line says why."""
from __future__ import annotations

import copy
from dataclasses import dataclass

from trainer.plan.memory import GIB, VISION_ATTENTION_BYTES_PER_PAIR, Workload, vision_bytes_per_patch

GB200_CLASS_GIB = 180  # GPUs this large come in NVL72 racks, where DeepEP / HybridEP pay
LARGEST_MBS_TRIED = 16


@dataclass
class Advice:
    """One recommendation and why."""

    what: str
    why: str

    def to_dict(self) -> dict:
        return {"what": self.what, "why": self.why}


def variant(cfg, **changes):
    """A deep copy of ``cfg`` with dotted changes, e.g. ``{"train.mbs": 4}``."""
    out = copy.deepcopy(cfg)
    for key, value in changes.items():
        section, name = key.split(".")
        setattr(getattr(out, section), name, value)
    return out


def _plan(cfg, plan):
    """The same job with ``cfg`` instead (the planner hands its own function in as ``plan.replan``)."""
    return plan.replan(cfg)


def vision_flops_share(cfg, work: Workload) -> float:
    """The vision tower's share of a micro-batch's training FLOPs (the profiler's FLOP model)."""
    from datasvc.registry import pipeline_part

    a, t = cfg.model.arch(), cfg.train
    spec = pipeline_part(cfg.model.pipeline, "flops").from_arch(cfg.model.preset, a)
    samples = max(1, round(t.seq_len * work.fill / work.sample_tokens))
    patches = work.sample_tokens * work.image_share * a.spatial_merge_size**2
    text = spec.text_flops(t.seq_len, [work.sample_tokens] * samples)
    vision = spec.vision_flops([patches] * samples) if work.image_share else 0.0
    if cfg.model.freeze_vision_model:
        vision /= 3.0  # forward only
    return vision / (text + vision)


def _strategy(plan, work) -> list:
    cfg, a, p = plan.cfg, plan.cfg.model.arch(), plan.cfg.parallel
    out = []
    if p.strategy == "fsdp":
        out.append(Advice("keep --strategy fsdp (Megatron-FSDP) for bring-up",
                          f"no pipeline stage boundaries to place across the embedding, the vision tower and "
                          f"{a.num_layers} decoder layers; parameters, gradients and optimizer state are sharded "
                          f"over all {plan.gpus} GPU(s); it is the choice when memory fit matters more than "
                          f"throughput, and when the vision tower is frozen for decoder tuning"))
        three_d = _plan(variant(cfg, **{"parallel.strategy": "3d"}), plan)
        if three_d.fits:
            out.append(Advice("consider --strategy 3d once the model is stable and there is time for sweeps",
                              f"it fits too ({three_d.need_gib:.0f} GiB); on one H200 3d ran 1.25-1.31x the "
                              f"tokens/s of fsdp (docs/benchmarks/mbs-sweep-and-large-micro-batches.md); worth it only for that headroom"))
        return out
    problems = []
    if a.num_layers % (p.pp * (p.vpp or 1)):
        problems.append(f"{a.num_layers} layers do not split over PP*VPP = {p.pp * (p.vpp or 1)}")
    if a.num_experts % p.ep:
        problems.append(f"EP {p.ep} does not divide {a.num_experts} experts")
    if p.pp > 1 and a.num_layers // p.pp < len(a.deepstack_visual_indexes) + 1:
        problems.append("the first stage is too short for the vision tower and its deepstack taps")
    if problems:
        out.append(Advice("use --strategy fsdp", "no clean 3d layout: " + "; ".join(problems)))
    else:
        out.append(Advice("--strategy 3d: keep it if the throughput headroom is worth the sweeps",
                          f"clean layout: {a.num_layers // p.pp} decoder layers per stage, EP {p.ep} divides "
                          f"{a.num_experts} experts; the first stage also carries the embedding and the vision tower"))
    fsdp = _plan(variant(cfg, **{"parallel.strategy": "fsdp", "parallel.pp": 1, "parallel.vpp": None}), plan)
    if fsdp.fits and not plan.fits:
        out.append(Advice("switch to --strategy fsdp --pp 1", f"it fits ({fsdp.need_gib:.0f} GiB per GPU) where 3d "
                          f"does not ({plan.need_gib:.0f} GiB): FSDP shards the weights and gradients too"))
    return out


def _batch(plan, work) -> list:
    cfg, t = plan.cfg, plan.cfg.train
    out = []
    largest = 0
    mbs = 1
    while mbs <= LARGEST_MBS_TRIED:
        if _plan(variant(cfg, **{"train.mbs": mbs, "train.gbs": mbs * max(1, t.gbs // max(1, t.mbs))}), plan).fits:
            largest = mbs
        mbs *= 2
    share = vision_flops_share(cfg, work)
    if largest == 0:
        out.append(Advice("no MBS fits with these settings", "even MBS 1 needs more than the GPU has; see the "
                          "nearest settings that fit"))
    elif share > 0.5:
        out.append(Advice(f"MBS up to {largest} fits; stay near MBS {min(largest, max(1, t.mbs))}",
                          f"the vision tower is {share:.0%} of the step's FLOPs and works per image, so a larger "
                          f"MBS mostly adds tower work; check the data side with `python -m datasvc.tools.profile`"))
    else:
        out.append(Advice(f"try MBS up to {largest} (largest that fits)",
                          f"the vision tower is {share:.0%} of the step's FLOPs: larger micro-batches feed the "
                          f"experts' GEMMs more tokens while the decoder dominates"))
    return out


def _memory_knobs(plan, work) -> list:
    cfg, a, m, t, rc = plan.cfg, plan.cfg.model.arch(), plan.cfg.model, plan.cfg.train, plan.cfg.recompute
    out = []
    if rc.granularity != "full" and not plan.fits:
        full = _plan(variant(cfg, **{"recompute.granularity": "full"}), plan)
        if plan.need_gib - full.need_gib > 1:
            out.append(Advice("--recompute full", f"keeps only each layer's input: {full.need_gib:.0f} GiB instead "
                              f"of {plan.need_gib:.0f}; costs about one extra forward (~1/3 more compute)"))
    elif rc.granularity == "full" and plan.fits:
        none = _plan(variant(cfg, **{"recompute.granularity": "none"}), plan)
        if none.fits:
            out.append(Advice("drop --recompute full", f"it fits without ({none.need_gib:.0f} GiB) and saves the "
                              f"recompute's extra forward"))
    if rc.granularity == "selective" and set(rc.modules) <= {"core_attn"}:
        out.append(Advice("selective recompute of core_attn saves almost nothing here",
                          "with flash attention the kept q/k/v and output are the recompute's own inputs and "
                          "outputs; recompute moe_act or layernorm, or go to full"))
    patches = t.mbs * t.seq_len * work.fill * work.image_share * a.spatial_merge_size**2
    if not m.freeze_vision_model and patches > 32768 and not m.vision_chunk_patches:
        out.append(Advice("--vision-chunk-patches 32768",
                          f"{patches:,.0f} patches in one tower call ask for about "
                          f"{VISION_ATTENTION_BYTES_PER_PAIR * patches**2 / GIB:.0f} GiB of attention buffers in its backward; 32k-patch "
                          f"chunks cost no measurable step time (16k cost 19% at MBS 4)"))
    if not t.expandable_segments and plan.parts.get("allocator_slack", 0) > 2:
        out.append(Advice("--expandable-segments", f"without it about {plan.parts['allocator_slack']:.0f} GiB "
                          f"(a freed block the size of the fp32 logits) stays reserved and unusable"))
    if not m.freeze_vision_model:
        frozen = _plan(variant(cfg, **{"model.freeze_vision_model": True}), plan)
        out.append(Advice("--freeze-vision-model for decoder-focused tuning",
                          f"saves {plan.need_gib - frozen.need_gib:.0f} GiB per GPU (the tower's gradients, "
                          f"optimizer state and {vision_bytes_per_patch(a, rc.granularity == 'full') / 1024:.0f} KiB "
                          f"of activations per patch) and the tower's backward"))
    return out


def _runtime(plan, work) -> list:
    cfg, p = plan.cfg, plan.cfg.parallel
    out = []
    if p.ep * (p.etp or p.tp) > 1 and plan.gpu_memory_gib >= GB200_CLASS_GIB:
        out.append(Advice("--moe-dispatcher flex --flex-backend hybridep",
                          "GB200-class GPUs in an NVLink rack: HybridEP/DeepEP dispatch beats alltoall there"))
    elif p.ep > 1:
        out.append(Advice("keep --moe-dispatcher alltoall", "the default dispatcher on H100/H200-class nodes; "
                          "flex (DeepEP/HybridEP) pays on GB200-class NVLink racks"))
    else:
        out.append(Advice("keep --moe-dispatcher alltoall (EP 1: experts are not split)",
                          "with EP 1 tokens never leave the GPU; EP > 1 splits the experts' memory"))
    if not cfg.cuda_graph.scope and cfg.parallel.strategy == "3d":
        why = ("not with --recompute full (per-layer graphs need selective or no recompute); "
               if cfg.recompute.granularity == "full" else "")
        out.append(Advice("once the loop is stable: --cuda-graph-scope moe_router moe_preprocess",
                          why + "packed THD rows cannot graph attention, the router and dispatch preprocessing can; "
                          "measured no gain at MBS 1 on one H200 (docs/benchmarks/do-cuda-graphs-pay.md)"))
    elif not cfg.cuda_graph.scope:
        out.append(Advice("no CUDA graphs under fsdp", "Megatron-FSDP's parameter hooks cannot be captured in "
                          "Transformer Engine's per-layer graphs; graphs need --strategy 3d"))
    if cfg.parallel.strategy == "3d":
        out.append(Advice("leave --static-shapes off",
                          "it graphs the vision tower at mbs x seq_len x 4 patches with dense masked attention "
                          "over all of them, in place of per-image flash attention: measured 0.90x the tokens/s "
                          "and 1.4x the peak memory on one H100 at MBS 1 (docs/benchmarks/do-cuda-graphs-pay.md)"))
    out.append(Advice("measure with real or calibrated synthetic images, not the image-free mock",
                      "the mock skips the vision tower and the image tokens: measured 2.1-2.5x optimistic on the "
                      "4-layer proxy and 1.4-1.6x at full depth (docs/benchmarks/4-layer-proxy-and-depth-proxy.md)"))
    return out


def recommendations(plan, work: Workload) -> list:
    """The decision guide applied to ``plan``: strategy, MBS, memory knobs, dispatcher, CUDA graphs, data."""
    return [*_strategy(plan, work), *_batch(plan, work), *_memory_knobs(plan, work), *_runtime(plan, work)]
