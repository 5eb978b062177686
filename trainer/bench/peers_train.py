"""The peers feeding the same trainer on GPUs: ``vlmfeed bench peers train`` (one subprocess per
case, each its own local Ray cluster, so the process tree measured is that case's alone).

Every case trains the model ``trainer.run`` picks by default on the GPU (the depth proxy on one
GPU; ``--proxy 4-layer-16-experts`` or ``4-layer-128-experts`` for the 4-layer ones) through ``trainer.megatron.loop.train`` with one
strategy and sequence length. The padded peers run Megatron-Bridge's stock ``qwen3_vl_step``
(``--padded``: ``to_stock_batch``) at ``--padded-mbs``; the packed paths (Energon's packing,
vlmfeed) run our THD step at the MBS of the case. Nothing is recomputed unless ``--recompute`` says.

The data path's CPU is budgeted: with ``--cores N`` the case process (and so the local Ray cluster,
its actors and Ray's own processes) runs on N cores, each trainer rank moves itself to the other
cores, and DataLoader workers a rank forks are moved back onto the N.

Per case: tokens/s over the whole steady window (totals over totals) with +-2 standard errors from
block means, TFLOP/s/GPU, data-wait share, real-token fraction, tokens per step, CPU seconds per
trained sample (every process of the tree but the trainer ranks themselves, so DataLoader workers
forked by a rank count), peak host RSS, time to the first step. Each case writes its JSON as it
ends, and a rerun of the same command skips the cases already written: a sweep longer than one
sitting runs in several.
"""
from __future__ import annotations

import json
import os
import time

from trainer.bench.peers_measure import (DATA_KINDS, ProcessTreeMeter, block_means, block_totals, mean_se, steady_count,
                                         steady_cpu, steady_start)
from trainer.bench.peers_grid import case_name, train_all
from trainer.bench.peers_report import service_settings, table

PROXIES = {  # depth: what --fit auto picks on one GPU; the 4-layer proxies by name
    "depth": [],
    "4-layer-16-experts": ["--model-preset", "qwen3vl-30b-a3b-4layers-16experts", "--expandable-segments"],
    "4-layer-128-experts": ["--model-preset", "qwen3vl-30b-a3b-4layers-128experts", "--expandable-segments"],
}


def add_train_parsers(sub, add_setting, paths) -> None:
    for name, text in (("train", "each path feeding the same trainer, per MBS (GPU)"),
                       ("all", "the data paths alone, then training"),
                       ("train-one", "one training case in this process (what `train` runs per case)")):
        p = sub.add_parser(name, help=text)
        add_setting(p)
        p.set_defaults(large=True)
        p.add_argument("--strategy", choices=["3d", "fsdp"], default="3d")
        p.add_argument("--iters", type=int, default=200)
        p.add_argument("--proxy", choices=list(PROXIES), default="depth")
        p.add_argument("--recompute", choices=["none", "selective", "full"], default="none")
        p.add_argument("--cores", type=int, default=None, help="host cores for the data path (default: all, "
                                                               "shared with the trainer ranks)")
        p.add_argument("--padded-mbs", type=int, default=None, help="MBS of the padded peers (default: the "
                                                                    "case's); pick it for equal tokens a step")
        p.add_argument("--world-size", type=int, default=1)
        p.add_argument("--tp", type=int, default=1)
        p.add_argument("--workers", type=int, default=None, help="DataLoader workers per rank, Ray Data or vlmfeed "
                                                                 "actors (default: --cores, else 8)")
        p.add_argument("--vlmfeed-actors", type=int, nargs=2, default=None, metavar=("MIN", "MAX"),
                       help="vlmfeed's actors per DP rank, autoscaled between (default: --workers for both)")
        p.add_argument("--case-timeout", type=int, default=1800, help="a case still running after this many "
                       "seconds is stopped as hung (200 steps of the depth proxy take 10-15 minutes)")
        p.add_argument("--deadline", type=float, default=None,
                       help="seconds from start after which no case starts and a running one is cut short")
        p.add_argument("--min-case-s", type=int, default=120, help="no case starts with less time than this "
                       "left before the deadline, nor with less than the longest case it finished took")
        p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "peers-train"))
        if name != "train-one":
            p.add_argument("--paths", nargs="+", default=list(paths), choices=paths)
            p.add_argument("--mbs-list", type=int, nargs="+", default=[2])
            p.add_argument("--repeats", type=int, default=2)
            p.add_argument("--profiles", nargs="+", default=None, help="a grid over these profiles (each its own folder)")
            p.add_argument("--cores-list", type=int, nargs="+", default=None, help="a grid over these data-path budgets")
        else:
            p.add_argument("--path", required=True, choices=paths)
            p.add_argument("--json", required=True)
            p.add_argument("--repeat", type=int, default=0)
        if name == "all":
            p.add_argument("--samples", type=int, default=96, help="samples each data path alone drains")


