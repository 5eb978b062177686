"""CPU development path: a real (tiny) model of the pipeline's family from transformers (its
``cpu_model``), trained on gloo.

It exists so the whole job (placement group, trainer actors, per-DP-rank data streams, metrics)
runs and is tested without GPUs. It consumes the same packed micro-batches as the Megatron
backend; packed rows are split back into their samples (each runs as its own sequence, so
attention and MRoPE restart per sample exactly as THD packing does on the GPU).
"""
from __future__ import annotations

import json
import logging
import math
import resource
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from datasvc.batch import IGNORE_INDEX, TrainBatch
from datasvc.registry import pipeline_part
from trainer.checkpoint import commit, load_cpu, save_cpu
from trainer.config import TrainerConfig
from trainer.rank_spread import gather_rank_spread

log = logging.getLogger("vlmfeed.trainer.cpu")


def _runs(ids: torch.Tensor, token: int) -> int:
    """How many runs of ``token`` the ids hold (one per image; one per temporal group of a video)."""
    return int(((ids[1:] == token) & (ids[:-1] != token)).sum() + int(ids[0] == token))


def split_samples(batch: TrainBatch, image_pad: int, video_pad: int) -> list[dict]:
    """Packed rows -> one dict per sample of the model's keyword arguments: its own tokens, labels,
    image and video patches (``image_pad``, ``video_pad``: the model's pad token ids, which mark where
    each image and video is)."""
    grids = batch.image_grid_thw
    patch_counts = (grids.prod(dim=1)).tolist() if len(grids) else []
    video_grids = batch.video_grid_thw if batch.has_videos else torch.zeros((0, 3), dtype=torch.int64)
    video_thw = video_grids.tolist()
    image_i, patch_off, video_i, video_off = 0, 0, 0, 0
    samples = []
    for r in range(batch.tokens.shape[0]):
        cu = batch.cu_seqlens[r]
        for j in range(int(batch.num_samples[r])):
            s, e = int(cu[j]), int(cu[j + 1])
            ids = batch.tokens[r, s:e]
            n_img = _runs(ids, image_pad)
            n_patch = sum(patch_counts[image_i:image_i + n_img])
            groups, n_vid = _runs(ids, video_pad), 0
            while groups > 0 and video_i + n_vid < len(video_thw):
                groups -= video_thw[video_i + n_vid][0]
                n_vid += 1
            n_vpatch = sum(t * h * w for t, h, w in video_thw[video_i:video_i + n_vid])
            sample = {
                "input_ids": ids,
                "labels": batch.labels[r, s:e],
                "pixel_values": batch.pixel_values[patch_off:patch_off + n_patch],
                "image_grid_thw": grids[image_i:image_i + n_img],
            }
            if n_vid:
                sample["pixel_values_videos"] = batch.pixel_values_videos[video_off:video_off + n_vpatch]
                sample["video_grid_thw"] = video_grids[video_i:video_i + n_vid]
            samples.append(sample)
            image_i += n_img
            patch_off += n_patch
            video_i += n_vid
            video_off += n_vpatch
    return samples


def sample_loss(model, sample: dict) -> tuple[torch.Tensor, int]:
    """Summed token loss (labels are already shifted) and the number of supervised tokens."""
    ids = sample["input_ids"].unsqueeze(0)
    kwargs = {}
    if len(sample["image_grid_thw"]):
        kwargs = dict(pixel_values=sample["pixel_values"], image_grid_thw=sample["image_grid_thw"])
    if "video_grid_thw" in sample:
        kwargs.update(pixel_values_videos=sample["pixel_values_videos"], video_grid_thw=sample["video_grid_thw"])
    if kwargs:  # 1 on image pads, 2 on video pads, as the processor marks them
        c = model.config
        kwargs["mm_token_type_ids"] = (ids == c.image_token_id).long() + 2 * (ids == c.video_token_id).long()
    labels = sample["labels"]
    keep = torch.nonzero(labels != IGNORE_INDEX).flatten()
    # Project only supervised positions onto the 152k vocabulary: most of a VLM row is image pads.
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), logits_to_keep=keep, **kwargs).logits[0]
    return F.cross_entropy(logits.float(), labels[keep], reduction="sum"), int(keep.numel())


