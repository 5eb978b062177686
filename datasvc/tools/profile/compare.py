"""Profiling several sources with the same settings, side by side, with ratios against the first."""
from __future__ import annotations

import numpy as np

from datasvc.tools.profile.sweep import Settings, profile
from datasvc.tools.profile.verdict import Demand, verdicts

COMPARE_ROWS = [
    ("samples/s", lambda r: r["rates"]["samples_per_s"]),
    ("images/s", lambda r: r["rates"]["images_per_s"]),
    ("MP/s", lambda r: r["rates"]["megapixels_per_s"]),
    ("micro-batches/s", lambda r: r["rates"]["micro_batches_per_s"]),
    ("vision tokens/sample", lambda r: r["per_sample"]["vision_tokens"]),
    ("text tokens/sample", lambda r: r["per_sample"]["text_tokens"]),
    ("images/sample", lambda r: r["per_sample"]["images"]),
    ("MP/sample", lambda r: r["per_sample"]["megapixels"]),
    ("dec+prep MP/s", lambda r: r["decode_preprocess"]["megapixels_per_s"]),
    ("dec+prep samples/s", lambda r: r["decode_preprocess"]["samples_per_s"]),
    ("actor CPU ms/MP", lambda r: r["cpu"].get("actor_cpu_ms_per_megapixel")),
    ("actor CPU ms/sample", lambda r: r["cpu"].get("actor_cpu_ms_per_sample")),
    ("packing efficiency", lambda r: r["packing_efficiency"]),
]


RATE_ROWS = ("samples/s", "images/s", "MP/s", "micro-batches/s")


def _median_run(runs: list[dict], key) -> float | None:
    vals = [key(r) for r in runs]
    vals = [v for v in vals if v is not None]
    return float(np.median(vals)) if vals else None


def compare(sources: dict[str, list[str]], settings: Settings, demand: Demand | None = None, repeat: int = 1,
            progress: bool = True) -> dict:
    """Profile each source with the same settings; rounds interleave the sources so that load from
    elsewhere on the machine hits all of them alike; each metric is the median over rounds."""
    per_round: dict[str, list[dict]] = {n: [] for n in sources}
    for rnd in range(repeat):
        for name, shards in sources.items():
            s = Settings(**{**settings.__dict__, "shards": shards})
            per_round[name].append(profile(s, demand, progress=progress, label=name if repeat == 1 else f"{name}#{rnd}"))
    reports = {n: reps[0] if len(reps) == 1 else _merge_rounds(reps, n, demand or Demand())
               for n, reps in per_round.items()}
    out = {"sources": {n: list(s) for n, s in sources.items()}, "reference": next(iter(sources)), "repeat": repeat,
           "reports": reports, "rows": compare_rows(reports),
           "rounds": {n: [r["runs"] for r in reps] for n, reps in per_round.items()}}
    from datasvc.tools.profile.videocost import video_cost

    vc = video_cost(sources, settings.pipeline, settings.pipeline_options(), settings.decode, settings.threads)
    if vc:
        out["video_cost"] = vc
    if settings.items_per_block is not None:
        warning = block_geometry_warning(reports)
        if warning:
            out["warning"] = warning
    return out


def block_geometry_warning(reports: dict[str, dict], tolerance: float = 1.25) -> str | None:
    """With a fixed number of work items a block (``--items-per-block``), sources whose shards hold
    different numbers of samples pack blocks of different sizes, and a block's last micro-batch is
    part empty: their rate rows then compare packing geometry as much as data (real-large 6-sample
    shards against synthetic 32-sample ones at MBS 8: 0.41x micro-batches/s with 4-item blocks,
    1.1-1.4x with sized blocks, on a 2-core VM). Says so when the sources' samples a block differ by more than
    ``tolerance``; None when they do not."""
    per_block = {}
    for name, rep in reports.items():
        sizes = [r["samples"] / r["blocks_measured"] for r in rep["runs"] if r.get("blocks_measured")]
        if sizes:
            per_block[name] = float(np.median(sizes))
    if len(per_block) < 2 or max(per_block.values()) <= tolerance * min(per_block.values()):
        return None
    sizes = ", ".join(f"{n} {v:.0f}" for n, v in per_block.items())
    return (f"blocks hold different numbers of samples ({sizes}): the rate rows compare packing geometry as "
            f"much as data; rerun without --items-per-block to size each source's blocks as trainer.run does")


def compare_rows(reports: dict[str, dict]) -> dict:
    """Metric rows for sources side by side, with ratios against the first source."""
    first = next(iter(reports))
    rows = {}
    ref_runs = reports[first]["runs"]
    for label, key in COMPARE_ROWS:
        if label in RATE_ROWS:  # one row per setting: rates depend on MBS and actors
            keys = [(r["micro_batch_size"], r["actors"]) for r in ref_runs]
            groups = [(f"{label} MBS {m} x{a}", (m, a)) for m, a in keys] if len(keys) > 1 else [(label, keys[0])]
        else:  # per-sample and per-megapixel costs: the median over settings
            groups = [(label, None)]
        for row_label, setting in groups:
            vals = {}
            for n, rep in reports.items():
                runs = [r for r in rep["runs"] if setting is None or (r["micro_batch_size"], r["actors"]) == setting]
                vals[n] = _median_run(runs, key)
            base = vals[first]
            rows[row_label] = {"values": vals, "ratio": {n: (v / base if (v is not None and base) else None)
                                                         for n, v in vals.items()}}
    return rows


def _merge_rounds(reps: list[dict], name: str, demand: Demand) -> dict:
    """One report per source: for each setting, the run whose samples/s is the median over rounds."""
    out = dict(reps[0])
    out["label"] = name
    runs = []
    for i in range(len(reps[0]["runs"])):
        cands = sorted((r["runs"][i] for r in reps), key=lambda r: r["rates"]["samples_per_s"])
        runs.append(cands[len(cands) // 2])
    out["runs"] = runs
    out["verdicts"] = verdicts(runs, out["settings"]["mbs"], demand)
    return out
