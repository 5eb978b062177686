"""DALI ``mixed`` decode (hardware JPEG decoder, nvJPEG) and resize on the GPU, to uint8 pixel rows
in host memory or straight to normalized ``pixel_values`` on the GPU.

Stages of one DALI batch (a *chunk*): feed the encoded bytes and target sizes, decode, resize to
raster pixel rows, one copy out of DALI's buffer; then, for ``pixel_values``, one fused kernel for
the whole chunk that reads every image's patch order in place, normalizes, casts and writes every
frame (``vision.to_pixel_values``). Chunks are filled from the caller's batches in order, so a
stream of small micro-batches decodes in wide DALI batches.
"""
from __future__ import annotations

import collections
import ctypes
import itertools
import threading
import time
from typing import Callable, Iterable, Iterator

import numpy as np

from datasvc.media.decode import CpuDecoder, DecodeJob, Timer, _needs_pil
from datasvc.media.imagefile import ImageHeader, orient
from datasvc.media.vision import ImageRejected, VisionSpec, to_pixel_values

Chunk = list  # [(slot, job indices of that slot)], at most ``max_batch`` images in all


def gpu_declines(header: ImageHeader) -> bool:
    """Images the CPU decoder takes instead (``CpuDecoder``: DALI on the CPU, or PIL): those only PIL
    decodes as HF does, and JPEGs stored as RGB, whose colour space libjpeg reads from the Adobe
    marker or the component names while a hardware JPEG decoder may take them for YCbCr."""
    return _needs_pil(header) or header.stored_rgb


class _Feed:
    """The external source of one pipeline. DALI pulls chunks from ``chunks`` lazily while it
    prefetches; each chunk handed over waits in ``fed``, with the arrays DALI was given for it,
    until its output comes out: DALI reads those arrays where they lie (no_copy), and after a
    failure the prefetched chunks can be fed to a fresh pipeline.

    DALI calls ``iter()`` at build and after each ``reset()``; the generator reads ``chunks`` only
    when the pipeline first pulls from it, so a stream sets ``chunks`` and then runs the epoch.
    """

    def __init__(self):
        self.chunks: Iterator[Chunk] = iter(())
        self.fed: collections.deque[tuple[Chunk, tuple]] = collections.deque()

    def __iter__(self):
        for chunk in self.chunks:
            jobs = _jobs(chunk)
            inputs = ([np.frombuffer(j.data, dtype=np.uint8) for j in jobs],
                      [np.array(j.decode_hw, dtype=np.float32) for j in jobs])  # fn.resize wants [H, W]
            self.fed.append((chunk, inputs))
            yield inputs

    def start(self, chunks: Iterator[Chunk]) -> None:
        self.chunks, self.fed = chunks, collections.deque()

    def out(self) -> Chunk:
        """The chunk whose output the pipeline just gave (or raised on): outputs come in order."""
        return self.fed.popleft()[0]

    def unfinished(self) -> list[Chunk]:
        return [chunk for chunk, _ in self.fed]


def _jobs(chunk: Chunk) -> list[DecodeJob]:
    return [slot.jobs[i] for slot, idx in chunk for i in idx]


class _Slot:
    """One caller batch in flight: its results fill in as the chunks holding its images come out.
    Its images are split into parts at creation: the first fills the ``room`` left in the chunk
    being filled, the rest start new chunks, so the slot knows how many parts it waits for."""

    def __init__(self, jobs: list[DecodeJob], max_batch: int, room: int):
        self.jobs = jobs
        self.results: list = [None] * len(jobs)
        gpu_idx = [i for i, j in enumerate(jobs) if not gpu_declines(j.header)]
        self.cpu_idx = [i for i, j in enumerate(jobs) if gpu_declines(j.header)]
        first = gpu_idx[:room]
        self.parts = ([first] if first else []) + [gpu_idx[s:s + max_batch]
                                                   for s in range(len(first), len(gpu_idx), max_batch)]
        self.parts_left = len(self.parts)

    def fill(self, idx: list[int], outputs: list) -> None:
        for i, o in zip(idx, outputs):
            self.results[i] = o
        self.parts_left -= 1

    def fail(self, idx: list[int]) -> None:
        """DALI raised on this chunk: the CPU decoder redoes it and isolates the bad image."""
        self.cpu_idx.extend(idx)
        self.parts_left -= 1


