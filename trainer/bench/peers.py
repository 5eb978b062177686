"""Side by side with what users pick instead: ``vlmfeed bench peers`` (``python -m trainer.bench peers``).

    vlmfeed bench peers data  [--cores 8] [--profile llava-sft] [--rate N]   the data paths alone, on CPU
    vlmfeed bench peers train [--mbs-list 2] [--padded-mbs 4]      each path feeding the same trainer (GPU)
    vlmfeed bench peers all   [--out DIR]                          both, then the ratios to vlmfeed
    vlmfeed bench peers duplication                                the stock path's repeated preprocessing

The paths, on the same shards, pixel limits and sequence length:
  megatron-bridge  Megatron-Bridge 0.6.2's own loader (``trainer.bench.peers_stock``): its recipe's
                   HF dataset config, the HF Qwen3-VL processor in DataLoader workers (as many as
                   the data path's cores), its Qwen-VL collate, padded rows, the stock ``qwen3_vl_step``;
  energon-packed   Megatron-Energon 7.4.1 with its packing API (``trainer.bench.peers_energon``): the
                   HF processor in Energon's workers, first-fit-decreasing over a packing buffer,
                   packed rows into our THD forward step;
  automodel-packed NeMo AutoModel 0.7.0's VLM packing (``trainer.bench.peers_automodel``): the HF
                   processor in its DataLoader workers, ``neat_packing_vlm`` planned by
                   ``greedy_knapsack_vt_balanced`` from image headers, its THD collater, in a process
                   of its own environment (it pins another transformers), packed rows into our THD step;
  ray-data         read_webdataset -> map_batches(HF processor, actor pool) -> streaming_split with
                   its resource limits bounded to the data path's cores, padded rows
                   (``trainer.bench.peers_raydata``), the stock ``qwen3_vl_step``;
  vlmfeed-cpu/gpu  the data service (CPU or GPU decode) at its defaults, packed rows, our THD step.

Samples: the bundled photos, or ``--profile NAME`` synthetic shards matched to a kind of data users
train on (``vlmfeed synth --help`` lists the profiles and their sources). ``--cores N``: the data path
(its workers, actors and Ray's own processes) runs on N cores; the trainer ranks run on the others.

Each path runs in its own process, so the process tree measured (``peers_measure``) holds only that
path's workers, actors and Ray processes. CPU seconds per sample count every process of the tree
(data workers, Ray's own, and the consumer, which for vlmfeed expands pixel rows).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from datasvc.batch import TrainBatch
from datasvc.usage import HelpFormatter, positive_float
from trainer.bench.peers_data import IN_RANK, PATHS, STOCK_MAX_PIXELS, STOCK_MIN_PIXELS, PeerSetting
from trainer.bench.peers_grid import run_case
from trainer.bench.peers_measure import Clock, ProcessTreeMeter, has_gpu, ratio

BASELINE = "vlmfeed-cpu"


# ------------------------------------------------------------------------------------------------
# Opening a path for one rank
# ------------------------------------------------------------------------------------------------
def vlmfeed_config(setting: PeerSetting, *, decode: str, actors: int, dp_size: int = 1, consumers: int = 1):
    """The data service as ``trainer.run`` configures it, at the peers' pixel limits."""
    from datasvc.config import DecodeConfig, PoolConfig, ServiceConfig
    from datasvc.pack.epoch import size_blocks
    from datasvc.training import BLOCK_MICRO_BATCHES, CHAIN_BLOCKS

    cfg = ServiceConfig(shards=setting.shards, pipeline=setting.pipeline,
                        pipeline_options={"min_pixels": setting.min_pixels, "max_pixels": setting.max_pixels},
                        seq_len=setting.seq_len, micro_batch_size=setting.mbs, dp_size=dp_size, pack=True,
                        consumers_per_replica=consumers, epochs=None, blocks_span_epochs=True,
                        chain_blocks=CHAIN_BLOCKS, seed=0, decode=DecodeConfig(device=decode, threads=1),
                        pool=PoolConfig(min_actors=actors, max_actors=actors), items_per_block=1)
    return size_blocks(cfg, target_micro_batches=BLOCK_MICRO_BATCHES)[0]


