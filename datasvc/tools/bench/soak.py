"""Soak: stream for N minutes over good and hostile shards while killing actors; count what is lost.

``vlmfeed bench soak --minutes 10``. The shards mix every class of bad data of
``datasvc.tools.bench.hostile`` (exceptions in parsing, duplicate members, a corrupt header
mid-shard, gzip, links, a truncated JPEG, an EXIF-rotated photo, a decompression-bomb PNG over the
decoded-bytes budget, a sample that kills its actor, and the tar edge cases: a .tar.gz padded over
the encoded-bytes budget, a pax size of -1, a pax header over 1 MiB, sparse members, a zero-filled
file, NFD captions, orphans, dotted names, one shard named twice) with good ones, while actors and
the feeder are killed from outside. The report (JSON) passes (``ok``) when:

- crashes == 0: the stream never raised;
- samples_lost == samples_duplicated == 0: for every completed epoch, the delivered keys equal
  exactly the keys an in-process run accepts, less the sample that kills its actor;
- uncounted_samples == 0: read == delivered + quarantined + skipped_by_rule + in_flight;
- rss_under_budget: the peak RSS of the cluster's processes stayed under ``rss_budget_mib``;
- tar_edge_reasons_missing is empty: each tar edge case was counted under its reason;
- a shard named twice was read once, and a shard rewritten between indexing and reading had every
  sample counted ``shard_changed`` (checked on its own before the stream: a feeder restarted during
  the stream refuses a changed dataset by design, so a rewrite mid-stream would stop the run).
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import time
import uuid
from collections import Counter, defaultdict

import psutil

from datasvc.samples import cache_dir
from datasvc.tools.bench.faults import faults


def accepted_keys(cfg) -> Counter:
    """What one epoch delivers in process (the reference for 'nothing lost'): the feeder's own
    producer, with the actors' work run inline (no fault injection)."""
    from datasvc.stream.producer import BlockProducer

    keys = Counter()
    for batch, _pos in BlockProducer(dataclasses.replace(cfg, epochs=1, pool=dataclasses.replace(cfg.pool, actor_hook=())), 0).micro_batches():
        keys.update(batch.sample_keys)
    return keys


def _ray_rss_mib() -> float:
    """RSS of this cluster's processes: the embedded cluster's are this process's descendants (so
    another Ray cluster on the host is not counted); a joined cluster's are every Ray process here."""
    procs = psutil.Process().children(recursive=True) or list(psutil.process_iter())
    total = 0
    for p in procs:
        try:
            cmd = " ".join(p.cmdline())
            if "ray::" in cmd or "raylet" in cmd or "plasma" in cmd:
                total += p.memory_info().rss
        except psutil.Error:  # it ended while being read: a killed actor
            continue
    return total / 2**20


DECODED_BYTES_BUDGET = 64 << 20  # per actor: the decompression bomb (75 MB decoded) is over it
ENCODED_BYTES_BUDGET = 64 << 20  # per actor: the padded .tar.gz sample (128 MiB of members) is over it
BOMB_SIDE = 5000
# What the tar edge cases of the hostile set are counted under, in every soak.
TAR_EDGE_REASONS = frozenset({"sample_too_large", "corrupt_tar_header", "tar_header_too_large", "sparse_member",
                              "unreadable_tar", "missing_image", "missing_text", "dotted_text_member"})


def _soak_config():
    from datasvc.config import BudgetConfig, PoolConfig, ServiceConfig
    from datasvc.samples import encode_image, real_photos, write_photo_shards
    from datasvc.tools.bench.hostile import write_hostile_set
    from datasvc.training import CHAIN_BLOCKS

    root = cache_dir("soak")
    good = write_photo_shards(os.path.join(root, "good"), samples_per_shard=6, copies=2)
    hostile, kill_key = write_hostile_set(os.path.join(root, "hostile"), encode_image(real_photos()[1][1]), good[0],
                                          bomb_side=BOMB_SIDE)
    alias = os.path.join(root, "hostile-alias")  # the hostile directory by a second name
    if not os.path.islink(alias):
        os.symlink(os.path.join(root, "hostile"), alias, target_is_directory=True)
    # Blocks pack in chains as in trainer.run, so a killed feeder often restarts mid-chain and must
    # replay the chain's earlier blocks to rebuild the rows they held.
    cfg = ServiceConfig(shards=tuple(good + hostile + [os.path.join(alias, "duplicates.tar")]), seq_len=512,
                        micro_batch_size=2, samples_per_item=4, items_per_block=2, chain_blocks=CHAIN_BLOCKS,
                        pipeline_options={"min_pixels": 32 * 32, "max_pixels": 192 * 192},
                        budget=BudgetConfig(decoded_bytes_budget=DECODED_BYTES_BUDGET,
                                            encoded_bytes_budget=ENCODED_BYTES_BUDGET),
                        pool=PoolConfig(actor_hook=faults(kill_on_key=kill_key), min_actors=1, max_actors=2,
                                        max_batches_ahead=3, autoscale_interval_s=2.0),
                        epochs=None)
    return cfg, kill_key