def workers(args) -> int:
    return args.workers or args.cores or 8


def vlmfeed_actors(args) -> tuple[int, int]:
    """vlmfeed's actors per DP rank, (min, max): as many as the peers' workers unless asked."""
    return tuple(args.vlmfeed_actors) if args.vlmfeed_actors else (workers(args), workers(args))


def trainer_argv(args, setting, path: str, out: str) -> list[str]:
    """``trainer.run``'s options for one case (its job builder then checks and sizes them)."""
    from trainer.bench.peers_data import PADDED

    argv = ["qwen3vl", "--shards", *setting.shards, "--seq-len", str(setting.seq_len), "--mbs", str(setting.mbs),
            "--strategy", args.strategy, "--train-iters", str(args.iters), "--world-size", str(args.world_size),
            "--tp", str(args.tp), "--min-pixels", str(setting.min_pixels), "--max-pixels", str(setting.max_pixels),
            "--data-actors", *map(str, vlmfeed_actors(args)), "--decode", "gpu" if path == "vlmfeed-gpu" else "cpu",
            "--recompute", args.recompute, "--out", out, *PROXIES[args.proxy]]
    if path in PADDED:
        # One sample a row, into the stock qwen3_vl_step. The memory planner sizes every row as a full
        # one of image tokens; a padded row is as wide as its longest sample, so it is left to the GPU.
        argv += ["--padded", "--fit", "off"]
    return argv


class Counted:
    """The rank's iterator, counting the samples the trainer takes (``marks``: the running count after
    each micro-batch, so the steady window's samples can be told from the warm-up's)."""

    def __init__(self, inner):
        self.inner, self.samples, self.marks = inner, 0, []

    def __iter__(self):
        return self

    def __next__(self):
        b = next(self.inner)
        self.samples += int(b.num_samples.sum())
        self.marks.append(self.samples)
        return b


class PinnedWorkers:
    """The rank's iterator; once it has started its DataLoader workers (forked from the rank, so on
    the rank's cores), they are moved onto the data path's cores. ``device``: where the packed THD
    step takes its tensors (the stock step moves its own)."""

    def __init__(self, inner, cores: set[int], device: str | None = None):
        self.inner, self.cores, self.device, self.pinned = inner, cores, device, 0

    def __iter__(self):
        return self

    def __next__(self):
        b = next(self.inner)
        if not self.pinned:
            from trainer.bench.peers_measure import pin_children

            self.pinned = pin_children(os.getpid(), self.cores)
        if self.device is not None:
            b = b.to(self.device, non_blocking=True)
        return b


