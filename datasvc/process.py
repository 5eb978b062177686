"""The per-sample stages, run on one work item: read -> decode -> preprocess -> tokenize.

Each stage is timed on its own (``datasvc.stats.StageTimes``) so the profiler can name the
bottleneck. Every sample read ends as an ``EncodedSample`` or as a counted rejection in
``Accounting``. ``ItemProcessor`` is what a preprocessing actor runs, and what the in-process
path (``datasvc.producer``) runs in its place.
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from datasvc.batch import EncodedSample
from datasvc.decode import DecodeJob, Decoder, probe
from datasvc.filters import SampleRules
from datasvc.registry import Pipeline
from datasvc.rejects import Accounting
from datasvc.shards import ReadLimits, SampleIndex, read_samples
from datasvc.stats import STAGES, StageTimes  # noqa: F401  (STAGES: where callers looked for it)
from datasvc.text import SampleRejected
from datasvc.vision import ImageRejected

@dataclass(frozen=True, slots=True)
class WorkItem:
    """A contiguous range of samples of one shard; the unit an actor processes and may redo."""

    shard: str
    first: int  # index of the first sample within the shard
    samples: tuple[SampleIndex, ...]

    @property
    def item_id(self) -> str:
        return f"{self.shard}#{self.first}"


@dataclass(slots=True)
class ItemResult:
    item_id: str
    samples: list[EncodedSample]
    accounting: Accounting
    times: StageTimes
    images: int = 0
    megapixels: float = 0.0


def process_item(item: WorkItem, pipeline: Pipeline, decoder: Decoder,
                 limits: ReadLimits = ReadLimits(), rules: SampleRules | None = None) -> ItemResult:
    """``rules``: the user's filters, checked before any pixel is decoded."""
    acct = Accounting()
    times = StageTimes()
    spec = pipeline.vision
    ignored: dict = {}

    t0 = time.perf_counter()
    raws = list(read_samples(item.shard, list(item.samples), limits, ignored))
    times.add("read", time.perf_counter() - t0, len(raws))
    acct.read += len(raws)
    acct.ignored_members.update(ignored)

    alive = [not raw.problem for raw in raws]
    problems = [(raw.problem, raw.detail) for raw in raws]
    blobs, owners = [], []
    for si, raw in enumerate(raws):
        if alive[si] and raw.text is None and raw.conversation is None:
            alive[si], problems[si] = False, ("missing_text", "no txt or json member")
        elif alive[si] and rules and (broken := rules.check(raw)):
            alive[si], problems[si] = False, (broken, "")
        elif alive[si]:
            blobs.extend(data for _ext, data in raw.images)
            owners.extend([si] * len(raw.images))
    per_sample: dict[int, list] = defaultdict(list)
    for owner, res in zip(owners, preprocess_images(blobs, spec, decoder, times)):
        if not alive[owner]:
            continue
        if isinstance(res, ImageRejected):
            alive[owner], problems[owner] = False, (res.reason, res.detail)
        else:
            per_sample[owner].append(res)

    t0 = time.perf_counter()
    encoded: list[EncodedSample] = []
    n_images, mp = 0, 0.0
    for si, raw in enumerate(raws):
        if not alive[si]:
            acct.reject(raw.shard, raw.key, *problems[si])
            continue
        parts = per_sample.get(si, [])
        grids = [g for _, g in parts]
        try:
            input_ids, labels = pipeline.encode(raw, grids)
        except SampleRejected as exc:
            acct.reject(raw.shard, raw.key, exc.reason, exc.detail)
            continue
        pixels = np.concatenate([p for p, _ in parts]) if parts else np.zeros((0, spec.patch_dim), np.uint8)
        encoded.append(EncodedSample(raw.key, raw.shard, input_ids, labels, pixels,
                                     np.asarray(grids, dtype=np.int64).reshape(-1, 3)))
        n_images += len(parts)
        mp += sum(p.shape[0] for p, _ in parts) * spec.patch_size**2 / 1e6
    times.add("tokenize", time.perf_counter() - t0, len(encoded))
    return ItemResult(item.item_id, encoded, acct, times, n_images, mp)


def encode_from_headers(raw, pipeline: Pipeline) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int, int]]]:
    """A sample's exact token rows and patch grids from its image headers alone, no pixel decoded
    (what packing and block sizing need). Raises ``ImageRejected`` or ``SampleRejected`` with the
    reason the run would count; a read problem comes back as an ``ImageRejected`` of that reason."""
    if raw.problem:
        raise ImageRejected(raw.problem, raw.detail)
    spec = pipeline.vision
    grids = []
    for _ext, data in raw.images:
        h = probe(data, spec.max_decode_pixels)
        grids.append(spec.grid(h.height, h.width))
    ids, labels = pipeline.encode(raw, grids)
    return ids, labels, grids


def preprocess_images(blobs: list[bytes], spec, decoder: Decoder,
                      times: StageTimes | None = None) -> list[tuple[np.ndarray, tuple] | ImageRejected]:
    """Encoded images -> (uint8 ``vision.pixel_rows``, grid) each, or the reason one was rejected.

    Every header is probed first, so the pixel cap and the aspect rule apply before any decode.
    """
    t0 = time.perf_counter()
    jobs, out = [], []
    for data in blobs:
        try:
            header = probe(data, spec.max_decode_pixels)
            jobs.append(DecodeJob(data, header, spec.target_size(header.height, header.width)))
            out.append(None)
        except ImageRejected as exc:
            out.append(exc)
    timer = times.add if times is not None else None
    if timer:
        timer("decode", time.perf_counter() - t0, 0)
    rows = iter(decoder.to_pixel_rows(jobs, spec, timer) if jobs else [])
    job_iter = iter(jobs)
    for i, o in enumerate(out):
        if o is not None:
            continue
        job, p = next(job_iter), next(rows)
        out[i] = p if isinstance(p, ImageRejected) else (p, job.grid(spec))
    return out


class ItemProcessor:
    """What a preprocessing actor holds and runs: the pipeline, a decoder, the read limits and the
    sample rules of a config. The in-process path (``datasvc.producer``) runs the same object."""

    def __init__(self, cfg, device_id: int | None = 0):
        from datasvc.decode import make_decoder
        from datasvc.registry import get_pipeline

        self.pipeline = get_pipeline(cfg.pipeline, **cfg.pipeline_options)
        self.decoder = make_decoder(cfg.decode, num_threads=cfg.decode_threads, device_id=device_id)
        self.limits = ReadLimits(max_images_per_sample=cfg.max_images_per_sample, max_text_bytes=cfg.max_text_bytes)
        self.rules = SampleRules.parse(cfg.filters)

    def __call__(self, item: WorkItem) -> ItemResult:
        return process_item(item, self.pipeline, self.decoder, self.limits, self.rules)
