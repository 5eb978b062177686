"""``vlmfeed samples --out DIR``: the bundled real photos as WebDataset shards, where you want them.

They are the default data of ``python -m trainer.run`` (which keeps its copy under
``$VLMFEED_CACHE``, else ``~/.cache/vlmfeed/photos-v1``): 96 samples of 24 photos from the
scikit-image, scikit-learn and matplotlib wheels, captions and two-image conversations."""
from __future__ import annotations

import argparse
import os
import sys

from datasvc.usage import HelpFormatter, positive_int


def main(argv: list[str] | None = None) -> int:
    from datasvc.samples import write_photo_shards

    ap = argparse.ArgumentParser(prog="vlmfeed samples", description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--out", required=True, help="directory to write the shards into")
    ap.add_argument("--copies", type=positive_int, default=4,
                    help="copies of the photo set (4 is the default data: 96 samples)")
    ap.add_argument("--crops", action="store_true", help="each copy after the first a different random crop")
    args = ap.parse_args(argv)
    if os.path.isfile(args.out):
        ap.error(f"--out {args.out} is a file; give a directory")
    paths = write_photo_shards(args.out, copies=args.copies, crops=args.crops)
    size = sum(os.path.getsize(p) for p in paths)
    print(f"wrote {len(paths)} shards ({size / 2**20:.1f} MiB) to {os.path.abspath(args.out)}/")
    return 0


if __name__ == "__main__":
    from datasvc.tools.cli import main as vlmfeed

    sys.exit(vlmfeed(["samples", *sys.argv[1:]]))
