"""A job's plan: per-GPU memory by part at the peak, the verdict, and the advice that goes with it."""
from __future__ import annotations

from dataclasses import dataclass, field

from trainer.plan.advice import Advice, recommendations
from trainer.plan.memory import (EXPANDABLE_SLACK, GIB, FP32, OUTSIDE_ALLOCATOR_GIB, PER_EXTRA_PROCESS_GIB,
                                 USABLE_SHARE, Workload, layout, moments, total_params)

# Order and wording of the parts in tables and JSON.
PART_NAMES = {
    "weights_bf16": "bf16 weights",
    "grads": "gradients (fp32 under 3d, bf16 shards under fsdp)",
    "main_params_fp32": "fp32 main params",
    "optimizer_states": "Adam moments (fp32)",
    "optimizer_step": "fp32 gradients for the update (fsdp)",
    "decoder_activations": "decoder activations",
    "vision_activations": "vision tower activations",
    "logits_fp32": "logits over the vocabulary (bf16 + fp32 + fp32 grad)",
    "moe_dispatch": "MoE dispatch buffers",
    "recompute": "recomputed layer (full recompute)",
    "vision_attention": "vision attention buffers (one call)",
    "allocator_slack": "allocator slack",
    "outside_allocator": "CUDA context, NCCL, workspaces, data actors",
}
STATE_PARTS = ("weights_bf16", "grads", "main_params_fp32", "optimizer_states")
TIGHT_SHARE = 0.03  # margins under 3% of the GPU are reported as tight


@dataclass
class Plan:
    cfg: object
    gpus: int
    gpu_memory_gib: float
    stage: str  # the pipeline stage whose GPU peaks highest ("only" without PP)
    moment: str  # what sets the peak: loss, decoder_backward, vision_backward, optimizer_step
    parts: dict[str, float]  # GiB at that moment, plus allocator slack and memory outside the allocator
    peak_gib: float  # what torch.cuda.max_memory_allocated would report
    need_gib: float  # peak + slack + outside the allocator
    usable_gib: float
    params_b: float
    workload: Workload = field(default_factory=Workload)
    advice: list[Advice] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.need_gib <= self.usable_gib

    @property
    def margin_gib(self) -> float:
        return self.usable_gib - self.need_gib

    @property
    def tight(self) -> bool:
        return self.fits and self.margin_gib < TIGHT_SHARE * self.gpu_memory_gib

    def replan(self, cfg) -> "Plan":
        """The plan of ``cfg`` on the same GPUs and data (no advice)."""
        return plan_job(cfg, self.gpus, self.gpu_memory_gib, self.workload, advise=False)

    def verdict(self) -> str:
        if not self.fits:
            return f"does not fit: needs {self.need_gib:.1f} GiB of {self.usable_gib:.1f} usable ({-self.margin_gib:.1f} over)"
        word = "fits, tight" if self.tight else "fits"
        return f"{word}: {self.need_gib:.1f} GiB of {self.usable_gib:.1f} usable ({self.margin_gib:.1f} GiB margin)"

    def summary(self) -> str:
        """One line: the job and its verdict."""
        return f"{describe(self.cfg, self.gpus)} on {self.gpus} x {self.gpu_memory_gib:g} GiB: {self.verdict()}"

    def to_dict(self) -> dict:
        c = self.cfg
        return {
            "peak_gib": round(self.peak_gib, 2), "fits": self.fits, "need_gib": round(self.need_gib, 2),
            "usable_gib": round(self.usable_gib, 2), "margin_gib": round(self.margin_gib, 2), "tight": self.tight,
            "gpus": self.gpus, "gpu_memory_gib": self.gpu_memory_gib, "stage": self.stage, "peak_at": self.moment,
            "params_billion": round(self.params_b, 3),
            "parts_gib": {k: round(v, 2) for k, v in self.parts.items()},
            "job": describe(c, self.gpus), "verdict": self.verdict(),
            "recommendations": [a.to_dict() for a in self.advice],
        }


def describe(cfg, gpus: int) -> str:
    """The settings that move memory, as flags."""
    m, p, rc, t = cfg.model, cfg.parallel, cfg.recompute, cfg.train
    bits = [m.preset]
    for name in ("num_layers", "num_experts", "vision_depth"):
        if getattr(m, name) is not None:
            bits.append(f"--{name.replace('_', '-')} {getattr(m, name)}")
    bits.append(f"--strategy {p.strategy}")
    bits += [f"--{n} {getattr(p, n)}" for n in ("tp", "pp", "cp", "ep") if getattr(p, n) > 1]
    if p.vpp:
        bits.append(f"--vpp {p.vpp}")
    bits += [f"--mbs {t.mbs}", f"--seq-len {t.seq_len}"]
    if rc.granularity != "none":
        bits.append(f"--recompute {rc.granularity}" + (f" ({' '.join(rc.modules)})" if rc.granularity == "selective" else ""))
    if m.vision_chunk_patches:
        bits.append(f"--vision-chunk-patches {m.vision_chunk_patches}")
    if t.expandable_segments:
        bits.append("--expandable-segments")
    if m.freeze_vision_model:
        bits.append("--freeze-vision-model")
    if m.freeze_language_model:
        bits.append("--freeze-language-model")
    return " ".join(bits)


def _stage_need(cfg, lay, work: Workload, first: bool, last: bool) -> tuple[str, dict[str, float], float, float]:
    """(moment, parts at the peak, peak allocated, need) of one stage's GPU."""
    mo = moments(cfg, lay, work, first, last)
    moment, peak = mo.peak()
    parts = dict(mo.parts[moment])
    states = sum(parts.get(k, 0.0) for k in STATE_PARTS)
    if cfg.train.expandable_segments:
        slack = EXPANDABLE_SLACK * (peak - states)
    else:
        # A freed block the size of the fp32 logits is kept reserved and cannot serve the next,
        # differently sized request (18.04 GiB stranded at MBS 8 against an 18.55 GiB request).
        a = cfg.model.arch()
        slack = FP32 * a.vocab_size / lay.tp * cfg.train.mbs * cfg.train.seq_len / lay.cp / GIB if last else 0.0
        slack = max(slack, EXPANDABLE_SLACK * (peak - states))
    outside = OUTSIDE_ALLOCATOR_GIB + PER_EXTRA_PROCESS_GIB * work.data_processes_on_gpu + (0.5 if lay.gpus > 1 else 0.0)
    parts["allocator_slack"], parts["outside_allocator"] = slack, outside
    return moment, parts, peak, peak + slack + outside


def plan_job(cfg, gpus: int, gpu_memory_gib: float, workload: Workload | None = None, advise: bool = True) -> Plan:
    """The per-GPU memory plan of ``cfg`` on ``gpus`` GPUs of ``gpu_memory_gib`` each (no torch, no Ray)."""

    work = workload or Workload()
    lay = layout(cfg, gpus)
    stages = [("only", True, True)] if lay.pp == 1 else [("first", True, False), ("last", False, True)]
    best = None
    for name, first, last in stages:
        moment, parts, peak, need = _stage_need(cfg, lay, work, first, last)
        if best is None or need > best[4]:
            best = (name, moment, parts, peak, need)
    name, moment, parts, peak, need = best
    plan = Plan(cfg=cfg, gpus=gpus, gpu_memory_gib=gpu_memory_gib, stage=name, moment=moment, parts=parts,
                peak_gib=peak, need_gib=need, usable_gib=USABLE_SHARE * gpu_memory_gib,
                params_b=total_params(cfg.model.arch()) / 1e9, workload=work)
    if advise:
        plan.advice = recommendations(plan, work)
    return plan
