"""What ``TrainerConfig.validate`` checks: the problems Megatron-Core and Megatron-Bridge would find
deep inside model construction, after minutes of start-up, found here in plain Python (no torch, no
Megatron import) and each said with what to change."""
from __future__ import annotations

import math
from datasvc.registry import pipeline_part
from trainer.checkpoint import check_long_run

# The sections' types (trainer.config's dataclasses) are named in annotations only: that module
# imports this one.

# Names Megatron-Core accepts (transformer_config.py, megatron-core 0.19.2)
RECOMPUTE_MODULES = {"core_attn", "moe_act", "layernorm", "mlp", "moe", "shared_experts"}
CUDA_GRAPH_SCOPES = {"attn", "mlp", "moe", "moe_router", "moe_preprocess"}
STATIC_VISION_MAX_PATCHES = 8192
"""The longest fixed vision length --static-shapes takes: attention under an arbitrary mask keeps
its scores, patches squared per head and layer, for the backward."""


def problems_of(cfg: TrainerConfig, world_size: int) -> list[str]:
    """Every problem, by section. Names and sizes are checked first: the later sections compute with
    them (the architecture, the parallel grid), so they run only once those are sound."""
    out = check_model_names(cfg.model)
    if out:
        return out
    out = _check_model(cfg.model) + _check_parallel_sizes(cfg.parallel)
    if out:
        return out
    a = cfg.model.arch()
    return [*_check_parallel_grid(cfg, world_size, a), *_check_pipeline(cfg.parallel, a),
            *_check_strategy(cfg.parallel), *_check_sequence(cfg), *_check_moe(cfg),
            *_check_recompute(cfg, a), *_check_cuda_graphs(cfg), *_check_optimizer(cfg.train),
            *check_long_run(cfg)]


def _etp(p: ParallelConfig) -> int:
    return p.etp or p.tp


def _model_chunks(p: ParallelConfig) -> int:
    return p.pp * (p.vpp or 1)


def check_model_names(m: ModelConfig) -> list[str]:
    arch = pipeline_part(m.pipeline, "arch")
    if m.preset in arch.RENAMED:
        return [f"model preset {m.preset!r} is now named {arch.RENAMED[m.preset]!r}: pass --model-preset {arch.RENAMED[m.preset]}"]
    if m.preset not in (names := arch.preset_names()):
        return [f"unknown model preset {m.preset!r} for {m.pipeline}; choose one of {names}"]
    return [f"--{name.replace('_', '-')} must be >= 1 (got {v})" for name in ("num_layers", "num_experts", "vision_depth")
            if (v := getattr(m, name)) is not None and v < 1]


def _check_model(m: ModelConfig) -> list[str]:
    out = []
    if m.hf_path and (m.num_layers or m.num_experts or m.vision_depth):
        out.append("--hf-path loads a full checkpoint; drop --num-layers/--num-experts/--vision-depth "
                   "(they would not match its weights) or drop --hf-path for a random-init proxy")
    if m.freeze_language_model and m.freeze_vision_model and m.freeze_vision_projection:
        out.append("everything is frozen (language model, vision model and projection): nothing to train")
    if m.vision_chunk_patches < 0:
        out.append(f"--vision-chunk-patches must be >= 0 (0 = no chunking), not {m.vision_chunk_patches}")
    return out


def _check_parallel_sizes(p: ParallelConfig) -> list[str]:
    return [f"--{name} must be >= 1" for name in ("tp", "pp", "cp", "ep", "etp")
            if (size := getattr(p, name)) is not None and size < 1]


def _check_parallel_grid(cfg: TrainerConfig, world_size: int, a) -> list[str]:
    """The world against TP/PP/CP/EP/ETP, and the model's heads and experts against them."""
    p, t = cfg.parallel, cfg.train
    out = []
    mp = p.tp * p.pp * p.cp
    if world_size % mp:
        out.append(f"TP*PP*CP = {p.tp}*{p.pp}*{p.cp} = {mp} must divide the world size {world_size}; "
                   f"change --tp/--pp/--cp or the number of GPUs")
    else:
        dp = world_size // mp
        if t.gbs % (t.mbs * dp):
            out.append(f"--gbs {t.gbs} must be a multiple of MBS*DP = {t.mbs}*{dp} = {t.mbs * dp}")
    etp = _etp(p)
    if world_size % (etp * p.ep * p.pp):
        out.append(f"ETP*EP*PP = {etp}*{p.ep}*{p.pp} must divide the world size {world_size} "
                   f"(Megatron's expert-parallel grid)")
    if a.num_experts % p.ep:
        out.append(f"EP={p.ep} must divide the number of experts ({a.num_experts}); "
                   f"change --ep or --num-experts")
    if a.num_attention_heads % p.tp or a.num_kv_heads % p.tp:
        out.append(f"TP={p.tp} must divide the attention heads ({a.num_attention_heads}) and the KV heads "
                   f"({a.num_kv_heads}); use TP <= {math.gcd(a.num_attention_heads, a.num_kv_heads)}")
    if a.vision_num_heads % p.tp:
        out.append(f"TP={p.tp} must divide the vision tower's heads ({a.vision_num_heads})")
    if etp > 1 and a.moe_ffn_hidden_size % etp:
        out.append(f"ETP={etp} must divide moe_ffn_hidden_size ({a.moe_ffn_hidden_size})")
    return out


