"""A run's summary: steady-state means of the per-step records of either backend (the same names
from both: ``step_time_s``, ``data_wait_share``, ``tokens_per_s``...), loss trend, data accounting."""
from __future__ import annotations

import math


def steady_window(records: list[dict]) -> list[dict]:
    """The steps past the first fifth (at least 2 steps) of compile / warm-up steps."""
    return records[max(2, len(records) // 5):] or records


def summarize(records: list[dict], data_stats, backend: str, world: int, wall_s: float) -> dict:
    """``data_stats``: the service's ``ServiceStats`` (None when it could not be read)."""
    data = data_stats.as_dict() if data_stats is not None else {}
    losses = [r["loss"] for r in records if r.get("loss") is not None]
    k = max(1, len(losses) // 5)
    steady = steady_window(records)

    def mean(*keys):
        vals = [next((r[k] for k in keys if r.get(k) is not None), None) for r in steady]
        vals = [v for v in vals if v is not None]
        return sum(vals) / len(vals) if vals else None

    def rnd(x, n=4):
        return None if x is None else round(x, n)

    return {
        "backend": backend, "world_size": world, "steps": len(records), "wall_s": round(wall_s, 1),
        "steady_steps": len(steady),
        "loss_first": sum(losses[:k]) / k if losses else None,
        "loss_last": sum(losses[-k:]) / k if losses else None,
        "loss_fell": bool(losses) and sum(losses[-k:]) / k < sum(losses[:k]) / k,
        "loss_finite": bool(losses) and all(math.isfinite(x) for x in losses),
        "step_time_s": rnd(mean("step_time_s")),
        "data_wait_share": rnd(mean("data_wait_share")),
        "tokens_per_s": rnd(mean("tokens_per_s"), 1),
        "real_token_fraction": rnd(mean("real_token_fraction")),
        # The CPU path has no FLOP accounting, only a 6 * params * tokens estimate, named as such.
        "tflops_per_gpu": rnd(mean("tflops_per_gpu", "tflops_per_gpu_estimate"), 3),
        # max / mean over DP ranks of their own compute (None with one DP rank): what the step waits for.
        "straggler_ratio": rnd(mean("straggler_ratio")),
        "val_loss_last": next((r["val_loss"] for r in reversed(records) if r.get("val_loss") is not None), None),
        "first_step": records[0]["step"] if records else None,
        "last_step": records[-1]["step"] if records else None,
        "exit_reason": records[-1].get("exit_reason") if records else None,
        "peak_mem_gib": rnd(max((r.get("peak_mem_gib") or 0 for r in records), default=None), 2),
        "data_accounting": data.get("accounting", {}),
        "autoscale_decisions": [d.as_dict() for r in data_stats.ranks for d in r.autoscale_decisions] if data_stats else [],
        "data": data,
    }
