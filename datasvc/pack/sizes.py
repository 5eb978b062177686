"""Each shard's per-sample sizes (tokens, image and video patch grids, or why the sample is
rejected), kept in a directory every feeder of a job can read.

A vision-balanced run (``datasvc.stream.balanced``) plans every DP rank's micro-batches in every feeder,
from headers. Without an index each feeder reads the image headers of all ranks' samples, so at
DP N the job reads every header N times. With one, a shard's headers are read once, by the first
feeder that needs them (or ahead of the job by ``build_index``), and the plan is the same bit for
bit: packing needs only lengths and patch counts.

An entry is named by the shard's path and its tar listing (every member's offset and size), the
pipeline and its options, and the read limits and rules: a rewritten shard or a changed setting
finds no entry and plans from headers again. Entries are written whole (a temporary file renamed
into place), so feeders racing on one shard at worst both build it.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading

import numpy as np

from datasvc.batch import IGNORE_INDEX, EncodedSample, grid_patches
from datasvc.config import ServiceConfig
from datasvc.read.shards import ShardIndex
from datasvc.rejects import Accounting
from datasvc.stats import StageTimes
from datasvc.wire import ItemResult, WorkItem

log = logging.getLogger("vlmfeed.sizes")

FORMAT = 1


def settings_digest(cfg: ServiceConfig) -> str:
    """What a sample's planned size depends on besides its bytes."""
    settings = [FORMAT, cfg.pipeline, sorted(cfg.pipeline_options.items()), cfg.budget.max_images_per_sample,
                cfg.budget.max_text_bytes, list(cfg.filters)]
    return hashlib.sha1(json.dumps(settings, default=str).encode()).hexdigest()[:16]


def shard_digest(index: ShardIndex) -> str:
    listing = [index.path, [[s.key, [[m.ext, m.offset, m.size] for m in s.members], s.problem]
                            for s in index.samples]]
    return hashlib.sha1(json.dumps(listing).encode()).hexdigest()[:16]


class HeaderProcessor:
    """A work item's samples as the plan needs them: exact token rows, and as many zero-width pixel
    rows as the sample has patches (packing counts patches by rows). Rejections as the run counts
    them where headers tell (read problems, missing text, the user's rules, image headers, encoding)."""

    def __init__(self, cfg: ServiceConfig):
        from datasvc.read.filters import SampleRules
        from datasvc.read.shards import ReadLimits

        self.pipeline = cfg.build_pipeline()
        self.limits = ReadLimits.of(cfg.budget)
        self.rules = SampleRules.parse(cfg.filters)

    def __call__(self, item: WorkItem) -> ItemResult:
        from datasvc.pack.headers import encode_from_headers
        from datasvc.read.shards import read_samples, why_no_text

        acct, out = Accounting(), []
        for raw in read_samples(item.shard, list(item.samples), self.limits):
            acct.read += 1
            if not raw.problem and raw.text is None and raw.conversation is None:
                acct.reject(raw.shard, raw.key, "missing_text", why_no_text(raw))
                continue
            broken = self.rules.check(raw) if self.rules and not raw.problem else None
            if broken:
                acct.reject(raw.shard, raw.key, broken, "")
                continue
            try:
                ids, labels, grids = encode_from_headers(raw, self.pipeline)
            except ValueError as exc:  # ImageRejected, SampleRejected: reason and detail
                acct.reject(raw.shard, raw.key, getattr(exc, "reason", "encode_error"), getattr(exc, "detail", ""))
                continue
            patches = sum(t * h * w for t, h, w in grids)
            videos = self._video_grids(raw)
            out.append(EncodedSample(raw.key, raw.shard, ids, labels, np.zeros((patches, 0), np.uint8),
                                     np.asarray(grids, np.int64).reshape(-1, 3),
                                     video_pixels=np.zeros((sum(t * h * w for t, h, w in videos), 0), np.uint8),
                                     video_grid_thw=np.asarray(videos, np.int64).reshape(-1, 3)))
        return ItemResult(item.item_id, out, acct, StageTimes())


    def _video_grids(self, raw) -> list[tuple[int, int, int]]:
        """Each video's grid from its container headers (frames chosen and sized, none decoded)."""
        video = self.pipeline.video
        if not raw.videos or video is None:  # encode_from_headers already rejected videos it cannot take
            return []
        from datasvc.media.video import plan_video

        return [tuple(plan_video(data, self.pipeline.vision, video).grid) for _ext, data in raw.videos]


