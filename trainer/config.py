"""Training options for the Megatron-Bridge backend: small typed sections, one top-level config.

Everything here is plain Python (no torch, no Megatron import), so ``python -m trainer.run`` can parse
and validate a job before any GPU is touched. ``TrainerConfig.validate(world_size)`` mirrors the checks
Megatron-Core / Megatron-Bridge would make later (deep inside model construction, after minutes of
start-up) and says what to change. ``trainer.megatron.container`` turns a validated config into a
Megatron-Bridge ``ConfigContainer``.

Command line: each option is a section field with ``flag(...)`` metadata; ``add_cli_args(parser)``
adds them (``trainer.flags``), ``from_args(args)`` builds the config. The checks themselves are in
``trainer.config_checks``.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from datasvc.training import DEVICE_DEFAULTS, add_data_flags, micro_batches_per_step
from datasvc.usage import UserError, positive_float, positive_int
from datasvc.registry import pipeline_part
from trainer.checkpoint import CheckpointingConfig, EvalConfig
from trainer.flags import add_section_flags, flag, flag_name, section_from_args
from trainer.config_checks import problems_of


class ConfigError(ValueError, UserError):
    """An invalid combination of options; the message lists every problem and what to change."""


# Sections ----------------------------------------------------------------------------------------
# A field with ``flag(...)`` is a command-line option of trainer.run and trainer.plan (trainer.flags).
@dataclass(kw_only=True)
class ModelConfig:
    pipeline: str = "qwen3vl"  # the model family (pipelines/NAME): its presets, HF config, CPU model
    preset: str = field(default="qwen3vl-30b-a3b", metadata=flag(
        "an architecture preset of the pipeline (default: its own)", name="--model-preset", type=str, default=None))
    # Overrides that turn a preset into a proxy that fits one or two GPUs (None keeps the preset's).
    num_layers: int | None = field(default=None, metadata=flag("decoder layers (proxy override)", type=int))
    num_experts: int | None = field(default=None, metadata=flag("experts per MoE layer (proxy override)", type=int))
    vision_depth: int | None = field(default=None, metadata=flag("vision tower layers (proxy override)", type=int))
    hf_path: str | None = field(default=None, metadata=flag(
        "start from this HF checkpoint (id or local dir) via AutoBridge (default: random init)"))
    freeze_language_model: bool = field(default=False, metadata=flag("freeze the language model"))
    freeze_vision_model: bool = field(default=False, metadata=flag("freeze the vision tower"))
    freeze_vision_projection: bool = field(default=False, metadata=flag("freeze the vision projection (mergers)"))
    vision_chunk_patches: int = field(default=0, metadata=flag(
        "run the vision tower over at most this many patches at a time, whole images (0 = a micro-batch's "
        "images at once); lowers its peak memory at large MBS", type=int))

    def arch(self):
        """The preset with the overrides applied (the pipeline's ``arch`` dataclass)."""
        return pipeline_part(self.pipeline, "arch").arch(self.preset, num_layers=self.num_layers,
                                                         num_experts=self.num_experts, vision_depth=self.vision_depth)


@dataclass(kw_only=True)
class ParallelConfig:
    strategy: Literal["fsdp", "3d"] = field(default="fsdp", metadata=flag(
        "fsdp: Megatron-FSDP (params, grads and optimizer state sharded over DP), overlaps on; 3d: TP/PP/VPP/CP/"
        "EP/ETP with the distributed optimizer"))
    tp: int = field(default=1, metadata=flag("tensor-parallel size"))
    pp: int = field(default=1, metadata=flag("pipeline-parallel size"))
    vpp: int | None = field(default=None, metadata=flag("virtual pipeline stages per rank"))
    cp: int = field(default=1, metadata=flag("context-parallel size"))
    ep: int = field(default=1, metadata=flag("expert-parallel size"))
    etp: int | None = field(default=None, metadata=flag("expert tensor-parallel size (default: Megatron's, as TP)"))


@dataclass(kw_only=True)
class MoEConfig:
    dispatcher: Literal["alltoall", "flex"] = field(default="alltoall", metadata=flag(
        "the MoE token dispatcher", name="--moe-dispatcher"))
    flex_backend: Literal["deepep", "hybridep"] | None = field(default=None, metadata=flag(
        "the flex dispatcher's backend (needed with --moe-dispatcher flex)"))
    aux_loss_coeff: float = field(default=1e-3, metadata=flag("load-balancing loss coefficient",
                                                              name="--moe-aux-loss-coeff"))


@dataclass(kw_only=True)
class RecomputeConfig:
    granularity: Literal["none", "full", "selective"] = field(default="none", metadata=flag(
        "activation recompute", name="--recompute"))
    modules: list[str] = field(default_factory=lambda: ["core_attn"], metadata=flag(
        "selective recompute: which modules (Megatron's names; default: core_attn)", name="--recompute-modules",
        default=None))
    num_layers: int = field(default=1, metadata=flag(
        "full recompute: layers per recompute chunk (Megatron's uniform method)", name="--recompute-num-layers",
        type=int))


@dataclass(kw_only=True)
class CudaGraphConfig:
    scope: list[str] = field(default_factory=list, metadata=flag(
        "per-layer Transformer Engine CUDA graphs over these parts of each decoder layer, e.g. moe_router "
        "moe_preprocess (empty: CUDA graphs off)", name="--cuda-graph-scope", nargs="*"))
    warmup_steps: int = field(default=3, metadata=flag("steps before capture", name="--cuda-graph-warmup-steps",
                                                       type=int))
    static_shapes: bool = field(default=False, metadata=flag(
        "the vision tower as CUDA graphs at one fixed length (--mbs x --seq-len x 4 patches, padding masked, "
        "each image attending within itself); --strategy 3d only"))

    @property
    def captures(self) -> bool:
        """Whether any part of the model is captured as CUDA graphs."""
        return bool(self.scope or self.static_shapes)

    def vision_length(self, mbs: int, seq_len: int, merge: int = 2) -> int:
        """The fixed number of vision patches the tower's graphs take."""
        return mbs * seq_len * merge * merge


CPU_DEVELOPMENT = {"seq_len": DEVICE_DEFAULTS["cpu"].seq_len, "train_iters": 30, "lr": 1e-3}
"""The CPU development path's training settings: a tiny model's run that finishes in minutes on two cores
and visibly learns."""


@dataclass(kw_only=True)
class TrainConfig:
    mbs: int = field(default=1, metadata=flag("micro-batch rows (a packed row holds several samples)"))
    gbs: int = field(default=8, metadata=flag("rows per optimizer step over all DP ranks (default: mbs x dp)"))
    seq_len: int = field(default=DEVICE_DEFAULTS["gpu"].seq_len, metadata=flag(data=True))
    train_iters: int = field(default=50, metadata=flag("optimizer steps"))
    lr: float = field(default=1e-4, metadata=flag("peak learning rate", type=positive_float))
    min_lr: float = field(default=1e-5, metadata=flag("learning rate at the end of the cosine decay"))
    warmup_iters: int = field(default=5, metadata=flag("linear warm-up steps", type=int))
    weight_decay: float = field(default=0.1, metadata=flag("AdamW weight decay"))
    clip_grad: float = field(default=1.0, metadata=flag("gradient norm clip"))
    bf16: bool = field(default=True, metadata=flag("bf16 mixed precision (--no-bf16: fp32)"))
    seed: int = field(default=1234, metadata=flag("the training seed (Megatron takes only one above 0)"))
    log_interval: int = field(default=1, metadata=flag("steps between log lines"))
    padded: bool = field(default=False, metadata=flag(
        "Megatron-Bridge's stock qwen3_vl_step on one sample per padded row (the comparison baseline; default: "
        "the packed THD step, MRoPE restarted per sample)"))
    # Large MBS leaves big freed blocks that a later, larger allocation (the fp32 logits) cannot reuse:
    # measured 18 GiB stranded at MBS 8.
    expandable_segments: bool = field(default=False, metadata=flag(
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True on every rank (less fragmentation at large MBS)"))

    def grad_accum(self, dp_size: int) -> int:
        """Micro-batches each of ``dp_size`` DP ranks trains per optimizer step."""
        return micro_batches_per_step(self.gbs, self.mbs, dp_size)

    def for_cpu_development(self, given: set[str]) -> "TrainConfig":
        """These settings on the CPU development path (``CPU_DEVELOPMENT``), but for the fields whose
        flags are in ``given`` (the user's own win)."""
        flags = {f.name: flag_name(f) for f in dataclasses.fields(self)}
        return dataclasses.replace(self, **{name: value for name, value in CPU_DEVELOPMENT.items()
                                            if flags[name] not in given})


@dataclass(kw_only=True)
class TrainerConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    cuda_graph: CudaGraphConfig = field(default_factory=CudaGraphConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointingConfig = field(default_factory=CheckpointingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def data_parallel_size(self, world_size: int) -> int:
        p = self.parallel
        return world_size // (p.tp * p.pp * p.cp)

    def validate(self, world_size: int) -> None:
        """Raise ConfigError listing every problem; cheap, no torch, call before any GPU work."""
        problems = problems_of(self, world_size)
        if problems:
            raise ConfigError("invalid training options:\n  - " + "\n  - ".join(problems))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# Command line ------------------------------------------------------------------------------------
FLAG_GROUPS = (("model", (ModelConfig,)), ("parallelism", (ParallelConfig,)), ("moe", (MoEConfig,)),
               ("memory and speed", (RecomputeConfig, CudaGraphConfig)), ("training", (TrainConfig,)),
               ("checkpoints, evaluation and export", (CheckpointingConfig, EvalConfig)))


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the training options: every flagged field of the sections (names follow the Megatron-Bridge
    performance guide)."""
    for title, sections in FLAG_GROUPS:
        group = parser.add_argument_group(title)
        for section in sections:
            add_section_flags(group, section)
    return parser


def from_args(args: argparse.Namespace) -> TrainerConfig:
    """Build the config from parsed arguments (unknown attributes are ignored)."""
    pipeline = getattr(args, "pipeline", ModelConfig.pipeline)  # the benches' parsers have none
    return TrainerConfig(
        model=section_from_args(ModelConfig, args, pipeline=pipeline,
                                preset=args.model_preset or pipeline_part(pipeline, "arch").DEFAULT_PRESET),
        parallel=section_from_args(ParallelConfig, args),
        moe=section_from_args(MoEConfig, args),
        recompute=section_from_args(RecomputeConfig, args),
        cuda_graph=section_from_args(CudaGraphConfig, args),
        train=section_from_args(TrainConfig, args),
        checkpoint=section_from_args(CheckpointingConfig, args),
        eval=section_from_args(EvalConfig, args),
    )
