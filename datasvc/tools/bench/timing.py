"""How the per-core benches time their contenders: on one thread each, wall time as the best of
passes taken in turns (and round by round), and process CPU time in alternated rounds, so that a
change of load on a shared host lands on every contender alike."""
from __future__ import annotations

import contextlib
import time

import numpy as np


@contextlib.contextmanager
def one_thread():
    """OpenCV and torch on one thread each inside the block, as they were before it afterwards.

    Only this process's thread pools are set, never the environment (``OMP_NUM_THREADS``), so
    nothing leaks into processes started meanwhile or later (a trainer a benchmark launches).
    """
    import cv2
    import torch

    cv2_threads, torch_threads = cv2.getNumThreads(), torch.get_num_threads()
    cv2.setNumThreads(1)
    torch.set_num_threads(1)
    try:
        yield
    finally:
        cv2.setNumThreads(cv2_threads)
        torch.set_num_threads(torch_threads)


def time_interleaved(runs: dict, photos: list, repeats: int, once: tuple[str, ...] = ()) -> dict[str, list[float]]:
    """Wall seconds of each of ``repeats`` passes of each run over all photos (after a warm-up),
    the runs taking turns pass by pass (the order reversed every other round), so a change of load
    on a shared host lands on all of them alike; the runs named in ``once`` get one pass."""
    for fn in runs.values():
        fn(photos[:2])
    secs: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(max(1, repeats)):
        for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
            if r and name in once:
                continue
            t0 = time.perf_counter()
            runs[name](photos)
            secs[name].append(time.perf_counter() - t0)
    return secs


def by_round(secs: dict[str, list[float]], baseline: str, path: str) -> dict:
    """``path``'s speed as a multiple of ``baseline``'s in each round of ``time_interleaved``
    (their passes ran back to back), with the median and range."""
    ratios = [b / p for b, p in zip(secs[baseline], secs[path])]
    return {"rounds": len(ratios), "ratio_median": round(float(np.median(ratios)), 3),
            "ratio_min": round(min(ratios), 3), "ratio_max": round(max(ratios), 3)}


def paired_cpu_ratio(fast, slow, photos: list, rounds: int = 7) -> dict:
    """Process CPU seconds of ``fast`` and ``slow`` over the photos, alternated for ``rounds`` rounds
    (which goes first alternates too), so load from elsewhere lands on both alike; per-round
    ``slow / fast`` ratios, their median and range."""
    fast(photos[:2])
    slow(photos[:2])
    secs: dict = {fast: [], slow: []}
    for r in range(rounds):
        for fn in ((fast, slow) if r % 2 == 0 else (slow, fast)):
            t0 = time.process_time()
            fn(photos)
            secs[fn].append(time.process_time() - t0)
    ratios = [b / a for a, b in zip(secs[fast], secs[slow])]
    return {"rounds": rounds, "fast_cpu_s_median": round(float(np.median(secs[fast])), 4),
            "slow_cpu_s_median": round(float(np.median(secs[slow])), 4),
            "ratio_median": round(float(np.median(ratios)), 3),
            "ratio_min": round(min(ratios), 3), "ratio_max": round(max(ratios), 3)}
