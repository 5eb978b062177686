"""GPU proofs for the Megatron-Bridge backend (run on a GPU box).

    python -m trainer.bench.gpu_proof packed            # packed row == samples alone, per-sample losses
    python -m trainer.bench.gpu_proof packed --video    # the same with video samples in the row
    python -m trainer.bench.gpu_proof train --strategy fsdp --steps 20 --mbs 2   # train() on synthetic rows

``packed``: builds the Qwen3-VL-30B-A3B proxy (4 decoder layers, full 27-layer vision tower, 128 experts)
on one GPU, runs a packed row (several image+text samples, THD PackedSeqParams, MRoPE restarted per
sample) and the same samples one per row (plain causal attention, no packing), and compares the mean
loss of each sample (bf16 tolerance). A control run treats the packed row as one sequence (no
boundaries, no MRoPE restart); it must disagree, which shows the comparison can fail.

``train``: the real ``trainer.megatron.loop.train`` loop fed by synthetic packed rows (no Ray, no data
service), to check the Bridge integration and the metrics lines on the device before the Ray job.
Results are printed as JSON and written under $OUT when set.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path

import torch

from datasvc.batch import IGNORE_INDEX, TrainBatch
from datasvc.usage import HelpFormatter
from pipelines.qwen3vl import TOKENS, VIDEO_PAD
from trainer.config import ModelConfig, ParallelConfig, TrainConfig, TrainerConfig


def _single_process_env() -> None:
    """Rank variables for a one-GPU run started by hand (torchrun or Ray would set them)."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])


