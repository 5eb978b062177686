"""A training job: its options, the decisions made before any rank starts (backend, world, data
service config), and the launch (trainer ranks on Ray, fed by the data service).

``build_job(args)`` checks everything it can before Ray starts, then connects, sizes the job to the
cluster and returns a ``Job``; ``launch(job)`` runs it and returns the last rank's step records,
the data service's statistics and the machines the ranks ran on. ``rank_main`` is what each trainer
actor runs.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import logging
import os
import time
import uuid
from dataclasses import dataclass

from datasvc.config import BalanceConfig, DecodeConfig, PoolConfig, ServiceConfig
from datasvc.flags import section_from_args
from datasvc.read.filters import add_filter_flags, filters_from_flags
from datasvc.training import CPU_RANKS, add_data_flags
from datasvc.usage import UserError, positive_int
from trainer.config import TrainerConfig
from trainer.flags import add_section_flags
from trainer.lifecycle import Resume, resolve_outputs, resume_from, start_run_control, stop_on_sigterm
from trainer.megatron.overrides import CPU_PATH_REFUSAL, BridgeOverrides, describe, validate_overrides

log = logging.getLogger("vlmfeed.run")
TRAINER_GPU_SHARE = 0.75


def add_job_args(p: argparse.ArgumentParser) -> None:
    """The options of the job and its data (the model and training options are trainer.config's)."""
    g = p.add_argument_group("job")
    g.add_argument("--backend", choices=["auto", "megatron", "cpu"], default="auto",
                   help="auto: megatron when the cluster has GPUs, else the CPU development path")
    g.add_argument("--world-size", type=positive_int, default=None, help=f"trainer ranks (default: all GPUs; {CPU_RANKS} on CPU)")
    g.add_argument("--address", default=None, help="Ray address (default: RAY_ADDRESS, else a local cluster)")
    g.add_argument("--out", default=None, help="directory for metrics.jsonl, summary.json and loss.png (default: "
                   "out/run; under `ray job submit`, ~/vlmfeed-runs/<job>, outside Ray's copy of the package)")
    g = p.add_argument_group("data")
    g.add_argument("--shards", nargs="+", default=None,
                   help="WebDataset shards: paths, globs, brace patterns, s3:// URLs, or an Energon dataset "
                        "DIR[:SPLIT] (default: bundled real photos)")
    add_data_flags(g, "--blend")
    g.add_argument("--valid-shards", nargs="+", default=None,
                   help="validation shards (the same forms as --shards), streamed by their own feeders, never "
                        "trained on; evaluated every --eval-interval steps")
    add_filter_flags(g)
    add_section_flags(g, BalanceConfig)
    add_data_flags(g, "--decode", "--max-pixels", "--min-pixels")
    add_data_flags(g, "--decode-threads", "--cpu-jpeg-decoder", "--resize-on")
    g.add_argument("--data-actors", type=positive_int, nargs=2, default=(1, 2), metavar=("MIN", "MAX"),
                   help="preprocessing actors per DP rank (autoscaled between)")
    add_data_flags(g, "--video-fps", "--video-max-pixels")
    add_data_flags(g, "--data-seed", "--items-per-block", "--block-micro-batches", "--chain-blocks")
    from trainer.plan.gate import add_plan_args

    add_plan_args(p)


@dataclass
class Job:
    """Everything a run needs, decided before any rank starts."""

    backend: str  # "megatron" or "cpu"
    world: int
    cfg: TrainerConfig
    data_cfg: ServiceConfig
    gpu_per_rank: float
    out: str
    metrics_path: str
    run: str  # names this run's data service actors
    block_sizing: dict | None = None  # how size_blocks chose items_per_block, when it did
    loopback: bool = False  # the embedded single-host cluster: ranks rendezvous on 127.0.0.1 only
    resume: Resume | None = None  # the checkpoint this run takes up, when --load found one
    valid_cfg: ServiceConfig | None = None  # the validation stream's config, with --valid-shards
    overrides: BridgeOverrides = BridgeOverrides()  # KEY=VALUE and --config-file, for Bridge's container

    @property
    def samples_path(self) -> str:
        return os.path.join(os.path.dirname(self.metrics_path), "samples.jsonl")

    @property
    def dp(self) -> int:
        return self.data_cfg.dp_size

    def describe(self) -> dict:
        """What the run summary records about what was trained (the configuration ``--fit auto`` may
        have picked) and the job's data geometry."""
        out = {"trained": {k: v for k, v in self.cfg.to_dict().items() if k not in ("checkpoint", "eval")},
               "items_per_block": self.data_cfg.items_per_block, "chain_blocks": self.data_cfg.chain_blocks}
        if self.block_sizing:
            out["block_sizing"] = self.block_sizing
        if self.resume:
            out["resumed"] = self.resume.describe()
        if self.overrides:
            out["bridge_overrides"] = describe(self.overrides)
        return out


# ------------------------------------------------------------------------------------------------
# Building a job
# ------------------------------------------------------------------------------------------------
def build_job(args: argparse.Namespace) -> Job:
    from trainer.plan.gate import plan_gate_cluster, plan_gate_declared

    check_args(args)
    resolve_outputs(args)
    plan_gate_declared(args)  # a job that declares its GPUs and cannot fit stops before Ray starts
    overrides = check_overrides(args)  # a key Bridge does not know stops before Ray starts too
    gpus, loopback = connect_cluster(args)
    backend = args.backend if args.backend != "auto" else ("megatron" if gpus else "cpu")
    if backend == "cpu" and overrides:
        raise SystemExit(f"this cluster has no GPUs, so trainer.run takes the CPU development path: {CPU_PATH_REFUSAL}")
    if backend == "megatron" and not gpus:
        raise SystemExit("--backend megatron needs GPUs and this Ray cluster has none: leave --backend out (the CPU "
                         "development path), or --address a cluster with GPUs")
    if backend == "megatron" and args.save and "://" in args.save:
        raise SystemExit("--save with Megatron-Bridge needs a filesystem path (local or shared); s3:// URLs are "
                         "supported on the CPU path only")
    plan_gate_cluster(args, backend, gpus)  # checked, or fit to the GPUs (--fit auto), before any rank starts
    cfg, world = trainer_config(args, backend, gpus)
    dp = cfg.data_parallel_size(world)
    check_cpus(args, world, dp)
    gpu_per_rank, decode_share = gpu_shares(args.decode, backend, world, dp, args.data_actors[1])
    data_cfg, sizing = data_config(args, cfg, backend, world, decode_share)
    data_cfg, resume = resume_from(cfg, data_cfg)
    valid_cfg = None
    if args.valid_shards:
        # Small items, so that a small validation set still gives every DP rank some.
        valid_cfg = dataclasses.replace(data_cfg, shards=tuple(args.valid_shards), blend="", remainder=None,
                                        balance=BalanceConfig(), samples_per_item=min(4, data_cfg.samples_per_item),
                                        pool=dataclasses.replace(data_cfg.pool, min_actors=1, max_actors=1))
    os.makedirs(args.out, exist_ok=True)
    metrics = os.path.abspath(os.path.join(args.out, "metrics.jsonl"))
    for name in ("metrics.jsonl", "samples.jsonl"):
        path = os.path.join(args.out, name)
        if os.path.exists(path) and not resume:  # a resumed run appends to the records it continues
            os.remove(path)
    return Job(backend=backend, world=world, cfg=cfg, data_cfg=data_cfg, gpu_per_rank=gpu_per_rank, out=args.out,
               metrics_path=metrics, run=f"vlmfeed-{uuid.uuid4().hex[:8]}",
               block_sizing=sizing.as_dict() if sizing else None, loopback=loopback, resume=resume,
               valid_cfg=valid_cfg, overrides=overrides)


def check_args(args: argparse.Namespace) -> None:
    """What the options alone can tell, before Ray starts."""
    from datasvc.registry import available

    if args.pipeline not in available():
        raise SystemExit(f"unknown pipeline {args.pipeline!r}; available: {', '.join(available())}")
    if args.model_preset:
        from trainer.config import ModelConfig
        from trainer.config_checks import check_model_names

        if problems := check_model_names(ModelConfig(pipeline=args.pipeline, preset=args.model_preset)):
            raise SystemExit("; ".join(problems))
    from datasvc.read.shards import expand_shards

    for flag, patterns in (("--shards", args.shards), ("--valid-shards", args.valid_shards)):
        if patterns:
            try:
                expand_shards(list(patterns))
            except UserError as exc:
                raise SystemExit(f"{flag}: {exc}") from None


def check_overrides(args: argparse.Namespace) -> BridgeOverrides:
    """Bridge overrides, checked on a container built here on CPU before Ray starts (a few seconds
    of Megatron import, only when there are any)."""
    overrides = BridgeOverrides.from_args(args)
    if overrides and args.backend == "cpu":
        raise SystemExit(CPU_PATH_REFUSAL)
    if overrides:
        from trainer.config import from_args

        validate_overrides(from_args(args), overrides, args.world_size or 1)
    return overrides


def connect_cluster(args: argparse.Namespace) -> tuple[int, bool]:
    """Join (or start) the Ray cluster; returns its GPU count, and whether it is the embedded
    cluster this process started on 127.0.0.1 (its ranks then rendezvous on loopback only)."""
    import ray

    from datasvc.service.cluster import connect

    embedded = not (ray.is_initialized() or args.address or os.environ.get("RAY_ADDRESS"))

    # Logical CPUs of an embedded cluster: enough for the trainer ranks plus the smallest data pools
    # (they oversubscribe a small dev box, which is what a development run wants).
    actors = args.data_actors[0] + (1 if args.valid_shards else 0)  # the validation stream's one actor a DP rank
    want_cpus = max(os.cpu_count() or 1, (args.world_size or CPU_RANKS) * (1 + actors * args.decode_threads))
    connect(args.address, num_cpus=want_cpus)
    loopback = embedded and ray.util.get_node_ip_address() == "127.0.0.1"
    return int(ray.cluster_resources().get("GPU", 0)), loopback


# Flags of trainer.config that only the Megatron-Bridge backend reads: given on the CPU path, they would
# change nothing, so they are refused there rather than ignored.
MEGATRON_ONLY_FLAGS = frozenset({
    "--strategy", "--vpp", "--etp", "--moe-dispatcher", "--flex-backend", "--moe-aux-loss-coeff", "--recompute",
    "--recompute-modules", "--recompute-num-layers", "--cuda-graph-scope", "--cuda-graph-warmup-steps",
    "--num-layers", "--num-experts", "--vision-depth", "--freeze-language-model", "--freeze-vision-model",
    "--freeze-vision-projection", "--vision-chunk-patches", "--expandable-segments", "--model-preset"})


def trainer_config(args: argparse.Namespace, backend: str, gpus: int) -> tuple[TrainerConfig, int]:
    """The validated trainer config and the world size; ``--gbs`` defaults to MBS x DP."""
    from trainer.config import from_args

    cfg = from_args(args)
    if backend == "cpu":
        cfg.train = cfg.train.for_cpu_development(args._given)
    world = args.world_size or (gpus if backend == "megatron" else CPU_RANKS)
    if backend == "megatron":
        if gpus < world:
            raise SystemExit(f"--world-size {world} needs {world} GPUs; the cluster has {gpus}")
        from trainer.config import ConfigError

        try:
            cfg.validate(world)
        except ConfigError as exc:
            raise SystemExit(str(exc)) from None
        if cfg.checkpoint.export_hf_on_save and (cfg.parallel.strategy != "3d" or not cfg.model.hf_path):
            raise SystemExit("--export-hf-on-save on GPUs is Megatron-Bridge's own export, which needs --strategy 3d "
                             "(torch_dist checkpoints) and --hf-path (its template); or use --export-hf at the end")
        if missing := missing_gpu_packages(cfg):
            raise SystemExit(missing)
    else:
        p = cfg.parallel
        if (p.tp, p.pp, p.cp, p.ep) != (1, 1, 1, 1):
            raise SystemExit("the CPU path is data-parallel only: drop --tp/--pp/--cp/--ep or use --backend megatron")
        if unused := sorted(args._given & MEGATRON_ONLY_FLAGS):
            raise SystemExit(f"{' '.join(unused)}: Megatron-Bridge knobs, which the CPU development path (a tiny model "
                             "on gloo, no GPU here) does not use; drop them, or train on GPUs")
        from trainer.checkpoint import check_long_run

        if problems := check_long_run(cfg):
            raise SystemExit("; ".join(problems))
    dp = cfg.data_parallel_size(world)
    if "--gbs" not in args._given:
        cfg.train.gbs = cfg.train.mbs * dp
    if cfg.train.gbs % (cfg.train.mbs * dp):
        raise SystemExit(f"--gbs {cfg.train.gbs} must be a multiple of mbs x dp = {cfg.train.mbs * dp}")
    return cfg, world


def missing_gpu_packages(cfg: TrainerConfig) -> str | None:
    """What a GPU job needs installed beyond Megatron-Bridge, in one line, or None: the pipeline's own
    kernels (its ``megatron.GPU_PACKAGES``) and the flex dispatcher's DeepEP."""
    from datasvc.registry import pipeline_part

    for module, what in pipeline_part(cfg.model.pipeline, "megatron").GPU_PACKAGES.items():
        if importlib.util.find_spec(module) is None:
            return f"{cfg.model.pipeline} on GPUs needs {what}: pip install -e '.[train]'"
    if cfg.moe.dispatcher == "flex" and importlib.util.find_spec("deep_ep") is None:
        return (f"--moe-dispatcher flex (--flex-backend {cfg.moe.flex_backend}) needs the deep_ep package "
                "(DeepEP, with HybridEP for hybridep) and expert parallelism over GPUs; install it, or "
                "use --moe-dispatcher alltoall")
    return None


def check_cpus(args: argparse.Namespace, world: int, dp: int) -> None:
    import ray

    cpus = ray.cluster_resources().get("CPU", 0)
    actors = args.data_actors[0] + (1 if args.valid_shards else 0)  # the validation stream's one actor a DP rank
    need = world + dp * actors * args.decode_threads
    if cpus < need:
        raise SystemExit(f"the cluster has {cpus:g} CPUs; {world} trainer ranks plus {dp} x {actors} "
                         f"preprocessing actors x {args.decode_threads} threads need {need}: lower --data-actors "
                         f"MIN or --decode-threads, drop --valid-shards, or add nodes")


def gpu_shares(decode: str, backend: str, world: int, dp: int, max_actors: int) -> tuple[float, float]:
    """(GPU per trainer rank, GPU per preprocessing actor). With GPU decode the ranks take
    TRAINER_GPU_SHARE of each GPU and the data actors of all DP ranks split the rest."""
    if decode != "gpu":
        return 1.0, 0.25  # the actor share is unused by CPU decode
    if backend != "megatron":
        raise SystemExit("--decode gpu needs GPUs in the cluster; use --decode cpu")
    return TRAINER_GPU_SHARE, (1 - TRAINER_GPU_SHARE) * world / (dp * max_actors)


def data_config(args: argparse.Namespace, cfg: TrainerConfig, backend: str, world: int, decode_share: float):
    """The data service's config (``datasvc.training``'s geometry), blocks sized from the shards unless
    ``--items-per-block`` is given. Returns (config, BlockSizing or None)."""
    from datasvc.training import training_config
    from trainer.workers import RankLayout

    layout0 = RankLayout(0, world, cfg.parallel.tp, cfg.parallel.cp, cfg.parallel.pp)
    data_cfg, sizing = training_config(
        tuple(args.shards or ()), device="gpu" if backend == "megatron" else "cpu", pipeline=args.pipeline,
        seq_len=cfg.train.seq_len, micro_batch_size=cfg.train.mbs, dp_size=layout0.dp_size,
        max_pixels=args.max_pixels, min_pixels=args.min_pixels,
        pipeline_options={"video_fps": args.video_fps, "video_max_pixels": args.video_max_pixels},
        block_micro_batches=args.block_micro_batches, items_per_block=args.items_per_block,
        blend=args.blend, filters=filters_from_flags(args), pack=not cfg.train.padded,
        consumers_per_replica=layout0.model_parallel, chain_blocks=args.chain_blocks, seed=args.data_seed,
        decode=section_from_args(DecodeConfig, args, gpu_share=decode_share),
        pool=PoolConfig(min_actors=args.data_actors[0], max_actors=args.data_actors[1]),
        balance=section_from_args(BalanceConfig, args, cost=balance_cost(cfg) if args.balance_dp else {},
                                  micro_batches_per_step=cfg.train.grad_accum(layout0.dp_size)))
    if sizing is not None:
        log.info("blocks of %d items (about %d micro-batches; %s tokens a sample over %d probed)",
                 data_cfg.items_per_block, args.block_micro_batches, sizing.tokens_per_sample, sizing.probed_samples)
    return data_cfg, sizing


def balance_cost(cfg: TrainerConfig) -> dict:
    """The cost model the feeders deal micro-batches with: fitted on the nearest setting, at this
    model's FLOPs (the pipeline's ``cost``)."""
    from datasvc.registry import pipeline_part

    m = cfg.model
    return pipeline_part(m.pipeline, "cost").options_for_training(m.preset, m.num_layers, m.num_experts, cfg.parallel.strategy,
                                recompute=cfg.recompute.granularity == "full", freeze_vision=m.freeze_vision_model)


# ------------------------------------------------------------------------------------------------
# Running it
# ------------------------------------------------------------------------------------------------
def rank_env(expandable_segments: bool, cuda_graphs: bool = False) -> dict[str, str]:
    """Environment the trainer ranks start with. The CUDA allocator reads its settings once, when
    CUDA starts in a process, so they must be there before the rank runs any code."""
    setting = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if expandable_segments and "expandable_segments" not in setting:
        setting = ",".join(filter(None, [setting, "expandable_segments:True"]))
    env = {"PYTORCH_CUDA_ALLOC_CONF": setting} if setting else {}
    if cuda_graphs and "expandable_segments:True" in setting:
        # NCCL's registration of graph-captured buffers reads freed memory under expandable segments;
        # Megatron-Core refuses to capture unless it is off.
        env["NCCL_GRAPH_REGISTER"] = "0"
    return env


def launch(job: Job) -> tuple[list[dict], dict, float, list[dict]]:
    """Run the job: (the reporting rank's step records, the data service's stats, wall seconds, the
    machines the ranks ran on, per host).
    A SIGTERM to this process (what Slurm, Kubernetes and ``ray job stop`` send) asks the ranks to
    save at the next step boundary and stop; the run then ends normally."""
    import ray

    from datasvc.service.client import DataService
    from trainer.workers import RankLayout, WorkerGroup

    cfg, world = job.cfg, job.world
    log.info("backend=%s world=%d dp=%d shards=%d seq_len=%d mbs=%d gbs=%d", job.backend, world, job.dp,
             len(job.data_cfg.shards), cfg.train.seq_len, cfg.train.mbs, cfg.train.gbs)
    # Ranks are placed first, so GPU-decoding data actors can only take what the ranks leave.
    group = WorkerGroup(world, use_gpu=job.backend == "megatron", gpu_per_rank=job.gpu_per_rank,
                        env=rank_env(cfg.train.expandable_segments, cfg.cuda_graph.captures), loopback=job.loopback)
    services = []
    try:  # each DP rank's feeder and actors on the node of its ranks, so batches stay on the node
        restore = job.resume.loader if job.resume else None
        services.append(DataService(job.data_cfg, run=job.run, nodes=data_nodes(job, group.node_ids), restore=restore))
        if job.valid_cfg is not None:
            services.append(DataService(job.valid_cfg, run=f"{job.run}-valid", nodes=data_nodes(job, group.node_ids)))
        control = start_run_control(f"{job.run}-control")
    except BaseException:
        group.shutdown()
        for svc in services:
            svc.shutdown()
        raise
    t0 = time.time()
    try:
        with stop_on_sigterm(control):
            per_rank = [(job, RankLayout(r, world, cfg.parallel.tp, cfg.parallel.cp, cfg.parallel.pp))
                        for r in range(world)]
            results = group.run_all(rank_main, per_rank)
        data_stats = services[0].stats()
    finally:
        group.shutdown()
        for svc in services:
            svc.shutdown()
        ray.kill(control)
    return next((r for r in results if r), []), data_stats, time.time() - t0, group.machines


def data_nodes(job: Job, rank_nodes: list[str]) -> dict[int, str]:
    """Each DP rank's node: where most trainer ranks of that replica are."""
    from datasvc.service.locality import replica_nodes
    from trainer.workers import RankLayout

    p = job.cfg.parallel
    dp_ranks = [RankLayout(r, job.world, p.tp, p.cp, p.pp).dp_rank for r in range(job.world)]
    return replica_nodes(rank_nodes, dp_ranks)


def rank_main(job: Job, layout):
    """Runs inside each trainer actor; the rank that reports (the last on Megatron, where the loss
    lives; rank 0 on CPU) returns its step records, the others an empty list."""
    from datasvc.service.client import DataClient

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    start = job.resume.loader.get(layout.dp_rank) if job.resume else None
    if job.backend == "megatron":
        from trainer.megatron.loop import MegatronRank, train

        last = layout.rank == layout.world - 1
        client = DataClient(job.data_cfg, layout.dp_rank, layout.consumer, run=job.run, device="cuda:0", start=start)
        valid = (DataClient(job.valid_cfg, layout.dp_rank, layout.consumer, run=f"{job.run}-valid", device="cuda:0")
                 if job.valid_cfg is not None else None)
        me = MegatronRank(metrics_sink=job.metrics_path if last else None, samples_path=job.samples_path if last else None,
                          control=f"{job.run}-control", resume=job.resume is not None,
                          redealt=bool(job.resume and job.resume.redealt),
                          out=job.out)
        records = train(job.cfg, client, me, world_size=layout.world, valid_iterator=valid, overrides=job.overrides)
        return records if last else []
    return _cpu_rank(job, layout, start)


def _cpu_rank(job: Job, layout, start: dict | None):
    import ray
    import torch
    import torch.distributed as dist

    from datasvc.service.client import DataClient
    from trainer.cpu_backend import CpuRank, train as cpu_train
    from trainer.rendezvous import init_distributed

    torch.set_num_threads(1)
    init_distributed("gloo")
    cfg = job.cfg
    try:
        client = DataClient(job.data_cfg, layout.dp_rank, layout.consumer, run=job.run, start=start)
        valid = (DataClient(job.valid_cfg, layout.dp_rank, layout.consumer, run=f"{job.run}-valid")
                 if job.valid_cfg is not None else None)
        control = ray.get_actor(f"{job.run}-control")
        me = CpuRank(rank=layout.rank, world=layout.world, dp_rank=layout.dp_rank,
                     grad_accum=cfg.train.grad_accum(layout.dp_size), metrics_path=job.metrics_path,
                     samples_path=job.samples_path, resume_step=job.resume.step if job.resume else 0,
                     stop_requested=lambda: ray.get(control.stop_reason.remote()))
        records = cpu_train(cfg, client, me, valid_iter=valid, loader=client if layout.consumer == 0 else None)
        client.close()
        if valid is not None:
            valid.close()
    finally:
        dist.destroy_process_group()
    return records if layout.rank == 0 else []
