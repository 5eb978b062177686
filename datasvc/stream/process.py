"""The per-sample stages, run on one work item: read -> decode -> preprocess -> tokenize.

Each stage is timed on its own (``datasvc.stats.StageTimes``) so the profiler can name the
bottleneck. Every sample read ends as an ``EncodedSample`` or as a counted rejection in
``Accounting``. ``ItemProcessor`` is what a preprocessing actor runs, and what the in-process
path (``datasvc.stream.producer``) runs in its place.
"""
from __future__ import annotations

import time
from collections import defaultdict
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


def process_item(item: WorkItem, pipeline: Pipeline, decoder: Decoder, limits: ReadLimits = ReadLimits(),
                 rules: SampleRules | None = None, budget: int | None = None, video_decoder=None) -> ItemResult:
    """``rules``: the user's filters, checked before any pixel is decoded. ``budget``: decoded bytes
    held at once (``ServiceConfig.decoded_bytes_budget``); the item decodes in parts that fit it, and
    a sample that alone does not is rejected ``sample_too_large``. Encoded bytes are held to
    ``limits.max_sample_bytes`` the same way, from the tar headers before anything is read: the item
    is read, decoded and encoded in parts under it. ``video_decoder()``: the
    ``datasvc.media.video.VideoDecoder`` for samples with videos (CPU DALI when not given)."""
    ranges = encoded_parts(item.samples, limits.max_sample_bytes)
    if len(ranges) == 1:
        return _process_part(item, pipeline, decoder, limits, rules, budget, video_decoder)
    return merge_results(item, [_process_part(WorkItem(item.shard, item.first + lo, item.samples[lo:hi]), pipeline,
                                              decoder, limits, rules, budget, video_decoder) for lo, hi in ranges])


def _process_part(item: WorkItem, pipeline: Pipeline, decoder: Decoder, limits: ReadLimits,
                  rules: SampleRules | None, budget: int | None, video_decoder) -> ItemResult:
    acct = Accounting()
    times = StageTimes()
    spec = pipeline.vision
    ignored: dict = {}

    t0 = time.perf_counter()
    raws = list(read_samples(item.shard, list(item.samples), limits, ignored))
    times.add("read", time.perf_counter() - t0, len(raws))
    acct.read += len(raws)
    acct.count_read(ignored)

    # problems[si]: (reason, detail, stage) of a sample that will not be delivered
    problems: list[tuple | None] = [(raw.problem, raw.detail, "read") if raw.problem else None for raw in raws]
    for si, raw in enumerate(raws):
        if problems[si] is None and raw.text is None and raw.conversation is None:
            problems[si] = ("missing_text", why_no_text(raw), "read")
        elif problems[si] is None and rules and (broken := rules.check(raw)):
            problems[si] = (broken, "", "read")
    jobs = _probe_samples(raws, problems, spec, times)
    decoded: dict[int, list] = defaultdict(list)
    for part in _budget_parts(jobs, problems, budget):
        _decode_part(part, jobs, problems, decoded, spec, decoder, times)
    videos = decode_sample_videos(raws, problems, spec, pipeline.video,
                                  video_decoder or _cpu_video_decoder, times.add)

    t0 = time.perf_counter()
    encoded: list[EncodedSample] = []
    n_images, mp = 0, 0.0
    for si, raw in enumerate(raws):
        parts = decoded.get(si, [])
        if problems[si] is None:
            grids = [g for _, g in parts]
            plans = [plan for _, plan in videos.get(si, [])]
            try:
                input_ids, labels = pipeline.encode(raw, grids, plans)
            except SampleRejected as exc:
                problems[si] = (exc.reason, exc.detail, "tokenize")
            except Exception as exc:  # a tokenizer or template failure costs this sample only
                problems[si] = ("encode_error", f"{type(exc).__name__}: {exc}"[:200], "tokenize")
        if problems[si] is not None:
            reason, detail, stage = problems[si]
            acct.reject(raw.shard, raw.key, reason, detail)
            times.fail(stage)
            continue
        blocks, frames = image_blocks([p for p, _ in parts], grids, spec)
        sample = EncodedSample(raw.key, raw.shard, input_ids, labels, blocks,
                               np.asarray(grids, dtype=np.int64).reshape(-1, 3), image_frame_hw=frames)
        if plans:
            sample.video_pixels = np.concatenate([r for r, _ in videos[si]])
            sample.video_grid_thw = np.asarray([p.grid for p in plans], dtype=np.int64)
        encoded.append(sample)
        n_images += len(parts)
        mp += sum(h * w for _, h, w in grids) * spec.patch_size**2 / 1e6
    times.add("tokenize", time.perf_counter() - t0, len(encoded))
    return ItemResult(item.item_id, encoded, acct, times, n_images, mp)


