"""Image decode and resize to the pipeline's target size, with NVIDIA DALI on CPU or GPU.

Stages: ``probe`` (``datasvc.media.imagefile``) reads the header only (size, format, mode, orientation)
and checks that the file is whole, so the pixel cap applies before any decode and both backends get
the same files; a backend's ``to_pixel_rows`` decodes the stored frame, resizes it to the exact
smart-resize target, applies the header's orientation and returns the image's uint8
``vision.pixel_rows`` (or, where the CPU backend leaves the last resize to the rank, the oriented
frame as a ``vision.FrameRows``). Patch order is the consumer's job (``vision.to_pixel_values``).
The GPU backend is ``datasvc.media.gpudecode``.

The CPU backend resizes with OpenCV (``datasvc.media.jpegscale``: which interpolation where, and why not torch).
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Literal, Protocol

import cv2
import numpy as np

from datasvc.media import jpegscale
from datasvc.media.jpegscale import resize_uint8  # noqa: F401  (datasvc.media.video's import)
from datasvc.media.imagefile import ImageHeader, orient, pil_decode_rgb, probe  # noqa: F401  (probe: the callers' import)
from datasvc.media.vision import FrameRows, ImageRejected, VisionSpec, frame_rows, pixel_rows

# Modes DALI decodes to the same RGB as PIL's convert("RGB"); anything else (CMYK, palette,
# alpha, 16-bit, GIF, BMP, TIFF) is converted by PIL exactly as the HF processor does.
_DALI_MODES = {("JPEG", "RGB"), ("JPEG", "L"), ("PNG", "RGB"), ("PNG", "L"), ("WEBP", "RGB")}

RANK_RESIZE_MAX_AREA = 2.0
"""A frame whose last resize is left to the rank holds at most this many times its target's pixels:
the bytes it adds to a batch, against the actor's CPU time it saves."""


@dataclass(frozen=True, slots=True)
class DecodeJob:
    data: bytes
    header: ImageHeader
    target_hw: tuple[int, int]

    def grid(self, spec: VisionSpec) -> tuple[int, int, int]:
        """The (t, h, w) patch grid of the resized image."""
        th, tw = self.target_hw
        return 1, th // spec.patch_size, tw // spec.patch_size

    @property
    def decode_hw(self) -> tuple[int, int]:
        """The target in the stored frame: what a decoder resizes to before it orients."""
        th, tw = self.target_hw
        return (tw, th) if self.header.orientation >= 5 else (th, tw)


Timer = Callable[[str, float, int], None]
"""(stage, seconds, count): how a decoder reports its stage times (``StageTimes.add``)."""


class Decoder(Protocol):
    name: str

    def to_pixel_rows(self, jobs: list[DecodeJob], spec: VisionSpec,
                      timer: Timer | None = None) -> list[np.ndarray | FrameRows | ImageRejected]:
        """The resized image's uint8 ``vision.pixel_rows`` [h*w, 3*P*P] per job, its decoded frame
        for the consumer to resize (``vision.FrameRows``), or why it failed."""


def _needs_pil(header: ImageHeader) -> bool:
    """Whether only PIL decodes this image to what HF's ``load_image`` gives: a mode DALI converts
    otherwise, or a file DALI reads otherwise (``ImageHeader.pil_only``: an animation, 16-bit
    samples, a lossless WebP with EXIF)."""
    fmt = "JPEG" if header.format == "MPO" else header.format
    return (fmt, header.mode) not in _DALI_MODES or bool(header.pil_only)