def _check_pipeline(p: ParallelConfig, a) -> list[str]:
    out = []
    if p.vpp is not None:
        if p.vpp < 2:
            out.append("--vpp must be >= 2 (or left unset)")
        if p.pp < 2:
            out.append("--vpp needs --pp >= 2 (virtual stages interleave pipeline stages)")
    chunks = _model_chunks(p)
    if a.num_layers % chunks:
        out.append(f"{a.num_layers} decoder layers cannot be split evenly over PP*VPP = {chunks} "
                   f"model chunks; change --num-layers, --pp or --vpp")
    elif a.num_layers // chunks < len(a.deepstack_visual_indexes):
        # Qwen3VLModel asserts this: deepstack features are added to the first stage's layers.
        out.append(f"the first pipeline chunk holds {a.num_layers // chunks} decoder layers but Qwen3-VL adds "
                   f"{len(a.deepstack_visual_indexes)} deepstack vision features there; use more layers "
                   f"or a smaller --pp/--vpp")
    if a.deepstack_visual_indexes and max(a.deepstack_visual_indexes) >= a.vision_depth:
        out.append(f"the vision tower needs more than {max(a.deepstack_visual_indexes)} layers for its "
                   f"deepstack taps {list(a.deepstack_visual_indexes)} (got --vision-depth {a.vision_depth})")
    return out


def _check_strategy(p: ParallelConfig) -> list[str]:
    if p.strategy == "fsdp":
        if p.pp > 1 or p.vpp is not None:
            # Megatron-Core does not forbid it outright, but no Megatron-Bridge recipe combines
            # Megatron-FSDP with PP; this trainer keeps pipelining to the 3d strategy.
            return ["--strategy fsdp (Megatron-FSDP) is run without pipeline parallelism here; use --pp 1 "
                    "(and no --vpp), or --strategy 3d for pipelining"]
    elif p.strategy != "3d":
        return [f"--strategy must be 'fsdp' or '3d' (got {p.strategy!r})"]
    return []


def _check_sequence(cfg: TrainerConfig) -> list[str]:
    p, t = cfg.parallel, cfg.train
    out = []
    if t.mbs < 1 or t.gbs < 1 or t.seq_len < 1 or t.train_iters < 1:
        out.append("--mbs, --gbs, --seq-len and --train-iters must be >= 1")
    if p.cp > 1 and t.seq_len % (2 * p.cp):
        out.append(f"--seq-len {t.seq_len} must be divisible by 2*CP = {2 * p.cp} (context parallel load balance)")
    if p.tp > 1 and t.seq_len % (p.tp * (2 * p.cp if p.cp > 1 else 1)):
        out.append(f"--seq-len {t.seq_len} must be divisible by TP{'*2*CP' if p.cp > 1 else ''} "
                   f"(sequence parallel is on with TP > 1 for Qwen3-VL MoE)")
    return out


def _check_moe(cfg: TrainerConfig) -> list[str]:
    moe, p = cfg.moe, cfg.parallel
    out = []
    if moe.dispatcher == "flex":
        if moe.flex_backend not in ("deepep", "hybridep"):
            out.append("--moe-dispatcher flex needs --flex-backend deepep or hybridep")
        if _etp(p) * p.ep <= 1:
            out.append("the flex dispatcher (DeepEP/HybridEP) needs TP*EP > 1; with one expert-parallel rank "
                       "use --moe-dispatcher alltoall")
    elif moe.dispatcher == "alltoall":
        if moe.flex_backend is not None:
            out.append("--flex-backend only applies with --moe-dispatcher flex")
    else:
        out.append(f"--moe-dispatcher must be alltoall or flex (got {moe.dispatcher!r})")
    return out


def _check_recompute(cfg: TrainerConfig, a) -> list[str]:
    rc = cfg.recompute
    out = []
    if rc.granularity == "selective":
        bad = set(rc.modules) - RECOMPUTE_MODULES
        if bad or not rc.modules:
            out.append(f"--recompute-modules {sorted(bad) or '(empty)'} not understood; "
                       f"choose from {sorted(RECOMPUTE_MODULES)}")
        if "mlp" in rc.modules:
            out.append("recompute module 'mlp' is for dense layers; every Qwen3-VL MoE layer is MoE, use 'moe' "
                       "or 'moe_act'")
    elif rc.granularity == "full":
        per_stage = a.num_layers // max(_model_chunks(cfg.parallel), 1)
        if not 1 <= rc.num_layers <= max(per_stage, 1):
            out.append(f"--recompute-num-layers must be between 1 and the layers per pipeline chunk ({per_stage})")
    elif rc.granularity != "none":
        out.append(f"--recompute must be none, full or selective (got {rc.granularity!r})")
    return out


