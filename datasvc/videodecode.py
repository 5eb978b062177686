"""DALI's video decoders (CPU, and NVDEC through the mixed backend) over planned videos, and the
decode of a work item's videos (``decode_sample_videos``): what ``datasvc.video`` plans, decoded.
"""
from __future__ import annotations

import threading
import time

import numpy as np

from datasvc.decode import Timer
from datasvc.video import (CPU_CODECS, GPU_CODECS, VIDEO_STAGES, VideoHeader, VideoPlan, VideoSpec,
                           check_sample_videos, frames_to_rows, plan_video)
from datasvc.vision import ImageRejected, VisionSpec


class _DaliVideo:
    """One DALI video pipeline (``cpu`` or ``mixed``) fed whole containers and frame indices."""

    def __init__(self, device_id: int | None, num_threads: int, max_batch: int):
        self.device_id, self.num_threads, self.max_batch = device_id, num_threads, max_batch
        self._lock = threading.Lock()  # a DALI pipeline is fed and run by one thread at a time
        self._pipe = None
        self._build()

    def _build(self) -> None:
        import gc

        from nvidia.dali import fn, pipeline_def, types

        if self._pipe is not None:  # a pipeline that raised stays broken: drop it before the next
            self._pipe = None
            gc.collect()
        device = "cpu" if self.device_id is None else "mixed"

        @pipeline_def(batch_size=self.max_batch, num_threads=self.num_threads, device_id=self.device_id,
                      exec_async=False, exec_pipelined=False, prefetch_queue_depth=1)
        def video_pipeline():
            encoded = fn.external_source(name="encoded", dtype=types.UINT8, ndim=1)
            frames = fn.external_source(name="frames", dtype=types.INT32, ndim=1)
            return fn.decoders.video(encoded, device=device, frames=frames, pad_mode="none")

        self._pipe = video_pipeline()
        self._pipe.build()

    def run(self, plans: list[VideoPlan]) -> list[np.ndarray]:
        with self._lock:
            try:
                self._pipe.feed_input("encoded", [np.frombuffer(p.data, dtype=np.uint8) for p in plans])
                self._pipe.feed_input("frames", [np.asarray(p.indices, dtype=np.int32) for p in plans])
                (out,) = self._pipe.run()
            except RuntimeError:
                self._build()
                raise
            if self.device_id is not None:
                out = out.as_cpu()
            return [np.asarray(out.at(i)) for i in range(len(plans))]

    def decode(self, plans: list[VideoPlan]) -> list[np.ndarray | ImageRejected]:
        results: list = [None] * len(plans)
        for start in range(0, len(plans), self.max_batch):
            chunk = list(range(start, min(start + self.max_batch, len(plans))))
            try:
                for i, frames in zip(chunk, self.run([plans[i] for i in chunk])):
                    results[i] = frames
            except RuntimeError:  # one bad video fails the batch: redo one by one to isolate it
                for i in chunk:
                    results[i] = self._alone(plans[i])
        return results

    def _alone(self, plan: VideoPlan) -> np.ndarray | ImageRejected:
        """One video by itself, tried twice: the first run of a pipeline rebuilt after a failure
        can fail with "pipeline object is no longer valid" (seen on the mixed backend)."""
        for attempt in range(2):
            try:
                return self.run([plan])[0]
            except RuntimeError as exc:
                lines = [ln for ln in str(exc).splitlines() if ln.strip() and "no longer valid" not in ln]
                detail = (lines[-1] if lines else str(exc).strip())[:200]
        return ImageRejected("video_corrupt", detail)