def peer_rank(path: str, cfg, setting, work_dir: str, layout, metrics_path: str, source,
              cores: tuple[set[int], set[int]]) -> tuple[list, int]:
    """Inside each trainer actor: move onto the ranks' cores, open the path for this rank, train,
    return (records, samples, the running sample count per micro-batch)."""
    import logging

    from trainer.bench.peers_measure import pin
    from trainer.megatron.loop import MegatronRank, train

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    data_cores, rank_cores = cores
    pin(os.getpid(), rank_cores)
    dp = layout.dp_size
    if path == "megatron-bridge":
        from trainer.bench.peers_stock import StockPath

        inner = PinnedWorkers(StockPath(setting, work_dir, samples=cfg.train.train_iters * cfg.train.gbs,
                                        dp_rank=layout.dp_rank, dp_size=dp, num_workers=source), data_cores)
    elif path == "energon-packed":
        from trainer.bench.peers_energon import EnergonPackedPath

        inner = PinnedWorkers(EnergonPackedPath(setting, work_dir, pad_id=_pad_id(setting), num_workers=source,
                                                dp_rank=layout.dp_rank, dp_size=dp), data_cores, "cuda:0")
    elif path == "automodel-packed":
        from trainer.bench.peers_automodel import AutoModelPackedPath

        inner = PinnedWorkers(AutoModelPackedPath(setting, work_dir, pad_id=_pad_id(setting), num_workers=source,
                                                  dp_rank=layout.dp_rank, dp_size=dp), data_cores, "cuda:0")
    elif path == "ray-data":
        from trainer.bench.peers_raydata import RayDataPath

        inner = RayDataPath(setting, source, pad_id=_pad_id(setting))
    else:
        from datasvc.service.client import DataClient

        data_cfg, run = source
        inner = DataClient(data_cfg, layout.dp_rank, layout.consumer, run=run, device="cuda:0")
    counted = Counted(inner)
    last = layout.rank == layout.world - 1
    records = train(cfg, counted, MegatronRank(metrics_sink=metrics_path if last else None), world_size=layout.world)
    return (records if last else []), counted.samples, counted.marks


def _pad_id(setting) -> int:
    from datasvc.registry import get_pipeline

    return get_pipeline(setting.pipeline).pad_id


