"""Megatron-Bridge backend: Qwen3-VL MoE trained on packed rows from the data service.

Reading order:
  1. ``build_provider`` / ``build_config_container``: a validated ``TrainerConfig`` becomes
     Megatron-Bridge's ``ConfigContainer`` (the real Qwen3-VL MoE provider, made by AutoBridge from a
     Hugging Face config, or from a checkpoint with ``--hf-path``).
  2. ``ExternalDataProvider``: plugs our per-rank iterator in with ``dataloader_type="external"``;
     ``TimedIterator`` measures how long the trainer blocks on it.
  3. ``pack_thd`` / ``mrope_position_ids``: pure tensor logic (CPU-testable) that turns B packed rows
     into one THD stream with per-sample boundaries and per-sample MRoPE positions.
  4. ``PackedForwardStep``: the forward step Megatron-Bridge calls per micro-batch.
  5. ``StepMetrics`` + ``train``: the training loop and the per-step JSON lines.

Batch contract (``datasvc.client.DataClient``, one dict per ``__next__``): tokens/labels [B,S] int64
(labels already shifted, -100 ignored), loss_mask [B,S] float32, cu_seqlens [B,K+1] int32 (sample j
of row r spans cu_seqlens[r,j]:cu_seqlens[r,j+1]; unused tail entries repeat the row's end),
num_samples [B], pixel_values [N,1536], image_grid_thw [n_images,3] (images in row-major token
order), sample_keys.

Why THD: several samples share one row, so attention must not cross sample boundaries and MRoPE must
restart at every sample. The model (``Qwen3VLModel``) accepts a flat ``[1, T]`` stream with THD
``PackedSeqParams``; Transformer Engine then attends within each segment only.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from megatron.bridge import AutoBridge
from megatron.bridge.data.base import DatasetBuildContext, DatasetProvider
from megatron.bridge.models.qwen_vl import qwen3_vl_step
from megatron.bridge.models.qwen_vl.modelling_qwen3_vl.rope import get_rope_index
from megatron.bridge.training.callbacks import Callback, CallbackContext
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
from megatron.bridge.training.losses import masked_next_token_loss
from megatron.bridge.training.state import GlobalState
from megatron.bridge.training.tokenizers.config import TokenizerConfig
from megatron.bridge.training.utils.flop_utils import accumulate_flops_metadata, get_model_chunk_vp_stage
from megatron.bridge.training.utils.pg_utils import get_pg_collection
from megatron.bridge.training.utils.visual_inputs import GenericVisualInputs
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.utils import get_model_config

from datasvc.batch import IGNORE_INDEX
from pipelines.qwen3vl import TOKENS, VIDEO_PAD as VIDEO_PAD_ID
from pipelines.qwen3vl.megatron import hf_config
from trainer.config import TrainerConfig
from trainer.vision_chunks import chunk_vision_hook

log = logging.getLogger("vlmfeed.megatron")

PAD_ID = TOKENS.pad
IMAGE_PAD_ID = TOKENS.image_pad
VISION_START_ID = TOKENS.vision_start


# ================================================================================================
# 1. Config: TrainerConfig -> Megatron-Bridge ConfigContainer
# ================================================================================================
def build_provider(cfg: TrainerConfig):
    """The Qwen3-VL MoE model provider (``Qwen3VLMoEModelProvider``) with every model-side knob set."""
    m, p, moe, rc, cg, t = cfg.model, cfg.parallel, cfg.moe, cfg.recompute, cfg.cuda_graph, cfg.train
    if m.hf_path:
        provider = AutoBridge.from_hf_pretrained(m.hf_path).to_megatron_provider(load_weights=True)
    else:
        provider = AutoBridge.from_hf_config(hf_config(m.arch())).to_megatron_provider(load_weights=False)

    # Parallelism. Qwen3-VL MoE's provider turns sequence parallel on itself when TP > 1 (finalize).
    provider.tensor_model_parallel_size = p.tp
    provider.pipeline_model_parallel_size = p.pp
    provider.virtual_pipeline_model_parallel_size = p.vpp
    provider.context_parallel_size = p.cp
    provider.expert_model_parallel_size = p.ep
    provider.expert_tensor_parallel_size = p.etp
    provider.sequence_parallel = p.tp > 1
    provider.pipeline_dtype = None  # finalize() takes params_dtype (bf16 under bf16_mixed) when PP > 1

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
    # With PP, stages exchange activations of shape [tokens, 1, hidden] for our flat THD stream, not
    # [seq_len, mbs, hidden]; variable_seq_lengths makes the P2P layer send the shape first.
    provider.variable_seq_lengths = p.pp > 1 and not t.padded
    # Megatron's non-TE linear layers (the output layer) implement gradient-accumulation fusion only
    # through APEX's fused_weight_gradient_mlp_cuda and refuse to build without it; the provider turns
    # the fusion on by default, so keep it only where that extension exists.
    provider.gradient_accumulation_fusion = bool(provider.gradient_accumulation_fusion) and _has_apex_wgrad_fusion()

    # MoE token dispatcher.
    provider.moe_aux_loss_coeff = moe.aux_loss_coeff
    if moe.dispatcher == "flex":
        provider.moe_token_dispatcher_type = "flex"
        provider.moe_flex_dispatcher_backend = moe.flex_backend
        provider.moe_shared_expert_overlap = False  # not supported with the flex dispatcher
    else:
        provider.moe_token_dispatcher_type = "alltoall"
        provider.moe_flex_dispatcher_backend = None

    # Activation recompute.
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

    # CUDA graphs (per layer, Transformer Engine), using megatron-core 0.19's cuda_graph_modules.
    if cg.scope:
        provider.cuda_graph_impl = "transformer_engine"
        provider.cuda_graph_modules = list(cg.scope)
        provider.cuda_graph_warmup_steps = cg.warmup_steps
    else:
        provider.cuda_graph_impl = "none"
    return provider


def _has_apex_wgrad_fusion() -> bool:
    return importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None


class TimedIterator:
    """Wraps the per-rank data iterator: counts time blocked in ``__next__`` and the real/slot tokens
    of each micro-batch. ``StepMetrics`` drains the counters once per optimizer step."""

    def __init__(self, inner: Iterator[dict], adapt: Callable[[dict], Any] | None = None):
        self.inner = inner
        self.adapt = adapt
        self.reset()

    def reset(self) -> None:
        self.wait_s = 0.0
        self.real_tokens = 0
        self.slot_tokens = 0
        self.micro_batches = 0

    def __iter__(self):
        return self

    def __next__(self):
        t0 = time.perf_counter()
        batch = next(self.inner)
        self.wait_s += time.perf_counter() - t0
        tokens = batch["tokens"]
        self.slot_tokens += tokens.numel()
        self.real_tokens += int(real_tokens_per_row(batch["cu_seqlens"], batch["num_samples"]).sum())
        self.micro_batches += 1
        return self.adapt(batch) if self.adapt else batch

    # Checkpoint resume goes straight to the data service's stream state.
    def save_state(self):
        return self.inner.save_state()

    def restore_state(self, state) -> None:
        self.inner.restore_state(state)


@dataclass(kw_only=True)
class ExternalDataProvider(DatasetProvider):
    """``dataloader_type="external"``: Megatron-Bridge passes our iterator through untouched (wrapped
    only in its RerunDataIterator). No validation or test split; the data service owns sharding
    (one stream per DP rank, identical across the TP/PP/CP ranks of a replica)."""

    dataloader_type: str = "external"
    num_workers: int = 0
    persistent_workers: bool = False
    pin_memory: bool = False
    data_sharding: bool = False
    seq_length: int = 4096  # read by a few Bridge helpers that look at cfg.dataset.seq_length
    skip_getting_attention_mask_from_dataset: bool = True  # stock qwen3_vl_step reads it

    # The iterator is a runtime object, kept off the dataclass fields so the config stays printable.
    def attach(self, iterator: TimedIterator | None) -> "ExternalDataProvider":
        object.__setattr__(self, "_iterator", iterator)
        return self

    @property
    def iterator(self) -> TimedIterator | None:
        return getattr(self, "_iterator", None)

    def build_datasets(self, context: DatasetBuildContext):
        if self.iterator is None:
            raise RuntimeError("ExternalDataProvider has no iterator attached (call .attach(iterator))")
        return self.iterator, None, None


def build_config_container(cfg: TrainerConfig, world_size: int,
                           iterator: TimedIterator | None = None) -> ConfigContainer:
    """The full Megatron-Bridge config. Call ``cfg.validate(world_size)`` first (``train`` does)."""
    p, t = cfg.parallel, cfg.train
    fsdp = p.strategy == "fsdp"
    arch = cfg.model.arch()

    optimizer = OptimizerConfig(
        optimizer="adam", lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay, bf16=t.bf16,
        adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=t.clip_grad,
        use_distributed_optimizer=True,
    )
    scheduler = SchedulerConfig(
        lr_decay_style="cosine", lr_warmup_iters=t.warmup_iters, lr_warmup_init=0.0,
        lr_decay_iters=t.train_iters, start_weight_decay=t.weight_decay, end_weight_decay=t.weight_decay,
        weight_decay_incr_style="constant", override_opt_param_scheduler=True,
    )
    ddp = DistributedDataParallelConfig(
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
    dataset = ExternalDataProvider(seq_length=t.seq_len).attach(iterator)
    return ConfigContainer(
        model=build_provider(cfg),
        train=TrainingConfig(
            train_iters=t.train_iters, global_batch_size=t.gbs, micro_batch_size=t.mbs,
            manual_gc=True, manual_gc_interval=100,
        ),
        validation=ValidationConfig(eval_iters=0, eval_interval=None),
        optimizer=optimizer,
        scheduler=scheduler,
        ddp=ddp,
        dataset=dataset,
        logger=LoggerConfig(log_interval=t.log_interval, log_throughput=True),
        # Our tokens arrive already tokenized; the null tokenizer only carries the vocabulary size.
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=arch.vocab_size),
        checkpoint=CheckpointConfig(save=None, load=None,
                                    ckpt_format="fsdp_dtensor" if fsdp else "torch_dist"),
        rng=RNGConfig(seed=t.seed),
        dist=DistributedInitConfig(use_megatron_fsdp=fsdp),
        mixed_precision="bf16_mixed" if t.bf16 else None,
    )


# ================================================================================================
# 2. Packed rows -> one THD stream (pure tensor logic)
# ================================================================================================
def real_tokens_per_row(cu_seqlens: torch.Tensor, num_samples: torch.Tensor) -> torch.Tensor:
    """End of the last sample of each row (tokens past it are padding)."""
    rows = torch.arange(cu_seqlens.shape[0], device=cu_seqlens.device)
    return cu_seqlens[rows, num_samples.long()].long()


@dataclass
class PackedTHD:
    """One micro-batch as a single THD stream of T tokens.

    ``segments`` are the attention units in stream order: every sample, plus one filler segment per
    row tail (padding attends only to padding, so it cannot disturb a sample and its outputs stay
    finite). ``sample_spans[k]`` is the (start, end) of sample k (row-major) in the stream.
    """

    tokens: torch.Tensor  # int64 [1, T]
    labels: torch.Tensor  # int64 [1, T], IGNORE_INDEX mapped to PAD_ID (loss_mask is 0 there)
    loss_mask: torch.Tensor  # float32 [1, T]
    cu_seqlens: torch.Tensor  # int32 [n_segments + 1]: real tokens of each segment
    cu_seqlens_padded: torch.Tensor  # int32 [n_segments + 1]: physical extent of each segment
    max_seqlen: int
    sample_spans: list[tuple[int, int]]

    @property
    def params(self) -> PackedSeqParams:
        return PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=self.cu_seqlens, cu_seqlens_kv=self.cu_seqlens,
            cu_seqlens_q_padded=self.cu_seqlens_padded, cu_seqlens_kv_padded=self.cu_seqlens_padded,
            max_seqlen_q=self.max_seqlen, max_seqlen_kv=self.max_seqlen,
        )


def pack_thd(tokens: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor,
             cu_seqlens: torch.Tensor, num_samples: torch.Tensor, *,
             segment_multiple: int = 1, total_multiple: int = 1) -> PackedTHD:
    """Flatten B packed rows into one THD stream.

    segment_multiple: every segment's physical length is rounded up to it (context parallel needs
        2*CP: each segment is split into 2*CP chunks). Samples are then copied apart with padding
        between them; with 1 the rows are used in place (a reshape).
    total_multiple: the stream length T is rounded up to it (sequence parallel needs T % (TP*CP) == 0).
    T is B*S whenever that fits, so shapes stay fixed from step to step without context parallel.
    """
    B, S = tokens.shape
    device = tokens.device
    spans_per_row = cu_seqlens.long().tolist()
    counts = num_samples.long().tolist()
    m = max(1, segment_multiple)

    # Lay out (source_row, source_start, real_len, physical_len) pieces in stream order.
    pieces: list[tuple[int, int, int, int, bool]] = []  # (+ is_sample)
    for r in range(B):
        for j in range(counts[r]):
            s, e = spans_per_row[r][j], spans_per_row[r][j + 1]
            if e > s:
                pieces.append((r, s, e - s, _round_up(e - s, m), True))
        if m == 1:  # rows in place: the row tail becomes a filler segment
            end = spans_per_row[r][counts[r]] if counts[r] else 0
            if S > end:
                pieces.append((r, end, S - end, S - end, False))
    used = sum(pc[3] for pc in pieces)
    total = _round_up(max(used, B * S if m == 1 else used), math.lcm(m, max(1, total_multiple)))
    if total > used:  # one filler segment at the end (a multiple of m, since both ends are)
        pieces.append((-1, 0, total - used, total - used, False))

    if m == 1 and total == B * S:
        flat_tokens, flat_labels, flat_mask = tokens.reshape(1, -1), labels.reshape(1, -1), loss_mask.reshape(1, -1)
    else:
        flat_tokens = torch.full((1, total), PAD_ID, dtype=tokens.dtype, device=device)
        flat_labels = torch.full((1, total), IGNORE_INDEX, dtype=labels.dtype, device=device)
        flat_mask = torch.zeros((1, total), dtype=loss_mask.dtype, device=device)
        at = 0
        for r, s, n, phys, _ in pieces:
            if r >= 0:
                flat_tokens[0, at:at + n] = tokens[r, s:s + n]
                flat_labels[0, at:at + n] = labels[r, s:s + n]
                flat_mask[0, at:at + n] = loss_mask[r, s:s + n]
            at += phys

    # Supervise only real targets; -100 is not a vocabulary index, so map it to the pad id (masked).
    supervised = flat_labels != IGNORE_INDEX
    flat_mask = flat_mask.float() * supervised
    flat_labels = torch.where(supervised, flat_labels, torch.full_like(flat_labels, PAD_ID))

    real = [0]
    phys = [0]
    spans, at = [], 0
    for r, s, n, p, is_sample in pieces:
        # A filler segment counts as "real" tokens: attention over it is well defined (no padded
        # holes whose outputs the kernel may leave unset), and the loss mask is 0 there anyway.
        real.append(real[-1] + n)  # TE convention: cumulative real lengths ...
        phys.append(phys[-1] + p)  # ... and cumulative physical extents (offsets in the stream)
        if is_sample:
            spans.append((at, at + n))
        at += p
    cu_real = torch.tensor(real, dtype=torch.int32, device=device)
    cu_phys = torch.tensor(phys, dtype=torch.int32, device=device)
    max_seqlen = max(b - a for a, b in zip(phys[:-1], phys[1:]))
    return PackedTHD(flat_tokens.long(), flat_labels.long(), flat_mask, cu_real, cu_phys, max_seqlen, spans)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def mrope_position_ids(packed: PackedTHD, image_grid_thw: torch.Tensor | None,
                       spatial_merge_size: int = 2) -> torch.Tensor:
    """MRoPE positions [3, 1, T] restarted at every segment, via Megatron-Bridge's own Qwen3-VL rope
    index (``get_rope_index`` walks the THD segments and consumes ``image_grid_thw`` in order)."""
    grid = image_grid_thw if image_grid_thw is not None and image_grid_thw.numel() else None
    position_ids, _ = get_rope_index(
        spatial_merge_size, IMAGE_PAD_ID, VIDEO_PAD_ID, VISION_START_ID, packed.tokens,
        image_grid_thw=grid, packed_seq_params=packed.params,
    )
    return position_ids


def per_sample_losses(token_losses: torch.Tensor, loss_mask: torch.Tensor,
                      spans: list[tuple[int, int]]) -> list[float]:
    """Mean loss over the supervised tokens of each sample (for the packed-vs-alone proof)."""
    lt, lm = token_losses.reshape(-1).float(), loss_mask.reshape(-1).float()
    out = []
    for a, b in spans:
        n = lm[a:b].sum()
        out.append(float((lt[a:b] * lm[a:b]).sum() / n) if n > 0 else float("nan"))
    return out


# ================================================================================================
# 3. Forward steps
# ================================================================================================
def _masked_loss(loss_mask: torch.Tensor, output_tensor, check_for_nan_in_loss: bool, check_for_spiky_loss: bool):
    """Bridge's masked next-token loss, with unsupervised positions zeroed first: 0 * NaN would
    otherwise leak a non-finite value from a position nobody trains on into the sum."""
    if isinstance(output_tensor, tuple):  # CP slices the loss mask inside the model
        losses, mask = output_tensor
        output_tensor = (torch.where(mask.bool(), losses, torch.zeros_like(losses)), mask)
    else:
        output_tensor = torch.where(loss_mask.reshape(output_tensor.shape).bool(), output_tensor,
                                    torch.zeros_like(output_tensor))
    return masked_next_token_loss(loss_mask, output_tensor, check_for_nan_in_loss=check_for_nan_in_loss,
                                  check_for_spiky_loss=check_for_spiky_loss)


class PackedForwardStep:
    """Forward step for packed rows: THD PackedSeqParams from the sample boundaries, MRoPE restarted
    per sample, per-token loss. Signature follows Megatron-Bridge (state injected by name)."""

    def __call__(self, state: GlobalState, data_iterator, model, return_schedule_plan: bool = False):
        if return_schedule_plan:
            raise NotImplementedError("overlap_moe_expert_parallel_comm schedule plans are not supported "
                                      "with packed rows")
        timers = state.timers
        timers("batch-generator", log_level=2).start()
        batch = next(data_iterator)
        timers("batch-generator").stop()

        pg = get_pg_collection(model)
        config = get_model_config(model)
        cp, tp = pg.cp.size(), pg.tp.size()
        packed = pack_thd(
            batch["tokens"], batch["labels"], batch["loss_mask"], batch["cu_seqlens"], batch["num_samples"],
            segment_multiple=2 * cp if cp > 1 else 1,
            total_multiple=tp * cp if config.sequence_parallel or cp > 1 else 1,
        )
        grid = batch.get("image_grid_thw")
        has_images = grid is not None and grid.numel() > 0
        position_ids = mrope_position_ids(packed, grid if has_images else None, config.spatial_merge_size)

        # Megatron-Bridge FLOP accounting: Σ s_i² over real segments for attention, vision patches for the ViT.
        accumulate_flops_metadata(
            state, packed.tokens, vp_stage=get_model_chunk_vp_stage(model),
            cu_seqlens=packed.cu_seqlens_padded, cu_seqlens_unpadded=packed.cu_seqlens,
            num_vision_patches=grid.prod(dim=-1).sum() if has_images else None,
        )

        output = model(
            input_ids=packed.tokens,
            position_ids=position_ids,
            attention_mask=None,
            labels=packed.labels,
            loss_mask=packed.loss_mask,
            packed_seq_params=packed.params,
            pixel_values=batch["pixel_values"] if has_images else None,
            image_grid_thw=grid if has_images else None,
        )
        rsm = state.cfg.rerun_state_machine
        loss_fn = _LossFn(packed.loss_mask, rsm.check_for_nan_in_loss, rsm.check_for_spiky_loss)
        return output, loss_fn


class _LossFn:
    """Picklable partial of ``_masked_loss`` (Megatron calls it with the model output)."""

    def __init__(self, loss_mask, check_nan, check_spiky):
        self.loss_mask, self.check_nan, self.check_spiky = loss_mask, check_nan, check_spiky

    def __call__(self, output_tensor):
        return _masked_loss(self.loss_mask, output_tensor, self.check_nan, self.check_spiky)


def to_stock_batch(batch: dict) -> dict:
    """Our batch in the form Megatron-Bridge's stock ``qwen3_vl_step`` expects (padded rows, one
    sample per row, ``visual_inputs``); it refuses collate-time packing, so packed rows are an error."""
    if int(batch["num_samples"].max()) > 1:
        raise ValueError("--padded runs the stock qwen3_vl_step, which needs one sample per row; configure "
                         "the data service without packing for this mode")
    labels = batch["labels"]
    supervised = labels != IGNORE_INDEX
    grid = batch.get("image_grid_thw")
    has_images = grid is not None and grid.numel() > 0
    return {
        "tokens": batch["tokens"],
        "labels": torch.where(supervised, labels, torch.full_like(labels, PAD_ID)),
        "loss_mask": batch["loss_mask"].float() * supervised,
        "position_ids": None,  # the model computes MRoPE from input_ids and grids
        "attention_mask": None,
        "visual_inputs": GenericVisualInputs(pixel_values=batch["pixel_values"], image_grid_thw=grid)
        if has_images else None,
    }


# ================================================================================================
# 4. Per-step metrics
# ================================================================================================
class StepMetrics(Callback):
    """Per optimizer step: step time, data wait, tokens/s, real-token fraction, TFLOP/s per GPU,
    peak memory, loss. FLOPs come from Megatron-Bridge's own accounting: train.py adds the step's
    FLOPs to ``train_state.floating_point_operations_so_far`` right after ``on_train_step_end``, so a
    step's record is completed at the next step's start (or at train end)."""

    def __init__(self, iterator: TimedIterator, sink: str | Path | Callable[[dict], None] | None):
        self.iterator = iterator
        self.sink = sink
        self.records: list[dict] = []
        self._pending: dict | None = None
        self._t0 = 0.0
        self._flops_before = 0.0

    def on_train_step_start(self, context: CallbackContext) -> None:
        self._finish_pending(context)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self._flops_before = context.state.train_state.floating_point_operations_so_far
        self._t0 = time.perf_counter()

    def on_train_step_end(self, context: CallbackContext) -> None:
        torch.cuda.synchronize()
        step_time = time.perf_counter() - self._t0
        it = self.iterator
        dev = torch.cuda.current_device()
        sums = torch.tensor([it.real_tokens, it.slot_tokens], dtype=torch.float64, device=dev)
        maxes = torch.tensor([it.wait_s, torch.cuda.max_memory_allocated() / 2**30, step_time],
                             dtype=torch.float64, device=dev)
        it.reset()
        # Sum tokens over DP replicas (each replica's TP/PP/CP ranks saw the same rows); the slowest
        # rank's wait, memory and step time are what bound the job.
        from megatron.core import parallel_state
        torch.distributed.all_reduce(sums, group=parallel_state.get_data_parallel_group())
        torch.distributed.all_reduce(maxes, op=torch.distributed.ReduceOp.MAX)
        real, slots = sums.tolist()
        wait, peak_gib, step_time = maxes.tolist()
        loss = None
        for key, value in (context.loss_dict or {}).items():
            if "loss" in key:
                loss = float(value.item() if torch.is_tensor(value) else value)
                break
        self._pending = {
            "step": context.state.train_state.step + 1,
            "step_time_s": step_time,
            "data_wait_s": wait,
            "data_wait_frac": wait / step_time if step_time > 0 else 0.0,
            "tokens_per_s": real / step_time,
            "slot_tokens_per_s": slots / step_time,
            "real_token_fraction": real / slots if slots else 0.0,
            "peak_mem_gib": peak_gib,
            "loss": loss,
            "grad_norm": context.grad_norm,
            "skipped": context.skipped_iter,
            "lr": context.optimizer.param_groups[0]["lr"] if context.optimizer is not None else None,
        }

    def on_train_end(self, context: CallbackContext) -> None:
        self._finish_pending(context)

    def _finish_pending(self, context: CallbackContext) -> None:
        rec, self._pending = self._pending, None
        if rec is None:
            return
        flops = context.state.train_state.floating_point_operations_so_far - self._flops_before
        world = torch.distributed.get_world_size()
        rec["tflops_per_gpu"] = flops / rec["step_time_s"] / world / 1e12 if rec["step_time_s"] else 0.0
        self.records.append(rec)
        # The last rank sits on the last pipeline stage (Megatron's rank order keeps PP outermost),
        # the only place the loss exists.
        if torch.distributed.get_rank() == world - 1:
            log.info("step %(step)d loss %(loss)s step %(step_time_s).3fs wait %(data_wait_s).4fs "
                     "%(tokens_per_s).0f tok/s real %(real_token_fraction).3f %(tflops_per_gpu).1f TFLOP/s/GPU "
                     "peak %(peak_mem_gib).1f GiB", rec)
            if callable(self.sink):
                self.sink(rec)
            elif self.sink is not None:
                with open(self.sink, "a") as f:
                    f.write(json.dumps(rec) + "\n")


# ================================================================================================
# 5. Entry point
# ================================================================================================
def check_runtime(cfg: TrainerConfig) -> None:
    """What the config alone cannot tell: a GPU, and the optional packages some knobs need."""
    if not torch.cuda.is_available():
        raise RuntimeError("the Megatron-Bridge backend needs a CUDA GPU; use the CPU path without one")
    if cfg.moe.dispatcher == "flex" and importlib.util.find_spec("deep_ep") is None:
        raise RuntimeError(f"--moe-dispatcher flex --flex-backend {cfg.moe.flex_backend} needs the deep_ep "
                           "package (DeepEP, with HybridEP for hybridep); install it or use alltoall")
    if cfg.parallel.strategy == "fsdp" and os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
        raise RuntimeError("Megatron-FSDP needs CUDA_DEVICE_MAX_CONNECTIONS unset or > 1")


def train(cfg: TrainerConfig, data_iterator: Iterator[dict],
          metrics_sink: str | Path | Callable[[dict], None] | None = None,
          *, world_size: int | None = None) -> list[dict]:
    """Train with Megatron-Bridge on this rank. Call on every rank, with RANK/WORLD_SIZE/LOCAL_RANK/
    MASTER_ADDR/MASTER_PORT set (Bridge initialises torch.distributed unless it already is).
    Returns this rank's per-step records; the last rank also writes them to ``metrics_sink``
    (a JSON-lines path, or a callable taking each record)."""
    world_size = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    cfg.validate(world_size)
    check_runtime(cfg)

    iterator = TimedIterator(data_iterator, adapt=to_stock_batch if cfg.train.padded else None)
    container = build_config_container(cfg, world_size, iterator)
    # A Ray actor sees exactly its own GPU; Bridge would otherwise pick cuda:LOCAL_RANK.
    container.dist.external_gpu_device_mapping = torch.cuda.device_count() == 1
    forward_step = qwen3_vl_step.forward_step if cfg.train.padded else PackedForwardStep()
    metrics = StepMetrics(iterator, metrics_sink)
    log.info("Megatron-Bridge backend: %s, strategy %s, %s rows", cfg.model.preset, cfg.parallel.strategy,
             "padded (stock qwen3_vl_step)" if cfg.train.padded else "packed (THD)")
    _run_bridge(container, forward_step, [metrics])
    return metrics.records


def _run_bridge(container: ConfigContainer, forward_step, callbacks: list[Callback]) -> None:
    """Megatron-Bridge's pretrain loop. ``megatron.bridge.training.pretrain`` imports
    nvidia-resiliency-ext at module level, whose registry release (0.4.1) predates what megatron-core
    0.19 needs (>= 0.6, and 0.4.1 breaks its import); where it is missing we run the same steps
    pretrain runs without in-process restart: setup, train, finish."""
    _skip_dataset_helper_compile()
    try:
        from megatron.bridge.training.pretrain import pretrain
    except ImportError:
        pretrain = None
    if pretrain is not None:
        pretrain(container, forward_step, callbacks=callbacks)
        return

    from megatron.bridge.data.utils import get_dataset_provider
    from megatron.bridge.training.callbacks import normalize_callbacks
    from megatron.bridge.training.config import runtime_config_update
    from megatron.bridge.training.setup import setup
    from megatron.bridge.training.train import _finish_train, train as bridge_train

    runtime_config_update(container)
    state = GlobalState()
    state.cfg = container
    manager = normalize_callbacks(callbacks)
    out = setup(state, get_dataset_provider(container.dataset), callback_manager=manager)
    if out.state.train_state.do_train:
        bridge_train(forward_step, out.model, out.optimizer, out.scheduler, out.train_data_iterator,
                     out.valid_data_iterator, out.state, out.checkpoint_manager, out.pg_collection,
                     callback_manager=manager)
    _finish_train(out.state, out.checkpoint_manager)


def _skip_dataset_helper_compile() -> None:
    """Megatron-Bridge's initialisation runs ``make`` in megatron/core/datasets to build the C++ index
    helpers of Megatron's own datasets, and exits the process when that fails. The megatron-core wheel
    ships those helpers prebuilt but without the Makefile, so ``make`` always fails there; our data
    arrives through ``dataloader_type="external"`` and never uses them, so skip the compile."""
    import megatron.bridge.training.initialize as bridge_init

    bridge_init.compile_helpers = lambda: log.info("dataset index helpers not compiled: external data iterator")