class GpuDecoder:
    """DALI ``mixed`` decode and resize on the GPU. ``to_pixel_rows`` copies uint8 pixel rows to the
    host once per chunk (one pinned copy); ``to_pixel_values`` and ``stream_pixel_values`` keep
    everything on the GPU, one kernel per chunk making ``pixel_values`` of its rows.

    The DALI pipeline runs asynchronously and pipelined, ``prefetch`` chunks in flight. A call is one
    DALI epoch, so the pipeline fills and drains once per call; ``stream_pixel_values`` keeps one
    epoch over a whole stream of batches (how a training rank would consume micro-batches). Images
    the GPU decoder cannot take (CMYK, 16-bit, palette, alpha) and any chunk DALI rejects go to the
    CPU backend, which isolates the bad image and names the reason.

    ``device_id=None`` runs the same pipeline with DALI's CPU operators and torch on the CPU: slow,
    but it lets machines without a GPU test the batching, recovery and pixel layout.
    """

    name = "gpu"

    # Load 0.9 sends most JPEGs to the H200's hardware decoder (8,712 img/s decode-only, 2,776 at
    # DALI's 0.65); 4 chunks in flight stream 1.03-1.09x faster than 2 (docs/benchmarks/gpu-decode.md).
    def __init__(self, device_id: int | None = 0, num_threads: int = 4, max_batch: int = 64,
                 hw_decoder_load: float = 0.9, prefetch: int = 4, copy_encoded: bool = False):
        import nvidia.dali  # noqa: F401  (missing DALI fails here, not at the first batch)
        import torch

        if device_id is not None and device_id >= torch.cuda.device_count():
            raise ValueError(f"GPU decode on CUDA device {device_id}, but this process sees "
                             f"{torch.cuda.device_count()}: use --decode cpu, or give the actors a GPU")
        self.max_batch, self.prefetch = max_batch, prefetch
        # False hands DALI the encoded bytes where they lie (external_source no_copy): the feed keeps
        # each chunk's jobs, so their bytes, until its output is out, as no_copy requires.
        self.copy_encoded = copy_encoded
        self.device_id, self.num_threads, self.hw_decoder_load = device_id, num_threads, hw_decoder_load
        self._torch_device = torch.device("cpu" if device_id is None else f"cuda:{device_id}")
        self._cpu = CpuDecoder(num_threads=num_threads, max_batch=max_batch)
        self._pipeline: tuple | None = None  # (DALI pipeline, its feed), built on first use
        self._lock = threading.Lock()

    def _build(self, feed: _Feed | None = None):
        from nvidia.dali import fn, pipeline_def, types

        feed = feed or _Feed()
        on_gpu = self.device_id is not None
        decode_opts = {"device": "mixed", "hw_decoder_load": self.hw_decoder_load} if on_gpu else {"device": "cpu"}
        decode_opts["adjust_orientation"] = False  # the header's orientation is applied after the resize

        @pipeline_def(batch_size=self.max_batch, num_threads=self.num_threads, device_id=self.device_id,
                      exec_async=True, exec_pipelined=True, prefetch_queue_depth=self.prefetch)
        def decode_pipeline():
            encoded, sizes = fn.external_source(source=feed, cycle="raise", num_outputs=2, batch=True,
                                                dtype=[types.UINT8, types.FLOAT], no_copy=not self.copy_encoded)
            images = fn.decoders.image(encoded, output_type=types.RGB, **decode_opts)
            return fn.resize(images, size=sizes, interp_type=types.INTERP_CUBIC, antialias=True, dtype=types.UINT8)

        pipe = decode_pipeline()
        pipe.build()
        self._pipeline = (pipe, feed)
        return pipe, feed

    def _stream(self, batches: Iterable[list[DecodeJob]], spec: VisionSpec, finish: Callable,
                cpu_finish: Callable, timer: Timer | None) -> Iterator[list]:
        """One DALI epoch over ``batches`` (pulled lazily, the chunks in flight ahead of the consumer);
        yields per batch, in order, ``finish(dali_output, jobs)`` spread over its jobs, with the
        CPU decoder's ``cpu_finish(pixel_rows, job)`` for the jobs DALI cannot take or rejected."""
        in_flight: collections.deque[_Slot] = collections.deque()

        def chunks() -> Iterator[Chunk]:
            chunk, room = [], self.max_batch
            for jobs in batches:
                slot = _Slot(list(jobs), self.max_batch, room)
                in_flight.append(slot)
                for idx in slot.parts:
                    chunk.append((slot, idx))
                    room -= len(idx)
                    if room == 0:
                        yield chunk
                        chunk, room = [], self.max_batch
            if chunk:
                yield chunk

        def completed(slot: _Slot) -> list:
            if slot.cpu_idx:
                rows = self._cpu.to_pixel_rows([slot.jobs[i] for i in slot.cpu_idx], spec, timer)
                for i, r in zip(slot.cpu_idx, rows):
                    slot.results[i] = cpu_finish(r, slot.jobs[i]) if isinstance(r, np.ndarray) else r
            return slot.results

        with self._lock:
            pipe, feed = self._pipeline or self._build()
            pending = chunks()
            feed.start(pending)
            clean = False
            try:
                t0 = time.perf_counter()
                while True:
                    while in_flight and in_flight[0].parts_left == 0:
                        slot = in_flight.popleft()
                        if timer:
                            timer("decode", time.perf_counter() - t0, len(slot.jobs) - len(slot.cpu_idx))
                        yield completed(slot)
                        t0 = time.perf_counter()
                    try:
                        (out,) = pipe.run()
                    except StopIteration:
                        break
                    except RuntimeError:
                        for slot, idx in feed.out():
                            slot.fail(idx)
                        # A DALI pipeline that raised stays broken: a fresh one takes the chunks it
                        # had prefetched, then the rest of the stream.
                        feed.start(itertools.chain(feed.unfinished(), pending))
                        pipe, feed = self._build(feed)
                        continue
                    chunk = feed.out()
                    results, first = finish(out, _jobs(chunk)), 0
                    for slot, idx in chunk:
                        slot.fill(idx, results[first:first + len(idx)])
                        first += len(idx)
                pipe.reset()
                clean = True
                while in_flight:  # batches with no DALI chunk left (all CPU, or empty)
                    yield completed(in_flight.popleft())
            finally:
                if not clean:
                    # Abandoned mid-stream or our own code raised: the pipeline still holds
                    # prefetched chunks of this stream.
                    self._build()

    def _pixels(self, out) -> tuple:
        """A DALI output batch copied into one flat uint8 tensor on the decoder's device, and the
        shape of each image in it."""
        import torch

        shapes = [tuple(s) for s in out.shape()]
        pixels = torch.empty(sum(int(np.prod(s)) for s in shapes), dtype=torch.uint8, device=self._torch_device)
        if self._torch_device.type == "cuda":
            stream = torch.cuda.current_stream(self._torch_device)
            # Blocking: DALI reuses its output buffers on the next run().
            out.copy_to_external(ctypes.c_void_p(pixels.data_ptr()), ctypes.c_void_p(stream.cuda_stream))
        else:
            out.copy_to_external(ctypes.c_void_p(pixels.data_ptr()))
        return pixels, shapes

    def _device_rows(self, out, jobs: list[DecodeJob], spec: VisionSpec) -> tuple:
        """A chunk -> (its images' uint8 pixel rows on the decoder's device, each oriented, and per
        job its (first, end) rows in them or why it has none)."""
        import torch

        pixels, shapes = self._pixels(out)
        if all((h, w) == j.decode_hw and j.header.orientation == 1 for j, (h, w, _) in zip(jobs, shapes)):
            # The usual case: the chunk's pixels are already its rows, no tensor op per image.
            ends = np.cumsum([h * w * c // spec.patch_dim for h, w, c in shapes]).tolist()
            return pixels.view(-1, spec.patch_dim), list(zip([0] + ends[:-1], ends))
        offset, rows, parts, spans = 0, 0, [], []
        for job, (h, w, c) in zip(jobs, shapes):
            if (h, w) != job.decode_hw:
                spans.append(ImageRejected("corrupt_image", f"decoded {h}x{w} != target {job.decode_hw}"))
            else:
                image = pixels[offset:offset + h * w * c]
                if job.header.orientation != 1:  # a copy of the resized image, in its display frame
                    image = orient(image.view(h, w, c), job.header.orientation)
                parts.append(image.view(-1, spec.patch_dim))
                spans.append((rows, rows + len(parts[-1])))
                rows += len(parts[-1])
            offset += h * w * c
        return (torch.cat(parts) if parts else pixels.new_empty((0, spec.patch_dim))), spans

    def _host_rows(self, out, jobs: list[DecodeJob], spec: VisionSpec) -> list[np.ndarray | ImageRejected]:
        """A chunk -> each image's uint8 pixel rows in host memory, oriented, or why not."""
        import torch

        rows, spans = self._device_rows(out, jobs, spec)
        if rows.is_cuda:
            # A fresh pinned block per chunk, not one reused staging buffer plus a pageable copy: torch
            # caches freed pinned blocks, so once a caller (an actor handing rows to Ray) drops a batch
            # its block comes back without a new pinning. Measured on the H200: 771 img/s to host and
            # 1,960 on to GPU pixel_values this way, 688 and 472 with the staging buffer.
            host = torch.empty(rows.shape, dtype=torch.uint8, pin_memory=True)
            host.copy_(rows, non_blocking=True)
            torch.cuda.current_stream(self._torch_device).synchronize()
            rows = host
        array = rows.numpy()
        return [s if isinstance(s, ImageRejected) else array[s[0]:s[1]] for s in spans]

    def _values(self, out, jobs: list[DecodeJob], spec: VisionSpec, dtype) -> list:
        """A chunk -> each image's ``pixel_values``, views into one tensor made by one
        ``to_pixel_values`` of the chunk's rows (on a GPU, one fused kernel launch)."""
        rows, spans = self._device_rows(out, jobs, spec)
        grids = [job.grid(spec) for job, s in zip(jobs, spans) if not isinstance(s, ImageRejected)]
        values = to_pixel_values(rows, spec, grids, dtype)
        return [s if isinstance(s, ImageRejected) else values[s[0]:s[1]] for s in spans]

    def to_pixel_rows(self, jobs: list[DecodeJob], spec: VisionSpec,
                      timer: Timer | None = None) -> list[np.ndarray | ImageRejected]:
        stream = self._stream([jobs], spec, lambda out, batch: self._host_rows(out, batch, spec),
                              lambda rows, job: rows, timer)
        return [r for batch in stream for r in batch]

    def to_pixel_values(self, jobs: list[DecodeJob], spec: VisionSpec, dtype=None,
                        timer: Timer | None = None) -> list:
        """Normalized ``pixel_values`` [h*w, spec.pixel_values_dim] per job (``vision.to_pixel_values``
        of its pixel rows), on the decoder's device, or why it failed; ``dtype`` None is bfloat16.

        Nothing goes through the host but the encoded bytes. An image's tensor is a view of its
        chunk's: keeping one keeps the chunk's memory.
        """
        return [r for batch in self.stream_pixel_values([jobs], spec, dtype, timer) for r in batch]

    def stream_pixel_values(self, batches: Iterable[list[DecodeJob]], spec: VisionSpec, dtype=None,
                            timer: Timer | None = None) -> Iterator[list]:
        """``to_pixel_values`` of each batch in turn, in one DALI epoch: the pipeline decodes the
        next chunks while the caller uses this batch, and never drains between batches. Batches are
        pulled lazily, as many as fill the chunks in flight: a batch's result comes once the chunk
        holding its last image is full (``max_batch`` images) or the stream has ended. One stream at
        a time per decoder (close or exhaust it first)."""
        import torch

        dtype = torch.bfloat16 if dtype is None else dtype
        return self._stream(batches, spec, lambda out, batch: self._values(out, batch, spec, dtype),
                            lambda rows, job: to_pixel_values(torch.from_numpy(rows).to(self._torch_device), spec,
                                                              [job.grid(spec)], dtype),
                            timer)
