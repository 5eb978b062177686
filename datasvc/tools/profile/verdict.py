"""Demand and verdict: does the data path keep one DP rank of a trainer fed, and with how much?

``Demand``: ``step_time_s`` is the trainer's time for ``grad_accum`` micro-batches of one
data-parallel rank (one value, or one per MBS); a model instead estimates it: FLOPs of the
micro-batches actually produced (the pipeline's ``flops_model``: padding included in the linear
layers, per-sample attention, the vision tower on the real patches) over ``gpus/dp x peak x MFU``;
``dp`` defaults to ``gpus`` (FSDP: every GPU is a DP rank, as in the published Qwen3-VL FSDP numbers).

Per MBS the verdict says whether the measured micro-batches/s of one DP rank's service reach that
demand, with how many actors (measured, else extrapolated from one actor's stage-timer capacity),
and names the bottleneck: the stage using the largest part of its component's capacity (actor
stages divided over the actors; pack in the one feeder; transfer in the one client thread). If
pack or transfer alone caps below the demand, the verdict says more actors will not help.

A video-heavy mix (at least ``VIDEO_HEAVY`` of the vision tokens, or of the decode and preprocess
time, from video) gets a ``video`` entry: the cost per decoded frame, whether video decode or video
resize is the bound stage, and what lowers it (NVDEC, fewer frames a second, fewer pixels a frame).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from datasvc.stats import STAGES
from datasvc.tools.profile.measure import ACTOR_STAGES


@dataclass
class Demand:
    """What a trainer consumes. Either ``step_time_s`` (per ``grad_accum`` micro-batches of one DP
    rank), or a model with GPUs, peak TFLOP/s and MFU (``dp`` data-parallel ranks share ``gpus``)."""

    step_time_s: list[float] | None = None
    grad_accum: int = 1
    model: object | None = None  # a pipeline's flops_model (registry.pipeline_module(name).flops_model)
    gpus: int = 8
    dp: int | None = None
    peak_tflops: float = 989.0
    mfu: float = 0.4

    def describe(self) -> dict:
        if self.step_time_s is not None:
            return {"kind": "step_time", "step_time_s": self.step_time_s, "grad_accum": self.grad_accum}
        if self.model is not None:
            return {"kind": "model", "model": self.model.to_dict(), "gpus": self.gpus, "dp": self.dp or self.gpus,
                    "peak_tflops": self.peak_tflops, "mfu": self.mfu,
                    "active_params": self.model.active_params_with_embedding,
                    "total_params": self.model.total_params}
        return {"kind": "none"}

    def mb_per_s(self, mbs_index: int, flops_per_mb: float | None) -> float | None:
        """Micro-batches per second one DP rank's trainer consumes."""
        if self.step_time_s is not None:
            st = self.step_time_s[mbs_index] if len(self.step_time_s) > 1 else self.step_time_s[0]
            return self.grad_accum / st
        if self.model is not None and flops_per_mb:
            dp = self.dp or self.gpus
            gpus_per_replica = self.gpus / dp
            return gpus_per_replica * self.peak_tflops * 1e12 * self.mfu / flops_per_mb
        return None


def bottleneck(run: dict) -> tuple[str, float]:
    """The stage that uses the largest part of its component's capacity: actor stages are spread
    over ``actors`` processes, pack runs in the one feeder, transfer in the one client thread."""
    best, load = "decode", -1.0
    nb = max(1, run["micro_batches"])
    for s in STAGES:
        par = run["actors"] if s in ACTOR_STAGES else 1
        per_mb = run["stages"][s]["seconds"] / nb / par
        if per_mb > load:
            best, load = s, per_mb
    return best, load


VIDEO_HEAVY = 0.5
"""Share of vision tokens, or of decode + preprocess time, from video past which a mix is video-heavy."""
_GPU_ONLY = ("video_codec_needs_gpu",)


def video_verdict(run: dict, bound: str) -> dict | None:
    """What the verdict says of video for one run whose bottleneck is ``bound``; None when the run
    has no video or the mix is not video-heavy."""
    vid = run.get("video")
    if not vid:
        return None
    shares = [vid.get("video_token_share"), vid.get("decode_time_share"), vid.get("preprocess_time_share")]
    if max((x for x in shares if x is not None), default=0.0) < VIDEO_HEAVY:
        return None
    decode_bound = bound == "decode" and (vid.get("decode_time_share") or 0) >= VIDEO_HEAVY
    resize_bound = bound == "preprocess" and (vid.get("preprocess_time_share") or 0) >= VIDEO_HEAVY
    stage = "video decode" if decode_bound else "video resize" if resize_bound else None
    fixes = []
    if decode_bound and run.get("decode") != "gpu":
        fixes.append("decode video on the GPU (--decode gpu: NVDEC takes H.264, HEVC, VP8, VP9, AV1)")
    if decode_bound or resize_bound:
        fixes.append("sample fewer frames a second (--video-fps below the pipeline's)")
        fixes.append("lower the video pixel cap (--video-max-pixels)")
    needs_gpu = sum(run.get("rejected", {}).get(r, 0) for r in _GPU_ONLY)
    if needs_gpu:
        fixes.append(f"{needs_gpu} sample(s) were rejected video_codec_needs_gpu: neither DALI's CPU decoder nor "
                     "this FFmpeg build decodes their codec; --decode gpu (NVDEC) may")
    token_share = vid.get("video_token_share") or 0.0
    text = (f"video-heavy ({100 * token_share:.0f}% of vision tokens from video, "
            f"{_ms(vid.get('decode_ms_per_frame'))} ms decode + {_ms(vid.get('preprocess_ms_per_frame'))} ms resize "
            f"per frame, {vid.get('video_vision_tokens_per_s') or 0:.0f} video tokens/s)")
    if stage:
        text += f"; {stage} is the bound stage"
    if fixes:
        text += ": " + "; ".join(fixes)
    return {"video_token_share": token_share, "bound_stage": stage, "fixes": fixes, "summary": text}


