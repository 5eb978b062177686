"""Measuring the data service at one setting (micro-batch size, actors) for one DP rank.

The service runs for real (Ray feeder, preprocessing actors, client; no trainer) and the client
consumes micro-batches as fast as it can. Measurement window: ``datasvc.tools.window`` (the first
block, with actor start-up, is left out; the window holds whole blocks). The stream repeats the
shards (``epochs=None``) until ``samples`` or ``seconds`` is reached.

Stage shares come from the feeder's per-stage timers (read, decode, preprocess, tokenize run in
the actors; pack in the feeder; transfer in the client), differenced over the window. CPU use is
measured with psutil on this driver's process tree (the local Ray cluster's processes) and on
the whole machine; the actors' CPU seconds per sample give a contention-free cost.
"""
from __future__ import annotations

import os
import sys
import time
import uuid
from dataclasses import dataclass, field

import numpy as np

from datasvc.batch import grid_patches
from datasvc.media.video import VIDEO_STAGES
from datasvc.pack.balance import shape_of
from datasvc.stats import STAGES
from datasvc.tools.window import steady_window, window_is_full

ACTOR_STAGES = tuple(s for s in STAGES if s not in ("pack", "transfer"))
"""Stages that run in the preprocessing actors (pack runs in the feeder, transfer in the client)."""


@dataclass
class _Tally:
    samples: int = 0
    batches: int = 0
    images: int = 0
    megapixels: float = 0.0
    videos: int = 0
    video_tokens: int = 0
    text_tokens: int = 0
    vision_tokens: int = 0
    real_tokens: int = 0
    row_tokens: int = 0
    flops: float = 0.0
    flops_text: float = 0.0
    flops_vision: float = 0.0

    def add(self, other: "_Tally") -> None:
        for k in self.__dataclass_fields__:
            setattr(self, k, getattr(self, k) + getattr(other, k))


def batch_flops(model, batch) -> dict:
    """Training FLOPs of one ``PackedBatch`` under ``model`` (a pipeline's ``flops_model``): linear
    layers over every row slot, padding included; attention within each sample; the vision tower
    on each image's patches."""
    grids = np.asarray(batch.image_grid_thw).reshape(-1, 3)
    lengths = [end - start for _row, start, end in batch.sample_spans()]
    return model.batch_flops(int(batch.tokens.size), lengths, grids.prod(axis=1) if len(grids) else np.zeros(0))


def _tally_batch(batch, spec, model=None) -> _Tally:
    grids = np.asarray(batch.image_grid_thw).reshape(-1, 3)
    patches = int(grids.prod(axis=1).sum()) if len(grids) else 0
    video_tokens = grid_patches(batch.video_grid_thw) // spec.merge_size**2
    vt = patches // spec.merge_size**2 + video_tokens
    real = batch.real_tokens
    t = _Tally(samples=len(batch.sample_keys), batches=1, images=len(grids),
               megapixels=patches * spec.patch_size**2 / 1e6, text_tokens=real - vt, vision_tokens=vt,
               real_tokens=real, row_tokens=int(batch.tokens.size), videos=len(batch.video_grid_thw),
               video_tokens=video_tokens)
    if model is not None:
        f = batch_flops(model, batch)
        t.flops, t.flops_text, t.flops_vision = f["total"], f["text"], f["vision"]
    return t


class _CpuMeter:
    """CPU seconds of this driver's process tree (the local Ray cluster) and of the machine."""

    def __init__(self, actor_pids: list[int]):
        import psutil

        self.psutil = psutil
        self.actor_pids = actor_pids
        self.t0 = time.perf_counter()
        self.sys0 = psutil.cpu_times()
        self.tree0 = self._tree()

    def _tree(self) -> dict[int, float]:
        out = {}
        try:
            me = self.psutil.Process(os.getpid())
            procs = [me] + me.children(recursive=True)
        except self.psutil.Error:
            return out
        for p in procs:
            try:
                c = p.cpu_times()
                out[p.pid] = c.user + c.system
            except self.psutil.Error:
                pass
        return out

    def read(self) -> dict:
        wall = max(1e-9, time.perf_counter() - self.t0)
        sys1 = self.psutil.cpu_times()
        tree1 = self._tree()
        busy = lambda c: c.user + c.system + getattr(c, "nice", 0) + getattr(c, "irq", 0) + getattr(c, "softirq", 0)  # noqa: E731
        tree = sum(v - self.tree0.get(pid, 0.0) for pid, v in tree1.items())
        actors = sum(tree1.get(pid, 0.0) - self.tree0.get(pid, 0.0) for pid in self.actor_pids if pid in tree1)
        return {"wall_s": wall, "service_cpu_s": tree, "actor_cpu_s": actors,
                "service_cores_busy": tree / wall, "machine_cores_busy": (busy(sys1) - busy(self.sys0)) / wall,
                "machine_cores": self.psutil.cpu_count()}