class VlmfeedPath:
    """The data service's client for one rank (the service started here unless one is given)."""

    def __init__(self, setting: PeerSetting, *, decode: str, actors: int, device: str | None = None):
        from datasvc.service.client import DataService

        self.name = f"vlmfeed-{decode}"
        self.service = DataService(vlmfeed_config(setting, decode=decode, actors=actors),
                                   run=f"peers-{os.getpid()}")
        self.client = self.service.client(0, device=device)
        cfg = self.service.cfg
        # A feeder holds up to three packed blocks ahead of the rank: a warm-up past them measures
        # the steady state, not the read-ahead.
        self.buffered_samples = 3 * cfg.items_per_block * cfg.samples_per_item

    def __iter__(self):
        return self

    def __next__(self) -> TrainBatch:
        return next(self.client)

    def close(self) -> None:
        self.client.close()
        self.service.shutdown()


def open_path(name: str, setting: PeerSetting, work_dir: str, *, workers: int, samples: int):
    """One rank's iterator of contract batches for the named path (Ray started already where the
    path needs it). ``workers``: DataLoader workers, Ray Data actors or vlmfeed actors."""
    if name == "megatron-bridge":
        from trainer.bench.peers_stock import StockPath

        return StockPath(setting, work_dir, samples=samples, num_workers=workers)
    if name == "energon-packed":
        from trainer.bench.peers_energon import EnergonPackedPath

        return EnergonPackedPath(setting, work_dir, pad_id=_pad_id(setting), num_workers=workers)
    if name == "automodel-packed":
        from trainer.bench.peers_automodel import AutoModelPackedPath

        return AutoModelPackedPath(setting, work_dir, pad_id=_pad_id(setting), num_workers=workers)
    if name == "ray-data":
        from trainer.bench.peers_raydata import RayDataPath, split_for_ranks

        (it,) = split_for_ranks(setting, 1, workers)
        return RayDataPath(setting, it, pad_id=_pad_id(setting))
    if name in ("vlmfeed-cpu", "vlmfeed-gpu"):
        return VlmfeedPath(setting, decode=name.split("-")[1], actors=workers,
                           device="cuda:0" if name == "vlmfeed-gpu" else None)
    raise ValueError(f"unknown path {name!r}; choose from {', '.join(PATHS)}")


def _pad_id(setting: PeerSetting) -> int:
    from datasvc.registry import get_pipeline

    return get_pipeline(setting.pipeline).pad_id