def file_checks(cfg) -> dict:
    """The shard-file cases a stream cannot show: the shard named twice (read once?), and a shard
    rewritten in place between indexing and reading, read as an actor reads a work item."""
    from datasvc.read.shards import expand_shards, index_shard
    from datasvc.samples import encode_image, real_photos
    from datasvc.stream.process import ItemProcessor
    from datasvc.tools.bench.hostile import good, rewrite_in_place, write_tar
    from datasvc.wire import WorkItem

    photo = encode_image(real_photos()[1][1])
    path = write_tar(os.path.join(cache_dir("soak"), "rewritten.tar"), [m for i in range(4) for m in good(f"rw{i}", photo)])
    index = index_shard(path)
    rewrite_in_place(path)
    result = ItemProcessor(dataclasses.replace(cfg, pool=dataclasses.replace(cfg.pool, actor_hook=())), device_id=None)(
        WorkItem(path, 0, tuple(index.samples)))
    return {"shard_names": len(cfg.shards), "shard_files": len({os.path.realpath(p) for p in cfg.shards}),
            "shard_files_read": len(expand_shards(list(cfg.shards))),
            "rewritten_shard": {"samples": len(index.samples), "delivered": len(result.samples),
                                "shard_changed": result.accounting.quarantined["shard_changed"]}}


def _inject_fault(svc, rng: random.Random, faults: Counter) -> None:
    """Kill a preprocessing actor (through Ray or with SIGKILL) or the feeder; count what was done."""
    import ray

    from datasvc.service.feeder import feeder_name

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


def soak(minutes: float, out: str | None = None, kill_every_s: float = 20.0, seed: int = 0,
         rss_budget_mib: float = 6144.0) -> dict:
    """Stream for ``minutes``, killing an actor or the feeder every ``kill_every_s``; the report
    (see the module doc) is printed, written to ``out`` as JSON, and returned."""
    from datasvc.service.client import DataService
    from datasvc.service.cluster import connect

    rng = random.Random(seed)
    cfg, kill_key = _soak_config()
    checks = file_checks(cfg)
    expected = accepted_keys(cfg)
    expected.pop(kill_key, None)  # quarantined worker_died by the actors; inline nothing kills it
    connect(num_cpus=max(2, os.cpu_count() or 2))
    svc = DataService(cfg, run=f"soak-{uuid.uuid4().hex[:6]}")
    client = svc.client(0, output="numpy")
    run = {"per_epoch": defaultdict(Counter), "faults": Counter(), "rss": {"first": None, "peak": 0.0},
           "batches": 0, "crash": "", "reasons_seen": set()}
    try:
        _stream(client, svc, minutes, kill_every_s, rng, run)
        stats = _feeder_stats(svc)
        run["rss"]["final"] = _ray_rss_mib()
    finally:
        client.close()
        svc.shutdown()
    report = _soak_report(minutes, run, expected, stats, rss_budget_mib, kill_key, checks)
    print("\n".join(f"{k:>36}: {v}" for k, v in report.items()))
    if out:
        with open(out, "w") as f:
            json.dump(report, f, indent=2)
    return report


def _stream(client, svc, minutes: float, kill_every_s: float, rng: random.Random, run: dict) -> None:
    """Take micro-batches until the clock runs out (or the stream ends or raises: a crash)."""
    from datasvc.service.feeder import EndOfData

    t_end = time.monotonic() + minutes * 60
    next_kill = time.monotonic() + kill_every_s
    last_report = time.monotonic()
    rss = run["rss"]
    while time.monotonic() < t_end:
        try:
            batch = next(client)
        except EndOfData:
            return
        except Exception as exc:  # a crash: the soak reports it instead of dying with it
            run["crash"] = f"{type(exc).__name__}: {exc}"[:2000]
            return
        run["batches"] += 1
        run["per_epoch"][client.last_position["epoch"]].update(batch.sample_keys)
        if time.monotonic() >= next_kill and t_end - time.monotonic() > 15:  # the last feeder lives to report
            next_kill = time.monotonic() + kill_every_s
            _note_reasons(svc, run["reasons_seen"])  # a killed feeder's accounting goes with it
            _inject_fault(svc, rng, run["faults"])
        now_rss = _ray_rss_mib()
        rss["first"] = now_rss if rss["first"] is None and run["batches"] >= 20 else rss["first"]
        rss["peak"] = max(rss["peak"], now_rss)
        if time.monotonic() - last_report > 30:
            last_report = time.monotonic()
            print(f"[soak] {run['batches']} micro-batches, epoch {client.last_position['epoch']}, "
                  f"faults {sum(run['faults'].values())}, ray RSS {now_rss:.0f} MiB", flush=True)