def _video_report(tally: _Tally, video_stages: dict, stages: dict | None = None, wall: float | None = None) -> dict:
    """What the videos cost: decode and resize time per decoded frame (the actors' ``VIDEO_STAGES``
    timers), video vision tokens a second of the window, their share of the vision tokens, and the
    share of the actors' decode and preprocess time that went to video (``stages``: all stages)."""
    dec, prep = (video_stages[s] for s in VIDEO_STAGES)
    per_frame = lambda st: 1e3 * st["seconds"] / st["count"] if st["count"] else None  # noqa: E731
    out = {"videos": tally.videos, "video_tokens": tally.video_tokens, "frames_decoded": dec["count"],
           "decode_ms_per_frame": per_frame(dec), "preprocess_ms_per_frame": per_frame(prep),
           "decode_frames_per_s": dec["count"] / dec["seconds"] if dec["seconds"] else None,
           "video_token_share": tally.video_tokens / tally.vision_tokens if tally.vision_tokens else None}
    if wall:
        out["video_vision_tokens_per_s"] = tally.video_tokens / wall
    if stages:
        for name, st in zip(("decode", "preprocess"), (dec, prep)):
            total = stages.get(name, {}).get("seconds", 0.0)
            out[f"{name}_time_share"] = min(1.0, st["seconds"] / total) if total else None
    return out


def _stage_diff(a: dict, b: dict, names: tuple = STAGES) -> dict:
    out = {}
    for s in names:
        sa, sb = a.get(s, {}), b.get(s, {})
        out[s] = {"seconds": max(0.0, sb.get("seconds", 0.0) - sa.get("seconds", 0.0)),
                  "count": sb.get("count", 0) - sa.get("count", 0)}
    return out


@dataclass
class _Block:
    """A block as the client saw it: when its first micro-batch arrived, and the feeder's stage
    timers, the client's transfer time and the CPU meter at that moment."""

    key: tuple
    t: float
    stats: dict | None
    transfer_s: float
    cpu: dict | None
    tally: _Tally = field(default_factory=_Tally)
    shapes: list = field(default_factory=list)  # balance.MicroBatchShape of each micro-batch


def _consume(client, feeder, spec, model, samples: int | None, seconds: float | None, timeout_s: float, bar):
    """Micro-batches until the window holds ``samples`` or ``seconds`` (or the stream ends, or
    ``timeout_s`` passes): (blocks seen, whether the stream ended, the CPU meter)."""
    import ray

    from datasvc.service.feeder import EndOfData

    blocks: list[_Block] = []
    cpu: _CpuMeter | None = None
    t_begin = time.perf_counter()
    while True:
        try:
            batch = next(client)
        except EndOfData:
            return blocks, True, cpu
        now = time.perf_counter()
        pos = client.last_position
        key = (pos["epoch"], pos["block"])
        if not blocks or blocks[-1].key != key:
            stats = ray.get(feeder.stats.remote()).as_dict() if blocks else None
            blocks.append(_Block(key, now, stats, client.transfer_s, cpu.read() if cpu else None))
            if len(blocks) == 2:  # the window opens at the second block's first micro-batch
                cpu = _CpuMeter([ray.get(a.pid.remote()) for a in ray.get(feeder.actor_handles.remote())])
            done = sum(b.tally.samples for b in blocks[2:-1])  # blocks 2 .. len-2 are complete
            elapsed = blocks[-2].t - blocks[1].t if len(blocks) >= 3 else 0.0
            if window_is_full(len(blocks), done, elapsed, samples, seconds) or now - t_begin > timeout_s:
                return blocks, False, cpu
        t = _tally_batch(batch, spec, model)
        blocks[-1].shapes.append(shape_of(batch))
        blocks[-1].tally.add(t)
        if len(blocks) >= 3:
            bar.update(t.samples)