class VideoDecoder:
    """DALI's video decoder over in-memory containers, fed each video's planned frame indices (it
    seeks to the keyframe before each run of frames instead of decoding the whole stream).

    ``device_id=None``: the CPU backend (libavcodec: VP8, VP9, MJPEG; other codecs are rejected
    ``video_codec_needs_gpu``). A device id: the mixed backend (NVDEC) for ``GPU_CODECS``, MJPEG
    (which NVDEC does not take) on the CPU backend; frames copied to the host for the resize."""

    def __init__(self, device_id: int | None = None, num_threads: int = 1, max_batch: int = 4):
        self.device_id, self.num_threads, self.max_batch = device_id, num_threads, max_batch
        self.name = "cpu" if device_id is None else "gpu"
        self._backends: dict[str, _DaliVideo] = {}
        self._backend("cpu" if device_id is None else "gpu")  # fail fast on a missing DALI or device

    def _backend(self, kind: str) -> _DaliVideo:
        if kind not in self._backends:
            device = None if kind == "cpu" else self.device_id
            self._backends[kind] = _DaliVideo(device, self.num_threads, self.max_batch)
        return self._backends[kind]

    def route(self, header: VideoHeader) -> str | None:
        """Which backend decodes this video here: ``gpu``, ``cpu`` or None (none can)."""
        least = GPU_CODECS.get(header.codec)
        if self.device_id is not None and least and header.width >= least[0] and header.height >= least[1]:
            return "gpu"
        return "cpu" if header.codec in CPU_CODECS else None

    def decode_frames(self, plans: list[VideoPlan]) -> list[np.ndarray | ImageRejected]:
        """The planned frames [F, H, W, 3] uint8 of each video as stored, or why it failed."""
        results: list = [None] * len(plans)
        by_backend: dict[str, list[int]] = {}
        for i, plan in enumerate(plans):
            kind = self.route(plan.header)
            if kind is None and self.device_id is not None:
                h = plan.header
                results[i] = ImageRejected("video_too_small_for_nvdec", f"{h.codec} {h.width}x{h.height} is under "
                                           f"NVDEC's {'x'.join(map(str, GPU_CODECS[h.codec]))}")
            elif kind is None:
                results[i] = ImageRejected("video_codec_needs_gpu",
                                           f"{plan.header.codec}: the CPU decoder takes {', '.join(CPU_CODECS)}")
            else:
                by_backend.setdefault(kind, []).append(i)
        for kind, idx in by_backend.items():
            for i, res in zip(idx, self._backend(kind).decode([plans[i] for i in idx])):
                results[i] = res
        return results

    def to_pixel_rows(self, plans: list[VideoPlan], vision: VisionSpec,
                      timer: Timer | None = None) -> list[np.ndarray | ImageRejected]:
        """Each planned video's uint8 rows (``frames_to_rows``), or why it failed. At most
        ``max_batch`` videos' stored frames are held at once: each batch is resized before the next
        is decoded."""
        out, decode_s, resize_s = [], 0.0, 0.0
        for start in range(0, len(plans), self.max_batch):
            batch = plans[start:start + self.max_batch]
            t0 = time.perf_counter()
            decoded = self.decode_frames(batch)
            t1 = time.perf_counter()
            for plan, frames in zip(batch, decoded):
                if isinstance(frames, ImageRejected):
                    out.append(frames)
                    continue
                try:
                    out.append(frames_to_rows(frames, plan, vision))
                except ImageRejected as exc:
                    out.append(exc)
            decode_s, resize_s = decode_s + t1 - t0, resize_s + time.perf_counter() - t1
        if timer:  # the actor's decode and preprocess stages, and the same time per video frame
            frames = sum(len(p.indices) for p in plans)
            timer("decode", decode_s, 0)
            timer("preprocess", resize_s, 0)
            timer(VIDEO_STAGES[0], decode_s, frames)
            timer(VIDEO_STAGES[1], resize_s, frames)
        return out


def decode_sample_videos(raws: list, problems: list, vision: VisionSpec, spec: VideoSpec | None,
                         decoder_for, timer: Timer | None = None) -> dict[int, list[tuple[np.ndarray, VideoPlan]]]:
    """Every live sample's videos, planned from their containers (the caps checked there) and then
    decoded together; a rejected video rejects its sample (``problems[si]``). ``decoder_for()``
    gives the ``VideoDecoder``, built only when a video is there to decode."""
    t0 = time.perf_counter()
    plans: dict[int, list[VideoPlan]] = {}
    for si, raw in enumerate(raws):
        if problems[si] is not None or not getattr(raw, "videos", None):
            continue
        if spec is None:
            problems[si] = ("video_not_supported", "this pipeline takes no video", "decode")
            continue
        try:
            mine = [plan_video(data, vision, spec) for _ext, data in raw.videos]
            check_sample_videos(mine, spec)
            plans[si] = mine
        except ImageRejected as exc:
            problems[si] = (exc.reason, exc.detail, "decode")
        except RuntimeError:  # PyAV missing: the installation's fault, not the sample's
            raise
        except Exception as exc:  # whatever a container does, it costs its sample alone
            problems[si] = ("video_corrupt", f"{type(exc).__name__}: {exc}"[:200], "decode")
    if timer:
        timer("decode", time.perf_counter() - t0, 0)
    if not plans:
        return {}
    flat = [(si, plan) for si, mine in plans.items() for plan in mine]
    rows = decoder_for().to_pixel_rows([plan for _, plan in flat], vision, timer)
    out: dict[int, list] = {}
    for (si, plan), res in zip(flat, rows):
        if problems[si] is not None:
            continue
        if isinstance(res, ImageRejected):
            problems[si] = (res.reason, res.detail, "decode")
            out.pop(si, None)
        else:
            out.setdefault(si, []).append((res, plan))
    return out