def all_reduce_grads(model) -> None:
    """Sum gradients over ranks in one flat buffer.

    Not DDP: ranks run different numbers of forward passes (one per packed sample), which DDP's
    per-forward collectives cannot match.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat)
    offset = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[offset:offset + n].view_as(p))
        offset += n


@dataclass(kw_only=True)
class CpuRank:
    """Where one CPU rank sits and what it reports: its place, where its loss and samples are written
    (rank 0), the step a resume starts at, and how it learns that the run should stop."""

    rank: int
    world: int
    dp_rank: int
    grad_accum: int
    metrics_path: str | None = None
    samples_path: str | None = None
    resume_step: int = 0
    stop_requested: Callable[[], str] = lambda: ""  # a reason ("SIGTERM"), or "" to go on


def build(cfg: TrainerConfig, model_cfg=None):
    """The model (from ``--hf-path`` when given, else the development config), its optimizer, and
    warm-up plus cosine decay to ``min_lr``, as the Megatron backend schedules it."""
    t = cfg.train
    if cfg.model.hf_path:
        from transformers import AutoModelForImageTextToText

        model = AutoModelForImageTextToText.from_pretrained(cfg.model.hf_path, dtype=torch.float32)
        model.config._attn_implementation = "sdpa"
    else:
        cpu_model = pipeline_part(cfg.model.pipeline, "cpu_model")
        model = cpu_model.build_model(model_cfg or cpu_model.CpuModelConfig(), t.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=0.0)

    def factor(step: int) -> float:
        if step < t.warmup_iters:
            return (step + 1) / (t.warmup_iters + 1)
        progress = min(1.0, (step - t.warmup_iters) / max(1, t.train_iters - t.warmup_iters))
        return (t.min_lr + (t.lr - t.min_lr) * 0.5 * (1 + math.cos(math.pi * progress))) / t.lr

    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def train(cfg: TrainerConfig, data_iter, me: CpuRank, *, valid_iter=None, loader=None,
          model_cfg=None) -> list[dict]:
    """Train on this rank from ``me.resume_step`` to ``cfg.train.train_iters``, saving, validating and
    stopping as ``cfg.checkpoint`` and ``cfg.eval`` say. ``loader``: this DP rank's client when this
    rank saves its loader state (the first consumer of each replica)."""
    if me.rank == 0:
        log.warning("CPU development path: tiny transformers %s on gloo; not a performance run", cfg.model.pipeline)
    ck = cfg.checkpoint
    model, opt, sched = build(cfg, model_cfg)
    if me.resume_step:
        load_cpu(ck.load, me.resume_step, rank=me.rank, model=model, optimizer=opt, scheduler=sched)
        if me.rank == 0:
            log.info("resumed from %s at step %d", ck.load, me.resume_step)
    n_params = sum(p.numel() for p in model.parameters())
    records = []
    sink = open(me.metrics_path, "a") if (me.metrics_path and me.rank == 0) else None
    samples = open(me.samples_path, "a") if (me.samples_path and me.rank == 0) else None
    began = time.monotonic()
    step = me.resume_step
    while step < cfg.train.train_iters:
        rec, keys = _train_step(model, opt, data_iter, me, step, n_params)
        sched.step()
        step += 1
        if valid_iter is not None and cfg.eval.eval_interval and step % cfg.eval.eval_interval == 0:
            rec["val_loss"] = validate(model, valid_iter, me, cfg.eval.eval_iters)
        reason = _agreed_stop(cfg, me, step, began)
        if ck.save and (reason or step == cfg.train.train_iters or (ck.save_interval and step % ck.save_interval == 0)):
            t0 = time.perf_counter()
            save_cpu(ck.save, step, rank=me.rank, dp_rank=me.dp_rank, model=model, optimizer=opt, scheduler=sched,
                     loader_state=loader.save_state() if loader is not None else None,
                     export_hf=ck.export_hf_on_save)
            if me.world > 1:
                dist.barrier()
            if me.rank == 0:
                commit(ck.save, step, ck.keep_last)
            rec["checkpoint_s"] = round(time.perf_counter() - t0, 3)
        if reason:
            rec["exit_reason"] = reason
        records.append(rec)
        if me.rank == 0:
            _log_step(rec)
            if sink:
                sink.write(json.dumps(rec) + "\n")
                sink.flush()
            if samples:
                samples.write(json.dumps({"step": rec["step"], "samples": keys}) + "\n")
                samples.flush()
        if reason:
            if me.rank == 0:
                log.warning("stopping after step %d (%s)%s", step, reason, f"; saved to {ck.save}" if ck.save else "")
            break
    if ck.export_hf and me.rank == 0:
        model.save_pretrained(ck.export_hf)
        log.info("Hugging Face checkpoint written to %s", ck.export_hf)
    for f in (sink, samples):
        if f:
            f.close()
    return records


def _train_step(model, opt, data_iter, me: CpuRank, step: int, n_params: int) -> tuple[dict, list]:
    """One optimizer step over ``me.grad_accum`` micro-batches: its record, and every DP rank's
    [sample key, epoch] pairs in the order trained (rank 0; the others get an empty list)."""
    t0 = time.perf_counter()
    wait0 = data_iter.wait_s
    loss_sum, n_tok, real, total = torch.zeros(()), 0, 0, 0
    opt.zero_grad(set_to_none=True)
    micro = []
    for _ in range(me.grad_accum):
        batch = next(data_iter)
        micro.append(batch)
        real += int(batch.cu_seqlens[torch.arange(len(batch.num_samples)), batch.num_samples.long()].sum())
        total += batch.tokens.numel()
    # Normalize by supervised tokens across the whole global batch, as Megatron's per-token loss does.
    local_tokens = sum(int((b.labels != IGNORE_INDEX).sum()) for b in micro)
    global_tokens = torch.tensor([local_tokens], dtype=torch.float64)
    if me.world > 1:
        dist.all_reduce(global_tokens)
    # This rank's own work: between the last collective before it and the gradient all-reduce,
    # so neither data wait nor waiting for the other ranks is in it.
    c0 = time.perf_counter()
    for batch in micro:
        for sample in split_samples(batch, model.config.image_token_id, model.config.video_token_id):
            loss, n = sample_loss(model, sample)
            (loss / global_tokens.item()).backward()
            loss_sum += loss.detach()
            n_tok += n
    compute_s = time.perf_counter() - c0
    if me.world > 1:
        all_reduce_grads(model)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    stats = torch.tensor([float(loss_sum), n_tok, real, total], dtype=torch.float64)
    if me.world > 1:
        dist.all_reduce(stats)
    gathered = gather_rank_spread(compute_s, sum(b.vision_patches for b in micro))
    keys = [[k, e] for b in micro for k, e in zip(b.sample_keys, b.sample_epochs)]
    if me.world > 1:
        every = [None] * me.world
        dist.all_gather_object(every, keys)
        keys = [k for rank_keys in every for k in rank_keys]
    dt = time.perf_counter() - t0
    waited = data_iter.wait_s - wait0
    rec = {
        "step": step + 1, "backend": "cpu", "loss": float(stats[0] / max(stats[1], 1)),
        "lr": opt.param_groups[0]["lr"],
        "step_time_s": round(dt, 4), "data_wait_s": round(waited, 4), "data_wait_share": round(waited / dt, 4),
        "tokens_per_s": round(float(stats[2]) / dt, 1), "real_token_fraction": round(float(stats[2] / stats[3]), 4),
        # 6 * params * tokens: a rough count for a dense model of this size (CPU path only)
        "tflops_per_gpu_estimate": round(6 * n_params * float(stats[2]) / me.world / dt / 1e12, 6),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "rank_compute_s": gathered.seconds, "rank_vision_patches": gathered.vision_patches,
        "straggler_ratio": gathered.straggler_ratio,
    }
    return rec, keys if me.rank == 0 else []


@torch.no_grad()
def validate(model, valid_iter, me: CpuRank, global_batches: int) -> float:
    """Loss per supervised token over ``global_batches`` global batches of the validation stream."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64)
    for _ in range(global_batches * me.grad_accum):
        for sample in split_samples(next(valid_iter), model.config.image_token_id, model.config.video_token_id):
            loss, n = sample_loss(model, sample)
            total += torch.tensor([float(loss), n], dtype=torch.float64)
    model.train()
    if me.world > 1:
        dist.all_reduce(total)
    return float(total[0] / max(total[1], 1))


