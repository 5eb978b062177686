"""How close block sizing's tokens-per-sample estimate comes, per probe size: ``vlmfeed bench sizing``.

``plan.size_blocks`` reads a probe of the shards; this measures how far its estimate strays from
the whole set's mean for each probe size, over several data seeds (default shards: the 384 photo
crops the GPU benchmarks call real-large).
"""
from __future__ import annotations

import time

import numpy as np


def bench_sizing(shards: list[str], probe_samples=(64, 128, 256), seeds: int = 8, max_pixels: int = 1048576,
                 seq_len: int = 4096, micro_batch_size: int = 8) -> dict:
    """Per probe size: ``size_blocks``' tokens-per-sample estimate against the mean over every sample
    (both from headers, nothing decoded), over ``seeds`` data seeds, and the seconds a probe takes."""
    import dataclasses

    from datasvc.config import ServiceConfig
    from datasvc.pack.epoch import sample_token_counts, size_blocks
    from datasvc.read.shards import expand_shards, index_shard

    paths = expand_shards(list(shards))
    cfg = ServiceConfig(shards=tuple(paths), pipeline="qwen3vl", pipeline_options={"max_pixels": max_pixels},
                        seq_len=seq_len, micro_batch_size=micro_batch_size)
    lengths = sample_token_counts(cfg, [index_shard(p) for p in paths])
    full = float(np.mean(lengths))
    rows = []
    for n in probe_samples:
        estimates, items, seconds = [], [], []
        for seed in range(seeds):
            t0 = time.perf_counter()
            sized, sizing = size_blocks(dataclasses.replace(cfg, seed=seed), probe_samples=n)
            seconds.append(time.perf_counter() - t0)
            estimates.append(sizing.tokens_per_sample)
            items.append(sized.items_per_block)
        errors = [e / full - 1 for e in estimates]
        rows.append({"probe_samples": n, "probed": sizing.probed_samples, "estimates": estimates,
                     "rel_sd": float(np.std(errors)), "worst_rel_error": float(max(map(abs, errors))),
                     "items_per_block": [min(items), max(items)], "seconds_median": float(np.median(seconds))})
    return {"shards": len(paths), "samples": len(lengths), "full_mean_tokens": full,
            "seeds": seeds, "micro_batch_size": micro_batch_size, "seq_len": seq_len, "max_pixels": max_pixels,
            "rows": rows}


def print_sizing(rep: dict) -> None:
    print(f"\nblock sizing probe: {rep['samples']} samples in {rep['shards']} shards, mean "
          f"{rep['full_mean_tokens']:.1f} tokens a sample, {rep['seeds']} seeds, MBS {rep['micro_batch_size']}")
    print(f"{'probe':>6} {'read':>5} {'s.d.':>7} {'worst':>7} {'items/block':>12} {'s':>6}")
    for r in rep["rows"]:
        lo, hi = r["items_per_block"]
        print(f"{r['probe_samples']:>6} {r['probed']:>5} {100 * r['rel_sd']:>6.1f}% {100 * r['worst_rel_error']:>6.1f}% "
              f"{f'{lo}-{hi}':>12} {r['seconds_median']:>6.2f}")
