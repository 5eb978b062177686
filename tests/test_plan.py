"""The memory planner against every peak recorded on the H200 (tests/data/recorded), and its answers across GPU counts."""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time

import pytest

from trainer.config import ModelConfig, ParallelConfig, RecomputeConfig, TrainConfig, TrainerConfig
from trainer.plan import Workload, fit_auto, nearest_fits, plan_job
from trainer.plan.__main__ import main as plan_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "tests", "data", "recorded")  # the H200 runs the planner is held to
H200_GIB = 141  # CUDA reported 139.80 GiB total in the recorded OOM messages
# Image tokens / real tokens of the bundled photo crops at the GPU path's 1 MP cap (~251 image
# tokens and ~30 text tokens a sample); the calibrated synthetic set matches it, the mock has none.
IMAGE_SHARE = {"real": 0.89, "synthetic": 0.89, "mock": 0.0}

# Every training case with a peak in tests/data/recorded: all on the 4-layer proxy with all 128 experts
# (trainer.bench ran `--num-layers 4 --seq-len 4096` on the full preset), full 27-layer vision tower.
# (results file, strategy, source, MBS, recompute, vision chunk patches, expandable segments, GPUs,
#  EP, vision frozen, real-token fraction of the step that peaked, measured peak_mem_gib).
# The fraction is read from the case's metrics.jsonl where one was kept, else 1.0 (rows full); on two
# GPUs the peak is the maximum over ranks while the fraction is one rank's, so 1.0 there too.
RECORDED = [
    ("h200/train-4layer-ray-stream-50-steps/bench.json", "fsdp", "real", 2, "none", 0, False, 1, 1, False, 0.95, 98.36),
    ("h200/train-4layer-ray-stream-50-steps/bench.json", "3d", "real", 2, "none", 0, False, 1, 1, False, 0.95, 105.07),
    ("h200/train-4layer-ray-stream-50-steps/bench.json", "3d", "mock", 2, "none", 0, False, 1, 1, False, 1.0, 76.76),
    ("h200/train-4layer-small-set-packed-padded-frozen/bench.json", "3d", "real", 1, "none", 0, False, 1, 1, False, 1.0, 84.85),
    ("h200/train-4layer-small-set-packed-padded-frozen/bench.json", "3d", "real", 2, "none", 0, False, 1, 1, True, 0.95, 72.11),
    ("h200/train-4layer-frozen-vision-mbs8/bench.json", "3d", "real", 1, "none", 0, False, 1, 1, False, 1.0, 84.81),
    ("h200/train-4layer-frozen-vision-mbs8/bench.json", "3d", "real", 2, "none", 0, False, 1, 1, False, 1.0, 106.00),
    ("h200/train-4layer-frozen-vision-mbs8/bench.json", "3d", "synthetic", 2, "none", 0, False, 1, 1, False, 1.0, 106.70),
    ("h200/train-4layer-frozen-vision-mbs8/bench.json", "3d", "mock", 2, "none", 0, False, 1, 1, False, 1.0, 76.76),
    ("h200/train-4layer-frozen-vision-mbs8/bench.json", "3d", "real", 8, "full", 0, False, 1, 1, True, 1.0, 106.18),
    ("h200/train-4layer-sources-fsdp-mbs1-2-fixed-blocks/bench.json", "fsdp", "real", 1, "none", 0, False, 1, 1, False, 1.0, 78.02),
    ("h200/train-4layer-sources-fsdp-mbs1-2-fixed-blocks/bench.json", "fsdp", "real", 2, "none", 0, False, 1, 1, False, 1.0, 99.29),
    ("h200/train-4layer-sources-fsdp-mbs1-2-fixed-blocks/bench.json", "fsdp", "synthetic", 2, "none", 0, False, 1, 1, False, 1.0, 99.99),
    ("h200/train-4layer-sources-fsdp-mbs1-2-fixed-blocks/bench.json", "fsdp", "mock", 2, "none", 0, False, 1, 1, False, 1.0, 70.02),
    ("h200/train-4layer-gpu-decode-and-mbs8-one-call/bench.json", "fsdp", "real", 4, "full", 0, False, 1, 1, False, 1.0, 83.36),
    ("h200/train-4layer-gpu-decode-and-mbs8-one-call/bench.json", "3d", "real", 4, "full", 0, False, 1, 1, False, 0.86, 90.07),
    ("h200/train-4layer-vision-chunks-16k/bench.json", "3d", "real", 4, "full", 16384, False, 1, 1, False, 0.86, 90.07),
    ("h200/train-4layer-vision-chunks-16k/bench.json", "fsdp", "real", 8, "full", 16384, False, 1, 1, False, 0.92, 112.44),
    ("h200/train-4layer-vision-chunks-32k-run2/bench.json", "3d", "real", 4, "full", 32768, False, 1, 1, False, 0.86, 90.08),
    ("h200/train-4layer-vision-chunks-32k-run2/bench.json", "3d", "real", 8, "full", 32768, True, 1, 1, False, 0.80, 118.04),
    ("h200/train-4layer-mbs8-steady/bench.json", "3d", "real", 8, "full", 32768, True, 1, 1, False, 0.92, 119.12),
    ("h200/train-4layer-mbs8-steady/bench.json", "fsdp", "real", 8, "full", 32768, True, 1, 1, False, 0.92, 112.37),
    ("h200/train-4layer-sources-3d-mbs8-fixed-blocks/bench.json", "3d", "synthetic", 8, "full", 32768, True, 1, 1, False, 0.74, 117.13),
    ("h200/train-4layer-sources-3d-mbs8-fixed-blocks/bench.json", "3d", "mock", 8, "full", 32768, True, 1, 1, False, 1.0, 108.81),
    ("h200/train-4layer-sized-blocks-per-epoch/bench.json", "3d", "real", 2, "none", 0, False, 1, 1, False, 1.0, 106.61),
    ("h200/train-4layer-sources-3d-mbs1-4-8-fsdp-mbs8/bench-fsdp-mock-mbs8.json", "fsdp", "mock", 8, "full", 32768, True, 1, 1, False, 1.0, 102.05),
    ("h200/train-4layer-sources-3d-mbs1-4-8-fsdp-mbs8/bench-3d-mbs1-4.json", "3d", "real", 1, "none", 0, False, 1, 1, False, 1.0, 84.99),
    ("h200/train-4layer-sources-3d-mbs1-4-8-fsdp-mbs8/bench-3d-mbs1-4.json", "3d", "synthetic", 1, "none", 0, False, 1, 1, False, 1.0, 84.96),
    ("h200/train-4layer-sources-3d-mbs1-4-8-fsdp-mbs8/bench-3d-mbs1-4.json", "3d", "mock", 1, "none", 0, False, 1, 1, False, 1.0, 69.15),
    ("h200/train-4layer-sources-3d-mbs1-4-8-fsdp-mbs8/bench-3d-mbs1-4.json", "3d", "real", 4, "full", 32768, False, 1, 1, False, 0.99, 90.89),
    ("h200/train-4layer-sources-3d-mbs1-4-8-fsdp-mbs8/bench-3d-mbs1-4.json", "3d", "synthetic", 4, "full", 32768, False, 1, 1, False, 1.0, 91.01),
    ("h200/train-4layer-sources-3d-mbs1-4-8-fsdp-mbs8/bench-3d-mbs1-4.json", "3d", "mock", 4, "full", 32768, False, 1, 1, False, 1.0, 85.15),
    ("h200/train-4layer-sources-3d-mbs1-4-8-fsdp-mbs8/bench-3d-fsdp-mbs8.json", "3d", "real", 8, "full", 32768, True, 1, 1, False, 1.0, 120.21),
    ("h200/train-4layer-sources-3d-mbs1-4-8-fsdp-mbs8/bench-3d-fsdp-mbs8.json", "3d", "synthetic", 8, "full", 32768, True, 1, 1, False, 0.99, 120.44),
    ("h200/train-4layer-sources-3d-mbs1-4-8-fsdp-mbs8/bench-3d-fsdp-mbs8.json", "fsdp", "real", 8, "full", 32768, True, 1, 1, False, 1.0, 113.38),
    ("h200/train-4layer-sources-3d-mbs1-4-8-fsdp-mbs8/bench-3d-fsdp-mbs8.json", "fsdp", "synthetic", 8, "full", 32768, True, 1, 1, False, 1.0, 113.69),
    ("h200/train-4layer-chains-4-vs-1/bench.json", "3d", "real", 4, "full", 32768, False, 1, 1, False, 1.0, 90.98),
    ("h200/train-4layer-chains-4-vs-1/bench.json", "3d", "real", 8, "full", 32768, True, 1, 1, False, 1.0, 120.41),
    ("h200/train-4layer-sources-3d-mbs2-fsdp-mbs1-2-4/bench-fsdp-mbs1-4.json", "fsdp", "real", 1, "none", 0, False, 1, 1, False, 1.0, 78.24),
    ("h200/train-4layer-sources-3d-mbs2-fsdp-mbs1-2-4/bench-fsdp-mbs1-4.json", "fsdp", "synthetic", 1, "none", 0, False, 1, 1, False, 1.0, 78.19),
    ("h200/train-4layer-sources-3d-mbs2-fsdp-mbs1-2-4/bench-fsdp-mbs1-4.json", "fsdp", "mock", 1, "none", 0, False, 1, 1, False, 1.0, 69.60),
    ("h200/train-4layer-sources-3d-mbs2-fsdp-mbs1-2-4/bench-fsdp-mbs1-4.json", "fsdp", "real", 4, "full", 32768, False, 1, 1, False, 1.0, 84.26),
    ("h200/train-4layer-sources-3d-mbs2-fsdp-mbs1-2-4/bench-fsdp-mbs1-4.json", "fsdp", "synthetic", 4, "full", 32768, False, 1, 1, False, 1.0, 84.33),
    ("h200/train-4layer-sources-3d-mbs2-fsdp-mbs1-2-4/bench-fsdp-mbs1-4.json", "fsdp", "mock", 4, "full", 32768, False, 1, 1, False, 1.0, 78.43),
    ("h200/train-4layer-sources-3d-mbs2-fsdp-mbs1-2-4/bench-3d-fsdp-mbs2.json", "3d", "real", 2, "none", 0, False, 1, 1, False, 1.0, 106.60),
    ("h200/train-4layer-sources-3d-mbs2-fsdp-mbs1-2-4/bench-3d-fsdp-mbs2.json", "3d", "synthetic", 2, "none", 0, False, 1, 1, False, 1.0, 107.29),
    ("h200/train-4layer-sources-3d-mbs2-fsdp-mbs1-2-4/bench-3d-fsdp-mbs2.json", "3d", "mock", 2, "none", 0, False, 1, 1, False, 1.0, 76.76),
    ("h200/train-4layer-sources-3d-mbs2-fsdp-mbs1-2-4/bench-3d-fsdp-mbs2.json", "fsdp", "real", 2, "none", 0, False, 1, 1, False, 0.99, 99.93),
    ("h200/train-4layer-sources-3d-mbs2-fsdp-mbs1-2-4/bench-3d-fsdp-mbs2.json", "fsdp", "synthetic", 2, "none", 0, False, 1, 1, False, 1.0, 100.56),
    ("h200/train-4layer-sources-3d-mbs2-fsdp-mbs1-2-4/bench-3d-fsdp-mbs2.json", "fsdp", "mock", 2, "none", 0, False, 1, 1, False, 1.0, 70.02),
    ("h200x2/train-4layer-1-vs-2-gpus/bench.json", "3d", "real", 2, "none", 0, False, 2, 2, False, 1.0, 79.14),
    ("h200x2/train-4layer-1-vs-2-gpus/bench.json", "3d", "real", 2, "none", 0, False, 1, 1, False, 0.98, 106.00),
    ("h200x2/train-4layer-1-vs-2-gpus/bench.json", "fsdp", "real", 2, "none", 0, False, 2, 1, False, 1.0, 73.77),
    ("h200x2/train-4layer-1-vs-2-gpus/bench.json", "fsdp", "real", 2, "none", 0, False, 1, 1, False, 0.98, 99.29),
]
# The depth-faithful proxy (48 layers, 16 experts) as issue 18 quotes it, one H200, 3d, full
# recompute, 32k-patch chunks: "peaks about 112 and 128 GiB" (no results file holds these runs).
QUOTED = [("qwen3vl-30b-a3b-48layers-16experts", 2, 112.0), ("qwen3vl-30b-a3b-48layers-16experts", 4, 128.0)]
# Runs that ran out of memory on one H200 (docs/benchmarks/mbs-sweep-and-large-micro-batches.md), each with the text in tests/data/recorded
# that records it: (evidence, strategy, MBS, recompute, vision chunk patches, expandable segments, fill)
OUT_OF_MEMORY = [
    ("Tried to allocate 54.75 GiB", "3d", 8, "full", 0, False, 1.0),  # vision attention backward
    ('"case": "fsdp-real-large-mbs8-recompute",', "fsdp", 8, "full", 0, False, 1.0),
    ("Tried to allocate 18.55 GiB", "3d", 8, "full", 16384, False, 1.0),  # logits, 18 GiB fragmented
    ('"case": "3d-real-mbs4",', "3d", 4, "none", 0, False, 0.9),  # fp32 logits, 9.3 GiB short
]