def _agreed_stop(cfg: TrainerConfig, me: CpuRank, step: int, began: float) -> str:
    """Why the run stops after ``step`` (a SIGTERM, --exit-interval, --exit-duration-in-mins), the
    same on every rank, or ""."""
    ck = cfg.checkpoint
    reason = ""
    if ck.exit_interval and step % ck.exit_interval == 0 and step < cfg.train.train_iters:
        reason = "exit_interval"
    elif ck.exit_duration_in_mins and time.monotonic() - began >= 60 * ck.exit_duration_in_mins:
        reason = "exit_duration_in_mins"
    elif me.rank == 0:
        reason = me.stop_requested()
    if me.world > 1:  # rank 0's view of the signal, and the step-count rules every rank computes alike
        box = [reason]
        dist.broadcast_object_list(box, src=0)
        reason = box[0]
    return reason


def _log_step(rec: dict) -> None:
    straggler = f" straggler {rec['straggler_ratio']:.2f}" if rec["straggler_ratio"] is not None else ""
    log.info("step %d loss %.4f step %.2fs wait %.1f%% tok/s %.0f real %.2f%s", rec["step"], rec["loss"],
             rec["step_time_s"], 100 * rec["data_wait_share"], rec["tokens_per_s"], rec["real_token_fraction"],
             straggler)
