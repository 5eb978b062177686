"""Choosing what fits: the largest model for the GPUs at hand, and the nearest settings that fit."""
from __future__ import annotations

import math

from datasvc.registry import pipeline_part
from trainer.config import ConfigError
from trainer.plan.advice import variant
from trainer.plan.memory import Workload
from trainer.plan.planner import Plan, describe, plan_job



def model_ladder(pipeline: str) -> tuple[str, ...]:
    """The pipeline's presets, largest first: full models, the depth-faithful proxy, the 4-layer proxy."""
    return tuple(pipeline_part(pipeline, "arch").SIZE_ORDER)


def _proxies(pipeline: str) -> dict:
    return pipeline_part(pipeline, "arch").PROXIES
CHUNK_PATCHES = 32768  # measured free at MBS 4 on the H200, where 16k chunks cost 19%
LARGEST_GPUS = 4096
# fit auto keeps this share of each GPU free: the calibration is within ~2% on one H200 and the
# fullest micro-batch of a run can hold more image patches than the planner's rows.
AUTO_MARGIN_SHARE = 0.05


def with_gbs(cfg, gpus: int):
    """``cfg`` with its global batch raised to the next multiple of MBS x DP (what validate wants)."""
    p, t = cfg.parallel, cfg.train
    dp = max(1, gpus // (p.tp * p.pp * p.cp))
    step = t.mbs * dp
    if t.gbs % step:
        t.gbs = step * max(1, math.ceil(t.gbs / step))
    return cfg


def with_model(cfg, preset: str):
    """``cfg`` with another preset and no layer/expert/depth overrides."""
    return variant(cfg, **{"model.preset": preset, "model.num_layers": None, "model.num_experts": None,
                            "model.vision_depth": None})


def _valid(cfg, gpus: int) -> bool:
    try:
        cfg.validate(gpus)
    except ConfigError:
        return False
    return True


def memory_ladder(cfg):
    """(what was added, config) from the settings as given to each memory knob added in turn:
    expandable segments (free), 32k-patch vision chunks (free at that size), full recompute."""
    out, added = [("as given", cfg)], []
    if not cfg.train.expandable_segments:
        cfg = variant(cfg, **{"train.expandable_segments": True})
        added.append("--expandable-segments")
        out.append((" ".join(added), cfg))
    if not cfg.model.vision_chunk_patches and not cfg.model.freeze_vision_model:
        cfg = variant(cfg, **{"model.vision_chunk_patches": CHUNK_PATCHES})
        added.append(f"--vision-chunk-patches {CHUNK_PATCHES}")
        out.append((" ".join(added), cfg))
    if cfg.recompute.granularity != "full":
        cfg = variant(cfg, **{"recompute.granularity": "full", "recompute.num_layers": 1})
        added.append("--recompute full")
        out.append((" ".join(added), cfg))
    return out


def _models_from(cfg) -> list:
    """The requested model, then every smaller rung of the ladder."""
    preset = cfg.model.preset
    overridden = any(getattr(cfg.model, n) is not None for n in ("num_layers", "num_experts", "vision_depth"))
    ladder = model_ladder(cfg.model.pipeline)
    start = ladder.index(preset) if preset in ladder else len(ladder)
    models = [cfg] if overridden or preset not in ladder else []
    return models + [with_model(cfg, p) for p in ladder[start:]]


def fit_auto(cfg, gpus: int, gpu_memory_gib: float, workload: Workload | None = None) -> tuple[object, Plan, str]:
    """The largest configuration that fits: the requested model (the full one by default), else the
    depth-faithful proxy, else the 4-layer proxy, each with memory knobs added only as needed.
    Returns (config, its plan, one sentence saying what was picked and why)."""
    best_of_first = None  # the requested model's smallest need, to say why it was not picked
    last = None
    for i, model in enumerate(_models_from(cfg)):
        for added, candidate in memory_ladder(model):
            candidate = with_gbs(candidate, gpus)
            if not _valid(candidate, gpus):
                continue
            plan = plan_job(candidate, gpus, gpu_memory_gib, workload)
            if i == 0 and (best_of_first is None or plan.need_gib < best_of_first.need_gib):
                best_of_first = plan
            last = (candidate, plan)
            if plan.margin_gib >= AUTO_MARGIN_SHARE * gpu_memory_gib:
                return candidate, plan, _reason(best_of_first or plan, plan, added)
    if last is None:
        try:
            with_gbs(cfg, gpus).validate(gpus)
            why = "check --tp/--pp/--cp/--ep"
        except ConfigError as exc:  # the requested settings' own problems say what to change
            why = "; ".join(line.strip(" -") for line in str(exc).splitlines()[1:])
        raise ConfigError(f"no configuration is valid on {gpus} GPU(s): {why}")
    candidate, plan = last
    return candidate, plan, (f"nothing fits {gpus} x {gpu_memory_gib:g} GiB, not even {describe(candidate, gpus)} "
                             f"({plan.need_gib:.0f} GiB per GPU): use GPUs with more memory or more of them")


def _reason(first: Plan, chosen: Plan, added: str) -> str:
    name = chosen.cfg.model.preset
    what = f"{name} ({chosen.params_b:.2f}B parameters)"
    knobs = "" if added == "as given" else " with " + added
    if first.cfg.model.preset == name:
        return (f"{what}{knobs} fits {chosen.gpus} x {chosen.gpu_memory_gib:g} GiB: "
                f"{chosen.need_gib:.0f} GiB per GPU, {chosen.margin_gib:.0f} GiB margin")
    pipeline = chosen.cfg.model.pipeline
    proxy = " (a proxy: " + _proxy_words(name, pipeline) + ")" if name in _proxies(pipeline) else ""
    return (f"{first.cfg.model.preset} needs at least {first.need_gib:.0f} GiB per GPU of {first.usable_gib:.0f} "
            f"usable ({describe(first.cfg, first.gpus)}); the largest that fits is {what}{proxy}{knobs}: "
            f"{chosen.need_gib:.0f} GiB per GPU")


def _proxy_words(name: str, pipeline: str) -> str:
    base, changes = _proxies(pipeline)[name]
    return f"{base} with " + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in changes.items())


