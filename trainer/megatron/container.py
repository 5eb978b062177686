"""TrainerConfig -> Megatron-Bridge ``ConfigContainer``: the Qwen3-VL MoE provider with every model-side
knob set, the optimizer, DDP/FSDP, fed by vlmfeed through ``trainer.megatron.provider`` (the same
plug-in a recipe of the user's takes); and the runtime checks the config alone cannot make."""
from __future__ import annotations

import importlib.util
import os
import threading

import torch
from megatron.bridge import AutoBridge
from megatron.bridge.training.config import (
    CheckpointConfig,
    ConfigContainer,
    DistributedDataParallelConfig,
    DistributedInitConfig,
    LoggerConfig,
    OptimizerConfig,
    RNGConfig,
    SchedulerConfig,
    TrainingConfig,
    ValidationConfig,
)
from megatron.bridge.training.tokenizers.config import TokenizerConfig

from datasvc.registry import pipeline_part
from trainer.config import TrainerConfig
from trainer.megatron.metrics import TimedIterator
from trainer.megatron.provider import VlmfeedDataProvider, feed_from_stream, without_missing_kernels
from trainer.megatron.vision_graphs import within_frames_hook
from trainer.vision_chunks import chunk_vision_hook


# ------------------------------------------------------------------------------------------------
# The model provider
# ------------------------------------------------------------------------------------------------
def build_bridge(cfg: TrainerConfig) -> AutoBridge:
    """The Hugging Face <-> Megatron bridge: from ``--hf-path`` when given, else from the preset's config."""
    if cfg.model.hf_path:
        return AutoBridge.from_hf_pretrained(cfg.model.hf_path)
    return AutoBridge.from_hf_config(pipeline_part(cfg.model.pipeline, "megatron").hf_config(cfg.model.arch()))


def build_provider(cfg: TrainerConfig, bridge: AutoBridge | None = None):
    """The Qwen3-VL MoE model provider (``Qwen3VLMoEModelProvider``) with every model-side knob set."""
    m, t = cfg.model, cfg.train
    provider = (bridge or build_bridge(cfg)).to_megatron_provider(load_weights=bool(m.hf_path))
    _set_parallel(provider, cfg)
    provider.seq_length = t.seq_len
    # The provider's defaults freeze both towers (a PEFT-style default); ours train everything unless asked.
    provider.freeze_language_model = m.freeze_language_model
    provider.freeze_vision_model = m.freeze_vision_model
    provider.freeze_vision_projection = m.freeze_vision_projection
    if m.vision_chunk_patches:
        provider.register_pre_wrap_hook(chunk_vision_hook(m.vision_chunk_patches))
    # Packed rows hold different numbers of supervised tokens; averaging per token over the whole
    # global batch weighs every token equally (and CP requires it for Qwen3-VL anyway).
    provider.calculate_per_token_loss = True
    without_missing_kernels(provider)
    _set_moe(provider, cfg)
    _set_recompute(provider, cfg)
    _set_cuda_graphs(provider, cfg)
    return provider


def _set_parallel(provider, cfg: TrainerConfig) -> None:
    """Parallel sizes. Qwen3-VL MoE's provider turns sequence parallel on itself when TP > 1 (finalize)."""
    p = cfg.parallel
    provider.tensor_model_parallel_size = p.tp
    provider.pipeline_model_parallel_size = p.pp
    provider.virtual_pipeline_model_parallel_size = p.vpp
    provider.context_parallel_size = p.cp
    provider.expert_model_parallel_size = p.ep
    provider.expert_tensor_parallel_size = p.etp
    provider.sequence_parallel = p.tp > 1
    provider.pipeline_dtype = None  # finalize() takes params_dtype (bf16 under bf16_mixed) when PP > 1
    # With PP, stages exchange activations of shape [tokens, 1, hidden] for our flat THD stream, not
    # [seq_len, mbs, hidden]; variable_seq_lengths makes the P2P layer send the shape first.
    provider.variable_seq_lengths = p.pp > 1 and not cfg.train.padded


def _set_moe(provider, cfg: TrainerConfig) -> None:
    """The MoE token dispatcher."""
    moe = cfg.moe
    provider.moe_aux_loss_coeff = moe.aux_loss_coeff
    if moe.dispatcher == "flex":
        provider.moe_token_dispatcher_type = "flex"
        provider.moe_flex_dispatcher_backend = moe.flex_backend
        provider.moe_shared_expert_overlap = False  # not supported with the flex dispatcher
    else:
        provider.moe_token_dispatcher_type = "alltoall"
        provider.moe_flex_dispatcher_backend = None


def _set_recompute(provider, cfg: TrainerConfig) -> None:
    """Activation recompute."""
    rc = cfg.recompute
    if rc.granularity == "full":
        provider.recompute_granularity = "full"
        provider.recompute_method = "uniform"
        provider.recompute_num_layers = rc.num_layers
        provider.recompute_modules = None
    elif rc.granularity == "selective":
        provider.recompute_granularity = "selective"
        provider.recompute_method = None
        provider.recompute_num_layers = None
        provider.recompute_modules = list(rc.modules)
    else:
        provider.recompute_granularity = None
        provider.recompute_modules = None


