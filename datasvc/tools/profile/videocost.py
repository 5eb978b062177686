"""What videos cost, measured in this process: decode + resize CPU time per sampled frame and exact
video vision tokens, per source, with ratios against the first; the video companion of
``cost.image_cost``, used by ``vlmfeed profile compare`` when a source holds video.

Why in-process CPU time: on a shared machine the service's wall-clock timers move by tens of
percent between rounds, process CPU time (DALI's threads included) barely does; sources are
interleaved each round and each video keeps its cheapest round.
"""
from __future__ import annotations

import math
import time

from datasvc.tools.profile.report import cost_table


def _plans(shards: list[str], vision, spec) -> tuple[list, int, int]:
    """Every video's plan (frames, size, grid from its container), how many videos were rejected,
    and how many samples were read."""
    from datasvc.media.video import plan_video
    from datasvc.media.vision import ImageRejected
    from datasvc.read.shards import ReadLimits, expand_shards, index_shard, read_samples

    plans, rejected, samples = [], 0, 0
    for path in expand_shards(list(shards)):
        for raw in read_samples(path, list(index_shard(path).samples), ReadLimits()):
            samples += 1
            for _ext, data in raw.videos:
                try:
                    plans.append(plan_video(data, vision, spec))
                except ImageRejected:
                    rejected += 1
    return plans, rejected, samples


def video_cost(sources: dict[str, list[str]], pipeline: str = "qwen3vl", pipeline_options: dict | None = None,
               decode: str = "cpu", threads: int = 1, repeat: int = 3) -> dict:
    """Per source: videos, sampled frames, vision tokens per video, CPU ms per sampled frame
    (decode + resize to pixel rows, as the actors do) and video tokens per CPU-second; {} when no
    source holds a video. Videos the decoder here cannot take (``video_codec_needs_gpu``) count
    as ``undecoded`` and are left out of the cost."""
    from datasvc.media.videodecode import VideoDecoder
    from datasvc.media.vision import ImageRejected
    from datasvc.registry import get_pipeline

    pipe = get_pipeline(pipeline, **(pipeline_options or {}))
    vision, spec = pipe.vision, pipe.video
    found = {name: _plans(shards, vision, spec) for name, shards in sources.items()}
    if spec is None or not any(plans for plans, _r, _s in found.values()):
        return {}
    decoder = VideoDecoder(device_id=None if decode == "cpu" else 0, num_threads=threads, max_batch=1)
    live = {n: [p for p in plans if decoder.route(p.header)] for n, (plans, _r, _s) in found.items()}
    best = {n: [math.inf] * len(ps) for n, ps in live.items()}
    for _ in range(max(1, repeat)):
        for name, plans in live.items():
            for i, plan in enumerate(plans):
                t0 = time.process_time()
                (rows,) = decoder.to_pixel_rows([plan], vision)
                best[name][i] = min(best[name][i], time.process_time() - t0)
                if isinstance(rows, ImageRejected):
                    best[name][i] = math.nan
    out = {}
    for name, plans in live.items():
        ok = [(p, t) for p, t in zip(plans, best[name]) if not math.isnan(t)]
        frames = sum(len(p.indices) for p, _t in ok)
        tokens = sum(math.prod(p.grid) // vision.merge_size**2 for p, _t in ok)
        cpu = sum(t for _p, t in ok)
        all_plans, rejected, samples = found[name]
        out[name] = {"samples": samples, "videos": len(ok), "rejected_videos": rejected,
                     "undecoded_videos": len(all_plans) - len(ok), "sampled_frames": frames, "cpu_s": cpu,
                     "vision_tokens_per_video": tokens / len(ok) if ok else None,
                     "cpu_ms_per_frame": 1e3 * cpu / frames if frames else None,
                     "video_tokens_per_cpu_s": tokens / cpu if cpu > 0 else None}
    first = next(iter(out))
    for o in out.values():
        o["ratio"] = {k: (o[k] / out[first][k] if o.get(k) and out[first].get(k) else None)
                      for k in ("vision_tokens_per_video", "cpu_ms_per_frame", "video_tokens_per_cpu_s")}
    return out


def video_cost_table(cost: dict) -> str:
    return cost_table(cost, "in-process video, CPU", [
        ("videos", "videos", "{:.0f}"), ("sampled frames", "sampled_frames", "{:.0f}"),
        ("vision tokens/video", "vision_tokens_per_video", "{:.1f}"),
        ("dec+resize CPU ms/frame", "cpu_ms_per_frame", "{:.2f}"),
        ("video tokens per CPU-s", "video_tokens_per_cpu_s", "{:.0f}")])