"""Vision-balanced global batches, simulated: predicted step time and straggler ratio (max / mean
rank cost) with and without ``datasvc.pack.balance`` at DP 8, 64 and 512 with Megatron-Bridge recipe
batch sizes, on the bundled photos, calibrated synthetic shards and a LAION-like mix.

    python -m datasvc.tools.bench.balance --out /tmp/balance          # table, balance.json, balance.png
    python -m datasvc.tools.bench.balance --fit --out /tmp/balance    # refit the H200 calibrations
    python -m datasvc.tools.bench.balance --check RUN.metrics.jsonl --calibration h200-3d   # held-out steps

Samples are encoded from image headers (exact token rows and patch grids, no pixel decoded) and
packed the way a feeder packs them (``packing.plan_rows``, ``packing.plan_micro_batches``): each
rank fills its rows from its own draw of samples, the fullest ``k * MBS`` rows a step, the rest
carried to its next step. Unbalanced, rank r trains its own micro-batches; balanced, the step's
micro-batches of all ranks are dealt by ``balance.assign``.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import time

import numpy as np

from datasvc.pack import balance
from datasvc.pack.packing import plan_micro_batches, plan_rows
from datasvc.usage import HelpFormatter

# Megatron-Bridge performance recipes (scripts/performance/configs/qwen_vl/
# qwen3_vl_workload_base_configs.py): 30B-A3B GBS 512 on 8 GPUs (EP 8, MBS 1 on H100/B200),
# 235B-A22B GBS 1024, MBS 1, 64 GPUs at TP 1 / EP 64 on GB300. DP 512 keeps the 235B recipe's GBS,
# which leaves each rank 2 micro-batches a step; GBS 4096 shows what more per rank buys.
SETTINGS = (
    {"setting": "30B-A3B recipe, DP 8", "dp": 8, "gbs": 512, "mbs": 1, "recipe_model": "qwen3vl-30b-a3b"},
    {"setting": "235B-A22B recipe, DP 64", "dp": 64, "gbs": 1024, "mbs": 1, "recipe_model": "qwen3vl-235b-a22b"},
    {"setting": "235B-A22B recipe GBS, DP 512", "dp": 512, "gbs": 1024, "mbs": 1, "recipe_model": "qwen3vl-235b-a22b"},
    {"setting": "DP 512, GBS 4096", "dp": 512, "gbs": 4096, "mbs": 1, "recipe_model": "qwen3vl-235b-a22b"},
)


# ---- samples --------------------------------------------------------------------------------------
def sample_pool(shards: list[str], pipeline, seq_len: int) -> list[tuple[int, tuple[int, ...]]]:
    """(tokens, patches per image) of every usable sample, from headers; rejects are left out."""
    from datasvc.pack.headers import encode_from_headers
    from datasvc.read.shards import ReadLimits, index_shard, read_samples

    pool = []
    for path in shards:
        for raw in read_samples(path, index_shard(path).samples, ReadLimits()):
            try:
                ids, _, grids = encode_from_headers(raw, pipeline)
            except ValueError:  # ImageRejected, SampleRejected: the run counts them and goes on
                continue
            if len(ids) <= seq_len:
                pool.append((len(ids), tuple(int(t * h * w) for t, h, w in grids)))
    return pool


def laion_like_profile():
    """Web photos with a wide size spread (0.03-4 MP, median 0.35) and 1-4 images a sample."""
    from datasvc.tools.synth import PROFILES, Dist

    return dataclasses.replace(PROFILES["web-photos"], name="laion-like",
                               description="web photos, 0.03-4 MP lognormal, 1-4 images a sample",
                               megapixels=Dist.lognormal(0.35, 1.1, 0.03, 4.0),
                               images_per_sample=Dist.choice([1, 2, 3, 4], [0.4, 0.3, 0.2, 0.1]))


def datasets(work_dir: str, synth_samples: int) -> dict[str, list[str]]:
    """Shards of every data set, synthetic ones written once into ``work_dir``."""
    from datasvc.samples import default_shards, large_shards
    from datasvc.tools.synth import calibrate, write_shards

    out = {"photos": default_shards(), "photos-large": large_shards()}
    for name, profile in (("calibrated-synthetic", lambda: calibrate(out["photos-large"])),
                          ("laion-like", laion_like_profile)):
        target = os.path.join(work_dir, f"{name}-{synth_samples}")
        if not os.path.exists(os.path.join(target, ".complete")):
            write_shards(target, synth_samples, profile(), seed=0, samples_per_shard=32, progress=False)
            open(os.path.join(target, ".complete"), "w").close()
        out[name] = sorted(os.path.join(target, f) for f in os.listdir(target) if f.endswith(".tar"))
    return out


# ---- packing one step ------------------------------------------------------------------------------
class RankStream:
    """One rank's feeder, shape-only: its own seeded draw of samples, packed into full rows."""

    def __init__(self, pool, rank: int, seed: int, seq_len: int, mbs: int, packed: bool = True):
        self.pool, self.seq_len, self.mbs, self.packed = pool, seq_len, mbs, packed
        self.rng = np.random.default_rng([seed, rank])
        self.carry: list[int] = []
        self.rank = rank

    def step(self, per_rank: int, step: int) -> list[balance.MicroBatchShape]:
        rows_needed = per_rank * self.mbs
        if not self.packed:  # the stock loaders' layout: one sample per row, padded to seq_len
            rows = [[self.pool[int(i)]] for i in self.rng.integers(len(self.pool), size=rows_needed)]
            return [balance.shape_from_rows(rows[k * self.mbs:(k + 1) * self.mbs], self.seq_len,
                                            f"{self.rank}/{step}/{k}", self.mbs) for k in range(per_rank)]
        chosen = list(self.carry)
        tokens = sum(self.pool[i][0] for i in chosen)
        while tokens < 1.08 * rows_needed * self.seq_len:
            i = int(self.rng.integers(len(self.pool)))
            chosen.append(i)
            tokens += self.pool[i][0]
        rows = plan_rows([self.pool[i][0] for i in chosen], self.seq_len)
        fill = [sum(self.pool[chosen[j]][0] for j in row) for row in rows]
        order = sorted(range(len(rows)), key=lambda r: (-fill[r], r))
        kept, held = order[:rows_needed], order[rows_needed:]
        self.carry = [chosen[j] for r in held for j in rows[r]]
        rows = [[self.pool[chosen[j]] for j in rows[r]] for r in kept]
        row_patches = [sum(sum(p) for _, p in row) for row in rows]
        return [balance.shape_from_rows([rows[r] for r in mb], self.seq_len, f"{self.rank}/{step}/{k}", self.mbs)
                for k, mb in enumerate(plan_micro_batches(row_patches, self.mbs))]