def measure(cfg, *, samples: int | None = None, seconds: float | None = None, model=None,
            progress: bool = True, desc: str = "", run: str | None = None, timeout_s: float | None = None) -> dict:
    """Run the data service for ``cfg`` (one DP rank) and measure it over whole blocks."""
    import ray
    from tqdm import tqdm

    from datasvc.service.client import DataService

    spec = cfg.model_layout().vision
    run = run or f"profile-{uuid.uuid4().hex[:8]}"
    svc = DataService(cfg, run=run)
    client = svc.client(0, output="numpy")
    feeder = svc.feeders[0]
    target = samples if samples is not None else (None if seconds is not None else 256)
    bar = tqdm(total=target, unit="sample", desc=desc or run, disable=not progress, file=sys.stderr, leave=False)
    t_begin = time.perf_counter()
    try:
        blocks, ended, cpu = _consume(client, feeder, spec, model, target, seconds,
                                      timeout_s or max(900.0, 3 * (seconds or 0)), bar)
    finally:
        bar.close()
        end_stats = ray.get(feeder.stats.remote()).as_dict()
        end_transfer = client.transfer_s
        client.close()
        svc.shutdown()
    window = steady_window(len(blocks), ended)
    if window is None:  # too few blocks: the whole run from the first micro-batch (biased by start-up)
        measured = blocks
        t0, t1 = (blocks[0].t if blocks else t_begin), time.perf_counter()
        s0, s1, transfer = {"stages": {}}, end_stats, end_transfer
        cpu_report = cpu.read() if cpu is not None else None
    else:
        opens, closes = blocks[window.opens], blocks[window.closes]
        measured = [blocks[i] for i in window.produced]
        t0, t1 = opens.t, closes.t
        s0, s1, transfer = opens.stats, closes.stats, closes.transfer_s - opens.transfer_s
        cpu_report = closes.cpu
    tally = _Tally()
    for b in measured:
        tally.add(b.tally)
    stages = _stage_diff(s0.get("stages", {}), s1.get("stages", {}))
    stages["transfer"] = {"seconds": max(0.0, transfer), "count": tally.batches}
    out = _run_report(cfg, tally, stages, max(1e-9, t1 - t0), cpu_report, end_stats["accounting"], model)
    if tally.videos:
        out["video"] = _video_report(tally, _stage_diff(s0.get("stages", {}), s1.get("stages", {}), VIDEO_STAGES),
                                     stages, max(1e-9, t1 - t0))
    out.update(short_run=window is None, blocks_measured=len(measured))
    out["micro_batch_shapes"] = [s for b in measured for s in b.shapes]  # for the straggler prediction
    return out


def _run_report(cfg, tally: _Tally, stages: dict, wall: float, cpu_report: dict | None, acct: dict, model) -> dict:
    total_stage_s = sum(v["seconds"] for v in stages.values()) or 1e-9
    for v in stages.values():
        v["share"] = v["seconds"] / total_stage_s
    rejected = dict(acct.get("quarantined", {}))
    for k, v in acct.get("skipped_by_rule", {}).items():
        rejected[k] = rejected.get(k, 0) + v
    n, nb = max(1, tally.samples), max(1, tally.batches)
    content = {"images": tally.images, "megapixels": tally.megapixels, "text_tokens": tally.text_tokens,
               "vision_tokens": tally.vision_tokens}
    dp_s = stages["decode"]["seconds"] + stages["preprocess"]["seconds"]
    actor_s = sum(stages[s]["seconds"] for s in ACTOR_STAGES)
    per = lambda amount, seconds: amount / seconds if seconds else None  # noqa: E731
    out = {
        "micro_batch_size": cfg.micro_batch_size, "actors": cfg.pool.min_actors, "decode_threads": cfg.decode.threads,
        "decode": cfg.decode.device,
        "window_s": wall, "samples": tally.samples, "micro_batches": tally.batches, **content,
        "rates": {f"{k}_per_s": v / wall for k, v in
                  {"samples": tally.samples, **content, "micro_batches": tally.batches}.items()},
        "per_sample": {k: v / n for k, v in content.items()},
        "samples_per_micro_batch": tally.samples / nb,
        "packing_efficiency": tally.real_tokens / max(1, tally.row_tokens),
        "stages": stages,
        "decode_preprocess": {"seconds": dp_s, "megapixels_per_s": per(tally.megapixels, dp_s),
                              "images_per_s": per(tally.images, dp_s), "samples_per_s": per(tally.samples, dp_s)},
        # One actor's capacity from its stage timers (read + decode + preprocess + tokenize).
        "actor_samples_per_s": per(tally.samples, actor_s),
        "pack_micro_batches_per_s": per(tally.batches, stages["pack"]["seconds"]),
        "transfer_micro_batches_per_s": per(tally.batches, stages["transfer"]["seconds"]),
        "cpu": dict(cpu_report or {}), "rejected": rejected, "accounting": acct,
    }
    if cpu_report and tally.samples:
        out["cpu"]["actor_cpu_ms_per_sample"] = 1e3 * cpu_report["actor_cpu_s"] / tally.samples
        if tally.megapixels:
            out["cpu"]["actor_cpu_ms_per_megapixel"] = 1e3 * cpu_report["actor_cpu_s"] / tally.megapixels
    if model is not None and tally.batches:
        out["flops_per_micro_batch"] = tally.flops / nb
        out["flops_vision_fraction"] = tally.flops_vision / max(1e-9, tally.flops)
    return out