def _moves(cfg, gpus: int):
    """(cost, what, config, gpus): one structural change each; cost orders them from least disruptive."""
    a, p, t = cfg.model.arch(), cfg.parallel, cfg.train
    yield 0, "", cfg, gpus
    if p.strategy == "3d":
        yield 2, "--strategy fsdp --pp 1", variant(cfg, **{"parallel.strategy": "fsdp", "parallel.pp": 1,
                                                             "parallel.vpp": None}), gpus
    for div in (2, 4, 8):
        if t.mbs // div >= 1 and t.mbs % div == 0:
            yield 3 + div // 2, f"--mbs {t.mbs // div}", variant(cfg, **{"train.mbs": t.mbs // div}), gpus
    ep = p.ep * 2
    while ep <= min(gpus, a.num_experts):
        if a.num_experts % ep == 0 and gpus % ep == 0:
            yield 4, f"--ep {ep}", variant(cfg, **{"parallel.ep": ep}), gpus
        ep *= 2
    for tp in (2, 4):
        if tp > p.tp and gpus % tp == 0:
            yield 5, f"--tp {tp}", variant(cfg, **{"parallel.tp": tp}), gpus
    n = gpus * 2
    while n <= LARGEST_GPUS:
        yield 6 + int(math.log2(n // gpus)), f"{n} GPUs", cfg, n
        n *= 2
    ladder = model_ladder(cfg.model.pipeline)
    if cfg.model.preset in ladder:
        here = ladder.index(cfg.model.preset)
        for i, preset in enumerate(ladder[here + 1:], start=here + 1):
            yield 12 + i, f"--model-preset {preset}", with_model(cfg, preset), gpus  # after up to 64x the GPUs


def nearest_fits(cfg, gpus: int, gpu_memory_gib: float, workload: Workload | None = None,
                 limit: int = 5) -> list[tuple[str, Plan]]:
    """The nearest settings that fit: the free memory knobs first, then one structural change
    (strategy, MBS, EP, TP, more GPUs, a smaller model). Returns (what changes, its plan), nearest first."""
    found: dict[str, tuple[float, str, Plan]] = {}  # per structural change, the fewest knobs that fit
    for knob_cost, (added, base) in enumerate(memory_ladder(cfg)):
        for cost, what, candidate, n in _moves(base, gpus):
            group = "gpus" if what.endswith("GPUs") else what
            score = cost * 10 + knob_cost
            if group in found and found[group][0] <= score:
                continue
            candidate = with_gbs(candidate, n)
            if not _valid(candidate, n):
                continue
            plan = plan_job(candidate, n, gpu_memory_gib, workload, advise=False)
            if plan.fits:
                label = " ".join(x for x in (what, added if added != "as given" else "") if x)
                found[group] = (score, label or "as given", plan)
    ranked = sorted(found.values(), key=lambda x: (x[0], x[2].need_gib))
    return [(label, plan) for _, label, plan in ranked[:limit]]