def simulate(pool, dp: int, gbs: int, mbs: int, models: dict[str, balance.CostModel], steps: int,
             seq_len: int = 4096, seed: int = 0, packed: bool = True) -> dict:
    per_rank = gbs // (dp * mbs)
    streams = [RankStream(pool, r, seed, seq_len, mbs, packed) for r in range(dp)]
    per_model = {name: {"ratio": [], "ratio_off": [], "step_s": [], "step_s_off": []} for name in models}
    fills, patches, balance_s = [], [], []
    for s in range(steps):
        shapes = [mb for st in streams for mb in st.step(per_rank, s)]
        fills.append(sum(sum(mb.sample_lengths) for mb in shapes) / sum(mb.slot_tokens for mb in shapes))
        patches.extend(mb.patches for mb in shapes)
        for name, model in models.items():
            t0 = time.perf_counter()
            out = balance.balance_step(shapes, dp, model)
            balance_s.append(time.perf_counter() - t0)
            rec = per_model[name]
            rec["ratio"].append(out.straggler_ratio)
            rec["ratio_off"].append(out.straggler_ratio_unbalanced)
            rec["step_s"].append(out.step_s)
            rec["step_s_off"].append(out.step_s_unbalanced)
    summary = {}
    for name, rec in per_model.items():
        summary[name] = {k: round(float(np.mean(v)), 4) for k, v in rec.items()}
        summary[name]["ratio_worst"] = round(float(np.max(rec["ratio"])), 4)
        summary[name]["ratio_off_worst"] = round(float(np.max(rec["ratio_off"])), 4)
        summary[name]["gain"] = round(summary[name]["step_s_off"] / summary[name]["step_s"] - 1, 4)
    mb_patches = np.asarray(patches, dtype=np.float64)
    return {"micro_batches_per_rank": per_rank, "steps": steps, "row_fill": round(float(np.mean(fills)), 4),
            "patches_per_micro_batch_cv": round(float(mb_patches.std() / max(mb_patches.mean(), 1e-9)), 3),
            "balance_ms": round(1000 * float(np.mean(balance_s)), 1), "models": summary}