# ------------------------------------------------------------------------------------------------
# Synthetic samples in the data service's format
# ------------------------------------------------------------------------------------------------
def synthetic_sample(rng: torch.Generator, grids: list[tuple[int, int, int]], n_before: int, n_after: int,
                     videos: list[tuple[int, int, int]] = ()):
    """(tokens, labels, image grids, video grids): text, image spans, video spans, text. A video span
    is laid out as Qwen3-VL's processor lays it out: per temporal group a timestamp (here four text
    tokens), then the group's pads between vision start and end, all inside an outer start and end.
    Labels are next tokens on text only."""
    ids = torch.randint(1000, 150000, (n_before,), generator=rng).tolist()
    for t, h, w in grids:
        ids += [TOKENS.vision_start] + [TOKENS.image_pad] * (t * h * w // 4) + [TOKENS.vision_end]
    for t, h, w in videos:
        ids += [TOKENS.vision_start]
        for _ in range(t):
            ids += torch.randint(1000, 150000, (4,), generator=rng).tolist()
            ids += [TOKENS.vision_start] + [VIDEO_PAD] * (h * w // 4) + [TOKENS.vision_end]
        ids += [TOKENS.vision_end]
    ids += torch.randint(1000, 150000, (n_after,), generator=rng).tolist()
    tokens = torch.tensor(ids)
    labels = torch.cat([tokens[1:], torch.tensor([IGNORE_INDEX])])
    labels[(tokens == TOKENS.image_pad) | (tokens == VIDEO_PAD) | (tokens == TOKENS.vision_start)] = IGNORE_INDEX
    return tokens, labels, grids, list(videos)


def rows_to_batch(rows: list[list[tuple]], seq_len: int, device, rng: torch.Generator) -> TrainBatch:
    """Pack samples into rows of seq_len the way the data service does (see datasvc.batch)."""
    B, K = len(rows), max(1, max(len(r) for r in rows))
    tokens = torch.full((B, seq_len), TOKENS.pad, dtype=torch.long)
    labels = torch.full((B, seq_len), IGNORE_INDEX, dtype=torch.long)
    cu = torch.zeros((B, K + 1), dtype=torch.int32)
    grids: list[tuple[int, int, int]] = []
    video_grids: list[tuple[int, int, int]] = []
    for r, samples in enumerate(rows):
        at = 0
        for j, (tk, lb, gr, *vids) in enumerate(samples):
            tokens[r, at:at + len(tk)], labels[r, at:at + len(tk)] = tk, lb
            at += len(tk)
            cu[r, j + 1] = at
            grids += gr
            video_grids += vids[0] if vids else []
        cu[r, len(samples) + 1:] = at
    n_patches = sum(t * h * w for t, h, w in grids)
    # Drawn before the videos' values, so a seed gives the proof the same inputs as in earlier runs.
    pixel_values = torch.randn(n_patches, 1536, generator=rng)
    videos = {}
    if video_grids:
        videos = {"pixel_values_videos": torch.randn(sum(t * h * w for t, h, w in video_grids), 1536, generator=rng),
                  "video_grid_thw": torch.tensor(video_grids, dtype=torch.long).reshape(-1, 3)}
    batch = TrainBatch(
        tokens=tokens, labels=labels, loss_mask=(labels != IGNORE_INDEX).float(), cu_seqlens=cu,
        num_samples=torch.tensor([len(r) for r in rows], dtype=torch.int32), pixel_values=pixel_values,
        image_grid_thw=torch.tensor(grids, dtype=torch.long).reshape(-1, 3),
        sample_keys=[f"synthetic/{r}/{j}" for r, s in enumerate(rows) for j in range(len(s))], **videos)
    return batch.to(device)


class SyntheticRows:
    """Endless packed micro-batches (2-4 image+text samples per row), with the DataClient interface."""

    GRIDS = [(1, 28, 28), (1, 32, 20), (1, 16, 24), (1, 20, 36), (1, 12, 12)]

    def __init__(self, mbs: int, seq_len: int, seed: int = 0):
        self.mbs, self.seq_len, self.seed, self.step = mbs, seq_len, seed, 0

    def __iter__(self):
        return self

    def __next__(self) -> TrainBatch:
        rng = torch.Generator().manual_seed(self.seed * 100003 + self.step)
        self.step += 1
        rows = []
        for _ in range(self.mbs):
            row, used = [], 0
            while True:
                g = self.GRIDS[int(torch.randint(len(self.GRIDS), (1,), generator=rng))]
                s = synthetic_sample(rng, [g], int(torch.randint(20, 80, (1,), generator=rng)),
                                     int(torch.randint(50, 400, (1,), generator=rng)))
                if used + len(s[0]) > self.seq_len:
                    break
                row.append(s)
                used += len(s[0])
            rows.append(row)
        return rows_to_batch(rows, self.seq_len, torch.device("cuda", torch.cuda.current_device()), rng)

    def save_state(self):
        return {"step": self.step}

    def restore_state(self, state):
        self.step = state["step"]


# ------------------------------------------------------------------------------------------------
# Proof 1: packed row == samples alone
# ------------------------------------------------------------------------------------------------
def build_model(num_layers: int, num_experts: int, seq_len: int):
    """One-GPU Qwen3-VL MoE proxy in bf16 (the provider of the real trainer config)."""
    from trainer.megatron.container import build_provider

    _single_process_env()
    cfg = TrainerConfig(model=ModelConfig(num_layers=num_layers, num_experts=num_experts),
                        parallel=ParallelConfig(strategy="3d"), train=TrainConfig(mbs=1, gbs=1, seq_len=seq_len))
    cfg.validate(1)
    provider = build_provider(cfg)
    provider.bf16 = True
    provider.params_dtype = torch.bfloat16
    provider.finalize()
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():  # an earlier model in this process left its groups
        parallel_state.destroy_model_parallel()
    provider.initialize_model_parallel(seed=1234)
    model = provider.provide_distributed_model(wrap_with_ddp=False, bf16=True)[0]
    model.eval()
    return model, provider


def proof_samples(rng: torch.Generator, with_video: bool) -> list[tuple]:
    """Image+text samples (and with ``with_video``, a video with an image, and a video alone)."""
    samples = [
        synthetic_sample(rng, [(1, 28, 28)], 40, 200),  # 196 image tokens
        synthetic_sample(rng, [(1, 16, 24), (1, 12, 12)], 30, 150),  # two images
        synthetic_sample(rng, [], 120, 0),  # text only
        synthetic_sample(rng, [(1, 32, 20)], 25, 300),
    ]
    if with_video:  # 4 temporal groups of 16x16 patches (64 pads each), then 2 groups of 20x12
        samples[1] = synthetic_sample(rng, [(1, 12, 12)], 30, 150, videos=[(4, 16, 16)])
        samples.append(synthetic_sample(rng, [], 20, 120, videos=[(2, 20, 12)]))
    return samples


def _rope(tokens, grid, videos):
    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl.rope import get_rope_index

    pos, _ = get_rope_index(2, TOKENS.image_pad, VIDEO_PAD, TOKENS.vision_start, tokens,
                            image_grid_thw=grid, video_grid_thw=None if videos is None else videos.clone())
    return pos


def _vision_inputs(batch: TrainBatch, grid_at: tuple[int, int], video_at: tuple[int, int], sample: tuple) -> dict:
    """One sample's slice of the batch's images and videos, as model keyword arguments."""
    _, _, grids, videos = sample
    out = {"pixel_values": None, "image_grid_thw": None, "pixel_values_videos": None, "video_grid_thw": None}
    for (g_at, p_at), n, (grid_key, all_grids), (pix_key, all_pixels) in (
            (grid_at, len(grids), ("image_grid_thw", batch.image_grid_thw), ("pixel_values", batch.pixel_values)),
            (video_at, len(videos), ("video_grid_thw", batch.video_grid_thw),
             ("pixel_values_videos", batch.pixel_values_videos))):
        if n:
            grid = all_grids[g_at:g_at + n]
            out[grid_key], out[pix_key] = grid, all_pixels[p_at:p_at + int(grid.prod(-1).sum())]
    return out


@torch.no_grad()
def packed_vs_alone(num_layers: int = 4, num_experts: int = 128, seq_len: int = 2048,
                    atol: float = 0.01, rtol: float = 0.0, with_video: bool = False) -> dict:
    from trainer.megatron.thd import mrope_position_ids, pack_thd, per_sample_losses

    model, provider = build_model(num_layers, num_experts, seq_len)
    device = torch.device("cuda", torch.cuda.current_device())
    rng = torch.Generator().manual_seed(7)
    samples = proof_samples(rng, with_video)
    batch = rows_to_batch([samples], seq_len, device, rng)
    videos = batch.video_grid_thw
    vision = {"pixel_values": batch.pixel_values, "image_grid_thw": batch.image_grid_thw,
              "pixel_values_videos": batch.pixel_values_videos, "video_grid_thw": videos}

    # Packed: one row, THD segments, MRoPE restarted per sample.
    p = pack_thd(batch.tokens, batch.labels, batch.loss_mask, batch.cu_seqlens, batch.num_samples)
    pos = mrope_position_ids(p, provider, batch.image_grid_thw, videos)
    out = model(input_ids=p.tokens, position_ids=pos, attention_mask=None, labels=p.labels,
                loss_mask=p.loss_mask, packed_seq_params=p.params, **vision)
    packed = per_sample_losses(out, p.loss_mask, p.sample_spans)

    # Alone: each sample as its own row, no packing at all (BSHD causal attention).
    alone, grid_at, video_at = [], (0, 0), (0, 0)
    for sample in samples:
        tokens, labels, grids, vids = sample
        mine = _vision_inputs(batch, grid_at, video_at, sample)
        grid_at = (grid_at[0] + len(grids), grid_at[1] + sum(t * h * w for t, h, w in grids))
        video_at = (video_at[0] + len(vids), video_at[1] + sum(t * h * w for t, h, w in vids))
        tk, lb = tokens[None].to(device), labels[None].to(device)
        mask = (lb != IGNORE_INDEX).float()
        lb = torch.where(lb == IGNORE_INDEX, torch.full_like(lb, TOKENS.pad), lb)
        o = model(input_ids=tk, position_ids=_rope(tk, mine["image_grid_thw"], mine["video_grid_thw"]),
                  attention_mask=None, labels=lb, loss_mask=mask, **mine)
        alone += per_sample_losses(o, mask, [(0, tk.shape[1])])

    # Control: the packed row as one sequence (attention crosses samples, positions run on).
    o = model(input_ids=p.tokens, position_ids=_rope(p.tokens, batch.image_grid_thw, videos), attention_mask=None,
              labels=p.labels, loss_mask=p.loss_mask, **vision)
    crossing = per_sample_losses(o, p.loss_mask, p.sample_spans)
    return _judge(packed, alone, crossing, atol, rtol) | {
        "num_layers": num_layers, "num_experts": num_experts, "vision_depth": provider.vision_config.depth,
        "with_video": with_video, "video_grids": [list(v) for s in samples for v in s[3]],
        "sample_tokens": [len(s[0]) for s in samples], "packed_loss": packed, "alone_loss": alone,
        "control_crossing_loss": crossing, "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
    }


def _judge(packed: list[float], alone: list[float], crossing: list[float], atol: float, rtol: float) -> dict:
    """One tolerance for both checks: the packed row must stay inside it for every sample, and the
    control (attention and positions crossing samples) must leave it for at least one sample after
    the first (the first sample sees no other sample in either layout). A control judged against a
    looser bar than the proof could pass the proof's own tolerance and show nothing."""
    tol = [atol + rtol * abs(b) for b in alone]
    diffs = [abs(a - b) for a, b in zip(packed, alone)]
    ok = all(d <= t for d, t in zip(diffs, tol))
    control_diffs = [abs(a - b) for a, b in zip(crossing[1:], alone[1:])]
    control_fails = any(d > t for d, t in zip(control_diffs, tol[1:]))
    return {"proof": "packed_vs_alone", "ok": ok and control_fails, "packed_within_tolerance": ok,
            "control_outside_tolerance": control_fails, "max_abs_diff": max(diffs),
            "tolerance": {"atol": atol, "rtol": rtol}, "control_max_diff": max(control_diffs)}


# ------------------------------------------------------------------------------------------------
# Proof 2: the training loop on synthetic rows
# ------------------------------------------------------------------------------------------------
def train_synthetic(strategy: str, steps: int, mbs: int, seq_len: int, num_layers: int, num_experts: int,
                    metrics_path: str | None, extra: list[str]) -> dict:
    from trainer.config import add_cli_args, from_args
    from trainer.megatron.loop import MegatronRank, train

    _single_process_env()
    args = add_cli_args(argparse.ArgumentParser()).parse_args(
        ["--strategy", strategy, "--mbs", str(mbs), "--gbs", str(mbs), "--seq-len", str(seq_len),
         "--train-iters", str(steps), "--num-layers", str(num_layers), "--num-experts", str(num_experts),
         "--warmup-iters", "2", "--lr", "3e-4", *extra])
    cfg = from_args(args)
    records = train(cfg, SyntheticRows(mbs, seq_len), MegatronRank(metrics_sink=metrics_path))
    losses = [r["loss"] for r in records if r["loss"] is not None]
    window = records[len(records) // 2:] or records
    return {
        "proof": "train_synthetic", "strategy": strategy, "steps": len(records),
        "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
        "ok": bool(losses) and all(map(lambda x: x == x and abs(x) < float("inf"), losses))
        and losses[-1] < losses[0],
        "steady": {k: sum(r[k] for r in window) / len(window)
                   for k in ("step_time_s", "tokens_per_s", "tflops_per_gpu", "data_wait_share",
                             "real_token_fraction", "peak_mem_gib")},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("proof", choices=["packed", "train"])
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--num-experts", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--strategy", choices=["fsdp", "3d"], default="fsdp")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--mbs", type=int, default=1)
    ap.add_argument("--video", action="store_true", help="packed: put video samples (and one video+image) in the row")
    args, extra = ap.parse_known_args(argv)
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    if args.proof == "packed":
        report = packed_vs_alone(args.num_layers, args.num_experts, args.seq_len or 2048, with_video=args.video)
    else:
        metrics = str(out_dir / f"metrics_{args.strategy}.jsonl") if out_dir else None
        report = train_synthetic(args.strategy, args.steps, args.mbs, args.seq_len or 4096, args.num_layers,
                                 args.num_experts, metrics, extra)
    text = json.dumps(report, indent=2)
    print(text)
    if out_dir and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
        (out_dir / f"proof_{args.proof}_{args.strategy if args.proof == 'train' else 'row'}"
                                      f"{'_video' if args.video else ''}.json").write_text(text)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
