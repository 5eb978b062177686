"""What does a vision-balanced feeder spend planning each step at DP N, from image headers and
from the shared sizes index (``datasvc.pack.sizes``), and what does it spend starting?

Every feeder of a ``balance_dp`` job plans the micro-batches of all N ranks. From headers that
means reading (and tokenizing) every rank's samples in every feeder; from a warm index, only
packing them. This times the plan and the deal alone (no pixel decoded) for the first steps of
rank 0's feeder, three ways in one run: headers, a cold index (this feeder writes it), a warm
index (another feeder wrote it), and reports seconds per step and the ratios. Starting is
listing every shard's samples: from the tars' headers, or from the listings kept beside the index
(``datasvc.read.listings``).

    python -m datasvc.tools.bench.planning --dp 8 64 512 --out /tmp/planning
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from itertools import islice

import numpy as np

from datasvc.tools.bench.provenance import stamp
from datasvc.usage import HelpFormatter


def write_shards(out_dir: str, samples: int, per_shard: int = 64, seed: int = 0) -> list[str]:
    """Real JPEG tars with a wide size mix (64 px to 1.3k px a side, 1-3 images a sample, captions
    of 3 to 120 words): what the plan reads are headers and text, so the pixels are flat."""
    import webdataset as wds

    from datasvc.samples import encode_image

    rng = np.random.default_rng(seed)
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for shard in range(-(-samples // per_shard)):
        path = os.path.join(out_dir, f"plan-{shard:05d}.tar")
        with wds.TarWriter(path) as sink:
            for i in range(shard * per_shard, min(samples, (shard + 1) * per_shard)):
                k = int(rng.choice([1, 1, 2, 3]))
                sample = {"__key__": f"s{i:06d}"}
                for m in range(k):
                    side = int(rng.choice([64, 160, 320, 640, 1280]))
                    img = np.full((side, int(side * rng.choice([0.75, 1.0, 1.33])), 3), int(rng.integers(255)), np.uint8)
                    sample[f"{m}.jpg" if k > 1 else "jpg"] = encode_image(img)
                text = "a caption " * int(rng.integers(3, 120))
                if k > 1:
                    sample["json"] = json.dumps({"messages": [
                        {"role": "user", "content": "<image>\n" * k + "Describe."},
                        {"role": "assistant", "content": text}]}).encode()
                else:
                    sample["txt"] = text
                sink.write(sample)
        paths.append(path)
    return paths


def time_plan(cfg, steps: int) -> tuple[float, float, int, dict | None]:
    """(seconds to start the feeder: listing every shard; seconds for the first ``steps`` planned and
    dealt steps; steps made; sizes index counts)."""
    from datasvc.stream.balanced import BalancedProducer

    t0 = time.perf_counter()
    producer = BalancedProducer(cfg, 0)
    t1 = time.perf_counter()
    made = sum(1 for _ in islice(producer._steps(), steps))
    seconds = time.perf_counter() - t1
    sizes = producer.sizes
    return t1 - t0, seconds, made, ({"built": sizes.built, "loaded": sizes.loaded} if sizes else None)


def bench_planning(dps: list[int], steps: int, mbs_per_step: int, seq_len: int, work_dir: str) -> dict:
    from datasvc.config import BalanceConfig, ServiceConfig

    samples = max(dps) * mbs_per_step * (steps + 1) * 6  # enough items for every rank's first steps
    shards = write_shards(os.path.join(work_dir, "shards"), samples)
    rows = []
    for dp in dps:
        base = ServiceConfig(shards=tuple(shards), seq_len=seq_len, micro_batch_size=1, samples_per_item=4,
                             items_per_block=2, pipeline_options={"max_pixels": 1024 * 1024}, epochs=1, dp_size=dp,
                             balance=BalanceConfig(enabled=True, micro_batches_per_step=mbs_per_step))
        index = os.path.join(work_dir, f"sizes-dp{dp}")
        shutil.rmtree(index, ignore_errors=True)
        row = {"dp": dp, "micro_batches_per_step": mbs_per_step}
        for name, cfg in (("headers", base), ("index_cold", dataclasses.replace(base, balance=dataclasses.replace(base.balance, sizes_index=index))),
                          ("index_warm", dataclasses.replace(base, balance=dataclasses.replace(base.balance, sizes_index=index)))):
            start, seconds, made, counts = time_plan(cfg, steps)
            row[name] = {"start_s": round(start, 4), "s_per_step": round(seconds / max(made, 1), 4), "steps": made,
                         "sizes_index": counts}
            print(f"  dp {dp:4d} {name:10s} start {start:7.3f} s, {seconds / max(made, 1):8.3f} s/step ({made} steps)",
                  flush=True)
        row["headers_vs_index_warm"] = round(row["headers"]["s_per_step"] / row["index_warm"]["s_per_step"], 2)
        row["start_headers_vs_index_warm"] = round(row["headers"]["start_s"] / row["index_warm"]["start_s"], 2)
        rows.append(row)
    return {"samples": samples, "shards": len(shards), "seq_len": seq_len, "rows": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m datasvc.tools.bench.planning", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--dp", type=int, nargs="+", default=[8, 64, 512])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--micro-batches-per-step", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--out", default="planning-bench")
    args = p.parse_args(argv)
    work = tempfile.mkdtemp(prefix="vlmfeed-planning-")
    try:
        rep = bench_planning(args.dp, args.steps, args.micro_batches_per_step, args.seq_len, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rep = stamp({"machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                             "load_avg_at_start": list(os.getloadavg())}, **rep},
                "What does a balanced feeder spend planning each step, from headers and from the sizes index?",
                "python -m datasvc.tools.bench.planning " + " ".join(sys.argv[1:] if argv is None else argv))
    print(f"\n{'dp':>5} {'headers s/step':>15} {'index cold':>11} {'index warm':>11} {'headers/warm':>13}"
          f" {'start: tars':>12} {'listings':>9} {'tars/listings':>14}")
    for r in rep["rows"]:
        print(f"{r['dp']:>5} {r['headers']['s_per_step']:>15.3f} {r['index_cold']['s_per_step']:>11.3f} "
              f"{r['index_warm']['s_per_step']:>11.3f} {r['headers_vs_index_warm']:>12.1f}x"
              f" {r['headers']['start_s']:>12.3f} {r['index_warm']['start_s']:>9.3f} "
              f"{r['start_headers_vs_index_warm']:>13.1f}x")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "planning.json"), "w") as f:
        json.dump(rep, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