def decode_job(data: bytes, spec) -> DecodeJob:
    """An encoded image's decode job from its header alone: the pixel cap and the aspect rule apply
    here, before any pixel is decoded (raises ``ImageRejected``)."""
    header = probe(data, spec.max_decode_pixels, spec.exif_orientation)
    return DecodeJob(data, header, spec.target_size(header.height, header.width))


def _probe_samples(raws: list, problems: list, spec, times: StageTimes) -> dict[int, list[DecodeJob]]:
    """Each live sample's decode jobs from its image headers; a rejected header rejects the sample."""
    t0 = time.perf_counter()
    jobs: dict[int, list[DecodeJob]] = {}
    for si, raw in enumerate(raws):
        if problems[si] is not None:
            continue
        mine = []
        for _ext, data in raw.images:
            try:
                mine.append(decode_job(data, spec))
            except ImageRejected as exc:  # the header, or its aspect ratio (target_size)
                problems[si] = (exc.reason, exc.detail, "decode")
                break
        else:
            jobs[si] = mine
    times.add("decode", time.perf_counter() - t0, 0)
    return jobs


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


def _decode_part(part: list[int], jobs: dict, problems: list, decoded: dict, spec, decoder: Decoder,
                 times: StageTimes) -> None:
    flat = [(si, job) for si in part for job in jobs[si]]
    if not flat:
        return
    try:
        rows = decoder.to_pixel_rows([job for _, job in flat], spec, times.add)
    except Exception as exc:  # the decoder failed as a whole: isolate the samples that make it fail
        if len(part) == 1:
            problems[part[0]] = ("decode_error", f"{type(exc).__name__}: {exc}"[:200], "decode")
            return
        for si in part:
            _decode_part([si], jobs, problems, decoded, spec, decoder, times)
        return
    for (si, job), res in zip(flat, rows):
        if problems[si] is not None:
            continue
        if isinstance(res, ImageRejected):
            problems[si] = (res.reason, res.detail, "decode")
            decoded.pop(si, None)
        else:
            decoded[si].append((res, job.grid(spec)))


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
        self.decoder = make_decoder(cfg.decode, num_threads=cfg.decode_threads, device_id=device_id,
                                    jpeg=cfg.cpu_jpeg_decoder, rank_resize=cfg.resize_on == "rank")
        from datasvc.read.energon import name_datasets

        name_datasets(cfg.shards)  # an Energon dataset named by its directory reads with its own schema here too
        self.limits = ReadLimits.of(cfg)
        self.rules = SampleRules.parse(cfg.filters)
        self.budget = cfg.decoded_bytes_budget
        self._video_device = None if cfg.decode == "cpu" else device_id
        self._video_threads = cfg.decode_threads
        self._video_decoder: VideoDecoder | None = None

    def video_decoder(self) -> VideoDecoder:
        if self._video_decoder is None:
            self._video_decoder = VideoDecoder(device_id=self._video_device, num_threads=self._video_threads)
        return self._video_decoder

    def __call__(self, item: WorkItem) -> ItemResult:
        return process_item(item, self.pipeline, self.decoder, self.limits, self.rules, self.budget,
                            self.video_decoder)


def make_decoder(kind: Literal["cpu", "gpu"], num_threads: int = 1, device_id: int | None = 0,
                 jpeg: Literal["dali", "libjpeg-turbo"] = "dali", rank_resize: bool = False) -> Decoder:
    if kind == "cpu":
        return CpuDecoder(num_threads=num_threads, jpeg=jpeg, rank_resize=rank_resize)
    if kind == "gpu":
        from datasvc.media.gpudecode import GpuDecoder

        return GpuDecoder(device_id=device_id, num_threads=max(2, num_threads))
    raise ValueError(f"decode backend must be 'cpu' or 'gpu', not {kind!r}")
