"""The Ray-streamed service against the in-process path: ``vlmfeed bench service``.

1..N preprocessing actors on the same synthetic web-photo shards, against the same work (plan,
items, decode, packing) done in this one process.
"""
from __future__ import annotations

import os
import platform
import time

from datasvc.samples import cached_tars
from datasvc.tools.window import steady_window


def service_shards(samples: int, seed: int = 0, samples_per_shard: int = 50) -> list[str]:
    """Synthetic web-photo shards for the service bench (cached)."""
    from datasvc.tools.synth import write_shards

    return cached_tars(f"bench-service-web-photos-{samples}-s{seed}-p{samples_per_shard}", lambda out: write_shards(
        out, samples, profile="web-photos", seed=seed, samples_per_shard=samples_per_shard, progress=False))


def _service_config(shards, actors: int, seq_len: int, max_pixels: int, samples_per_item: int, epochs: int = 1):
    from datasvc.config import DecodeConfig, PoolConfig, ServiceConfig

    return ServiceConfig(shards=tuple(shards), seq_len=seq_len, micro_batch_size=1, epochs=epochs, seed=0,
                         samples_per_item=samples_per_item, items_per_block=2, prefetch=2,
                         decode=DecodeConfig(device="cpu", threads=1), pipeline_options={"max_pixels": max_pixels},
                         pool=PoolConfig(min_actors=actors, max_actors=actors, autoscale_interval_s=3600.0,
                                         max_batches_ahead=8))


def run_in_process(cfg) -> dict:
    """The same work as the service, in this one process: each rank's ``BlockProducer`` (the
    feeder's own plan, items, packing and chains) with the actors' ``ItemProcessor`` inline."""
    from datasvc.stream.process import ItemProcessor
    from datasvc.stream.producer import BlockProducer

    processor = ItemProcessor(cfg)
    producers = [BlockProducer(cfg, rank, process=processor) for rank in range(cfg.dp_size)]
    samples = batches = 0
    t0 = time.perf_counter()
    for producer in producers:
        for batch, _pos in producer.micro_batches():
            batches += 1
            samples += len(batch.sample_keys)
    secs = time.perf_counter() - t0
    images = sum(p.stats().stream.images for p in producers)
    mp = sum(p.stats().stream.megapixels for p in producers)
    return {"seconds": round(secs, 3), "samples": samples, "images": images, "megapixels": round(mp, 2),
            "micro_batches": batches, "samples_per_s": round(samples / secs, 2),
            "images_per_s": round(images / secs, 2), "mp_per_s": round(mp / secs, 2)}


def warm_up(cfg) -> None:
    """One work item through the actors' work (imports, DALI, tokenizer, page cache), untimed."""
    from datasvc.pack.epoch import EpochPlan
    from datasvc.stream.process import ItemProcessor

    ItemProcessor(cfg)(EpochPlan(cfg).items(0, 0)[0])


def run_service(cfg, run: str) -> dict:
    """Drain the configured epochs through Ray; rates over the whole run and over the steady-state
    window (``datasvc.tools.window``: from the second block's first micro-batch on)."""
    from datasvc.service.client import DataService
    from datasvc.service.feeder import EndOfData

    t_start = time.perf_counter()
    svc = DataService(cfg, run=run)
    try:
        client = svc.client(0, output="numpy")
        blocks: list[tuple[tuple, float, int]] = []  # (position of the block, first arrival, samples)
        batches = 0
        while True:
            try:
                b = next(client)
            except EndOfData:
                break
            now = time.perf_counter()
            batches += 1
            pos = client.last_position
            key = (pos["epoch"], pos["block"])
            if not blocks or blocks[-1][0] != key:
                blocks.append((key, now, 0))
            blocks[-1] = (key, blocks[-1][1], blocks[-1][2] + len(b.sample_keys))
        t_end = time.perf_counter()
        stats = svc.stats().ranks[0].as_dict()
    finally:
        svc.shutdown()
    return _service_report(blocks, batches, t_start, t_end, stats)