def _ms(v) -> str:
    return "?" if v is None else f"{v:.2f}"


def verdict(runs: list[dict], demand_mb_s: float | None, mbs: int) -> dict:
    """Does the data path keep one DP rank of the trainer fed at this MBS, and with how much?"""
    mine = sorted((r for r in runs if r["micro_batch_size"] == mbs), key=lambda r: r["actors"])
    if not mine:
        raise ValueError(f"no runs for micro_batch_size {mbs}")
    best = max(mine, key=lambda r: r["rates"]["micro_batches_per_s"])
    name, _ = bottleneck(best)
    v = {"micro_batch_size": mbs, "demand_micro_batches_per_s": demand_mb_s,
         "supply_micro_batches_per_s": {r["actors"]: r["rates"]["micro_batches_per_s"] for r in mine},
         "bottleneck": name}
    if demand_mb_s is None:
        v.update(keeps_up=None, summary=f"MBS {mbs}: no demand given; bottleneck {name}")
        return _with_video(v, best, name)
    _judge(v, mine, best, name, demand_mb_s, mbs)
    return _with_video(v, best, v["bottleneck"])


def _with_video(v: dict, best: dict, bound: str) -> dict:
    video = video_verdict(best, bound)
    if video is not None:
        v["video"] = video
        v["summary"] += "; " + video["summary"]
    return v


def _judge(v: dict, mine: list[dict], best: dict, name: str, demand_mb_s: float, mbs: int) -> None:
    """Whether the runs of one MBS keep up with ``demand_mb_s``, and with how many actors (into ``v``)."""
    ok = [r for r in mine if r["rates"]["micro_batches_per_s"] >= demand_mb_s]
    # Extrapolated actors: one actor's capacity from its stage timers (samples/s), in micro-batches.
    spm = np.mean([r["samples_per_micro_batch"] for r in mine]) or 1.0
    per_actor = [r["actor_samples_per_s"] / spm for r in mine if r.get("actor_samples_per_s")]
    per_actor_mb_s = float(np.median(per_actor)) if per_actor else None
    caps = {s: best.get(f"{s}_micro_batches_per_s") for s in ("pack", "transfer")}
    threads = best["decode_threads"]
    if per_actor_mb_s:
        need = max(1, math.ceil(demand_mb_s / per_actor_mb_s))
        if not ok:  # the measured pools fell short, whatever the stage timers say
            need = max(need, max(r["actors"] for r in mine) + 1)
    else:
        need = None
    v["actor_micro_batches_per_s"] = per_actor_mb_s
    v["actors_needed_estimate"] = demand_mb_s / per_actor_mb_s if per_actor_mb_s else None
    v["actors_needed"] = ok[0]["actors"] if ok else need
    v["cores_needed"] = (v["actors_needed"] * threads) if v["actors_needed"] else None
    v["headroom"] = best["rates"]["micro_batches_per_s"] / demand_mb_s if demand_mb_s else None
    limited = [s for s, c in caps.items() if c is not None and c < demand_mb_s]
    if ok:
        v["keeps_up"] = True
        v["summary"] = (f"MBS {mbs}: keeps up with {ok[0]['actors']} actor(s) ({ok[0]['actors'] * threads} cores) "
                        f"per DP rank: supplies {ok[0]['rates']['micro_batches_per_s']:.2f} micro-batches/s vs "
                        f"{demand_mb_s:.3g} needed"
                        + (f" (~{v['actors_needed_estimate']:.2f} actor's worth)" if v["actors_needed_estimate"] else "")
                        + f"; bottleneck {name}")
    else:
        v["keeps_up"] = False
        if limited:
            v["bottleneck"] = limited[0]
            v["actors_needed"] = None
            v["cores_needed"] = None
            v["summary"] = (f"MBS {mbs}: does NOT keep up ({best['rates']['micro_batches_per_s']:.2f} vs "
                            f"{demand_mb_s:.3g} micro-batches/s); {limited[0]} in one process caps it at "
                            f"{caps[limited[0]]:.2f}/s, more actors will not help")
        else:
            v["summary"] = (f"MBS {mbs}: does NOT keep up ({best['rates']['micro_batches_per_s']:.2f} vs "
                            f"{demand_mb_s:.3g} micro-batches/s with {best['actors']} actor(s)); needs about "
                            f"{need} actors ({need * threads if need else '?'} cores) per DP rank; bottleneck {name}")


def verdicts(runs: list[dict], mbs_list: list[int], demand: Demand) -> list[dict]:
    """One verdict per MBS, against the demand at the FLOPs of that MBS's measured micro-batches."""
    out = []
    for i, mbs in enumerate(mbs_list):
        flops = [r["flops_per_micro_batch"] for r in runs if r["micro_batch_size"] == mbs and "flops_per_micro_batch" in r]
        out.append(verdict(runs, demand.mb_per_s(i, float(np.mean(flops)) if flops else None), mbs))
    return out
