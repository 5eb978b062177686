"""``python -m trainer.run qwen3vl [options]``: train a VLM on Ray, fed by the vlmfeed data service.

Under ``ray job submit`` it joins that cluster; run directly it starts a local Ray on 127.0.0.1.
With GPUs in the cluster it trains with Megatron-Bridge (``trainer.megatron_backend``); without,
it runs the CPU development path (``trainer.cpu_backend``) with the same orchestration and data.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
import uuid

log = logging.getLogger("vlmfeed.run")
TRAINER_GPU_SHARE = 0.75


def parse_args(argv: list[str]) -> argparse.Namespace:
    from datasvc.plan import TRAINING_CHAIN_BLOCKS
    from trainer.config import add_cli_args

    p = argparse.ArgumentParser(prog="python -m trainer.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("pipeline", help="model pipeline in pipelines/ (e.g. qwen3vl)")
    g = p.add_argument_group("job")
    g.add_argument("--backend", choices=["auto", "megatron", "cpu"], default="auto",
                   help="auto: megatron when the cluster has GPUs, else the CPU development path")
    g.add_argument("--world-size", type=int, default=None, help="trainer ranks (default: all GPUs; 2 on CPU)")
    g.add_argument("--address", default=None, help="Ray address (default: RAY_ADDRESS, else a local cluster)")
    g.add_argument("--out", default="out/run", help="directory for metrics.jsonl and summary.json")
    g = p.add_argument_group("data")
    g.add_argument("--shards", nargs="+", default=None, help="WebDataset shards (default: bundled real photos)")
    g.add_argument("--decode", choices=["cpu", "gpu"], default="cpu")
    g.add_argument("--decode-threads", type=int, default=1)
    g.add_argument("--data-actors", type=int, nargs=2, default=(1, 2), metavar=("MIN", "MAX"),
                   help="preprocessing actors per DP rank (autoscaled between)")
    g.add_argument("--max-pixels", type=int, default=None, help="image pixel cap (default: 1 MP on GPU, 64K on CPU)")
    g.add_argument("--min-pixels", type=int, default=None)
    g.add_argument("--data-seed", type=int, default=0)
    g.add_argument("--items-per-block", type=int, default=None,
                   help="work items packed together (default: sized from the shards to fill --block-micro-batches)")
    g.add_argument("--block-micro-batches", type=int, default=8,
                   help="micro-batches a packing block should fill when --items-per-block is not given: "
                        "about half a micro-batch of padding rows is lost per chain of --chain-blocks blocks; "
                        "memory grows with it")
    g.add_argument("--chain-blocks", type=int, default=TRAINING_CHAIN_BLOCKS,
                   help="blocks packed as a chain: a block's part-filled rows wait for the next block's samples "
                        "(1: each block on its own); a restore re-reads up to this many - 1 blocks")
    add_cli_args(p)
    args = p.parse_args(argv)
    args._given = {a.split("=")[0] for a in argv if a.startswith("--")}
    return args


def gpu_shares(decode: str, backend: str, world: int, dp: int, max_actors: int) -> tuple[float, float]:
    """(GPU per trainer rank, GPU per preprocessing actor). With GPU decode the ranks take
    TRAINER_GPU_SHARE of each GPU and the data actors of all DP ranks split the rest."""
    if decode != "gpu":
        return 1.0, 0.25  # the actor share is unused by CPU decode
    if backend != "megatron":
        raise SystemExit("--decode gpu needs GPUs in the cluster; use --decode cpu")
    return TRAINER_GPU_SHARE, (1 - TRAINER_GPU_SHARE) * world / (dp * max_actors)


def rank_env(expandable_segments: bool) -> dict[str, str]:
    """Environment the trainer ranks start with. The CUDA allocator reads its settings once, when
    CUDA starts in a process, so they must be there before the rank runs any code."""
    setting = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if expandable_segments and "expandable_segments" not in setting:
        setting = ",".join(filter(None, [setting, "expandable_segments:True"]))
    return {"PYTORCH_CUDA_ALLOC_CONF": setting} if setting else {}


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)

    import ray

    from datasvc.cluster import connect
    from datasvc.config import ServiceConfig
    from datasvc.plan import size_blocks
    from datasvc.registry import available
    from datasvc.service import DataService
    from trainer.config import from_args
    from trainer.workers import RankLayout, WorkerGroup

    if args.pipeline not in available():
        raise SystemExit(f"unknown pipeline {args.pipeline!r}; available: {', '.join(available())}")
    if args.block_micro_batches < 1 or args.chain_blocks < 1 or (
            args.items_per_block is not None and args.items_per_block < 1):
        raise SystemExit("--block-micro-batches, --chain-blocks and --items-per-block must be >= 1")
    # Logical CPUs of an embedded cluster: enough for the trainer ranks plus the smallest data pools
    # (they oversubscribe a small dev box, which is what a development run wants).
    want_cpus = max(os.cpu_count() or 1, (args.world_size or 2) * (1 + args.data_actors[0] * args.decode_threads))
    connect(args.address, num_cpus=want_cpus)
    gpus = int(ray.cluster_resources().get("GPU", 0))
    backend = args.backend if args.backend != "auto" else ("megatron" if gpus else "cpu")
    if backend == "cpu":
        # Small defaults so the development path finishes in minutes on two cores.
        defaults = {"--seq-len": ("seq_len", 1024), "--train-iters": ("train_iters", 30), "--lr": ("lr", 1e-3)}
        for flag, (attr, value) in defaults.items():
            if flag not in args._given:
                setattr(args, attr, value)
    cfg = from_args(args)
    world = args.world_size or (gpus if backend == "megatron" else 2)
    if backend == "megatron":
        if gpus < world:
            raise SystemExit(f"--world-size {world} needs {world} GPUs; the cluster has {gpus}")
        cfg.validate(world)
    else:
        p = cfg.parallel
        if (p.tp, p.pp, p.cp, p.ep) != (1, 1, 1, 1):
            raise SystemExit("the CPU path is data-parallel only: drop --tp/--pp/--cp/--ep or use --backend megatron")
    layout0 = RankLayout(0, world, cfg.parallel.tp, cfg.parallel.cp, cfg.parallel.pp)
    dp = layout0.dp_size
    if "--gbs" not in args._given:
        cfg.train.gbs = cfg.train.mbs * dp
    if cfg.train.gbs % (cfg.train.mbs * dp):
        raise SystemExit(f"--gbs {cfg.train.gbs} must be a multiple of mbs x dp = {cfg.train.mbs * dp}")

    cpus = ray.cluster_resources().get("CPU", 0)
    need = world + dp * args.data_actors[0] * args.decode_threads
    if cpus < need:
        raise SystemExit(f"the cluster has {cpus:g} CPUs; {world} trainer ranks plus {dp} x {args.data_actors[0]} "
                         f"preprocessing actors x {args.decode_threads} threads need {need}: lower --data-actors "
                         f"MIN or --decode-threads, or add nodes")
    from datasvc.samples import default_shards

    shards = tuple(args.shards or default_shards())
    gpu_per_rank, decode_share = gpu_shares(args.decode, backend, world, dp, args.data_actors[1])
    pipe_opts = {"max_pixels": args.max_pixels or (1024 * 1024 if backend == "megatron" else 256 * 256)}
    if args.min_pixels or pipe_opts["max_pixels"] < 65536:
        pipe_opts["min_pixels"] = args.min_pixels or min(65536, pipe_opts["max_pixels"])
    data_cfg = ServiceConfig(shards=shards, pipeline=args.pipeline, pipeline_options=pipe_opts,
                             seq_len=cfg.train.seq_len, micro_batch_size=cfg.train.mbs, dp_size=dp,
                             pack=not cfg.train.padded,
                             consumers_per_replica=layout0.model_parallel, epochs=None, blocks_span_epochs=True,
                             chain_blocks=args.chain_blocks,
                             seed=args.data_seed,
                             decode=args.decode, decode_threads=args.decode_threads, decode_gpu_share=decode_share,
                             min_actors=args.data_actors[0], max_actors=args.data_actors[1],
                             items_per_block=args.items_per_block or 1)
    sizing = None
    if args.items_per_block is None:
        data_cfg, sizing = size_blocks(data_cfg, target_micro_batches=args.block_micro_batches)
        log.info("blocks of %d items (about %d micro-batches; %s tokens a sample over %d probed)",
                 data_cfg.items_per_block, args.block_micro_batches, sizing.tokens_per_sample, sizing.probed_samples)
    os.makedirs(args.out, exist_ok=True)
    metrics = os.path.abspath(os.path.join(args.out, "metrics.jsonl"))
    if os.path.exists(metrics):
        os.remove(metrics)
    run = f"vlmfeed-{uuid.uuid4().hex[:8]}"
    log.info("backend=%s world=%d dp=%d shards=%d seq_len=%d mbs=%d gbs=%d", backend, world, dp, len(shards),
             cfg.train.seq_len, cfg.train.mbs, cfg.train.gbs)
    # Ranks are placed first, so GPU-decoding data actors can only take what the ranks leave.
    group = WorkerGroup(world, use_gpu=backend == "megatron", gpu_per_rank=gpu_per_rank,
                        env=rank_env(cfg.train.expandable_segments))
    try:
        service = DataService(data_cfg, run=run)
    except BaseException:
        group.shutdown()
        raise
    t0 = time.time()
    try:
        per_rank = [(backend, cfg, data_cfg, run, RankLayout(r, world, cfg.parallel.tp, cfg.parallel.cp,
                                                              cfg.parallel.pp), metrics) for r in range(world)]
        results = group.run_all(rank_main, per_rank)
        data_stats = service.stats()
    finally:
        group.shutdown()
        service.shutdown()
    records = next((r for r in results if r), [])
    summary = summarize(records, data_stats, backend, world, time.time() - t0)
    summary["items_per_block"] = data_cfg.items_per_block
    summary["chain_blocks"] = data_cfg.chain_blocks
    if sizing:
        summary["block_sizing"] = sizing.as_dict()
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(json.dumps({k: v for k, v in summary.items() if k != "data"}, indent=2))
    if not summary["loss_finite"]:
        log.error("loss is not finite")
        return 1
    return 0


def rank_main(backend, cfg, data_cfg, run, layout, metrics_path):
    """Runs inside each trainer actor."""
    import torch

    from datasvc.client import DataClient

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if backend == "megatron":
        from trainer.megatron.loop import train

        client = DataClient(data_cfg, layout.dp_rank, layout.consumer, run=run, device="cuda:0")
        records = train(cfg, client, metrics_path if layout.rank == layout.world - 1 else None,
                        world_size=layout.world)
        return records if layout.rank == layout.world - 1 else []
    import torch.distributed as dist

    from trainer.cpu_backend import train as cpu_train

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=layout.rank, world_size=layout.world)
    try:
        client = DataClient(data_cfg, layout.dp_rank, layout.consumer, run=run)
        grad_accum = cfg.train.gbs // (cfg.train.mbs * layout.dp_size)
        records = cpu_train(client, steps=cfg.train.train_iters, grad_accum=grad_accum, lr=cfg.train.lr,
                            seed=cfg.train.seed, metrics_path=metrics_path, rank=layout.rank, world=layout.world)
        client.close()
    finally:
        dist.destroy_process_group()
    return records if layout.rank == 0 else []


def steady_window(records: list[dict]) -> list[dict]:
    """The steps past the first fifth (at least 2 steps) of compile / warm-up steps."""
    return records[max(2, len(records) // 5):] or records


def summarize(records: list[dict], data_stats: dict, backend: str, world: int, wall_s: float) -> dict:
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
        "data_wait_share": rnd(mean("data_wait_share", "data_wait_frac")),
        "tokens_per_s": rnd(mean("tokens_per_s"), 1),
        "real_token_fraction": rnd(mean("real_token_fraction")),
        "tflops_per_gpu": rnd(mean("tflops_per_gpu", "tflops_per_gpu_estimate"), 3),
        "peak_mem_gib": rnd(max((r.get("peak_mem_gib") or 0 for r in records), default=None), 2),
        "data_accounting": data_stats.get("accounting", {}),
        "autoscale_decisions": [d for r in data_stats.get("ranks", []) for d in r.get("autoscale_decisions", [])],
        "data": data_stats,
    }


if __name__ == "__main__":
    sys.exit(main())
