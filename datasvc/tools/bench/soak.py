"""Soak: stream for N minutes over good and hostile shards while killing actors; count what is lost.

``vlmfeed bench soak --minutes 10``. Samples lost must be 0: for every completed epoch,
the delivered keys equal exactly the keys an in-process run accepts (no loss, no duplicates).
"""
from __future__ import annotations

import dataclasses
import io
import json
import os
import random
import signal
import tarfile
import time
import uuid
from collections import Counter, defaultdict

import psutil

from datasvc.samples import cache_dir


def write_hostile_shards(out_dir: str, photo_shards: list[str]) -> list[str]:
    """A truncated copy of a good shard, a shard of bad members, and a file that is not a tar."""
    import pickle

    os.makedirs(out_dir, exist_ok=True)
    data = open(photo_shards[0], "rb").read()
    paths = [os.path.join(out_dir, "truncated.tar"), os.path.join(out_dir, "bad-members.tar"),
             os.path.join(out_dir, "garbage.tar")]
    with open(paths[0], "wb") as f:
        f.write(data[: len(data) * 2 // 3])
    members = [("zero.jpg", b""), ("zero.txt", b"zero"), ("rand.jpg", os.urandom(4000)), ("rand.txt", b"r"),
               ("nocap.jpg", data[1024:9000]), ("evil.pyd", pickle.dumps({"x": 1})), ("evil.txt", b"pickle"),
               ("latin.jpg", b"\xff\xd8\xff"), ("latin.txt", "\xe9t\xe9".encode("latin-1"))]
    with tarfile.open(paths[1], "w") as tar:
        for name, blob in members:
            info = tarfile.TarInfo(name)
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
    with open(paths[2], "wb") as f:
        f.write(os.urandom(20000))
    return paths


def accepted_keys(cfg) -> Counter:
    """What one epoch delivers in process (the reference for 'nothing lost'): the feeder's own
    producer, with the actors' work run inline."""
    from datasvc.producer import BlockProducer

    keys = Counter()
    for batch, _pos in BlockProducer(dataclasses.replace(cfg, epochs=1), 0).micro_batches():
        keys.update(batch.sample_keys)
    return keys


def _ray_rss_mib() -> float:
    total = 0
    for p in psutil.process_iter(["cmdline", "memory_info"]):
        cmd = " ".join(p.info.get("cmdline") or [])
        if "ray::" in cmd or "raylet" in cmd or "plasma" in cmd:
            total += p.info["memory_info"].rss if p.info.get("memory_info") else 0
    return total / 2**20


def _soak_config():
    from datasvc.config import ServiceConfig
    from datasvc.plan import TRAINING_CHAIN_BLOCKS
    from datasvc.samples import write_photo_shards

    root = cache_dir("soak")
    good = write_photo_shards(os.path.join(root, "good"), samples_per_shard=6, copies=2)
    shards = good + write_hostile_shards(os.path.join(root, "bad"), good)
    # Blocks pack in chains as in trainer.run, so a killed feeder often restarts mid-chain and must
    # replay the chain's earlier blocks to rebuild the rows they held.
    return ServiceConfig(shards=tuple(shards), seq_len=512, micro_batch_size=2, samples_per_item=4,
                         items_per_block=2, chain_blocks=TRAINING_CHAIN_BLOCKS,
                         pipeline_options={"min_pixels": 32 * 32, "max_pixels": 192 * 192},
                         epochs=None, min_actors=1, max_actors=2, max_batches_ahead=3, autoscale_interval_s=2.0)


def _inject_fault(svc, rng: random.Random, faults: Counter) -> None:
    """Kill a preprocessing actor (through Ray or with SIGKILL) or the feeder; count what was done."""
    import ray

    from datasvc.service import feeder_name

    kind = rng.choice(["ray.kill actor", "SIGKILL actor", "ray.kill feeder"])
    try:
        if kind == "ray.kill feeder":
            ray.kill(ray.get_actor(feeder_name(svc.run, 0)), no_restart=True)
        else:
            actors = ray.get(ray.get_actor(feeder_name(svc.run, 0)).actor_handles.remote())
            if actors:
                victim = rng.choice(actors)
                if kind == "SIGKILL actor":
                    os.kill(ray.get(victim.pid.remote(), timeout=10), signal.SIGKILL)
                else:
                    ray.kill(victim, no_restart=True)
        faults[kind] += 1
    except Exception as exc:  # the victim may already be gone; count, do not stop
        faults[f"{kind} (no target: {type(exc).__name__})"] += 1


def soak(minutes: float, out: str | None = None, kill_every_s: float = 20.0, seed: int = 0) -> dict:
    import ray

    from datasvc.cluster import connect
    from datasvc.client import DataService
    from datasvc.service import EndOfData, feeder_name

    rng = random.Random(seed)
    cfg = _soak_config()
    expected = accepted_keys(cfg)
    connect(num_cpus=max(2, os.cpu_count() or 2))
    svc = DataService(cfg, run=f"soak-{uuid.uuid4().hex[:6]}")
    client = svc.client(0, output="numpy")
    per_epoch: dict[int, Counter] = defaultdict(Counter)
    faults = Counter()
    rss = {"first": None, "peak": 0.0}
    t_end = time.monotonic() + minutes * 60
    next_kill = time.monotonic() + kill_every_s
    batches = 0
    last_report = time.monotonic()
    try:
        while time.monotonic() < t_end:
            batch = next(client)
            batches += 1
            per_epoch[client.last_position["epoch"]].update(batch.sample_keys)
            if time.monotonic() >= next_kill:
                next_kill = time.monotonic() + kill_every_s
                _inject_fault(svc, rng, faults)
            now_rss = _ray_rss_mib()
            rss["first"] = now_rss if rss["first"] is None and batches >= 20 else rss["first"]
            rss["peak"] = max(rss["peak"], now_rss)
            if time.monotonic() - last_report > 30:
                last_report = time.monotonic()
                print(f"[soak] {batches} micro-batches, epoch {client.last_position['epoch']}, "
                      f"faults {sum(faults.values())}, ray RSS {now_rss:.0f} MiB", flush=True)
    except EndOfData:
        pass
    stats = ray.get(ray.get_actor(feeder_name(svc.run, 0)).stats.remote())
    rss["final"] = _ray_rss_mib()
    client.close()
    svc.shutdown()
    report = _soak_report(minutes, batches, per_epoch, expected, faults, stats, rss)
    print("\n".join(f"{k:>36}: {v}" for k, v in report.items()))
    if out:
        with open(out, "w") as f:
            json.dump(report, f, indent=2)
    return report


def _soak_report(minutes: float, batches: int, per_epoch: dict[int, Counter], expected: Counter,
                 faults: Counter, stats: dict, rss: dict) -> dict:
    completed = sorted(per_epoch)[:-1]  # the last epoch was cut off by the clock
    lost = sum(sum((expected - per_epoch[e]).values()) for e in completed)
    dup = sum(sum((per_epoch[e] - expected).values()) for e in completed)
    return {
        "minutes": minutes, "micro_batches": batches, "epochs_completed": len(completed),
        "samples_delivered": sum(sum(c.values()) for c in per_epoch.values()),
        "expected_per_epoch": sum(expected.values()), "samples_lost": lost, "samples_duplicated": dup,
        "faults_injected": dict(faults), "faults_total": sum(faults.values()),
        "actors_replaced_current_feeder": stats["actors_replaced"],
        "quarantined_by_reason_current_feeder": stats["accounting"]["quarantined"],
        "ray_rss_mib_after_warmup": round(rss["first"] or 0, 1), "ray_rss_mib_peak": round(rss["peak"], 1),
        "ray_rss_mib_final": round(rss["final"], 1),
    }