# ------------------------------------------------------------------------------------------------
# The data path alone
# ------------------------------------------------------------------------------------------------
def data_alone(name: str, setting: PeerSetting, work_dir: str, *, cores: int, workers: int, samples: int,
               report: str | None = None, rate: float | None = None) -> dict:
    """Drain one path in this process, pinned to ``cores`` cores: time to the first micro-batch;
    then, past a warm-up that outlasts the path's read-ahead (``buffered_samples``: vlmfeed holds
    up to three packed blocks), samples/s and tree CPU-s per sample over ``samples`` samples
    (totals over totals; errors from five blocks of batches); peak tree RSS. The report is written
    to ``report`` before teardown.

    ``rate``: take at most this many samples a second. At full speed a path's CPU per sample leaves
    out what it spends per second whatever it delivers (idle processes, polling, its runtime's own
    threads); in training the step time sets the rate, and that share counts."""
    os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:cores]))
    meter = ProcessTreeMeter().start()
    t0 = time.perf_counter()
    ray_tmp = None
    if name not in IN_RANK:
        from datasvc.service.cluster import connect

        ray_tmp = tempfile.mkdtemp(prefix="peers-ray-", dir="/tmp")
        connect(num_cpus=max(cores, workers + 1), temp_dir=ray_tmp)
    path = open_path(name, setting, work_dir, workers=workers, samples=1 << 20)
    try:
        first = next(path)
        t_first = time.perf_counter() - t0
        warm = int(first.num_samples.sum())
        while warm < max(samples // 4, getattr(path, "buffered_samples", 0)):
            warm += int(next(path).num_samples.sum())
        clock, n, real = Clock(meter), 0, []
        start_cpu = meter.cpu_s()
        clock.mark(0)
        rate_from = time.perf_counter()
        while n < max(samples, getattr(path, "buffered_samples", 0)):
            b = next(path)
            n += int(b.num_samples.sum())
            real.append(_real_fraction(b))
            if rate:  # hold the next take until the rate allows it
                time.sleep(max(0.0, rate_from + n / rate - time.perf_counter()))
            clock.mark(n)
        wall = clock.marks[-1][0] - clock.marks[0][0]
        cpu = {k: v - start_cpu[k] for k, v in meter.cpu_s().items()}
        sps, cps = clock.block_rates()
        rep = {"path": name, "cores": cores, "workers": workers, "rate_samples_per_s": rate,
               "warmup_samples": warm, "samples": n,
               "micro_batches": len(real), "time_to_first_batch_s": round(t_first, 2), "wall_s": round(wall, 2),
               "samples_per_s": round(n / wall, 3), "samples_per_s_blocks": list(sps),
               "cpu_s_per_sample": round(cpu["total"] / n, 4), "cpu_s_per_sample_blocks": list(cps),
               # Without the consumer: on a GPU host vlmfeed's rank expands pixel rows on its GPU, and the
               # padded peers' consumer only pads rows; the consumer's share is its own figure.
               "cpu_s_per_sample_without_consumer": round((cpu["total"] - cpu["driver"]) / n, 4),
               "cpu_s_by_kind": {k: round(v, 2) for k, v in cpu.items()},
               "real_token_fraction": round(sum(real) / len(real), 4), "peak_rss_gib": round(meter.peak_rss_gib, 3)}
        if report:  # written before teardown: a process that fails after it still counts
            with open(report, "w") as f:
                json.dump(rep, f, indent=1)
    finally:
        meter.stop()
        try:  # a teardown that fails costs nothing measured
            path.close()
            _stop_ray(ray_tmp)
        except Exception as exc:  # noqa: BLE001
            print(f"[peers] {name}: teardown: {type(exc).__name__}: {exc}", file=sys.stderr)
    return rep


def _real_fraction(batch: TrainBatch) -> float:
    from trainer.bench.peers_data import real_token_fraction

    return real_token_fraction(batch)


def _stop_ray(tmp: str | None) -> None:
    if tmp is None:
        return
    import shutil

    import ray

    ray.shutdown()
    shutil.rmtree(tmp, ignore_errors=True)


def data_all(args) -> dict:
    """Each path alone in its own process; the ratios of each to vlmfeed's CPU path."""
    results = {}
    for name in args.paths:
        if name == "vlmfeed-gpu" and not has_gpu():
            results[name] = {"path": name, "skipped": "needs a CUDA GPU (GPU decode)"}
            continue
        with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
            cmd = [sys.executable, "-m", "trainer.bench.peers", "data-one", "--path", name, "--json", out.name,
                   *_setting_args(args), "--cores", str(args.cores), "--samples", str(args.samples)]
            if args.rate:
                cmd += ["--rate", str(args.rate)]
            if args.workers:
                cmd += ["--workers", str(args.workers)]
            print(f"[peers] data alone: {name} on {args.cores} cores", flush=True)
            rc = run_case(cmd, args.case_timeout)
            # The report is written before teardown: a process that fails after it still counts.
            results[name] = json.load(open(out.name)) if os.path.getsize(out.name) else {"path": name}
            if rc != 0:
                results[name]["rc"] = rc
        print(f"[peers] {name}: " + json.dumps({k: results[name].get(k) for k in (
            "samples_per_s", "cpu_s_per_sample", "time_to_first_batch_s", "peak_rss_gib", "rc")}), flush=True)
    base = results.get(BASELINE, {})
    for name, r in results.items():
        if "samples_per_s_blocks" in r and "samples_per_s_blocks" in base:
            r["samples_per_s_vs_vlmfeed"] = ratio(tuple(r["samples_per_s_blocks"]), tuple(base["samples_per_s_blocks"]))
            r["cpu_s_per_sample_vs_vlmfeed"] = ratio(tuple(r["cpu_s_per_sample_blocks"]),
                                                     tuple(base["cpu_s_per_sample_blocks"]))
            r["cpu_s_per_sample_without_consumer_vs_vlmfeed"] = round(
                r["cpu_s_per_sample_without_consumer"] / base["cpu_s_per_sample_without_consumer"], 3)
    return {"cores": args.cores, "setting": _setting_dict(args), "paths": results,
            "duplication": duplication(results)}


# ------------------------------------------------------------------------------------------------
# The stock path's repeated work across model-parallel ranks
# ------------------------------------------------------------------------------------------------
LAYOUTS = (  # (name, world, tp, pp, cp): Megatron-Bridge's Qwen3-VL SFT recipes and common 3D layouts
    ("30b-a3b sft recipe: 8 GPUs, TP1 PP1 (EP8)", 8, 1, 1, 1),
    ("235b-a22b sft recipe: 32 GPUs, TP4 PP1 (EP32)", 32, 4, 1, 1),
    ("64 GPUs, TP4 PP2", 64, 4, 2, 1),
    ("64 GPUs, TP2 PP4 CP2", 64, 2, 4, 2),
)


def duplication(measured: dict | None = None, workers_per_rank: int = 2) -> list[dict]:
    """Per layout: how often each trained sample is preprocessed. Bridge's DataLoader runs on every
    rank and shards by DP rank, so the TP x PP x CP ranks of one replica each preprocess the same
    samples (world/DP times the work); vlmfeed preprocesses once per DP replica and hands every
    rank of it the same micro-batch. Measured CPU-s per sample, where given, are scaled by it."""
    out = []
    for name, world, tp, pp, cp in LAYOUTS:
        mp = tp * pp * cp
        row = {"layout": name, "world": world, "dp": world // mp, "stock_preprocessing_per_sample": mp,
               "vlmfeed_preprocessing_per_sample": 1, "stock_dataloader_workers": world * workers_per_rank}
        for path, r in (measured or {}).items():
            if "cpu_s_per_sample" in r:
                times = mp if path == "megatron-bridge" else 1
                row[f"{path}_cpu_s_per_trained_sample"] = round(r["cpu_s_per_sample"] * times, 4)
        out.append(row)
    return out


# ------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------
def _add_setting(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shards", nargs="+", default=None, help="WebDataset shards (default: the bundled photos)")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--mbs", type=int, default=2)
    p.add_argument("--min-pixels", type=int, default=STOCK_MIN_PIXELS)
    p.add_argument("--max-pixels", type=int, default=STOCK_MAX_PIXELS)
    p.add_argument("--profile", default=None, help="synthetic shards of this profile instead of the bundled "
                                                   "photos (`vlmfeed synth --help` lists them), made once and cached")
    p.add_argument("--profile-samples", type=int, default=1024, help="samples in the synthetic shards")
    p.add_argument("--work-dir", default=None, help="where the conversion and processor are kept "
                                                    "(default: the cache beside the bundled shards)")


def _setting(args) -> PeerSetting:
    from datasvc.samples import default_shards, large_shards

    if args.shards:
        shards = args.shards
    elif args.profile:
        from datasvc.tools.synth import cached_profile_shards

        shards = cached_profile_shards(args.profile, args.profile_samples)
    else:
        shards = large_shards() if getattr(args, "large", False) else default_shards()
    return PeerSetting(shards=tuple(shards), seq_len=args.seq_len, mbs=args.mbs,
                       min_pixels=args.min_pixels, max_pixels=args.max_pixels)


def _setting_args(args) -> list[str]:
    out = ["--seq-len", str(args.seq_len), "--mbs", str(args.mbs), "--min-pixels", str(args.min_pixels),
           "--max-pixels", str(args.max_pixels), "--work-dir", _work_dir(args)]
    if args.profile and not args.shards:
        out += ["--profile", args.profile, "--profile-samples", str(args.profile_samples)]
    return out + (["--shards", *args.shards] if args.shards else [])


def _setting_dict(args) -> dict:
    s = _setting(args)
    return {"shards": len(s.shards), "profile": args.profile, "seq_len": s.seq_len, "mbs": s.mbs, "min_pixels": s.min_pixels,
            "max_pixels": s.max_pixels}


def _work_dir(args) -> str:
    if args.work_dir:
        return args.work_dir
    import hashlib

    from datasvc.samples import cache_dir

    s = _setting(args)  # the conversion and the processor depend on the shards and pixel limits only
    key = hashlib.sha1(json.dumps([list(s.shards), s.min_pixels, s.max_pixels]).encode()).hexdigest()
    return cache_dir("peers", key[:12])


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="vlmfeed bench peers", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, text in (("data", "the data paths alone on this host's CPU"),):
        p = sub.add_parser(name, help=text)
        _add_setting(p)
        p.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
        p.add_argument("--cores", type=int, default=min(16, os.cpu_count() or 1))
        p.add_argument("--workers", type=int, default=None, help="per path (default: Bridge's 2 DataLoader "
                                                                 "workers; --cores actors for the others)")
        p.add_argument("--samples", type=int, default=96)
        p.add_argument("--rate", type=positive_float, default=None, metavar="SAMPLES_PER_S",
                       help="take at most this many samples a second (default: as fast as each path delivers); "
                            "CPU per sample then counts what a path spends per second, as in training")
        p.add_argument("--case-timeout", type=int, default=900)
        p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench-peers.json"))
        # The bundled photos as 384 distinct crops: one epoch outlasts every path's warm-up, so no
        # path pays an epoch restart (Ray Data re-runs its whole dataset, actors included) inside it.
        p.set_defaults(large=True)
    one = sub.add_parser("data-one", help="one path alone, in this process (what `data` runs per path)")
    _add_setting(one)
    one.add_argument("--path", required=True, choices=PATHS)
    one.add_argument("--cores", type=int, default=2)
    one.add_argument("--workers", type=int, default=None)
    one.add_argument("--samples", type=int, default=96)
    one.add_argument("--rate", type=positive_float, default=None)
    one.add_argument("--json", required=True)
    one.set_defaults(large=True)
    sub.add_parser("duplication", help="the stock path's repeated preprocessing per layout")
    from trainer.bench.peers_train import add_train_parsers

    add_train_parsers(sub, _add_setting, PATHS)
    return ap


def default_workers(path: str, cores: int, given: int | None) -> int:
    """As many workers or actors as the data path has cores, for every path (Bridge's recipes set 2
    DataLoader workers a rank, which waits for data on a fast GPU: tuned, it gets the cores)."""
    return given or cores


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    command = "vlmfeed bench peers " + " ".join(argv)
    if args.cmd == "duplication":
        print(json.dumps(duplication(), indent=1))
        return 0
    if args.cmd == "data-one":
        data_alone(args.path, _setting(args), _work_dir(args), cores=args.cores,
                   workers=default_workers(args.path, args.cores, args.workers), samples=args.samples,
                   report=args.json, rate=args.rate)
        return 0
    if args.cmd in ("train", "train-one"):
        from trainer.bench.peers_train import train_main

        return train_main(args, _setting(args), _work_dir(args), _setting_args(args), _setting_args, command)
    rep = {"data_alone": data_all(args)}
    if args.cmd == "all":
        from trainer.bench.peers_grid import train_all

        rep["training"] = train_all(args, _setting(args), _setting_args(args), _setting_args)
        args.out = os.path.join(args.out, "bench-peers.json")
    from datasvc.tools.bench.provenance import stamp
    from trainer.bench import trainer_defaults
    from trainer.bench.peers_train import QUESTION

    rep = stamp(rep, QUESTION, command, trainer_defaults())
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rep, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
