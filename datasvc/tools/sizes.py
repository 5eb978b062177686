"""``vlmfeed sizes``: each shard's per-sample sizes written ahead of a vision-balanced job
(``datasvc.sizes``), so that its feeders plan from the index and no shard's headers are read
more than once. Give the settings the job will use: an entry made with other pixel limits or
rules is not used (the feeders plan those shards from headers)."""
from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor


def _index_some(cfg, directory: str, paths: list[str]) -> dict:
    from datasvc.listings import index_shards
    from datasvc.sizes import build_index

    return build_index(cfg, directory, index_shards(paths, directory))


def main(argv: list[str] | None = None) -> int:
    from datasvc.config import ServiceConfig
    from datasvc.shards import expand_shards

    ap = argparse.ArgumentParser(prog="vlmfeed sizes", description=__doc__.split("\n\n")[0])
    ap.add_argument("shards", nargs="+", help="shard paths, globs or brace patterns")
    ap.add_argument("--out", required=True, help="the index directory (the job's --sizes-index)")
    ap.add_argument("--pipeline", default="qwen3vl")
    ap.add_argument("--max-pixels", type=int, default=None)
    ap.add_argument("--min-pixels", type=int, default=None)
    ap.add_argument("--filter", action="append", default=[], help="a rule the job applies (repeat)")
    ap.add_argument("--processes", type=int, default=1, help="shards indexed in parallel")
    args = ap.parse_args(argv)
    options = {k: v for k, v in (("max_pixels", args.max_pixels), ("min_pixels", args.min_pixels)) if v}
    try:
        cfg = ServiceConfig(shards=tuple(args.shards), pipeline=args.pipeline, pipeline_options=options,
                            filters=tuple(args.filter))
    except ValueError as exc:
        print(f"vlmfeed sizes: {exc}", file=sys.stderr)
        return 2
    paths = expand_shards(list(cfg.shards))
    t0, done, built, kept = time.perf_counter(), 0, 0, 0
    chunks = [paths[i:i + 8] for i in range(0, len(paths), 8)]
    with ProcessPoolExecutor(max(1, args.processes)) as pool:
        for report in pool.map(_index_some, [cfg] * len(chunks), [args.out] * len(chunks), chunks):
            done, built, kept = done + report["shards"], built + report["built"], kept + report["already_there"]
            print(f"  {done}/{len(paths)} shards indexed ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    print(json.dumps({"shards": len(paths), "built": built, "already_there": kept, "directory": args.out,
                      "seconds": round(time.perf_counter() - t0, 1)}))
    return 0
