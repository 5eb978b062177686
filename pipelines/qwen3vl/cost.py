"""Predicted seconds of a packed Qwen3-VL micro-batch: the model-specific part of the cost model
that ``datasvc.pack.balance`` balances DP ranks with.

The per-step metrics the trainer has recorded on the H200 (``tests/data/recorded/*.metrics.jsonl``) hold
step time, row-slot and real tokens, and Megatron-Bridge's own FLOP count of the step; they do not
hold the step's images. So the fit goes through the FLOP model (``flops.py``):

* Megatron-Bridge counts the decoder as exactly ``6 * active_params * slot tokens`` (the image-free
  mock's FLOPs match it to 0.1%), so a step's FLOPs beyond that are its vision FLOPs, and those over
  Megatron-Bridge's FLOPs per patch (calibrated on the photo set's known patches per real token) give
  the step's vision patches.
* Each step is then ``t = overhead + text_flops / R_text + vision_flops / R_vision`` with our FLOP
  model's counts (decoder linear + per-sample attention; tower linear + per-image attention), fitted
  by least squares over real-photo, calibrated-synthetic and image-free steps of one setting. The
  mock pins ``R_text`` and the overhead; the image steps pin ``R_vision``.
* The coefficients of ``CostModel`` follow from the FLOP model at those two effective rates. The
  metrics cannot separate a tower's per-patch cost from its patches-squared attention (no per-image
  sizes were recorded), nor the decoder's linear from its attention cost: those splits are the FLOP
  model's, at one effective rate per tower. That is a modelling assumption, not a measurement.

Depths other than the measured 4-layer proxy (the full 48-layer 30B-A3B, 235B-A22B) reuse the
fitted rates through their own FLOP model: derived, not measured.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from datasvc.pack.balance import CostModel
from pipelines.qwen3vl.flops import ModelSpec, from_arch
from pipelines.qwen3vl.arch import arch

MEASURED_PRESET = "qwen3vl-30b-a3b-4layer"
"""The model the H200 runs trained: 30B-A3B with 4 decoder layers (128 experts), full vision tower."""


def measured_model() -> ModelSpec:
    return from_arch(MEASURED_PRESET, arch("qwen3vl-30b-a3b", num_layers=4))


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """Effective rates of one training setting, fitted to recorded steps, and where they came from."""

    name: str
    text_tflops: float
    """Effective decoder TFLOP/s (our FLOP count over the decoder's share of the step)."""
    vision_tflops: float
    step_overhead_s: float
    hardware: str
    setting: str
    files: tuple[str, ...]
    commit: str
    steps: int
    rms_rel_error: float
    """Root mean square of (predicted - measured) / measured over the fitted steps."""
    case_rel_errors: dict
    """Per case (metrics file): mean predicted over mean measured step time, minus one."""
    rel_std_errors: dict
    """Standard error of each fitted term over its value (overhead, text, vision): how well the
    recorded steps pin it down."""
    model: str = MEASURED_PRESET
    """The model the steps trained; other models get its rates through their own FLOP model."""


_H200 = "1x NVIDIA H200, Megatron-Bridge 0.6.2, megatron-core 0.19.2, TE 2.20.2, torch 2.11.0+cu130"
CALIBRATIONS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calibrations.json")
"""The fitted settings, as ``python -m datasvc.tools.bench.balance --fit`` writes them (real photos at
a 1 MP cap, seq 4096, MBS = GBS, steps after the first fifth of each run), with notes on each."""


def load_calibrations(path: str = CALIBRATIONS_FILE) -> dict[str, Calibration]:
    with open(path) as f:
        records = json.load(f)["calibrations"]
    return {r["name"]: Calibration(**{**r, "files": tuple(r["files"])}) for r in records}


CALIBRATIONS: dict[str, Calibration] = load_calibrations()


def cost_model(preset: str | None = None, calibration: str | None = None, num_layers: int | None = None,
               num_experts: int | None = None, vision_trainable: bool = True) -> CostModel:
    """The cost model of ``preset`` (default: the calibration's own model) at ``calibration``'s fitted
    rates (default: 3d, no recompute). Presets: flops.PRESETS names or ``qwen3vl-30b-a3b-4layer``;
    ``num_layers`` and ``num_experts`` override the preset's, as the trainer's proxies do, and a frozen
    tower (``vision_trainable=False``) costs its forward only. A model other than the calibration's
    gets its rates through its own FLOPs (derived)."""
    import dataclasses

    from pipelines.qwen3vl.flops import PRESETS

    name = calibration or "h200-3d"
    if name not in CALIBRATIONS:
        raise ValueError(f"unknown calibration {name!r}; fitted: {', '.join(sorted(CALIBRATIONS))}")
    c = CALIBRATIONS[name]
    preset = preset or c.model
    if preset != MEASURED_PRESET and preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose {MEASURED_PRESET} or one of {', '.join(PRESETS)}")
    model = model_spec(preset)
    if num_layers or num_experts:
        if preset == MEASURED_PRESET:
            raise ValueError(f"{MEASURED_PRESET} is already a proxy: give its preset, qwen3vl-30b-a3b, with the overrides")
        model = from_arch(f"{preset}-{num_layers or 'all'}layers-{num_experts or 'all'}experts",
                          arch(preset, num_layers=num_layers, num_experts=num_experts))
    fitted = model_spec(c.model)
    same = dataclasses.replace(model, name=fitted.name) == fitted
    if same:
        model = fitted
    model = dataclasses.replace(model, vision_trainable=vision_trainable)
    return from_rates(model, c, derived=not same or not vision_trainable)


def options_for_training(preset: str, num_layers: int | None, num_experts: int | None, strategy: str,
                         recompute: bool, freeze_vision: bool) -> dict:
    """``cost_model`` options for a training setting (what ``trainer.run --balance-dp`` hands the
    feeders): the calibration fitted on the nearest strategy and recompute choice, at the trained
    model's own FLOPs. Megatron-FSDP with recompute was fitted on the full-depth proxy only."""
    if strategy == "fsdp":
        calibration = "h200-depth-proxy-fsdp" if recompute else "h200-fsdp"
    else:
        calibration = "h200-3d-recompute" if recompute else "h200-3d"
    return {"preset": preset, "calibration": calibration, "num_layers": num_layers, "num_experts": num_experts,
            "vision_trainable": not freeze_vision}


def model_spec(preset: str) -> ModelSpec:
    from pipelines.qwen3vl.flops import PRESETS

    return measured_model() if preset == MEASURED_PRESET else PRESETS[preset]


def flop_coefficients(model: ModelSpec) -> dict:
    """FLOPs per unit of each term of ``CostModel`` (forward + backward), from ``flops.py``."""
    v = model.vision
    mult = 6.0 if model.vision_trainable else 2.0
    per_patch = v.patch_in * v.hidden + v.depth * (4 * v.hidden**2 + 2 * v.hidden * v.mlp)
    merger_in = v.hidden * v.merge**2
    per_merged = (1 + len(v.deepstack_layers)) * (merger_in * merger_in + merger_in * v.out_hidden)
    return {
        "decoder_per_token": 6.0 * model.active_params,
        "decoder_per_token_sq": 12.0 * model.layers * model.heads * model.head_dim,
        "vision_per_patch": mult * (per_patch + per_merged / v.merge**2),
        "vision_per_patch_sq": (mult / 2.0) * 4.0 * v.depth * v.hidden,
    }


def from_rates(model: ModelSpec, c: Calibration, derived: bool = False) -> CostModel:
    f = flop_coefficients(model)
    text, vision = c.text_tflops * 1e12, c.vision_tflops * 1e12
    how = (f"derived: this model's FLOPs at the rates fitted on {c.model}" if derived
           else "fitted on this model")
    source = (f"{c.name} ({c.setting}; {c.hardware}; files {', '.join(c.files)} at commit {c.commit}; "
              f"{c.steps} steps, rms error {c.rms_rel_error:.1%}); {how}")
    return CostModel(decoder_per_token=f["decoder_per_token"] / text,
                     decoder_per_token_sq=f["decoder_per_token_sq"] / text,
                     vision_per_patch=f["vision_per_patch"] / vision,
                     vision_per_patch_sq=f["vision_per_patch_sq"] / vision,
                     step_overhead=c.step_overhead_s, name=model.name, source=source)


# ---- the fit --------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class PhotoStats:
    """What the fit needs of the real-photo set, from image headers (no decode)."""

    patches_per_real_token: float
    patch_sq_per_patch: float
    """sum(p^2) / sum(p) over images: the mean image size seen by a patch."""
    mean_sample_tokens: float
    token_sq_per_sample: float


def _steps(path: str) -> list[dict]:
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return records[max(1, len(records) // 5):]


def _regressors(model: ModelSpec, rec: dict, has_images: bool, stats: PhotoStats, mb_per_patch: float):
    """(text FLOPs, vision FLOPs, seconds) of one recorded step. Records that carry the step's own
    ``vision_patches`` / ``vision_patches_sq`` / ``sample_tokens_sq`` and ``compute_s`` (step time
    less data wait) are used as they are; older records get them from the FLOP count and the set."""
    t = rec["step_time_s"]
    slots, real = rec["slot_tokens_per_s"] * t, rec["tokens_per_s"] * t
    f = flop_coefficients(model)
    samples = real / stats.mean_sample_tokens if has_images else 0.0
    tokens_sq = rec.get("sample_tokens_sq", samples * stats.token_sq_per_sample)
    text = f["decoder_per_token"] * slots + f["decoder_per_token_sq"] * tokens_sq
    patches = 0.0
    if has_images:
        patches = max(0.0, rec["tflops_per_gpu"] * t * 1e12 - f["decoder_per_token"] * slots) / mb_per_patch
    patches = rec.get("vision_patches", patches)
    patches_sq = rec.get("vision_patches_sq", patches * stats.patch_sq_per_patch)
    vision = f["vision_per_patch"] * patches + f["vision_per_patch_sq"] * patches_sq
    return text, vision, rec.get("compute_s", t)


def fit(name: str, files: dict[str, bool], stats: PhotoStats, *, setting: str, commit: str,
        hardware: str = _H200, real_files: list[str] | None = None, model: str = MEASURED_PRESET) -> Calibration:
    """Least squares of step time on (1, text FLOPs, vision FLOPs) over the steps of ``files``
    (path -> whether its samples carry images). ``real_files`` (default: the image files) calibrate
    Megatron-Bridge's FLOPs per patch against the photo set's patches per real token."""
    model_name, model = model, model_spec(model)
    dec = flop_coefficients(model)["decoder_per_token"]
    real_files = real_files if real_files is not None else [p for p, img in files.items() if img]
    vis_flops = real_patches = 0.0
    for path in real_files:
        for r in _steps(path):
            t = r["step_time_s"]
            vis_flops += r["tflops_per_gpu"] * t * 1e12 - dec * r["slot_tokens_per_s"] * t
            real_patches += r["tokens_per_s"] * t * stats.patches_per_real_token
    mb_per_patch = vis_flops / real_patches
    rows, times, case = [], [], []
    for path, has_images in files.items():
        for r in _steps(path):
            text, vision, t = _regressors(model, r, has_images, stats, mb_per_patch)
            rows.append((1.0, text, vision))
            times.append(t)
            case.append(path)
    a, t = np.asarray(rows), np.asarray(times)
    scale = a.max(axis=0)
    coef, *_ = np.linalg.lstsq(a / scale, t, rcond=None)
    coef = coef / scale
    if (coef[1:] <= 0).any():
        raise ValueError(f"fit of {name} gave a non-positive rate {coef}: the files do not separate "
                         "decoder from vision (need image-free and image steps of one setting)")
    pred = a @ coef
    dof = max(1, len(t) - a.shape[1])
    scaled = a / scale
    cov = np.linalg.pinv(scaled.T @ scaled) * float(np.sum((t - pred) ** 2)) / dof
    se = np.sqrt(np.clip(np.diag(cov), 0, None)) / scale / np.maximum(np.abs(coef), 1e-30)
    errors = {}
    for path in files:
        m = np.asarray([c == path for c in case])
        errors[path.rsplit("/", 1)[-1]] = round(float(pred[m].mean() / t[m].mean() - 1), 4)
    return Calibration(name=name, text_tflops=round(1 / coef[1] / 1e12, 2),
                       vision_tflops=round(1 / coef[2] / 1e12, 2), step_overhead_s=round(max(0.0, coef[0]), 4),
                       hardware=hardware, setting=setting, files=tuple(p.rsplit("/", 1)[-1] for p in files),
                       commit=commit, steps=len(t), rms_rel_error=round(float(np.sqrt(np.mean((pred / t - 1) ** 2))), 4),
                       case_rel_errors=errors, model=model_name,
                       rel_std_errors={k: round(float(v), 3) for k, v in zip(("overhead", "text", "vision"), se)})


def check(files: list[str], calibration: str | None = None) -> list[dict]:
    """The calibration's cost model against recorded steps it was not fitted on: each steady step's
    predicted seconds from the step's own inputs (``vision_patches``, ``vision_patches_sq``,
    ``sample_tokens_sq`` and its slot tokens) against its measured ``compute_s``. Per file: mean
    predicted over mean measured minus one, the rms of the per-step relative errors, and their
    correlation."""
    model = cost_model(calibration=calibration)
    out = []
    for path in files:
        steps = [r for r in _steps(path) if "vision_patches" in r and "compute_s" in r]
        if not steps:
            out.append({"file": path, "steps": 0, "why": "no steady step records the cost inputs"})
            continue
        pred = np.asarray([model.step_overhead
                           + model.decoder_from_sums(r["slot_tokens_per_s"] * r["step_time_s"], r["sample_tokens_sq"])
                           + model.vision_from_sums(r["vision_patches"], r["vision_patches_sq"]) for r in steps])
        meas = np.asarray([r["compute_s"] for r in steps])
        corr = float(np.corrcoef(pred, meas)[0, 1]) if len(steps) > 2 and pred.std() > 0 and meas.std() > 0 else None
        out.append({"file": path, "steps": len(steps), "calibration": calibration or "default",
                    "mean_rel_error": round(float(pred.mean() / meas.mean() - 1), 4),
                    "rms_rel_error": round(float(np.sqrt(np.mean((pred / meas - 1) ** 2))), 4),
                    "correlation": None if corr is None else round(corr, 3),
                    "measured_s": round(float(meas.mean()), 4), "predicted_s": round(float(pred.mean()), 4)})
    return out


def _commit(paths: list[str]) -> str:
    """The commits that recorded the files (git, when the repository is there)."""
    import subprocess

    found = []
    for path in paths:
        try:
            out = subprocess.run(["git", "log", "-1", "--format=%h", "--", os.path.abspath(path)], capture_output=True, text=True,
                                 cwd=os.path.dirname(os.path.abspath(path)), timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            out = ""
        found.append(out or "unknown")
    return "+".join(sorted(set(found)))


def calibration_inputs(results_dir: str) -> dict[str, tuple[dict[str, bool], dict]]:
    """The settings fitted, each: metrics files (path -> carries images) and the fit's labels. Each
    setting holds real-photo, calibrated-synthetic and image-free runs of one strategy and
    recompute choice from the same software; image-free runs pin the decoder and the overhead."""
    def files(strategy: str, cases: list[str]) -> dict[str, bool]:
        out = {}
        for case in cases:
            for source in ("real", "synthetic", "mock"):
                path = os.path.join(results_dir, case.format(strategy=strategy, source=source))
                if os.path.exists(path):
                    out[path] = source != "mock"
        return out

    plain = ["h200/train-4layer-sources-3d-mbs1-4-8-fsdp-mbs8/{strategy}-{source}-large-mbs1.metrics.jsonl", "h200/train-4layer-sources-3d-mbs2-fsdp-mbs1-2-4/{strategy}-{source}-large-mbs1.metrics.jsonl",
             "h200/train-4layer-sources-3d-mbs2-fsdp-mbs1-2-4/{strategy}-{source}-large-mbs2.metrics.jsonl"]
    recompute = ["h200/train-4layer-sources-3d-mbs1-4-8-fsdp-mbs8/{strategy}-{source}-large-mbs4-recompute-vchunk32k.metrics.jsonl",
                 "h200/train-4layer-sources-3d-mbs1-4-8-fsdp-mbs8/{strategy}-{source}-large-mbs8-recompute-vchunk32k-expseg.metrics.jsonl",
                 "h200/train-4layer-sources-3d-mbs2-fsdp-mbs1-2-4/{strategy}-{source}-large-mbs4-recompute-vchunk32k.metrics.jsonl"]
    depth = ["h200/train-depth-proxy-fsdp-mbs1-2/{strategy}-{source}-large-mbs1-depth-proxy.metrics.jsonl",
             "h200/train-depth-proxy-fsdp-mbs1-2/{strategy}-{source}-large-mbs2-depth-proxy.metrics.jsonl"]
    proxy, depth_proxy = "4-layer 30B-A3B proxy (128 experts)", "30B-A3B depth proxy (48 layers, 16 experts)"
    settings = {
        "h200-3d": ("3d", plain, proxy, "3d (TP=PP=EP=1), MBS 1-2, no recompute"),
        "h200-3d-recompute": ("3d", recompute, proxy, "3d, MBS 4-8, full recompute, 32k-patch vision chunks"),
        "h200-fsdp": ("fsdp", plain, proxy, "Megatron-FSDP on one GPU, MBS 1-2, no recompute"),
        "h200-fsdp-recompute": ("fsdp", recompute, proxy, "Megatron-FSDP, MBS 4-8, full recompute, 32k-patch chunks"),
        "h200-depth-proxy-fsdp": ("fsdp", depth, depth_proxy, "Megatron-FSDP on one GPU, MBS 1-2, full recompute, "
                                  "32k-patch vision chunks (what trainer.run picks with no flags)"),
    }
    models = {"h200-depth-proxy-fsdp": "qwen3vl-30b-a3b-48layers-16experts"}
    out = {}
    for name, (strategy, cases, model, setting) in settings.items():
        chosen = files(strategy, cases)
        if any(chosen.values()) and not all(chosen.values()):
            out[name] = (chosen, {"setting": f"{model}, {setting}", "commit": _commit(list(chosen)),
                                  "model": models.get(name, MEASURED_PRESET)})
    return out