def _feeder_stats(svc, timeout: float | None = None) -> dict:
    import ray

    from datasvc.service.feeder import feeder_name

    return ray.get(ray.get_actor(feeder_name(svc.run, 0)).stats.remote(), timeout=timeout).as_dict()


def _note_reasons(svc, seen: set) -> None:
    try:
        stats = _feeder_stats(svc, timeout=10)
    except Exception:  # a feeder still restarting from the last fault has nothing to say yet
        return
    seen.update(stats["accounting"]["quarantined"])


def _soak_report(minutes: float, run: dict, expected: Counter, stats: dict, rss_budget_mib: float,
                 kill_key: str, checks: dict) -> dict:
    per_epoch, faults, rss = run["per_epoch"], run["faults"], run["rss"]
    completed = sorted(per_epoch)[:-1]  # the last epoch was cut off by the clock
    lost_keys = {e: sorted(expected - per_epoch[e]) for e in completed if expected - per_epoch[e]}
    dup_keys = {e: sorted(per_epoch[e] - expected) for e in completed if per_epoch[e] - expected}
    lost = sum(sum((expected - per_epoch[e]).values()) for e in completed)
    dup = sum(sum((per_epoch[e] - expected).values()) for e in completed)
    a = stats["accounting"]
    quarantined, skipped = sum(a["quarantined"].values()), sum(a["skipped_by_rule"].values())
    uncounted = a["read"] - (a["delivered"] + quarantined + skipped + a.get("in_flight", 0))
    report = {
        "minutes": minutes, "micro_batches": run["batches"], "epochs_completed": len(completed),
        "crashes": int(bool(run["crash"])), "crash": run["crash"],
        "samples_delivered": sum(sum(c.values()) for c in per_epoch.values()),
        "expected_per_epoch": sum(expected.values()), "samples_lost": lost, "samples_duplicated": dup,
        "lost_keys_by_epoch": lost_keys, "duplicated_keys_by_epoch": dup_keys,
        "faults_injected": dict(faults), "faults_total": sum(faults.values()),
        "accounting_current_feeder": {"read": a["read"], "delivered": a["delivered"], "quarantined": quarantined,
                                      "skipped_by_rule": skipped, "in_flight": a.get("in_flight", 0)},
        "uncounted_samples": uncounted,
        "actors_replaced_current_feeder": stats["actors_replaced"],
        "quarantined_by_reason_current_feeder": a["quarantined"],
        "quarantine_reasons_every_feeder": sorted(run["reasons_seen"] | set(a["quarantined"])),
        "kill_key": kill_key,  # quarantined worker_died by each feeder that reached it
        "decoded_bytes_budget_mib": DECODED_BYTES_BUDGET >> 20, "rss_budget_mib": rss_budget_mib,
        "ray_rss_mib_after_warmup": round(rss["first"] or 0, 1), "ray_rss_mib_peak": round(rss["peak"], 1),
        "ray_rss_mib_final": round(rss.get("final", 0), 1),
        "rss_under_budget": rss["peak"] <= rss_budget_mib,
        "encoded_bytes_budget_mib": ENCODED_BYTES_BUDGET >> 20,
        "tar_edge_reasons_missing": sorted(TAR_EDGE_REASONS - run["reasons_seen"] - set(a["quarantined"])),
        **checks,
    }
    rewritten = checks["rewritten_shard"]
    report["ok"] = (report["crashes"] == 0 and lost == 0 and dup == 0 and uncounted == 0
                    and report["rss_under_budget"] and not report["tar_edge_reasons_missing"]
                    and checks["shard_files_read"] == checks["shard_files"] < checks["shard_names"]
                    and rewritten["shard_changed"] == rewritten["samples"] > 0 == rewritten["delivered"])
    return report