def _check_static_shapes(cfg: TrainerConfig) -> list[str]:
    if not cfg.cuda_graph.static_shapes:
        return []
    out = []
    length = cfg.cuda_graph.vision_length(cfg.train.mbs, cfg.train.seq_len)
    if length > STATIC_VISION_MAX_PATCHES:
        out.append(f"--static-shapes fixes the vision tower at --mbs x --seq-len x 4 = {length} patches, over the "
                   f"{STATIC_VISION_MAX_PATCHES} its masked attention can hold; use --mbs 1 --seq-len "
                   f"{STATIC_VISION_MAX_PATCHES // 4} or less, or drop --static-shapes")
    if cfg.parallel.strategy == "fsdp":
        out.append("--static-shapes captures CUDA graphs, which cannot hold Megatron-FSDP's parameter hooks; "
                   "use --strategy 3d")
    if cfg.parallel.pp > 1 or cfg.parallel.cp > 1:
        out.append("--static-shapes needs the vision tower on one stage and whole: use --pp 1 --cp 1")
    if cfg.model.vision_chunk_patches:
        out.append("--static-shapes runs the vision tower once per micro-batch; drop --vision-chunk-patches")
    if cfg.train.padded:
        out.append("--static-shapes is for packed rows; drop --padded")
    return out


def _check_cuda_graphs(cfg: TrainerConfig) -> list[str]:
    cg, rc = cfg.cuda_graph, cfg.recompute
    if not cg.scope:
        return _check_static_shapes(cfg)
    scope = set(cg.scope)
    out = []
    bad = scope - CUDA_GRAPH_SCOPES
    if bad:
        out.append(f"--cuda-graph-scope {sorted(bad)} not understood; choose from {sorted(CUDA_GRAPH_SCOPES)}")
    if "mlp" in scope:
        out.append("CUDA-graph scope 'mlp' captures dense MLPs; Qwen3-VL MoE has none (use moe_router)")
    if "moe" in scope:
        out.append("CUDA-graph scope 'moe' needs drop-and-pad MoE (fixed expert capacity), which this trainer "
                   "does not use; use 'moe_router moe_preprocess'")
    if "moe" in scope and "moe_router" in scope:
        out.append("CUDA-graph scope cannot hold both 'moe' and 'moe_router'")
    if "moe_preprocess" in scope and "moe_router" not in scope:
        out.append("CUDA-graph scope 'moe_preprocess' needs 'moe_router' too")
    if cfg.parallel.strategy == "fsdp":  # Transformer Engine refuses modules with hooks
        out.append("per-layer CUDA graphs cannot capture Megatron-FSDP's parameter hooks; use --strategy 3d")
    if rc.granularity == "full":
        out.append("--recompute full is incompatible with per-layer CUDA graphs (Megatron allows full recompute "
                   "only with full-iteration graphs); use --recompute selective or drop --cuda-graph-scope")
    if rc.granularity == "selective" and "moe" in rc.modules and "moe_router" in scope:
        out.append("recompute module 'moe' cannot be combined with the 'moe_router' CUDA graph; recompute "
                   "'moe_act' instead or drop moe_router from the scope")
    return out + _check_graphs_with_packing(cfg, scope) + _check_static_shapes(cfg) + (
        ["--cuda-graph-warmup-steps must be >= 1"] if cg.warmup_steps < 1 else [])


def _check_graphs_with_packing(cfg: TrainerConfig, scope: set[str]) -> list[str]:
    """Packed rows (THD, variable token counts under PP/CP) against what CUDA graphs can capture."""
    p = cfg.parallel
    if cfg.train.padded:
        return []
    out = []
    if "attn" in scope:
        out.append("packed rows pass THD PackedSeqParams to attention, which Transformer Engine CUDA graphs "
                   "cannot take; drop 'attn' from --cuda-graph-scope (keep moe_router moe_preprocess) or "
                   "use --padded")
    if p.pp > 1 or p.cp > 1:
        out.append("CUDA graphs need fixed shapes, but packed rows with PP > 1 or CP > 1 have a variable "
                   "token count per micro-batch; use --padded or drop --cuda-graph-scope")
    return out


def _check_optimizer(t: TrainConfig) -> list[str]:
    if t.lr <= 0 or t.min_lr < 0 or t.min_lr > t.lr:
        return [f"need 0 <= --min-lr <= --lr and --lr > 0 (got lr={t.lr}, min_lr={t.min_lr})"]
    return []
