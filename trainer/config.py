"""Training options for the Megatron-Bridge backend: small typed sections, one top-level config.

Everything here is plain Python (no torch, no Megatron import), so ``python -m trainer.run`` can parse
and validate a job before any GPU is touched. ``TrainerConfig.validate(world_size)`` mirrors the checks
Megatron-Core / Megatron-Bridge would make later (deep inside model construction, after minutes of
start-up) and says what to change. ``trainer.megatron.container`` turns a validated config into a
Megatron-Bridge ``ConfigContainer``.

Command line: ``add_cli_args(parser)`` adds the options, ``from_args(args)`` builds the config. The
checks themselves are in ``trainer.config_checks``.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from datasvc.training import DEVICE_DEFAULTS, add_data_flags, micro_batches_per_step
from datasvc.usage import UserError, positive_float, positive_int
from datasvc.registry import pipeline_part
from trainer.checkpoint import CheckpointingConfig, EvalConfig, add_long_run_args
from trainer.config_checks import problems_of


class ConfigError(ValueError, UserError):
    """An invalid combination of options; the message lists every problem and what to change."""


# Sections ----------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class ModelConfig:
    pipeline: str = "qwen3vl"  # the model family (pipelines/NAME): its presets, HF config, CPU model
    preset: str = "qwen3vl-30b-a3b"
    # Overrides that turn a preset into a proxy that fits one or two GPUs (None keeps the preset's).
    num_layers: int | None = None
    num_experts: int | None = None
    vision_depth: int | None = None
    # A Hugging Face checkpoint (id or local dir) to start from through AutoBridge; None = random init.
    hf_path: str | None = None
    freeze_language_model: bool = False
    freeze_vision_model: bool = False
    freeze_vision_projection: bool = False
    # Run the vision tower over at most this many patches of a micro-batch at a time (whole images;
    # 0 = all at once). Bounds the tower's transient attention memory at large MBS.
    vision_chunk_patches: int = 0

    def arch(self):
        """The preset with the overrides applied (the pipeline's ``arch`` dataclass)."""
        return pipeline_part(self.pipeline, "arch").arch(self.preset, num_layers=self.num_layers,
                                                         num_experts=self.num_experts, vision_depth=self.vision_depth)


@dataclass(kw_only=True)
class ParallelConfig:
    # fsdp: Megatron-FSDP (params, grads and optimizer state sharded over DP), overlaps on.
    # 3d:   TP/PP/VPP/CP/EP/ETP with the distributed optimizer.
    strategy: Literal["fsdp", "3d"] = "fsdp"
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    cp: int = 1
    ep: int = 1
    etp: int | None = None  # expert tensor parallel; None = Megatron's default (same as TP)


@dataclass(kw_only=True)
class MoEConfig:
    dispatcher: Literal["alltoall", "flex"] = "alltoall"
    flex_backend: Literal["deepep", "hybridep"] | None = None  # required with dispatcher="flex"
    aux_loss_coeff: float = 1e-3


@dataclass(kw_only=True)
class RecomputeConfig:
    granularity: Literal["none", "full", "selective"] = "none"
    # selective: which modules to recompute (Megatron's names); full: uniform, every layer.
    modules: list[str] = field(default_factory=lambda: ["core_attn"])
    num_layers: int = 1  # full recompute: layers per recompute chunk (Megatron "uniform" method)


@dataclass(kw_only=True)
class CudaGraphConfig:
    # Per-layer Transformer Engine CUDA graphs over these parts of each decoder layer, e.g.
    # ["attn", "moe_router", "moe_preprocess"]; empty = CUDA graphs off.
    scope: list[str] = field(default_factory=list)
    warmup_steps: int = 3
    # The vision tower's layers as CUDA graphs at one fixed length: the most patches a micro-batch
    # can carry (every token an image token), padding masked, each frame attending within itself
    # (trainer.megatron.vision_graphs).
    static_shapes: bool = False

    def vision_length(self, mbs: int, seq_len: int, merge: int = 2) -> int:
        """The fixed number of vision patches the tower's graphs take."""
        return mbs * seq_len * merge * merge


CPU_DEVELOPMENT = {"seq_len": DEVICE_DEFAULTS["cpu"].seq_len, "train_iters": 30, "lr": 1e-3}
"""The CPU development path's training settings: a tiny model's run that finishes in minutes on two cores
and visibly learns."""


@dataclass(kw_only=True)
class TrainConfig:
    mbs: int = 1  # rows per micro-batch (a packed row holds several samples)
    gbs: int = 8  # rows per optimizer step, over all DP ranks
    seq_len: int = DEVICE_DEFAULTS["gpu"].seq_len
    train_iters: int = 50
    lr: float = 1e-4
    min_lr: float = 1e-5
    warmup_iters: int = 5
    weight_decay: float = 0.1
    clip_grad: float = 1.0
    bf16: bool = True
    seed: int = 1234
    log_interval: int = 1
    # padded=True: Megatron-Bridge's stock qwen3_vl_step with one sample per padded row (comparison
    # baseline); False: our packed forward step (THD, MRoPE restarted per sample).
    padded: bool = False
    # PyTorch's expandable allocator segments on each rank: large MBS leaves big freed blocks that a
    # later, larger allocation (the fp32 logits) cannot reuse; measured 18 GiB stranded at MBS 8.
    expandable_segments: bool = False

    def grad_accum(self, dp_size: int) -> int:
        """Micro-batches each of ``dp_size`` DP ranks trains per optimizer step."""
        return micro_batches_per_step(self.gbs, self.mbs, dp_size)

    def for_cpu_development(self, given: set[str]) -> "TrainConfig":
        """These settings on the CPU development path (``CPU_DEVELOPMENT``), but for the fields whose
        flags are in ``given`` (the user's own win)."""
        return dataclasses.replace(self, **{name: value for name, value in CPU_DEVELOPMENT.items()
                                            if "--" + name.replace("_", "-") not in given})


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
def _bool_flag(group, name: str, default: bool, help: str) -> None:
    group.add_argument(name, action=argparse.BooleanOptionalAction, default=default, help=help)


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the Megatron backend's options (names follow the Megatron-Bridge performance guide)."""
    d = TrainerConfig()
    g = parser.add_argument_group("model")
    g.add_argument("--model-preset", default=None, help="an architecture preset of the pipeline (default: its own)")
    g.add_argument("--num-layers", type=int, default=None, help="decoder layers (proxy override)")
    g.add_argument("--num-experts", type=int, default=None, help="experts per MoE layer (proxy override)")
    g.add_argument("--vision-depth", type=int, default=None, help="vision tower layers (proxy override)")
    g.add_argument("--hf-path", default=None, help="start from this HF checkpoint via AutoBridge (default: random init)")
    _bool_flag(g, "--freeze-language-model", False, "freeze the language model")
    _bool_flag(g, "--freeze-vision-model", False, "freeze the vision tower")
    _bool_flag(g, "--freeze-vision-projection", False, "freeze the vision projection (mergers)")
    g.add_argument("--vision-chunk-patches", type=int, default=d.model.vision_chunk_patches,
                   help="run the vision tower over at most this many patches at a time, whole images "
                        "(0 = a micro-batch's images at once); lowers its peak memory at large MBS")

    g = parser.add_argument_group("parallelism")
    g.add_argument("--strategy", choices=["fsdp", "3d"], default=d.parallel.strategy)
    for name in ("tp", "pp", "cp", "ep"):
        g.add_argument(f"--{name}", type=positive_int, default=getattr(d.parallel, name))
    g.add_argument("--vpp", type=positive_int, default=None)
    g.add_argument("--etp", type=positive_int, default=None)

    g = parser.add_argument_group("moe")
    g.add_argument("--moe-dispatcher", choices=["alltoall", "flex"], default=d.moe.dispatcher)
    g.add_argument("--flex-backend", choices=["deepep", "hybridep"], default=None)
    g.add_argument("--moe-aux-loss-coeff", type=float, default=d.moe.aux_loss_coeff)

    g = parser.add_argument_group("memory and speed")
    g.add_argument("--recompute", choices=["none", "full", "selective"], default=d.recompute.granularity)
    g.add_argument("--recompute-modules", nargs="+", default=None, help="selective recompute modules")
    g.add_argument("--recompute-num-layers", type=int, default=d.recompute.num_layers)
    g.add_argument("--cuda-graph-scope", nargs="*", default=[],
                   help="e.g. moe_router moe_preprocess (empty: CUDA graphs off)")
    g.add_argument("--cuda-graph-warmup-steps", type=int, default=d.cuda_graph.warmup_steps)
    _bool_flag(g, "--static-shapes", d.cuda_graph.static_shapes,
               "the vision tower as CUDA graphs at one fixed length (--mbs x --seq-len x 4 patches, padding "
               "masked, each image attending within itself); --strategy 3d only")

    g = parser.add_argument_group("training")
    g.add_argument("--mbs", type=positive_int, default=d.train.mbs, help="micro-batch rows")
    g.add_argument("--gbs", type=positive_int, default=d.train.gbs, help="global batch rows")
    add_data_flags(g, "--seq-len")
    g.add_argument("--train-iters", type=positive_int, default=d.train.train_iters)
    g.add_argument("--lr", type=positive_float, default=d.train.lr)
    g.add_argument("--min-lr", type=float, default=d.train.min_lr)
    g.add_argument("--warmup-iters", type=int, default=d.train.warmup_iters)
    g.add_argument("--weight-decay", type=float, default=d.train.weight_decay)
    g.add_argument("--clip-grad", type=float, default=d.train.clip_grad)
    _bool_flag(g, "--bf16", True, "bf16 mixed precision (--no-bf16: fp32)")
    g.add_argument("--seed", type=positive_int, default=d.train.seed, help="the training seed (Megatron takes only one above 0)")
    g.add_argument("--log-interval", type=positive_int, default=d.train.log_interval)
    _bool_flag(g, "--padded", False, "stock Megatron-Bridge qwen3_vl_step on padded rows (comparison)")
    _bool_flag(g, "--expandable-segments", False, "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True on every "
               "rank (less fragmentation at large MBS)")
    add_long_run_args(parser)  # checkpoints, evaluation and export: trainer.checkpoint
    return parser


def from_args(args: argparse.Namespace) -> TrainerConfig:
    """Build the config from parsed arguments (unknown attributes are ignored)."""
    pipeline = getattr(args, "pipeline", ModelConfig.pipeline)  # the benches' parsers have none
    return TrainerConfig(
        model=_named_as_fields(ModelConfig, args, pipeline=pipeline,
                               preset=args.model_preset or pipeline_part(pipeline, "arch").DEFAULT_PRESET),
        parallel=_named_as_fields(ParallelConfig, args),
        moe=MoEConfig(dispatcher=args.moe_dispatcher, flex_backend=args.flex_backend,
                      aux_loss_coeff=args.moe_aux_loss_coeff),
        recompute=RecomputeConfig(granularity=args.recompute, modules=list(args.recompute_modules or ["core_attn"]),
                                  num_layers=args.recompute_num_layers),
        cuda_graph=CudaGraphConfig(scope=list(args.cuda_graph_scope or []), warmup_steps=args.cuda_graph_warmup_steps,
                                   static_shapes=args.static_shapes),
        train=_named_as_fields(TrainConfig, args, seq_len=args.seq_len or TrainConfig.seq_len),
        checkpoint=_named_as_fields(CheckpointingConfig, args),  # trainer.checkpoint.add_long_run_args
        eval=_named_as_fields(EvalConfig, args),
    )


def _named_as_fields(section: type, args: argparse.Namespace, **given):
    """A config section whose flags are named as its fields (``--min-lr`` fills ``min_lr``)."""
    return section(**{f.name: getattr(args, f.name) for f in dataclasses.fields(section) if f.name not in given},
                   **given)
