"""Each shard's tar listing (``ShardIndex``: samples, their members' offsets and sizes, what the
scan found wrong) kept in the sizes index's directory, so a feeder starts by reading one small file
per shard instead of every tar header of the dataset.

Without it each feeder of a job walks every shard's headers at start (about 170 us a sample on a
2-core VM: minutes per feeder at a million samples), because every feeder plans every rank's
order. A listing is used only while the shard file still has the size and modification time it
was listed at (an object: its size and the store's ETag, one metadata request instead of ranged
reads of every header); a rewritten, damaged or foreign entry is listed from the tar again. Entries
are written whole, a temporary file renamed into place, so feeders racing on one shard at worst
both list it.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile

from datasvc.read.shards import Member, SampleIndex, ShardIndex, index_shard, shard_stamp, shard_where

log = logging.getLogger("vlmfeed.listings")

FORMAT = 2  # 2: each sample says whether its shard expects an image of it


class ShardListings:
    def __init__(self, directory: str):
        self.directory = directory
        self.listed = self.loaded = 0  # shards listed from their tar here, and read from the directory

    def index(self, path: str) -> ShardIndex:
        stamp = shard_stamp(path)
        if not stamp:  # nothing tells this file's versions apart: list it every time
            return index_shard(path)
        cached = self._load(path, stamp)
        if cached is not None:
            self.loaded += 1
            return cached
        index = index_shard(path)
        self.listed += 1
        if stamp == index.stamp[1:] == shard_stamp(path):  # unchanged while it was read: safe to keep
            self._write(path, stamp, index)
        return index

    def entry_path(self, path: str) -> str:
        digest = hashlib.sha1(_where(path).encode()).hexdigest()[:16]
        return os.path.join(self.directory, f"{os.path.basename(path)}.{digest}.listing.json")

    def _load(self, path: str, stamp: tuple) -> ShardIndex | None:
        try:
            with open(self.entry_path(path)) as f:
                entry = json.load(f)
            if entry["format"] != FORMAT or entry["path"] != _where(path) or entry["stamp"] != list(stamp):
                return None
            stamp = (_where(path), *stamp)  # every sample read from this listing is read only from this version
            samples = [SampleIndex(key, tuple(Member(*m) for m in members), problem, detail, repeated, expected, stamp)
                       for key, members, problem, detail, repeated, expected in entry["samples"]]
            return ShardIndex(path, samples, entry["truncated"], entry["damaged_headers"], entry["lost_bytes"], stamp)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:  # a damaged entry is listed again, not trusted
            log.warning("listing of %s unreadable (%s): reading its tar headers", path, exc)
            return None

    def _write(self, path: str, stamp: tuple, index: ShardIndex) -> None:
        entry = {"format": FORMAT, "path": _where(path), "stamp": list(stamp), "truncated": index.truncated,
                 "damaged_headers": index.damaged_headers, "lost_bytes": index.lost_bytes,
                 "samples": [[s.key, [[m.ext, m.offset, m.size] for m in s.members], s.problem, s.detail, s.repeated,
                              s.image_expected] for s in index.samples]}
        try:
            os.makedirs(self.directory, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".partial-")
            with os.fdopen(fd, "w") as f:
                json.dump(entry, f)
            os.replace(tmp, self.entry_path(path))
        except OSError as exc:  # a read-only or full directory costs start time, not correctness
            log.warning("listing of %s not written (%s); it is read from the tar next time too", path, exc)


_where = shard_where  # where a listing says it came from


def index_shards(paths: list[str], directory: str = "") -> list[ShardIndex]:
    """Every shard's listing, from ``directory`` where it holds a current one (none: from the tars)."""
    if not directory:
        return [index_shard(p) for p in paths]
    listings = ShardListings(directory)
    return [listings.index(p) for p in paths]