def _set_cuda_graphs(provider, cfg: TrainerConfig) -> None:
    """CUDA graphs (per layer, Transformer Engine), using megatron-core 0.19's cuda_graph_modules;
    with --static-shapes, the vision tower's whole layers at one fixed length, under the per-frame
    mask (Bridge captures them after the warm-up steps, beside the decoder's)."""
    cg = cfg.cuda_graph
    provider.cuda_graph_warmup_steps = cg.warmup_steps
    if cg.scope:
        provider.cuda_graph_impl = "transformer_engine"
        provider.cuda_graph_modules = list(cg.scope)
    else:
        provider.cuda_graph_impl = "none"
    if cg.static_shapes:
        provider.vision_cuda_graph_impl = "transformer_engine"
        provider.vision_cuda_graph_scope = []
        provider.max_vision_cuda_graph_seq_length = cg.vision_length(cfg.train.mbs, cfg.train.seq_len)
        provider.register_pre_wrap_hook(within_frames_hook)


# ------------------------------------------------------------------------------------------------
# The container
# ------------------------------------------------------------------------------------------------
def build_config_container(cfg: TrainerConfig, world_size: int, iterator: TimedIterator | None = None, *,
                           valid_iterator=None, bridge: AutoBridge | None = None,
                           resume: bool = False) -> ConfigContainer:
    """The full Megatron-Bridge config. Call ``cfg.validate(world_size)`` first (``train`` does).
    ``resume``: the driver found a checkpoint in ``cfg.checkpoint.load`` to take up."""
    t, ck, ev = cfg.train, cfg.checkpoint, cfg.eval
    fsdp = cfg.parallel.strategy == "fsdp"
    evaluate = valid_iterator is not None and ev.eval_interval is not None
    container = ConfigContainer(
        model=build_provider(cfg, bridge),
        train=TrainingConfig(
            train_iters=t.train_iters, global_batch_size=t.gbs, micro_batch_size=t.mbs,
            manual_gc=True, manual_gc_interval=100,
            # A SIGTERM (from the driver, or sent to the rank) saves at the next step and stops.
            exit_signal_handler=threading.current_thread() is threading.main_thread(),
            exit_interval=ck.exit_interval, exit_duration_in_mins=ck.exit_duration_in_mins,
        ),
        validation=ValidationConfig(eval_iters=ev.eval_iters if evaluate else 0,
                                    eval_interval=ev.eval_interval if evaluate else None),
        optimizer=OptimizerConfig(
            optimizer="adam", lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay, bf16=t.bf16,
            adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=t.clip_grad,
            use_distributed_optimizer=True,
        ),
        scheduler=SchedulerConfig(
            lr_decay_style="cosine", lr_warmup_iters=t.warmup_iters, lr_warmup_init=0.0,
            lr_decay_iters=t.train_iters, start_weight_decay=t.weight_decay, end_weight_decay=t.weight_decay,
            weight_decay_incr_style="constant", override_opt_param_scheduler=True,
        ),
        ddp=_ddp_config(fsdp),
        dataset=VlmfeedDataProvider(seq_length=t.seq_len),
        logger=LoggerConfig(log_interval=t.log_interval, log_throughput=True),
        # Our tokens arrive already tokenized; the null tokenizer only carries the vocabulary size.
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=cfg.model.arch().vocab_size),
        checkpoint=CheckpointConfig(save=ck.save, load=ck.load if resume else None,
                                    save_interval=ck.save_interval or (t.train_iters if ck.save else None),
                                    also_save_hf_checkpoint=ck.export_hf_on_save, hf_source_path=cfg.model.hf_path,
                                    ckpt_format="fsdp_dtensor" if fsdp else "torch_dist"),
        # Graph capture needs graph-safe RNG states; Bridge makes them only for the decoder's own graphs.
        rng=RNGConfig(seed=t.seed, te_rng_tracker=cfg.cuda_graph.static_shapes),
        dist=DistributedInitConfig(use_megatron_fsdp=fsdp),
        mixed_precision="bf16_mixed" if t.bf16 else None,
    )
    feed_from_stream(container, iterator, valid_iterator if evaluate else None, padded=t.padded)
    return container


def _ddp_config(fsdp: bool) -> DistributedDataParallelConfig:
    return DistributedDataParallelConfig(
        check_for_nan_in_grad=True,
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=True,
        # Per-token loss: gradients are summed, then divided by the global token count; averaging
        # inside the collective would divide by DP size a second time.
        average_in_collective=False,
        use_megatron_fsdp=fsdp,
        data_parallel_sharding_strategy="optim_grads_params" if fsdp else "no_shard",
        # Megatron-FSDP overlaps its own all-gathers/reduce-scatters per module. Plain DDP buckets do
        # not: Bridge's VLM recipes keep them off because a micro-batch without images leaves the
        # vision tower without gradients and an overlapped bucket then never fires.
        overlap_grad_reduce=fsdp,
        overlap_param_gather=fsdp,
    )


def check_runtime(cfg: TrainerConfig) -> None:
    """What the config alone cannot tell: a GPU, and the optional packages some knobs need."""
    if not torch.cuda.is_available():
        raise RuntimeError("the Megatron-Bridge backend needs a CUDA GPU; use the CPU path without one")
    if cfg.moe.dispatcher == "flex" and importlib.util.find_spec("deep_ep") is None:
        raise RuntimeError(f"--moe-dispatcher flex --flex-backend {cfg.moe.flex_backend} needs the deep_ep "
                           "package (DeepEP, with HybridEP for hybridep); install it or use alltoall")
    if cfg.parallel.strategy == "fsdp" and os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
        raise RuntimeError("Megatron-FSDP needs CUDA_DEVICE_MAX_CONNECTIONS unset or > 1")