class CpuDecoder:
    """DALI CPU decode (libjpeg-turbo, libpng, libwebp), OpenCV resize. Runs without a GPU.

    Each image is resized straight from DALI's output buffer, and a frame left to the rank (or an
    image already at its target) travels on as a view of it, so a frame is never copied here:
    DALI's dynamic executor hands out a fresh buffer each run and keeps it while a view of it
    lives. Copying each frame out cost the actors 9-18% of their CPU time.

    ``jpeg="libjpeg-turbo"`` is the explicit, measured option of decoding RGB and grayscale JPEGs
    with OpenCV's libjpeg-turbo instead, at the reduced DCT scale that still covers the target
    (``datasvc.media.jpegscale``); DALI cannot scale its decode.

    ``rank_resize`` leaves the last resize of a frame (after any halving, within
    ``RANK_RESIZE_MAX_AREA`` of its target) to the consumer: such an image comes back as its frame,
    a ``vision.FrameRows``, which ``vision.to_pixel_values`` resizes on the rank's device with HF's
    own resize. At the default 16 MP cap that resize, a full-frame pass of nearly the decode's cost
    on the CPU, is most of what the actor does beyond decoding.
    """

    name = "cpu"

    def __init__(self, num_threads: int = 1, max_batch: int = 32, jpeg: Literal["dali", "libjpeg-turbo"] = "dali",
                 rank_resize: bool = False):
        if jpeg not in ("dali", "libjpeg-turbo"):
            raise ValueError(f"jpeg must be 'dali' or 'libjpeg-turbo', not {jpeg!r}")
        self.num_threads, self.max_batch, self.jpeg = num_threads, max_batch, jpeg
        self.rank_resize = rank_resize
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="resize") if num_threads > 1 else None
        cv2.setNumThreads(1)  # parallel across images (the pool), not within one resize
        self._lock = threading.Lock()  # a DALI pipeline is fed and run by one thread at a time
        self._build()

    def _build(self) -> None:
        from nvidia.dali import fn, pipeline_def, types

        # Dynamic executor: the legacy one copies each decoded image again (TensorList::CopySample),
        # 1.05x libjpeg-turbo's CPU time on the same bytes against 0.94x with this one.
        @pipeline_def(batch_size=self.max_batch, num_threads=self.num_threads, device_id=None,
                      exec_dynamic=True, exec_async=True, exec_pipelined=True, prefetch_queue_depth=1)
        def decode_pipeline():
            encoded = fn.external_source(name="encoded", dtype=types.UINT8)
            # Orientation is the header's call (datasvc.media.imagefile), applied after the resize.
            return fn.decoders.image(encoded, device="cpu", output_type=types.RGB, adjust_orientation=False)

        self._pipe = decode_pipeline()
        self._pipe.build()

    def _map(self, fn: Callable, items: list) -> list:  # OpenCV releases the GIL: threads help
        return list(self._pool.map(fn, items)) if self._pool else [fn(x) for x in items]

    def _dali(self, blobs: list[bytes], finish: Callable) -> list:
        """``finish(i, image)`` of each of DALI's decodes of ``blobs``; an image is a view of DALI's
        output buffer, which lives as long as a view of it does."""
        with self._lock:
            try:
                self._pipe.feed_input("encoded", [np.frombuffer(b, dtype=np.uint8) for b in blobs])
                (out,) = self._pipe.run()
            except RuntimeError:
                self._build()  # a DALI pipeline that raised stays broken: start a fresh one
                raise
            views = [np.asarray(out[i]) for i in range(len(blobs))]  # no copy: DALI's own memory
            return self._map(lambda i: finish(i, views[i]), list(range(len(views))))

    def _dali_finish(self, jobs: list[DecodeJob], finish: Callable) -> list:
        """``finish(job, image)`` of each job's DALI decode, in batches; a failed batch is redone
        one by one to isolate the image DALI refuses. That one is PIL's to decode, as it is HF's:
        DALI's parsers refuse some files PIL reads whole; what PIL refuses too is ``corrupt_image``."""
        results: list = []
        for start in range(0, len(jobs), self.max_batch):
            chunk = jobs[start:start + self.max_batch]
            try:
                results += self._dali([j.data for j in chunk], lambda i, img: finish(chunk[i], img))
            except RuntimeError:
                for job in chunk:
                    try:
                        results += self._dali([job.data], lambda i, img: finish(job, img))
                    except RuntimeError as exc:
                        image = _pil_or_reject(job.data, job.header.pixels)
                        if isinstance(image, ImageRejected):
                            dali = str(exc).splitlines()[0]
                            image = ImageRejected("corrupt_image", f"{image.detail} (DALI: {dali})"[:200])
                        results.append(finish(job, image))
        return results

    def to_pixel_rows(self, jobs: list[DecodeJob], spec: VisionSpec,
                      timer: Timer | None = None) -> list[np.ndarray | FrameRows | ImageRejected]:
        t0, resize_s = time.perf_counter(), []

        def finish(job: DecodeJob, img, scale: int = 1):
            t = time.perf_counter()
            rows = _finish(job, img, scale, spec, self.rank_resize)
            resize_s.append(time.perf_counter() - t)
            return rows

        out: list = [None] * len(jobs)
        if self.jpeg == "libjpeg-turbo":
            scaled = [i for i, j in enumerate(jobs)
                      if j.header.format in ("JPEG", "MPO") and j.header.mode in ("RGB", "L")]
            for i, rows in zip(scaled, self._map(lambda i: _turbo_rows(jobs[i], finish), scaled)):
                out[i] = rows  # None: libjpeg-turbo refused it; DALI names the reason below
        pil = [i for i, j in enumerate(jobs) if out[i] is None and _needs_pil(j.header)]
        for i, img in zip(pil, self._map(lambda i: _pil_or_reject(jobs[i].data, jobs[i].header.pixels), pil)):
            out[i] = finish(jobs[i], img)
        rest = [i for i, r in enumerate(out) if r is None]
        for i, rows in zip(rest, self._dali_finish([jobs[i] for i in rest], finish)):
            out[i] = rows
        if timer:
            # Resizes run inside the decode pass (on DALI's buffer), spread over the threads: their
            # thread-seconds over the thread count stand for their share of the wall time.
            total = time.perf_counter() - t0
            prep = min(total, sum(resize_s) / max(1, self.num_threads))
            timer("decode", total - prep, len(jobs))
            timer("preprocess", prep, len(jobs))
        return out


