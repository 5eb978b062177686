"""The peers' training cases as figures: a path's repeats pooled (totals over totals), each path's ratio to
vlmfeed's CPU path, and a grid as the markdown table the docs page holds."""
from __future__ import annotations

import dataclasses
import json

from trainer.bench.peers_measure import ratio, ratio_estimate


def pooled(runs: list[dict]) -> dict:
    """A path's repeats as one figure: tokens/s as total tokens over total seconds of every steady
    block of every repeat, +-2 standard errors from those blocks; CPU per trained sample as totals
    over totals; the repeats themselves kept."""
    finished = [r for r in runs if "steady_blocks" in r]
    out = {"path": runs[0].get("path"), "repeats": len(finished), "runs": runs}
    if not finished:
        return out
    tokens = [t for r in finished for t in r["steady_blocks"]["tokens"]]
    seconds = [s for r in finished for s in r["steady_blocks"]["seconds"]]
    rate, se = ratio_estimate(tokens, seconds)
    out["tokens_per_s"], out["tokens_per_s_blocks"] = round(rate, 1), [rate, se]
    out["tokens_per_s_pm_2se"] = round(2 * se, 1) if se is not None else None
    samples = sum(r.get("samples_trained") or 0 for r in finished)
    cpu = sum(r.get("data_cpu_s") or 0 for r in finished)
    out["cpu_s_per_trained_sample"] = round(cpu / samples, 4) if samples else None
    steady_n = sum(r.get("steady_samples_trained") or 0 for r in finished)
    steady_s = sum(r.get("steady_data_cpu_s") or 0 for r in finished)
    out["steady_cpu_s_per_trained_sample"] = round(steady_s / steady_n, 4) if steady_n else None
    # The data path's own worker processes alone: Ray's system processes and the case's driver serve
    # every path here (the ranks are Ray actors), though a peer run by torchrun would not have them.
    workers_s = sum((r.get("steady_cpu_s_by_kind") or {}).get("data_workers") or 0 for r in finished)
    out["steady_worker_cpu_s_per_trained_sample"] = (
        round(workers_s / steady_n, 4) if steady_n and all("steady_cpu_s_by_kind" in r for r in finished) else None)
    for key in ("mbs", "tokens_per_step", "data_wait_share", "real_token_fraction", "tflops_per_gpu",
                "peak_mem_gib", "peak_host_rss_gib", "time_to_first_step_s", "data_cores", "workers"):
        vals = [r[key] for r in finished if r.get(key) is not None]
        out[key] = round(sum(vals) / len(vals), 4) if vals else None
    return out


def ratios(cases: dict) -> None:
    base = cases.get("vlmfeed-cpu", {})
    for r in cases.values():
        if "tokens_per_s_blocks" in r and "tokens_per_s_blocks" in base:
            r["tokens_per_s_vs_vlmfeed"] = ratio(tuple(r["tokens_per_s_blocks"]), tuple(base["tokens_per_s_blocks"]))
        if r.get("cpu_s_per_trained_sample") and base.get("cpu_s_per_trained_sample"):
            r["cpu_per_sample_vs_vlmfeed"] = round(r["cpu_s_per_trained_sample"] / base["cpu_s_per_trained_sample"], 3)


def table(grid: dict) -> str:
    """One grid's cases as a markdown table (what the docs page holds)."""
    head = ("| MBS | path | repeats | tokens/s +-2 s.e. | x vlmfeed (CPU) | tokens/step | data wait | row fill "
            "| data CPU-s / trained sample | steady | steady, workers only | peak GPU GiB |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for key, cases in grid.items():
        for path, c in cases.items():
            if not c.get("tokens_per_s"):
                rows.append(f"| {key[3:]} | {path} | 0 | did not finish: {[r.get('rc') for r in c.get('runs', [])]} |"
                            " | | | | | | | |")
                continue
            vs = c.get("tokens_per_s_vs_vlmfeed") or {}
            rows.append(f"| {int(c.get('mbs') or key[3:])} | {path} | {c['repeats']} | {c['tokens_per_s']:,.0f} "
                        f"+- {c.get('tokens_per_s_pm_2se') or 0:,.0f} | {vs.get('ratio')} +- {vs.get('pm_2se')} "
                        f"| {c.get('tokens_per_step') or 0:,.0f} | {100 * (c.get('data_wait_share') or 0):.2f}% "
                        f"| {c.get('real_token_fraction')} | {c.get('cpu_s_per_trained_sample')} "
                        f"| {c.get('steady_cpu_s_per_trained_sample')} | {c.get('steady_worker_cpu_s_per_trained_sample')} "
                        f"| {c.get('peak_mem_gib')} |")
    return "\n".join([head, *rows])


def service_settings(cfg) -> dict:
    """The data service's settings as the case ran them (a rerun compares against these); a section
    (``decode``, ``pool``, ...) as a dict of its own."""
    out = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            out[f.name] = service_settings(value)
            continue
        try:
            json.dumps(value)
        except TypeError:
            value = repr(value)
        out[f.name] = value
    return out