def _service_report(blocks: list[tuple[tuple, float, int]], batches: int, t_start: float, t_end: float,
                    stats: dict) -> dict:
    total = t_end - t_start
    samples = sum(n for _, _, n in blocks)
    images, mp = stats["images"], stats["megapixels"]
    window = steady_window(len(blocks), ended=True)
    if window is not None:
        steady_s = blocks[window.closes][1] - blocks[window.opens][1]
        steady_samples = sum(blocks[i][2] for i in window.produced)
    else:  # too few blocks for a steady state: the whole run
        steady_s, steady_samples = total, samples
    frac = steady_samples / max(1, samples)
    return {"seconds": round(total, 3), "startup_s": round(blocks[0][1] - t_start, 3) if blocks else None,
            "samples": samples, "images": images, "megapixels": round(mp, 2),
            "micro_batches": batches, "blocks": len(blocks), "samples_per_s": round(samples / total, 2), "images_per_s": round(images / total, 2),
            "mp_per_s": round(mp / total, 2), "steady_window_s": round(steady_s, 3),
            "steady_window_samples": steady_samples, "steady_window_blocks": len(window.produced) if window else 0,
            "steady_samples_per_s": round(steady_samples / max(1e-9, steady_s), 2),
            "steady_images_per_s": round(images * frac / max(1e-9, steady_s), 2),
            "steady_mp_per_s": round(mp * frac / max(1e-9, steady_s), 2),
            "consumer_wait_s": stats["consumer_wait_s"], "producer_blocked_s": stats["producer_blocked_s"],
            "stages": stats["stages"], "accounting": stats["accounting"],
            "packing_efficiency": stats["packing_efficiency"]}


def bench_service(max_actors: int | None = None, samples: int = 200, seq_len: int = 4096,
                  max_pixels: int = 16777216, samples_per_item: int = 8, shards: list[str] | None = None,
                  epochs: int = 2) -> dict:
    import ray

    from datasvc.service.cluster import connect

    cpus = os.cpu_count() or 1
    max_actors = max_actors or cpus
    shards = shards or service_shards(samples)
    counts = []
    n = 1
    while n < max_actors:
        counts.append(n)
        n *= 2
    counts.append(max_actors)
    cfg1 = _service_config(shards, 1, seq_len, max_pixels, samples_per_item)
    warm_up(cfg1)
    in_proc = run_in_process(cfg1)
    started_ray = not ray.is_initialized()
    connect(num_cpus=cpus, object_store_memory=512 * 1024 * 1024)
    by_actors = {}
    try:
        for n in counts:
            by_actors[str(n)] = run_service(_service_config(shards, n, seq_len, max_pixels, samples_per_item, epochs),
                                            run=f"bench{n}-{os.getpid()}")
    finally:
        if started_ray:
            ray.shutdown()
    r1 = by_actors["1"]["steady_samples_per_s"]
    for n, r in by_actors.items():
        r["scaling_efficiency"] = round(r["steady_samples_per_s"] / max(1e-9, int(n) * r1), 3)
    return {
        "kind": "service",
        "machine": {"platform": platform.platform(), "cpus": cpus, "load_avg_at_start": list(os.getloadavg())},
        "shards": {"count": len(shards), "samples": samples, "profile": "web-photos", "paths": shards},
        "config": {"epochs_streamed": epochs, "steady_state": "from the second block's first micro-batch to the last block's",
                   "seq_len": seq_len, "micro_batch_size": 1, "max_pixels": max_pixels,
                   "samples_per_item": samples_per_item, "decode": "cpu", "decode_threads": 1},
        "in_process": in_proc,
        "ray": by_actors,
        "ray_vs_in_process_1_actor": round(r1 / max(1e-9, in_proc["samples_per_s"]), 3),
        "ray_vs_in_process_1_actor_total": round(by_actors["1"]["samples_per_s"] / max(1e-9, in_proc["samples_per_s"]), 3),
        "goal_ray_vs_in_process": 0.9,
    }


def print_service(rep: dict) -> None:
    ip = rep["in_process"]
    print(f"\n{rep['shards']['samples']} synthetic web-photo samples ({rep['config']['epochs_streamed']} epochs "
          f"streamed; steady state {rep['config']['steady_state']}), {rep['machine']['cpus']} CPUs, "
          f"seq_len {rep['config']['seq_len']}, max_pixels {rep['config']['max_pixels']}")
    print(f"{'path':16} {'samples/s':>10} {'images/s':>9} {'MP/s':>7} {'total s':>8} {'startup s':>10} "
          f"{'scaling':>8} {'wait s':>7}")
    print(f"{'in-process':16} {ip['samples_per_s']:10.2f} {ip['images_per_s']:9.2f} {ip['mp_per_s']:7.2f} "
          f"{ip['seconds']:8.2f} {'-':>10} {'-':>8} {'-':>7}")
    for n, r in rep["ray"].items():
        print(f"{'ray ' + n + ' actor(s)':16} {r['steady_samples_per_s']:10.2f} {r['steady_images_per_s']:9.2f} "
              f"{r['steady_mp_per_s']:7.2f} {r['seconds']:8.2f} {r['startup_s']:10.2f} "
              f"{r['scaling_efficiency']:8.3f} {r['consumer_wait_s']:7.2f}")
    print(f"ray (1 actor, steady state) / in-process: {rep['ray_vs_in_process_1_actor']:.3f} "
          f"(goal >= {rep['goal_ray_vs_in_process']}); including actor startup: "
          f"{rep['ray_vs_in_process_1_actor_total']:.3f}")
