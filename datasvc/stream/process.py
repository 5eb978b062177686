"""The per-sample stages, run on one work item (``ItemStages``): read -> check -> probe -> decode
images -> decode videos -> tokenize.

Each stage is timed on its own (``datasvc.stats.StageTimes``) so the profiler can name the
bottleneck. Every sample read ends as an ``EncodedSample`` or as a counted rejection in
``Accounting``. ``ItemProcessor`` is what a preprocessing actor runs, and what the in-process
path (``datasvc.stream.producer``) runs in its place.
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from datasvc.batch import EncodedSample
from datasvc.media.decode import CpuDecoder, DecodeJob, Decoder, probe
from datasvc.media.videodecode import VideoDecoder, decode_sample_videos
from datasvc.media.vision import ImageRejected, image_blocks
from datasvc.read.filters import SampleRules
from datasvc.read.shards import ReadLimits, SampleIndex, read_samples, sample_bytes, why_no_text
from datasvc.registry import Pipeline
from datasvc.rejects import Accounting, SampleRejected
from datasvc.stats import StageTimes
from datasvc.wire import ItemResult, WorkItem

DECODE_BYTES_PER_PIXEL = 10
"""Peak bytes held per source pixel while an image decodes and resizes (the decoded RGB, the
decoder's buffers, the resize): 9.0 measured on a 16 MP PNG with the CPU decoder when it copied
DALI's output, 6.0 since it resizes from DALI's buffer (4-5 in batches); the budget keeps the margin."""


def decoded_bytes(jobs: list[DecodeJob]) -> int:
    """What decoding these images at once holds at its peak, from their headers alone."""
    return sum(j.header.pixels for j in jobs) * DECODE_BYTES_PER_PIXEL


def encoded_parts(samples: tuple[SampleIndex, ...], budget: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges of ``samples``, in order, whose encoded bytes (from their tar headers) stay
    under ``budget`` together; a sample over it alone is a range of its own (the reader rejects it
    ``sample_too_large`` without reading it)."""
    ranges: list[tuple[int, int]] = []
    lo, used = 0, 0
    for i, s in enumerate(samples):
        need = sample_bytes(s) if not s.problem else 0
        if i > lo and used + need > budget:
            ranges.append((lo, i))
            lo, used = i, 0
        used += need
    if lo < len(samples):
        ranges.append((lo, len(samples)))
    return ranges


@dataclass
class ItemWork:
    """One work item's samples as they pass the stages. Each stage fills its own field and records in
    ``problems[si]`` why sample ``si`` will not be delivered: (reason, detail, stage)."""

    item: WorkItem
    raws: list = field(default_factory=list)
    problems: list[tuple | None] = field(default_factory=list)
    jobs: dict[int, list[DecodeJob]] = field(default_factory=dict)
    """Sample index -> its images' decode jobs, from their headers."""
    decoded: dict[int, list] = field(default_factory=lambda: defaultdict(list))
    """Sample index -> (pixel rows, grid) of each image."""
    videos: dict = field(default_factory=dict)
    """Sample index -> (pixel rows, plan) of each video."""
    encoded: dict[int, tuple] = field(default_factory=dict)
    """Sample index -> (input_ids, labels)."""
    tokenize_s: float = 0.0
    acct: Accounting = field(default_factory=Accounting)
    times: StageTimes = field(default_factory=StageTimes)


class ItemStages:
    """The per-sample stages of one work item, in order (``STAGES``): ``read`` (the tar members under
    the read limits), ``check`` (text present, the user's rules, before any pixel is decoded),
    ``probe`` (image headers: the pixel cap and the aspect rule), ``decode_images`` (in parts under
    the decoded-bytes budget), ``decode_videos``, ``tokenize`` (the pipeline's chat format). Each
    takes the item's ``ItemWork``; ``result`` makes the delivered samples and counts the rest."""

    STAGES = ("read", "check", "probe", "decode_images", "decode_videos", "tokenize")

    def __init__(self, pipeline: Pipeline, decoder: Decoder, limits: ReadLimits = ReadLimits(),
                 rules: SampleRules | None = None, budget: int | None = None, video_decoder=None):
        self.pipeline, self.spec, self.decoder = pipeline, pipeline.vision, decoder
        self.limits, self.rules, self.budget = limits, rules, budget
        self.video_decoder = video_decoder or _cpu_video_decoder

    def __call__(self, item: WorkItem) -> ItemResult:
        """Encoded bytes are held to ``limits.max_sample_bytes``, from the tar headers before anything
        is read: the item runs the stages in parts under it."""
        ranges = encoded_parts(item.samples, self.limits.max_sample_bytes)
        if len(ranges) == 1:
            return self.run(item)
        return merge_results(item, [self.run(WorkItem(item.shard, item.first + lo, item.samples[lo:hi]))
                                    for lo, hi in ranges])

    def run(self, item: WorkItem) -> ItemResult:
        work = ItemWork(item)
        for stage in self.STAGES:
            getattr(self, stage)(work)
        return self.result(work)

    def read(self, w: ItemWork) -> None:
        ignored: dict = {}
        t0 = time.perf_counter()
        w.raws = list(read_samples(w.item.shard, list(w.item.samples), self.limits, ignored))
        w.times.add("read", time.perf_counter() - t0, len(w.raws))
        w.acct.read += len(w.raws)
        w.acct.count_read(ignored)
        w.problems = [(raw.problem, raw.detail, "read") if raw.problem else None for raw in w.raws]

    def check(self, w: ItemWork) -> None:
        for si, raw in enumerate(w.raws):
            if w.problems[si] is None and raw.text is None and raw.conversation is None:
                w.problems[si] = ("missing_text", why_no_text(raw), "read")
            elif w.problems[si] is None and self.rules and (broken := self.rules.check(raw)):
                w.problems[si] = (broken, "", "read")

    def probe(self, w: ItemWork) -> None:
        """Each live sample's decode jobs from its image headers; a rejected header rejects the sample."""
        t0 = time.perf_counter()
        for si, raw in enumerate(w.raws):
            if w.problems[si] is not None:
                continue
            mine = []
            for _ext, data in raw.images:
                try:
                    mine.append(decode_job(data, self.spec))
                except ImageRejected as exc:  # the header, or its aspect ratio (target_size)
                    w.problems[si] = (exc.reason, exc.detail, "decode")
                    break
            else:
                w.jobs[si] = mine
        w.times.add("decode", time.perf_counter() - t0, 0)

    def decode_images(self, w: ItemWork) -> None:
        """Decoded bytes are held to ``budget`` (``BudgetConfig.decoded_bytes_budget``): the samples
        decode in parts that fit it, and a sample that alone does not is rejected ``sample_too_large``."""
        for part in _budget_parts(w.jobs, w.problems, self.budget):
            self._decode_part(part, w)

    def _decode_part(self, part: list[int], w: ItemWork) -> None:
        flat = [(si, job) for si in part for job in w.jobs[si]]
        if not flat:
            return
        try:
            rows = self.decoder.to_pixel_rows([job for _, job in flat], self.spec, w.times.add)
        except Exception as exc:  # the decoder failed as a whole: isolate the samples that make it fail
            if len(part) == 1:
                w.problems[part[0]] = ("decode_error", f"{type(exc).__name__}: {exc}"[:200], "decode")
                return
            for si in part:
                self._decode_part([si], w)
            return
        for (si, job), res in zip(flat, rows):
            if w.problems[si] is not None:
                continue
            if isinstance(res, ImageRejected):
                w.problems[si] = (res.reason, res.detail, "decode")
                w.decoded.pop(si, None)
            else:
                w.decoded[si].append((res, job.grid(self.spec)))

    def decode_videos(self, w: ItemWork) -> None:
        w.videos = decode_sample_videos(w.raws, w.problems, self.spec, self.pipeline.video, self.video_decoder,
                                        w.times.add)

    def tokenize(self, w: ItemWork) -> None:
        """The pipeline's tokens and labels of each live sample; a sample it refuses costs only itself."""
        t0 = time.perf_counter()
        for si, raw in enumerate(w.raws):
            if w.problems[si] is not None:
                continue
            grids = [g for _, g in w.decoded.get(si, [])]
            plans = [plan for _, plan in w.videos.get(si, [])]
            try:
                w.encoded[si] = self.pipeline.encode(raw, grids, plans)
            except SampleRejected as exc:
                w.problems[si] = (exc.reason, exc.detail, "tokenize")
            except Exception as exc:  # a tokenizer or template failure costs this sample only
                w.problems[si] = ("encode_error", f"{type(exc).__name__}: {exc}"[:200], "tokenize")
        w.tokenize_s = time.perf_counter() - t0

    def result(self, w: ItemWork) -> ItemResult:
        """Each sample delivered as an ``EncodedSample`` or counted as rejected, under its stage."""
        t0 = time.perf_counter()
        samples: list[EncodedSample] = []
        n_images, mp, spec = 0, 0.0, self.spec
        for si, raw in enumerate(w.raws):
            if w.problems[si] is not None:
                reason, detail, stage = w.problems[si]
                w.acct.reject(raw.shard, raw.key, reason, detail)
                w.times.fail(stage)
                continue
            parts = w.decoded.get(si, [])
            grids = [g for _, g in parts]
            input_ids, labels = w.encoded[si]
            blocks, frames = image_blocks([p for p, _ in parts], grids, spec)
            sample = EncodedSample(raw.key, raw.shard, input_ids, labels, blocks,
                                   np.asarray(grids, dtype=np.int64).reshape(-1, 3), image_frame_hw=frames)
            if videos := w.videos.get(si):
                sample.video_pixels = np.concatenate([rows for rows, _ in videos])
                sample.video_grid_thw = np.asarray([plan.grid for _, plan in videos], dtype=np.int64)
            samples.append(sample)
            n_images += len(parts)
            mp += sum(h * wd for _, h, wd in grids) * spec.patch_size**2 / 1e6
        w.times.add("tokenize", w.tokenize_s + time.perf_counter() - t0, len(samples))
        return ItemResult(w.item.item_id, samples, w.acct, w.times, n_images, mp)


def process_item(item: WorkItem, pipeline: Pipeline, decoder: Decoder, limits: ReadLimits = ReadLimits(),
                 rules: SampleRules | None = None, budget: int | None = None, video_decoder=None) -> ItemResult:
    """``item`` through ``ItemStages``: ``rules``, the user's filters; ``budget``, decoded bytes held at
    once; ``video_decoder()``, the ``datasvc.media.video.VideoDecoder`` for samples with videos (CPU
    DALI when not given)."""
    return ItemStages(pipeline, decoder, limits, rules, budget, video_decoder)(item)


def decode_job(data: bytes, spec) -> DecodeJob:
    """An encoded image's decode job from its header alone: the pixel cap and the aspect rule apply
    here, before any pixel is decoded (raises ``ImageRejected``)."""
    header = probe(data, spec.max_decode_pixels, spec.exif_orientation)
    return DecodeJob(data, header, spec.target_size(header.height, header.width))


def _budget_parts(jobs: dict[int, list[DecodeJob]], problems: list, budget: int | None) -> list[list[int]]:
    """Samples grouped, in order, so that each group's decode stays under ``budget``."""
    parts: list[list[int]] = []
    used = 0
    for si, mine in jobs.items():
        need = decoded_bytes(mine)
        if budget is not None and need > budget:
            problems[si] = ("sample_too_large", f"decoding its {len(mine)} image(s) holds ~{need >> 20} MiB "
                            f"> decoded_bytes_budget {budget >> 20} MiB", "decode")
            continue
        if not parts or (budget is not None and used + need > budget):
            parts.append([])
            used = 0
        parts[-1].append(si)
        used += need
    return parts


_CPU_VIDEO_DECODER: list = []


def _cpu_video_decoder() -> VideoDecoder:
    """One CPU video decoder for the process, built when the first video arrives."""
    if not _CPU_VIDEO_DECODER:
        _CPU_VIDEO_DECODER.append(VideoDecoder(device_id=None))
    return _CPU_VIDEO_DECODER[0]


def split_item(item: WorkItem, parts: int) -> list[WorkItem]:
    """The item cut into ``parts`` contiguous items (at most one per sample), to redo in pieces."""
    n = len(item.samples)
    bounds = [round(i * n / parts) for i in range(parts + 1)] if parts < n else list(range(n + 1))
    return [WorkItem(item.shard, item.first + lo, item.samples[lo:hi]) for lo, hi in zip(bounds, bounds[1:])]


def merge_results(item: WorkItem, results: list[ItemResult]) -> ItemResult:
    """One result for ``item`` from the results of its pieces (``split_item``), in order."""
    acct, times, samples = Accounting(), StageTimes(), []
    images, mp = 0, 0.0
    for r in results:
        samples.extend(r.samples)
        acct.merge(r.accounting)
        times.merge(r.times)
        images += r.images
        mp += r.megapixels
    return ItemResult(item.item_id, samples, acct, times, images, mp)


def quarantine_item(item: WorkItem, reason: str, detail: str) -> ItemResult:
    """Every sample of the item counted as rejected for ``reason``."""
    acct = Accounting()
    acct.read = len(item.samples)
    for s in item.samples:
        acct.reject(item.shard, s.key, reason, detail)
    return ItemResult(item.item_id, [], acct, StageTimes())


def preprocess_images(blobs: list[bytes], spec, decoder: Decoder,
                      times: StageTimes | None = None) -> list[tuple[np.ndarray, tuple] | ImageRejected]:
    """Encoded images -> (uint8 ``vision.pixel_rows``, grid) each, or the reason one was rejected: the
    actors' probe (``decode_job``) and decoder on images alone, as the per-core benches time them.
    """
    t0 = time.perf_counter()
    jobs, out = [], []
    for data in blobs:
        try:
            jobs.append(decode_job(data, spec))
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
    sample rules of a config. The in-process path (``datasvc.stream.producer``) runs the same object."""

    def __init__(self, cfg, device_id: int | None = 0):
        self.pipeline = cfg.build_pipeline()
        self.decoder = make_decoder(cfg.decode.device, num_threads=cfg.decode.threads, device_id=device_id,
                                    jpeg=cfg.decode.cpu_jpeg_decoder, rank_resize=cfg.decode.resize_on == "rank")
        from datasvc.read.energon import name_datasets

        name_datasets(cfg.shards)  # an Energon dataset named by its directory reads with its own schema here too
        self.limits = ReadLimits.of(cfg.budget)
        self.rules = SampleRules.parse(cfg.filters)
        self.budget = cfg.budget.decoded_bytes_budget
        self._video_device = None if cfg.decode.device == "cpu" else device_id
        self._video_threads = cfg.decode.threads
        self._video_decoder: VideoDecoder | None = None
        self.stages = ItemStages(self.pipeline, self.decoder, self.limits, self.rules, self.budget,
                                 self.video_decoder)

    def video_decoder(self) -> VideoDecoder:
        if self._video_decoder is None:
            self._video_decoder = VideoDecoder(device_id=self._video_device, num_threads=self._video_threads)
        return self._video_decoder

    def __call__(self, item: WorkItem) -> ItemResult:
        return self.stages(item)


def make_decoder(kind: Literal["cpu", "gpu"], num_threads: int = 1, device_id: int | None = 0,
                 jpeg: Literal["dali", "libjpeg-turbo"] = "dali", rank_resize: bool = False) -> Decoder:
    if kind == "cpu":
        return CpuDecoder(num_threads=num_threads, jpeg=jpeg, rank_resize=rank_resize)
    if kind == "gpu":
        from datasvc.media.gpudecode import GpuDecoder

        return GpuDecoder(device_id=device_id, num_threads=max(2, num_threads))
    raise ValueError(f"decode backend must be 'cpu' or 'gpu', not {kind!r}")