def _results_files():
    for folder, _, names in os.walk(RESULTS):
        for name in names:
            if name.endswith((".json", ".txt")):
                yield os.path.join(folder, name)


@functools.cache
def recorded_peaks() -> dict[str, set[float]]:
    """Every case's peak_mem_gib in tests/data/recorded, by file name (folders may be reorganized)."""
    out: dict[str, set[float]] = {}
    for path in _results_files():
        if not path.endswith(".json"):
            continue
        with open(path) as f:
            data = json.load(f)
        if isinstance(data, list):
            peaks = {round(c["peak_mem_gib"], 2) for c in data if isinstance(c, dict) and c.get("peak_mem_gib")}
            out.setdefault(os.path.basename(path), set()).update(peaks)
    return out


@functools.cache
def results_text() -> str:
    return "\n".join(open(p, errors="replace").read() for p in _results_files())


def job(strategy="fsdp", mbs=1, recompute="none", chunk=0, expandable=False, gpus=1, ep=1, frozen=False,
        preset="qwen3vl-30b-a3b", num_layers=None, tp=1, pp=1):
    dp = max(1, gpus // (tp * pp))
    return TrainerConfig(
        model=ModelConfig(preset=preset, num_layers=num_layers, vision_chunk_patches=chunk,
                          freeze_vision_model=frozen),
        parallel=ParallelConfig(strategy=strategy, ep=ep, tp=tp, pp=pp),
        recompute=RecomputeConfig(granularity=recompute),
        train=TrainConfig(mbs=mbs, gbs=mbs * dp, seq_len=4096, expandable_segments=expandable))


def _case_id(c) -> str:
    extra = [f"chunk{c[5]}"] * bool(c[5]) + ["expandable"] * c[6] + ["frozen-vision"] * c[9]
    return "-".join([c[1], c[2], f"mbs{c[3]}", f"recompute-{c[4]}", *extra, f"{c[7]}gpu"])


@pytest.mark.parametrize("case", RECORDED, ids=_case_id)
def test_recorded_peaks_within_ten_percent(case):
    name, strategy, source, mbs, rc, chunk, exp, gpus, ep, frozen, fill, measured = case
    peaks = recorded_peaks()
    assert measured in peaks.get(name, set()) or any(measured in v for v in peaks.values()), (name, measured)
    cfg = job(strategy, mbs, rc, chunk, exp, gpus, ep, frozen, num_layers=4)
    plan = plan_job(cfg, gpus, H200_GIB, Workload(image_share=IMAGE_SHARE[source], fill=fill), advise=False)
    assert abs(plan.peak_gib - measured) / measured <= 0.10, (plan.peak_gib, measured)
    assert plan.fits, plan.verdict()  # every recorded case ran


@pytest.mark.parametrize("preset,mbs,measured", QUOTED)
def test_depth_proxy_peaks_as_quoted(preset, mbs, measured):
    plan = plan_job(job("3d", mbs, "full", 32768, True, preset=preset), 1, H200_GIB,
                    Workload(image_share=IMAGE_SHARE["real"]), advise=False)
    assert abs(plan.peak_gib - measured) / measured <= 0.10, plan.peak_gib
    assert plan.fits


# The depth proxy as trainer.run picks it with no flags on one H200 (fsdp, MBS 1, full recompute,
# 32k-patch chunks, expandable segments), real photos and the image-free mock: (summary file, source, peak).
DEPTH_PROXY_RUNS = [
    ("h200/train-depth-proxy-main-command/summary.json", "real", 109.28),
    ("h200/train-depth-proxy-real-vs-mock-fsdp-mbs1/real.summary.json", "real", 109.28),
    ("h200/train-depth-proxy-real-vs-mock-fsdp-mbs1/mock.summary.json", "mock", 109.0),
]


@pytest.mark.parametrize("name,source,measured", DEPTH_PROXY_RUNS, ids=lambda v: str(v))
def test_depth_proxy_runs_within_ten_percent(name, source, measured):
    with open(os.path.join(RESULTS, name)) as f:
        assert json.load(f)["peak_mem_gib"] == pytest.approx(measured, abs=0.01)
    plan = plan_job(job("fsdp", 1, "full", 32768, True, preset="qwen3vl-30b-a3b-48layers-16experts"), 1, H200_GIB,
                    Workload(image_share=IMAGE_SHARE[source]), advise=False)
    assert abs(plan.peak_gib - measured) / measured <= 0.10, plan.peak_gib
    assert plan.fits


@pytest.mark.parametrize("case", OUT_OF_MEMORY, ids=lambda c: f"{c[1]}-mbs{c[2]}-{c[3]}-chunk{c[4]}")
def test_recorded_out_of_memory_runs_do_not_fit(case):
    evidence, strategy, mbs, rc, chunk, exp, fill = case
    assert evidence in results_text(), evidence
    plan = plan_job(job(strategy, mbs, rc, chunk, exp, num_layers=4), 1, H200_GIB,
                    Workload(image_share=IMAGE_SHARE["real"], fill=fill))
    assert not plan.fits, plan.verdict()
    fixes = nearest_fits(plan.cfg, 1, H200_GIB, Workload(image_share=IMAGE_SHARE["real"], fill=fill))
    assert fixes and all(p.fits for _, p in fixes)


MODELS = [("qwen3vl-30b-a3b", None), ("qwen3vl-235b-a22b", None), ("qwen3vl-30b-a3b-48layers-16experts", None),
          ("qwen3vl-30b-a3b-4layers-16experts", None), ("qwen3vl-30b-a3b-4layers-128experts", None)]


@pytest.mark.parametrize("preset", [m for m, _ in MODELS])
def test_answers_for_1_8_64_gpus_of_80_141_186_gib(preset):
    t0 = time.perf_counter()
    needs = {}
    for gpus in (1, 8, 64):
        for gib in (80, 141, 186):
            plan = plan_job(job("fsdp", 2, "full", 32768, True, gpus=gpus, preset=preset), gpus, gib)
            d = plan.to_dict()
            assert isinstance(d["peak_gib"], float) and isinstance(d["fits"], bool)
            assert d["fits"] == (plan.need_gib <= plan.usable_gib)
            assert plan.advice and all(a.what and len(a.why) > 20 for a in plan.advice)
            needs[gpus, gib] = plan
    assert time.perf_counter() - t0 < 2.0  # nine plans with advice, well under a second each
    for gib in (80, 141, 186):  # FSDP shards the states: more GPUs never need more per GPU
        assert needs[1, gib].need_gib >= needs[8, gib].need_gib >= needs[64, gib].need_gib
    for gpus in (1, 8, 64):  # more memory never turns a fit into a miss
        fits = [needs[gpus, g].fits for g in (80, 141, 186)]
        assert fits == sorted(fits)


def test_verdicts_across_machines():
    def fits(preset, gpus, gib, **kw):
        return plan_job(job(gpus=gpus, preset=preset, **kw), gpus, gib, advise=False).fits

    full = dict(strategy="fsdp", mbs=2, recompute="full", chunk=32768, expandable=True)
    assert not any(fits("qwen3vl-30b-a3b", 1, g, **full) for g in (80, 141, 186))  # 31B x 16 B > 186 GiB
    assert fits("qwen3vl-30b-a3b", 8, 141, **full) and fits("qwen3vl-30b-a3b", 64, 80, **full)
    assert not any(fits("qwen3vl-235b-a22b", n, g, **full) for n in (1, 8) for g in (80, 141, 186))
    assert fits("qwen3vl-235b-a22b", 64, 141, **full) and fits("qwen3vl-235b-a22b", 64, 186, **full)
    assert fits("qwen3vl-30b-a3b-48layers-16experts", 1, 141, **full) and not fits("qwen3vl-30b-a3b-48layers-16experts", 1, 80, **full)
    assert fits("qwen3vl-30b-a3b-4layers-16experts", 1, 80, **full)


@pytest.mark.parametrize("gpus,gib,picked", [
    (1, 80, "qwen3vl-30b-a3b-4layers-16experts"), (1, 141, "qwen3vl-30b-a3b-48layers-16experts"),
    (8, 141, "qwen3vl-30b-a3b"), (64, 186, "qwen3vl-30b-a3b")])
def test_fit_auto_picks_the_largest_model_that_fits(gpus, gib, picked):
    cfg, plan, reason = fit_auto(job(gpus=gpus), gpus, gib)
    assert cfg.model.preset == picked and plan.fits and not plan.tight, reason
    assert picked in reason and "GiB" in reason
    cfg.validate(gpus)


def test_fit_auto_keeps_a_requested_235b_where_it_fits():
    cfg, plan, reason = fit_auto(job(gpus=64, preset="qwen3vl-235b-a22b"), 64, 186)
    assert cfg.model.preset == "qwen3vl-235b-a22b" and plan.fits, reason


def test_recommendations_name_their_reasons():
    plan = plan_job(job("3d", 8, "full", 0, False, num_layers=4), 1, H200_GIB)
    advice = {a.what: a.why for a in plan.advice}
    assert any("--vision-chunk-patches" in w for w in advice)  # 118k patches in one call
    assert any("--expandable-segments" in w for w in advice)
    assert any("mock" in w for w in advice) and any("dispatcher" in w for w in advice)
    assert any("cuda-graph" in w for w in advice) and any("freeze-vision" in w for w in advice)
    assert any(w.startswith("try MBS") or "MBS" in w for w in advice)
    fsdp = plan_job(job("fsdp", 2, num_layers=4), 1, H200_GIB)
    assert any("bring-up" in a.what and "frozen" in a.why for a in fsdp.advice)
    bad = plan_job(job("3d", 1, gpus=8, pp=8, preset="qwen3vl-30b-a3b-4layers-16experts"), 8, H200_GIB)
    assert any(a.what == "use --strategy fsdp" and "layers" in a.why for a in bad.advice)


def test_cli_json_has_peak_and_fits(capsys):
    rc = plan_main(["qwen3vl", "--gpus", "1", "--gpu-memory-gib", "141", "--json", "--num-layers", "4",
                    "--strategy", "3d", "--mbs", "8", "--recompute", "full", "--vision-chunk-patches", "32768",
                    "--expandable-segments"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["fits"] is True and 108 < out["peak_gib"] < 132
    assert set(out["parts_gib"]) >= {"weights_bf16", "grads", "main_params_fp32", "optimizer_states",
                                     "logits_fp32", "allocator_slack", "outside_allocator"}
    rc = plan_main(["qwen3vl", "--gpus", "1", "--json"])  # the full 30B on one GPU
    out = json.loads(capsys.readouterr().out)
    assert rc == 1 and out["fits"] is False and out["nearest_fits"]


def test_cli_needs_no_torch_ray_or_megatron_and_answers_fast():
    code = ("import sys, time; t = time.perf_counter(); from trainer.plan.__main__ import main; "
            "main(['qwen3vl', '--gpus', '8', '--gpu-memory-gib', '80']); "
            "print('elapsed', time.perf_counter() - t); "
            "print('loaded', [m for m in ('torch', 'ray', 'megatron', 'transformers') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60).stdout
    assert "loaded []" in out, out
    assert float(out.split("elapsed")[1].split()[0]) < 1.0
    assert "verdict:" in out and "recommendations:" in out


def test_run_stops_before_ray_when_the_model_cannot_fit():
    code = ("import sys\nfrom trainer.run import main\n"
            "try:\n    main(['qwen3vl', '--backend', 'megatron', '--world-size', '1', '--gpu-memory-gib', '80',\n"
            "          '--model-preset', 'qwen3vl-30b-a3b'])\n"
            "except SystemExit as exc:\n    print(exc)\n    print('exit', exc.code is not None and exc.code != 0)\n"
            "print('ray loaded', 'ray' in sys.modules)\n")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    elapsed = time.perf_counter() - t0
    out = proc.stdout
    assert "does not fit" in out and "nearest settings that fit" in out and "fp32 main params" in out, out
    assert "exit True" in out and "ray loaded False" in out, out
    assert elapsed < 30, elapsed  # seconds, not the minutes a model build would take


def test_run_fit_auto_rewrites_the_options_to_what_fits():
    from trainer.plan.gate import plan_gate_declared
    from trainer.run import parse_args

    args = parse_args(["qwen3vl", "--world-size", "1", "--gpu-memory-gib", "141", "--mbs", "2"])
    plan_gate_declared(args)
    assert args.model_preset == "qwen3vl-30b-a3b-48layers-16experts" and args.fit == "off"
    from trainer.config import from_args

    cfg = from_args(args)
    assert plan_job(cfg, 1, 141, advise=False).fits and cfg.train.mbs == 2
    kept = parse_args(["qwen3vl", "--world-size", "8", "--gpu-memory-gib", "141"])
    plan_gate_declared(kept)
    assert kept.model_preset == "qwen3vl-30b-a3b"
    off = parse_args(["qwen3vl", "--world-size", "1", "--gpu-memory-gib", "80", "--fit", "off"])
    plan_gate_declared(off)
    assert from_args(off).model.preset == "qwen3vl-30b-a3b"  # the pipeline's own, untouched


def test_fit_auto_climbs_down_the_pipelines_own_presets():
    from trainer.plan.gate import plan_gate_declared
    from trainer.run import parse_args

    args = parse_args(["qwen35vl", "--world-size", "1", "--gpu-memory-gib", "141"])
    plan_gate_declared(args)
    assert args.model_preset.startswith("qwen35vl-35b-a3b-") and args.model_preset.endswith("-16experts")


def test_gpu_memory_from_the_clusters_gpu_type():
    from trainer.plan.gate import gpu_memory_from_resources

    assert gpu_memory_from_resources({"GPU": 8, "accelerator_type:H200": 1.0}) == 141
    assert gpu_memory_from_resources({"GPU": 4, "accelerator_type:GB200": 1.0}) == 186
    assert gpu_memory_from_resources({"CPU": 2}) is None


def test_a_knob_the_gpus_cannot_take_stops_in_one_line_before_any_rank():
    from trainer.plan.gate import plan_gate
    from trainer.run import parse_args

    args = parse_args(["qwen3vl", "--moe-dispatcher", "flex", "--flex-backend", "hybridep"])
    with pytest.raises(SystemExit) as exc:
        plan_gate(args, 1, 141)
    message = str(exc.value)
    assert "\n" not in message and "flex" in message and "--moe-dispatcher alltoall" in message
