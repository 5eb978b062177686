"""``vlmfeed sizes``: each shard's per-sample sizes written ahead of a vision-balanced job
(``datasvc.pack.sizes``), so that its feeders plan from the index and no shard's headers are read
more than once. Give the settings the job will use: an entry made with other pixel limits or
rules is not used (the feeders plan those shards from headers)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

from datasvc.read.filters import add_filter_flags, filters_from_flags
from datasvc.training import add_data_flags, geometry_from_flags
from datasvc.usage import HelpFormatter


def _index_some(cfg, directory: str, paths: list[str]) -> dict:
    from datasvc.pack.sizes import build_index
    from datasvc.read.listings import index_shards

    return build_index(cfg, directory, index_shards(paths, directory))


def main(argv: list[str] | None = None) -> int:
    from datasvc.config import ServiceConfig
    from datasvc.read.shards import expand_shards

    ap = argparse.ArgumentParser(prog="vlmfeed sizes", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    ap.add_argument("shards", nargs="+", help="shard paths, globs or brace patterns")
    ap.add_argument("--out", required=True, help="the index directory (the job's --sizes-index)")
    add_data_flags(ap, "--pipeline")
    add_data_flags(ap, "--device", "--max-pixels", "--min-pixels")  # the job's, so its feeders find these sizes
    add_filter_flags(ap)  # the job's rules, so its feeders find these sizes
    ap.add_argument("--processes", type=int, default=1, help="shards indexed in parallel")
    args = ap.parse_args(argv)
    try:
        options = geometry_from_flags(args, args.pipeline)["pipeline_options"]
        cfg = ServiceConfig(shards=tuple(args.shards), pipeline=args.pipeline, pipeline_options=options,
                            filters=filters_from_flags(args))
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
    print(f"wrote {os.path.abspath(args.out)}/: the sizes of {built} shard(s) ({kept} already there); give it to "
          f"trainer.run as --sizes-index {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    from datasvc.tools.cli import main as vlmfeed

    sys.exit(vlmfeed(["sizes", *sys.argv[1:]]))