class SizesIndex:
    """A header processor (``HeaderProcessor``'s interface: ``WorkItem -> ItemResult``)
    that answers from the shard's entry in ``directory``, writing the entry on first use."""

    def __init__(self, cfg: ServiceConfig, directory: str, indexes: list[ShardIndex], headers=None):
        self.directory = directory
        self.headers = headers or HeaderProcessor(cfg)
        self.settings = settings_digest(cfg)
        self.indexes = {idx.path: idx for idx in indexes}
        self._entries: dict[str, tuple[list, dict]] = {}
        self._lock = threading.Lock()
        self.built = self.loaded = 0  # entries made from headers here, and read from the directory

    def entry_path(self, shard: str) -> str:
        digest = hashlib.sha1(f"{shard_digest(self.indexes[shard])}/{self.settings}".encode()).hexdigest()[:24]
        return os.path.join(self.directory, f"{os.path.basename(shard)}.{digest}.json")

    def __call__(self, item: WorkItem) -> ItemResult:
        sizes, position = self._entry(item.shard)
        acct, out = Accounting(), []
        for sample in item.samples:
            acct.read += 1
            size = sizes[position[_sample_id(sample)]]
            if "reason" in size:
                acct.reject(item.shard, sample.key, size["reason"], size["detail"])
                continue
            out.append(_placeholder(item.shard, sample.key, size))
        return ItemResult(item.item_id, out, acct, StageTimes())

    def entry(self, shard: str) -> list:
        """The shard's sizes, one per sample in shard order."""
        return self._entry(shard)[0]

    def _entry(self, shard: str) -> tuple[list, dict]:
        """(the shard's sizes, each sample's place among them), read or built once."""
        with self._lock:
            if shard not in self._entries:
                sizes = self._load(shard) or self._build(shard)
                self._entries[shard] = sizes, {_sample_id(s): i for i, s in enumerate(self.indexes[shard].samples)}
            return self._entries[shard]

    def _load(self, shard: str) -> list | None:
        try:
            with open(self.entry_path(shard)) as f:
                entry = json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:  # a damaged entry is rebuilt, not trusted
            log.warning("sizes index entry for %s unreadable (%s): planning it from headers", shard, exc)
            return None
        if len(entry.get("samples", ())) != len(self.indexes[shard].samples):
            return None
        self.loaded += 1
        return entry["samples"]

    CHUNK = 500  # samples read per call: below the accounting log's bound, so every rejection is named

    def _build(self, shard: str) -> list:
        """One size per sample in shard order (keys may repeat in a shard; positions do not)."""
        samples = self.indexes[shard].samples
        sizes: list = []
        for first in range(0, len(samples), self.CHUNK):
            chunk = samples[first:first + self.CHUNK]
            keys = [s.key for s in chunk]
            if len(set(keys)) == len(keys):
                sizes.extend(self._read(shard, first, chunk))
            else:  # a repeated key: its results cannot be told apart within one read
                for i, sample in enumerate(chunk):
                    sizes.extend(self._read(shard, first + i, [sample]))
        self.built += 1
        self._write(shard, sizes)
        return sizes

    def _read(self, shard: str, first: int, chunk) -> list:
        result = self.headers(WorkItem(shard, first, tuple(chunk)))
        by_key: dict[str, dict] = {s.key: {"tokens": s.num_tokens, "images": s.image_grid_thw.tolist(),
                                           "videos": s.video_grid_thw.tolist()} for s in result.samples}
        by_key.update((r.key, {"reason": r.reason, "detail": r.detail}) for r in result.accounting.log)
        missing = [s.key for s in chunk if s.key not in by_key]
        assert not missing, f"{shard}: samples neither planned nor rejected: {missing[:3]}"
        return [by_key[s.key] for s in chunk]

    def _write(self, shard: str, entry: list) -> None:
        path = self.entry_path(shard)
        try:
            os.makedirs(self.directory, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".partial-")
            with os.fdopen(fd, "w") as f:
                json.dump({"format": FORMAT, "shard": shard, "settings": self.settings, "samples": entry}, f)
            os.replace(tmp, path)
        except OSError as exc:  # a read-only or full directory costs speed, not correctness
            log.warning("sizes index entry %s not written (%s); planning goes on from headers", path, exc)


def _sample_id(sample) -> tuple[str, int]:
    """A sample's place in its shard: keys may repeat in a shard, member offsets do not."""
    return sample.key, sample.members[0].offset if sample.members else -1


def _placeholder(shard: str, key: str, size: dict) -> EncodedSample:
    """A sample of the planned length and patch grids; its token values are never read (the
    decoded sample's own replace it when the rows are made)."""
    n = int(size["tokens"])
    images = np.asarray(size["images"], np.int64).reshape(-1, 3)
    videos = np.asarray(size["videos"], np.int64).reshape(-1, 3)
    return EncodedSample(key, shard, np.zeros(n, np.int32), np.full(n, IGNORE_INDEX, np.int32),
                         np.zeros((grid_patches(images), 0), np.uint8), images,
                         video_pixels=np.zeros((grid_patches(videos), 0), np.uint8),
                         video_grid_thw=videos)


def build_index(cfg: ServiceConfig, directory: str, indexes: list[ShardIndex]) -> dict:
    """Every shard's entry, written ahead of a job (the ones already there are kept)."""
    sizes = SizesIndex(cfg, directory, indexes)
    for idx in indexes:
        sizes.entry(idx.path)
    return {"shards": len(indexes), "built": sizes.built, "already_there": sizes.loaded, "directory": directory}