def _turbo_rows(job: DecodeJob, finish: Callable) -> np.ndarray | ImageRejected | None:
    stored = job.header.stored_hw
    d = jpegscale.dct_scale(stored, job.decode_hw)
    img = jpegscale.decode_scaled(job.data, d)
    return None if img is None else finish(job, img, d)


def _finish(job: DecodeJob, img, scale: int, spec: VisionSpec, rank_resize: bool = False):
    """A frame decoded at 1/``scale`` of its stored size -> its pixel rows: resized to the target,
    then oriented; with ``rank_resize``, the oriented frame itself where its last resize may be
    left to the rank. Where no pixel changes these are views of the decoder's buffer."""
    if not isinstance(img, np.ndarray):
        return img
    stored = job.header.stored_hw
    expect_hw = jpegscale.scaled_hw(stored, scale)
    if img.shape[:2] != expect_hw:
        return ImageRejected("corrupt_image", f"decoded {img.shape[:2]} != header {expect_hw}")
    frame, extent = jpegscale.halve_large(img, job.decode_hw, (stored[0] / scale, stored[1] / scale))
    th, tw = job.decode_hw
    if (rank_resize and extent == frame.shape[:2] and extent != (th, tw)
            and extent[0] * extent[1] <= RANK_RESIZE_MAX_AREA * th * tw):
        # A whole frame: the rank's resize spans it as HF's spans the stored one.
        return frame_rows(orient(frame, job.header.orientation), spec)
    resized = jpegscale.resize_rest(frame, extent, job.decode_hw)
    return pixel_rows(orient(resized, job.header.orientation), spec)


def _pil_or_reject(data: bytes, pixels: int) -> np.ndarray | ImageRejected:
    try:
        return pil_decode_rgb(data, pixels)
    except Exception as exc:
        return ImageRejected("corrupt_image", f"{type(exc).__name__}: {exc}"[:200])