# ---- report ----------------------------------------------------------------------------------------
def _table(results: list[dict]) -> str:
    head = ("| data | rows | setting | k | model | step s off | step s on | gain | straggler off | on | worst on |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in results:
        for role, m in r["models"].items():
            name = r["fitted_model"] + " (fitted)" if role == "proxy" else r["recipe_model"] + " (derived)"
            lines.append(f"| {r['data']} | {r['layout']} | {r['setting']} | {r['micro_batches_per_rank']} | {name} | "
                         f"{m['step_s_off']:.3f} | {m['step_s']:.3f} | {m['gain']:+.1%} | {m['ratio_off']:.3f} | "
                         f"**{m['ratio']:.3f}** | {m['ratio_worst']:.3f} |")
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["proxy", "recipe"]
    titles = {"proxy": f"{results[0]['fitted_model']}, fitted on the H200", "recipe": "the recipe's model, derived (FLOPs at fitted rates)"}
    layouts = [lay for lay in ("packed", "padded") if any(r["layout"] == lay for r in results)]
    fig, axes = plt.subplots(len(layouts), len(names), figsize=(6.5 * len(names), 4.8 * len(layouts)), squeeze=False)
    for (li, layout), (ni, name) in itertools.product(enumerate(layouts), enumerate(names)):
        _panel(axes[li][ni], [r for r in results if r["layout"] == layout], name, f"{titles[name]}; {layout} rows")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def _panel(ax, results: list[dict], name: str, title: str) -> None:
    labels = [f"{r['data']}\n{r['setting'].split(',')[-1].strip()} k={r['micro_batches_per_rank']}" for r in results]
    x = np.arange(len(results))
    ax.bar(x - 0.2, [r["models"][name]["ratio_off"] for r in results], 0.4, label="unbalanced")
    ax.bar(x + 0.2, [r["models"][name]["ratio"] for r in results], 0.4, label="balanced")
    ax.axhline(1.05, color="k", ls="--", lw=0.8, label="goal 1.05")
    ax.set_ylim(1.0, max(1.1, 1.02 * max(r["models"][name]["ratio_off"] for r in results)))
    ax.set_xticks(x, labels, rotation=90, fontsize=6)
    ax.set_ylabel("straggler ratio (max / mean rank cost)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)


def run_simulation(args) -> dict:
    from datasvc.registry import get_pipeline

    pipeline = get_pipeline(args.pipeline, max_pixels=args.max_pixels)
    shards = datasets(args.work_dir, args.synth_samples)
    fitted = balance.cost_model(args.pipeline, None, args.calibration)  # the model the calibration was fitted on
    results = []
    for data, paths in shards.items():
        pool = sample_pool(paths, pipeline, args.seq_len)
        for layout, st in ((lay, st) for lay in args.layouts for st in SETTINGS):
            models = {"proxy": fitted, "recipe": balance.cost_model(args.pipeline, st["recipe_model"], args.calibration)}
            t0 = time.perf_counter()
            res = simulate(pool, st["dp"], st["gbs"], st["mbs"], models, args.steps, args.seq_len, args.seed,
                           packed=layout == "packed")
            results.append({"data": data, "layout": layout, "samples": len(pool), "fitted_model": fitted.name,
                            **st, **res,
                            "seconds": round(time.perf_counter() - t0, 2)})
            print(f"[balance] {data} {layout} {st['setting']}: " + ", ".join(
                f"{n}: {m['ratio_off']:.3f} -> {m['ratio']:.3f}" for n, m in res["models"].items()), flush=True)
    return {"results": results, "calibration": args.calibration, "max_pixels": args.max_pixels,
            "seq_len": args.seq_len, "steps": args.steps,
            "cost_models": {n: balance.cost_model(args.pipeline, n, args.calibration).as_dict()
                            for n in sorted({fitted.name} | {st["recipe_model"] for st in SETTINGS})}}


def run_fit(args) -> dict:
    from datasvc.registry import pipeline_module

    cost = _cost_module(pipeline_module(args.pipeline))
    stats = photo_stats(args.pipeline, args.max_pixels)
    fitted = {name: dataclasses.asdict(cost.fit(name, files, stats, **kw))
              for name, (files, kw) in cost.calibration_inputs(args.results_dir).items()}
    for c in fitted.values():
        print(f"[fit] {c['name']}: text {c['text_tflops']} TFLOP/s, vision {c['vision_tflops']} TFLOP/s, "
              f"overhead {c['step_overhead_s']} s, {c['steps']} steps, rms error {c['rms_rel_error']:.1%}; "
              f"per case {c['case_rel_errors']}")
    return {"photo_stats": dataclasses.asdict(stats), "calibrations": fitted}


def check_recorded(files: list[str], pipeline: str, calibration: str | None) -> list[dict]:
    """The pipeline's cost model against recorded steps it was not fitted on (its ``cost.check``),
    printed per file."""
    from datasvc.registry import pipeline_module

    out = _cost_module(pipeline_module(pipeline)).check(files, calibration)
    for r in out:
        if r["steps"]:
            print(f"[check] {os.path.basename(r['file'])}: {r['steps']} steps, predicted {r['predicted_s']} s "
                  f"against {r['measured_s']} s ({r['mean_rel_error']:+.1%}), rms {r['rms_rel_error']:.1%}", flush=True)
    return out


def _cost_module(package):
    import importlib

    return importlib.import_module(f"{package.__name__}.cost")


def photo_stats(pipeline_name: str, max_pixels: int):
    """The real-photo set's patches per token and size moments, from headers (the H200 runs' data)."""
    from datasvc.registry import get_pipeline, pipeline_module
    from datasvc.samples import large_shards

    pool = sample_pool(large_shards(), get_pipeline(pipeline_name, max_pixels=max_pixels), 1 << 30)
    tokens = np.asarray([t for t, _ in pool], dtype=np.float64)
    patches = np.asarray([p for _, ps in pool for p in ps], dtype=np.float64)
    return _cost_module(pipeline_module(pipeline_name)).PhotoStats(
        patches_per_real_token=float(patches.sum() / tokens.sum()),
        patch_sq_per_patch=float(np.square(patches).sum() / patches.sum()),
        mean_sample_tokens=float(tokens.mean()), token_sq_per_sample=float(np.square(tokens).mean()))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="vlmfeed bench balance", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--out", default="balance-bench")
    p.add_argument("--work-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "vlmfeed", "balance"))
    p.add_argument("--pipeline", default="qwen3vl")
    p.add_argument("--calibration", default=None, help="fitted calibration (default: the pipeline's)")
    p.add_argument("--max-pixels", type=int, default=1024 * 1024, help="image cap (the trainer's GPU default)")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--steps", type=int, default=4, help="global steps simulated per setting")
    p.add_argument("--synth-samples", type=int, default=384)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layouts", nargs="+", choices=("packed", "padded"), default=["packed", "padded"],
                   help="packed rows (this service) and/or one padded sample per row (the stock loaders)")
    p.add_argument("--fit", action="store_true", help="refit the calibrations from --results-dir")
    p.add_argument("--results-dir", default="tests/data/recorded", help="where the recorded H200 steps are")
    p.add_argument("--check", nargs="+", metavar="METRICS_JSONL", default=None,
                   help="predict these recorded steps from their own inputs with --calibration and report the error")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.work_dir, exist_ok=True)
    if args.check:
        with open(os.path.join(args.out, "balance_check.json"), "w") as f:
            json.dump(check_recorded(args.check, args.pipeline, args.calibration), f, indent=1)
        return 0
    if args.fit:
        report = run_fit(args)
        with open(os.path.join(args.out, "balance_fit.json"), "w") as f:
            json.dump(report, f, indent=1)
        return 0
    report = run_simulation(args)
    print(_table(report["results"]))
    with open(os.path.join(args.out, "balance.json"), "w") as f:
        json.dump(report, f, indent=1)
    plot(report["results"], os.path.join(args.out, "balance.png"))
    print(f"[balance] wrote {args.out}/balance.json and balance.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
