"""CPU development path: a real (tiny) Qwen3-VL MoE from transformers, trained with DDP on gloo.

It exists so the whole job (placement group, trainer actors, per-DP-rank data streams, metrics)
runs and is tested without GPUs. It consumes the same packed micro-batches as the Megatron
backend; packed rows are split back into their samples (each runs as its own sequence, so
attention and MRoPE restart per sample exactly as THD packing does on the GPU).
"""
from __future__ import annotations

import json
import logging
import resource
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from datasvc.batch import IGNORE_INDEX, vision_patches
from pipelines.qwen3vl import TOKENS, VIDEO_PAD
from pipelines.qwen3vl.cpu_model import CpuModelConfig, build_model
from trainer.rank_spread import gather_rank_spread

log = logging.getLogger("vlmfeed.trainer.cpu")

IMAGE_PAD = TOKENS.image_pad


def _runs(ids: torch.Tensor, token: int) -> int:
    """How many runs of ``token`` the ids hold (one per image; one per temporal group of a video)."""
    return int(((ids[1:] == token) & (ids[:-1] != token)).sum() + int(ids[0] == token))


def split_samples(batch: dict) -> list[dict]:
    """Packed rows -> one dict per sample with its own tokens, labels, image and video patches."""
    grids = batch["image_grid_thw"]
    patch_counts = (grids.prod(dim=1)).tolist() if len(grids) else []
    video_grids = batch.get("video_grid_thw", torch.zeros((0, 3), dtype=torch.int64))
    video_thw = video_grids.tolist()
    image_i, patch_off, video_i, video_off = 0, 0, 0, 0
    samples = []
    for r in range(batch["tokens"].shape[0]):
        cu = batch["cu_seqlens"][r]
        for j in range(int(batch["num_samples"][r])):
            s, e = int(cu[j]), int(cu[j + 1])
            ids = batch["tokens"][r, s:e]
            n_img = _runs(ids, IMAGE_PAD)
            n_patch = sum(patch_counts[image_i:image_i + n_img])
            groups, n_vid = _runs(ids, VIDEO_PAD), 0
            while groups > 0 and video_i + n_vid < len(video_thw):
                groups -= video_thw[video_i + n_vid][0]
                n_vid += 1
            n_vpatch = sum(t * h * w for t, h, w in video_thw[video_i:video_i + n_vid])
            sample = {
                "input_ids": ids,
                "labels": batch["labels"][r, s:e],
                "pixel_values": batch["pixel_values"][patch_off:patch_off + n_patch],
                "image_grid_thw": grids[image_i:image_i + n_img],
            }
            if n_vid:
                sample["pixel_values_videos"] = batch["pixel_values_videos"][video_off:video_off + n_vpatch]
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
        kwargs["mm_token_type_ids"] = (ids == IMAGE_PAD).long() + 2 * (ids == VIDEO_PAD).long()
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


def train(data_iter, *, steps: int, grad_accum: int, lr: float, seed: int, metrics_path: str | None,
          rank: int, world: int, model_cfg: CpuModelConfig = CpuModelConfig()) -> list[dict]:
    if rank == 0:
        log.warning("CPU development path: tiny transformers Qwen3-VL MoE on gloo; not a performance run")
    model = build_model(model_cfg, seed)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    records = []
    sink = open(metrics_path, "a") if (metrics_path and rank == 0) else None
    for step in range(steps):
        t0 = time.perf_counter()
        wait0 = data_iter.wait_s
        loss_sum, n_tok, real, total = torch.zeros(()), 0, 0, 0
        opt.zero_grad(set_to_none=True)
        micro = []
        for _ in range(grad_accum):
            batch = next(data_iter)
            micro.append(batch)
            real += int(batch["cu_seqlens"][torch.arange(len(batch["num_samples"])), batch["num_samples"].long()].sum())
            total += batch["tokens"].numel()
        # Normalize by supervised tokens across the whole global batch, as Megatron's per-token loss does.
        local_tokens = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in micro)
        global_tokens = torch.tensor([local_tokens], dtype=torch.float64)
        if world > 1:
            dist.all_reduce(global_tokens)
        # This rank's own work: between the last collective before it and the gradient all-reduce,
        # so neither data wait nor waiting for the other ranks is in it.
        c0 = time.perf_counter()
        for batch in micro:
            for sample in split_samples(batch):
                loss, n = sample_loss(model, sample)
                (loss / global_tokens.item()).backward()
                loss_sum += loss.detach()
                n_tok += n
        compute_s = time.perf_counter() - c0
        if world > 1:
            all_reduce_grads(model)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        stats = torch.tensor([float(loss_sum), n_tok, real, total], dtype=torch.float64)
        if world > 1:
            dist.all_reduce(stats)
        gathered = gather_rank_spread(compute_s, sum(vision_patches(b) for b in micro))
        spread = {"rank_compute_s": gathered.seconds, "rank_vision_patches": gathered.vision_patches,
                  "straggler_ratio": gathered.straggler_ratio}
        dt = time.perf_counter() - t0
        waited = data_iter.wait_s - wait0
        rec = {
            "step": step + 1, "backend": "cpu", "loss": float(stats[0] / max(stats[1], 1)),
            "step_time_s": round(dt, 4), "data_wait_s": round(waited, 4), "data_wait_share": round(waited / dt, 4),
            "tokens_per_s": round(float(stats[2]) / dt, 1), "real_token_fraction": round(float(stats[2] / stats[3]), 4),
            # 6 * params * tokens: a rough count for a dense model of this size (CPU path only)
            "tflops_per_gpu_estimate": round(6 * n_params * float(stats[2]) / world / dt / 1e12, 6),
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            **spread,
        }
        records.append(rec)
        if rank == 0:
            _log_step(rec)
            if sink:
                sink.write(json.dumps(rec) + "\n")
                sink.flush()
    if sink:
        sink.close()
    return records


def _log_step(rec: dict) -> None:
    straggler = f" straggler {rec['straggler_ratio']:.2f}" if rec["straggler_ratio"] is not None else ""
    log.info("step %d loss %.4f step %.2fs wait %.1f%% tok/s %.0f real %.2f%s", rec["step"], rec["loss"],
             rec["step_time_s"], 100 * rec["data_wait_share"], rec["tokens_per_s"], rec["real_token_fraction"],
             straggler)
