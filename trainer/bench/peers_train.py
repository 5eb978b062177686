"""The peers feeding the same trainer on GPUs: ``vlmfeed bench peers train`` (one subprocess per
case, each its own local Ray cluster, so the process tree measured is that case's alone).

Every case trains the 4-layer 30B-A3B proxy through ``trainer.megatron.loop.train`` with one
strategy, sequence length and MBS. The padded peers run Megatron-Bridge's stock ``qwen3_vl_step``
(``--padded``: ``to_stock_batch``); vlmfeed runs packed rows with our THD step. Per case: tokens/s
and TFLOP/s/GPU (steady steps, five block means for the errors), data-wait share, real-token
fraction, CPU seconds per trained sample (every process of the tree but the trainer ranks
themselves, so DataLoader workers forked by a rank count), peak host RSS, time to the first step.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from trainer.bench.peers_measure import ProcessTreeMeter, block_means, mean_se, ratio

PROXY = ["--num-layers", "4"]
MEMORY = ["--recompute", "full", "--vision-chunk-patches", "32768"]  # what MBS 4-8 needs to fit (cases.py)


def add_train_parsers(sub, add_setting, paths) -> None:
    for name, text in (("train", "each path feeding the same trainer, per MBS (GPU)"),
                       ("all", "the data paths alone, then training"),
                       ("train-one", "one training case in this process (what `train` runs per case)")):
        p = sub.add_parser(name, help=text)
        add_setting(p)
        p.set_defaults(large=True)
        p.add_argument("--strategy", choices=["3d", "fsdp"], default="3d")
        p.add_argument("--iters", type=int, default=20)
        p.add_argument("--world-size", type=int, default=1)
        p.add_argument("--tp", type=int, default=1)
        p.add_argument("--workers", type=int, default=None, help="Bridge DataLoader workers per rank (default "
                                                                 "its recipes' 2); Ray Data / vlmfeed actors (8)")
        p.add_argument("--case-timeout", type=int, default=600)
        p.add_argument("--deadline", type=float, default=None,
                       help="seconds from start after which no case starts and a running one is cut short")
        p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "peers-train"))
        if name != "train-one":
            p.add_argument("--paths", nargs="+", default=list(paths), choices=paths)
            p.add_argument("--mbs-list", type=int, nargs="+", default=[2, 4])
        else:
            p.add_argument("--path", required=True, choices=paths)
            p.add_argument("--json", required=True)
        if name == "all":
            p.add_argument("--cores", type=int, default=16, help="host cores for the data paths alone")
            p.add_argument("--samples", type=int, default=96, help="samples each data path alone drains")


def trainer_argv(args, setting, path: str, out: str) -> list[str]:
    """``trainer.run``'s options for one case (its job builder then checks and sizes them)."""
    actors = str(args.workers or 8)
    argv = ["qwen3vl", "--shards", *setting.shards, "--seq-len", str(setting.seq_len), "--mbs", str(setting.mbs),
            "--strategy", args.strategy, "--train-iters", str(args.iters), "--world-size", str(args.world_size),
            "--tp", str(args.tp), "--min-pixels", str(setting.min_pixels), "--max-pixels", str(setting.max_pixels),
            "--data-actors", actors, actors, "--decode", "gpu" if path == "vlmfeed-gpu" else "cpu",
            "--out", out, *PROXY]
    if setting.mbs >= 4:
        argv += MEMORY
    if not path.startswith("vlmfeed"):
        argv.append("--padded")  # one sample a row into the stock qwen3_vl_step
    return argv


class Counted:
    """The rank's iterator, counting the samples the trainer takes."""

    def __init__(self, inner):
        self.inner, self.samples = inner, 0

    def __iter__(self):
        return self

    def __next__(self):
        b = next(self.inner)
        self.samples += int(b["num_samples"].sum())
        return b


def peer_rank(path: str, cfg, setting, work_dir: str, layout, metrics_path: str, source) -> tuple[list, int]:
    """Inside each trainer actor: open the path for this rank, train, return (records, samples)."""
    import logging

    from trainer.megatron.loop import MegatronRank, train

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    dp = layout.dp_size
    if path == "megatron-bridge":
        from trainer.bench.peers_stock import StockPath

        inner = StockPath(setting, work_dir, samples=cfg.train.train_iters * cfg.train.gbs, dp_rank=layout.dp_rank,
                          dp_size=dp, num_workers=source)
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
    return (records if last else []), counted.samples


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

    out = os.path.join(args.out, f"{args.path}-mbs{setting.mbs}")
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
    meter = ProcessTreeMeter().start()
    t0 = time.time()
    group = WorkerGroup(world, use_gpu=True, gpu_per_rank=job.gpu_per_rank, env=rank_env(cfg.train.expandable_segments))
    service = None
    try:
        meter.set_ranks(ray.get([a.run.remote(os.getpid) for a in group.actors]))
        layouts = [RankLayout(r, world, cfg.parallel.tp, cfg.parallel.cp, cfg.parallel.pp) for r in range(world)]
        sources = _sources(args, setting, job, layouts)
        if args.path.startswith("vlmfeed"):
            from datasvc.service.client import DataService

            service = DataService(job.data_cfg, run=job.run)
        refs = [a.run.remote(peer_rank, args.path, cfg, setting, work_dir, lay, job.metrics_path, src)
                for a, lay, src in zip(group.actors, layouts, sources)]
        first_step_s = _wait(refs, job.metrics_path, t0)
        results = ray.get(refs)
        cpu = meter.cpu_s()
    finally:
        meter.stop()
        group.shutdown()
        if service is not None:
            service.shutdown()
    records = next((r for r, _ in results if r), [])
    samples = sum(n for _, n in results) // max(1, cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp)
    summary = summarize(records, None, "megatron", world, time.time() - t0)
    for key in ("data", "data_accounting", "autoscale_decisions"):
        summary.pop(key, None)
    steady = steady_window(records)
    data_cpu = cpu["data_workers"] + cpu["ray_system"] + cpu["driver"]
    return {"path": args.path, "mbs": setting.mbs, "strategy": args.strategy, "world": world, **summary,
            "tokens_per_s_blocks": list(mean_se(block_means([r["tokens_per_s"] for r in steady]))),
            "tflops_blocks": list(mean_se(block_means([r.get("tflops_per_gpu") for r in steady]))),
            "samples_trained": samples, "time_to_first_step_s": first_step_s,
            "data_cpu_s": round(data_cpu, 2), "cpu_s_by_kind": {k: round(v, 2) for k, v in cpu.items()},
            "cpu_s_per_trained_sample": round(data_cpu / samples, 4) if samples else None,
            "peak_host_rss_gib": round(meter.peak_rss_gib, 2)}