def train_one(args, setting, work_dir: str) -> dict:
    """One case in this process: the job built as ``trainer.run`` builds it, the ranks placed, the
    path opened per rank, the process tree metered from before the first rank starts."""
    import ray

    from trainer.job import build_job, rank_env
    from trainer.run import parse_args
    from trainer.summary import steady_window, summarize
    from trainer.workers import RankLayout, WorkerGroup

    from trainer.bench.peers_measure import pin, split_cores

    cores = split_cores(args.cores)
    pin(os.getpid(), cores[0])  # before Ray starts: its processes and actors inherit the data cores
    out = os.path.join(args.out, case_name(args.path, setting.mbs, args.repeat))
    job = build_job(parse_args(trainer_argv(args, setting, args.path, out)))
    cfg, world = job.cfg, job.world
    if args.path == "ray-data" and cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp > 1:
        raise SystemExit("ray-data: streaming_split gives every rank its own rows, so the ranks of one "
                         "model-parallel replica would differ; run it data-parallel only (--tp 1)")
    if args.path == "megatron-bridge":
        # What each rank's loader reads, made once before the ranks start: the conversations, the
        # processor, and the Hugging Face datasets cache of the JSON (ranks building it at once race).
        from trainer.bench.peers_stock import StockPath

        StockPath(setting, work_dir, samples=1, num_workers=0).close()
    if args.path == "energon-packed":
        from trainer.bench.peers_energon import prepared_dataset

        prepared_dataset(setting, work_dir)
    meter = ProcessTreeMeter().start()
    t0 = time.time()
    group = WorkerGroup(world, use_gpu=True, gpu_per_rank=job.gpu_per_rank,
                        env=rank_env(cfg.train.expandable_segments, cfg.cuda_graph.captures))
    service = None
    try:
        meter.set_ranks(ray.get([a.run.remote(os.getpid) for a in group.actors]))
        layouts = [RankLayout(r, world, cfg.parallel.tp, cfg.parallel.cp, cfg.parallel.pp) for r in range(world)]
        sources = _sources(args, setting, job, layouts)
        if args.path.startswith("vlmfeed"):
            from datasvc.service.client import DataService

            service = DataService(job.data_cfg, run=job.run)
        refs = [a.run.remote(peer_rank, args.path, cfg, setting, work_dir, lay, job.metrics_path, src, cores)
                for a, lay, src in zip(group.actors, layouts, sources)]
        steady_from = steady_start(cfg.train.train_iters)
        first_step_s, cpu_at_steady = _wait(refs, job.metrics_path, t0, meter, steady_from)
        results = ray.get(refs)
        cpu = meter.cpu_s()
    finally:
        meter.stop()
        group.shutdown()
        if service is not None:
            service.shutdown()
    records = next((r for r, _, _ in results if r), [])
    mp = max(1, cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp)
    samples = sum(n for _, n, _ in results) // mp
    per_step = max(1, cfg.train.gbs // (cfg.train.mbs * job.dp))  # micro-batches a rank takes a step
    steady_samples = sum(steady_count(m, steady_from * per_step) for _, _, m in results) // mp
    summary = summarize(records, None, "megatron", world, time.time() - t0)
    for key in ("data", "data_accounting", "autoscale_decisions"):
        summary.pop(key, None)
    steady = steady_window(records)
    data_cpu = sum(cpu[k] for k in DATA_KINDS)
    return {"path": args.path, "mbs": setting.mbs, "strategy": args.strategy, "world": world, "proxy": args.proxy,
            "repeat": args.repeat, "data_cores": len(cores[0]), "rank_cores": len(cores[1]),
            "workers": workers(args), "vlmfeed_actors": list(vlmfeed_actors(args)) if args.path.startswith("vlmfeed")
            else None, "recompute": args.recompute, **summary, "machines": group.machines,
            "data_config": service_settings(job.data_cfg) if args.path.startswith("vlmfeed") else None,
            "steady_blocks": block_totals(steady),
            "tokens_per_step": round(sum(r["tokens_per_s"] * r["step_time_s"] for r in steady) / len(steady), 1)
            if steady else None,
            "tflops_blocks": list(mean_se(block_means([r.get("tflops_per_gpu") for r in steady]))),
            "samples_trained": samples, "time_to_first_step_s": first_step_s,
            "data_cpu_s": round(data_cpu, 2), "cpu_s_by_kind": {k: round(v, 2) for k, v in cpu.items()},
            "cpu_s_per_trained_sample": round(data_cpu / samples, 4) if samples else None,
            **steady_cpu(cpu, cpu_at_steady, steady_samples),
            "peak_host_rss_gib": round(meter.peak_rss_gib, 2)}


def _sources(args, setting, job, layouts) -> list:
    """Per rank: what its path needs from the driver."""
    from trainer.bench.peers_data import IN_RANK

    if args.path == "ray-data":
        from trainer.bench.peers_raydata import split_for_ranks

        splits = split_for_ranks(setting, job.dp, workers(args))
        return [splits[lay.dp_rank] for lay in layouts]
    if args.path in IN_RANK:
        return [workers(args)] * len(layouts)
    return [(job.data_cfg, job.run)] * len(layouts)


def _wait(refs, metrics_path: str, t0: float, meter, steady_from: int) -> tuple[float | None, dict | None]:
    """Block until the ranks finish; returns the seconds until the first step's record appeared, and
    the tree's CPU when the record of step ``steady_from`` appeared (a poll of a second: a step or two
    of skew against the step count)."""
    import ray

    first, at_steady = None, None
    pending = list(refs)
    while pending:
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=1.0)
        if not os.path.exists(metrics_path) or os.path.getsize(metrics_path) == 0:
            continue
        if first is None:
            first = round(time.time() - t0, 1)
        if at_steady is None:
            with open(metrics_path) as f:
                if sum(1 for _ in f) >= steady_from:
                    at_steady = meter.cpu_s()
    return first, at_steady


QUESTION = "How does vlmfeed compare with what I would use instead?"


def train_main(args, setting, work_dir: str, setting_args: list[str], setting_args_of, command: str) -> int:
    from datasvc.tools.bench.provenance import stamp
    from trainer.bench import trainer_defaults

    if args.cmd == "train":
        result = train_all(args, setting, setting_args, setting_args_of)
        rep = stamp(result, QUESTION, command, trainer_defaults())
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "bench-peers-train.json")
        with open(path, "w") as f:
            json.dump(rep, f, indent=1)
        # The grids are the cases' own keys; the provenance stamp's sections are not cases.
        found = {k: v for k, v in result.items() if isinstance(v, dict)}
        grids = found if found and all(not k.startswith("mbs") for k in found) else {"": found}
        for name, grid in grids.items():
            if grid and "skipped" not in grid:
                print(f"\n{name}\n{table(grid)}" if name else table(grid))
        print(f"wrote {path}")
        return 0
    rep = stamp(train_one(args, setting, work_dir), QUESTION, command, trainer_defaults())
    with open(args.json, "w") as f:
        json.dump(rep, f, indent=1)
    return 0