def _sources(args, setting, job, layouts) -> list:
    """Per rank: what its path needs from the driver."""
    if args.path == "ray-data":
        from trainer.bench.peers_raydata import split_for_ranks

        splits = split_for_ranks(setting, job.dp, args.workers or 8)
        return [splits[lay.dp_rank] for lay in layouts]
    if args.path == "megatron-bridge":
        return [args.workers] * len(layouts)
    return [(job.data_cfg, job.run)] * len(layouts)


def _wait(refs, metrics_path: str, t0: float) -> float | None:
    """Block until the ranks finish; returns the seconds until the first step's record appeared."""
    import ray

    first = None
    pending = list(refs)
    while pending:
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=1.0)
        if first is None and os.path.exists(metrics_path) and os.path.getsize(metrics_path) > 0:
            first = round(time.time() - t0, 1)
    return first


def train_all(args, setting, setting_args: list[str]) -> dict:
    """Every (MBS, path) case in its own process; per MBS the ratios to vlmfeed's CPU path."""
    if not _has_gpu():
        return {"skipped": "no CUDA GPU here: run `vlmfeed bench peers train` on the GPU host"}
    out: dict = {}
    start = time.time()
    for mbs in args.mbs_list:
        cases = {}
        for path in args.paths:
            timeout = args.case_timeout
            if args.deadline is not None:
                timeout = min(timeout, int(args.deadline - (time.time() - start)))
                if timeout < 90:
                    cases[path] = {"path": path, "rc": "skipped (deadline)"}
                    continue
            with tempfile.NamedTemporaryFile("r", suffix=".json") as f:
                cmd = [sys.executable, "-m", "trainer.bench.peers", "train-one", "--path", path, "--json", f.name,
                       *_with_mbs(setting_args, mbs), "--strategy", args.strategy, "--iters", str(args.iters),
                       "--world-size", str(args.world_size), "--tp", str(args.tp), "--out", args.out]
                cmd += ["--workers", str(args.workers)] if args.workers else []
                print(f"[peers] train: {path} mbs {mbs}", flush=True)
                t0 = time.time()
                rc = _run(cmd, timeout)
                cases[path] = json.load(open(f.name)) if rc == 0 and os.path.getsize(f.name) else \
                    _partial(path, rc, os.path.join(args.out, f"{path}-mbs{mbs}", "metrics.jsonl"), time.time() - t0)
            print(f"[peers] {path} mbs {mbs}: " + json.dumps({k: cases[path].get(k) for k in (
                "tokens_per_s", "tflops_per_gpu", "data_wait_share", "cpu_s_per_trained_sample", "rc")}), flush=True)
        _ratios(cases)
        out[f"mbs{mbs}"] = cases
    return out


def _run(cmd: list[str], timeout: int):
    """The case in its own process group, all of it (its Ray cluster too) killed at the timeout."""
    import signal

    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return "timeout"


def _partial(path: str, rc, metrics: str, wall_s: float) -> dict:
    """A case cut short or failed: the steady summary of the steps it finished, marked partial."""
    out = {"path": path, "rc": rc}
    if os.path.exists(metrics):
        from trainer.bench.training import partial_summary

        out.update(partial_summary(metrics, wall_s))
    return out


def _with_mbs(cmd: list[str], mbs: int) -> list[str]:
    i = cmd.index("--mbs")
    return cmd[:i + 1] + [str(mbs)] + cmd[i + 2:]


def _ratios(cases: dict) -> None:
    base = cases.get("vlmfeed-cpu", {})
    for r in cases.values():
        if "tokens_per_s_blocks" in r and "tokens_per_s_blocks" in base:
            r["tokens_per_s_vs_vlmfeed"] = ratio(tuple(r["tokens_per_s_blocks"]), tuple(base["tokens_per_s_blocks"]))
            r["tflops_vs_vlmfeed"] = ratio(tuple(r["tflops_blocks"]), tuple(base["tflops_blocks"]))
        if r.get("cpu_s_per_trained_sample") and base.get("cpu_s_per_trained_sample"):
            r["cpu_per_sample_vs_vlmfeed"] = round(r["cpu_s_per_trained_sample"] / base["cpu_s_per_trained_sample"], 3)


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def train_main(args, setting, work_dir: str, setting_args: list[str]) -> int:
    if args.cmd == "train":
        rep = train_all(args, setting, setting_args)
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "bench-peers-train.json")
        with open(path, "w") as f:
            json.dump(rep, f, indent=1)
        print(f"wrote {path}")
        return 0
    rep = train_one(args, setting, work_dir)
    with open(args.json, "w") as f:
        json.dump(rep, f, indent=1)
    return 0
