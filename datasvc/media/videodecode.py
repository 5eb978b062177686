"""DALI's video decoders (CPU, and NVDEC through the mixed backend) over planned videos, FFmpeg's
(PyAV) for what neither DALI backend here takes, and the decode of a work item's videos
(``decode_sample_videos``): what ``datasvc.media.video`` plans, decoded.
"""
from __future__ import annotations

import functools
import io
import threading
import time

import numpy as np

from datasvc.media.decode import Timer
from datasvc.media.video import (CPU_CODECS, GPU_CODECS, VIDEO_STAGES, VideoHeader, VideoPlan, VideoSpec,
                           check_sample_videos, frames_to_rows, plan_video)
from datasvc.media.vision import ImageRejected, VisionSpec


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


_PYAV_DECODERS = {"av1": ("libdav1d", "libaom-av1")}
"""Decoders to look for per codec where FFmpeg's own one is not a software decoder (its native AV1
decoder needs a hardware accelerator); any other codec is looked up by its name."""


@functools.lru_cache(maxsize=None)
def pyav_decodes(codec: str) -> bool:
    """Whether this FFmpeg build (PyAV's) has a software decoder for ``codec``."""
    try:
        import av
    except ImportError:
        return False
    for name in _PYAV_DECODERS.get(codec, (codec,)):
        try:
            av.Codec(name, "r")
            return True
        except Exception:  # UnknownCodecError, or a name that is only an encoder here
            continue
    return False


class _PyAVVideo:
    """FFmpeg's decoders through PyAV, one thread, for videos no DALI backend here takes: the same
    frames (presentation order, as DALI's ``frames`` indices mean them) as uint8 RGB as stored.

    The container is demuxed once (no decode) to number the frames by sorted pts, as DALI indexes
    them; decoding starts at the last keyframe at or before the first wanted frame and stops after
    the last one. If that start misses a wanted frame (a stream whose keyframe flags or timestamps
    cannot be trusted), the video is decoded again from its first packet, counting frames in
    output order where it has no timestamps: correctness before speed."""

    def decode(self, plans: list[VideoPlan]) -> list[np.ndarray | ImageRejected]:
        return [self._one(plan) for plan in plans]

    @staticmethod
    def _one(plan: VideoPlan) -> np.ndarray | ImageRejected:
        wanted = set(plan.indices)
        try:
            got, total, seeked = _pyav_frames(plan.data, wanted, from_start=False)
            if len(got) < len(wanted) and seeked:
                got, total, _ = _pyav_frames(plan.data, wanted, from_start=True)
            if len(got) < len(wanted):
                missing = sorted(wanted - got.keys())
                return ImageRejected("video_truncated", f"decoded {len(got)} of {len(wanted)} planned frames; "
                                     f"frame {missing[0]} is not among the stream's {total}")
            return np.stack([got[i] for i in plan.indices])
        except Exception as exc:  # whatever FFmpeg makes of bad bytes, it costs this video alone
            return ImageRejected("video_corrupt", f"{type(exc).__name__}: {exc}"[:200])


def _pyav_frames(data: bytes, wanted: set[int], from_start: bool) -> tuple[dict[int, np.ndarray], int, bool]:
    """({index: RGB frame} of the wanted frames decoded, frames in the stream, whether it seeked)."""
    import av
    from av.video.reformatter import Interpolation

    # DALI's CPU backend converts with swscale's bilinear full-chroma, accurately rounded path;
    # the same flags give its frames bit for bit (FFmpeg's fast default differs by ~2/255 on
    # average, up to 37 at colour edges). One swscale thread: the actor owns one core.
    convert = {"format": "rgb24", "interpolation": Interpolation.BILINEAR | Interpolation.FULL_CHR_H_INT
               | Interpolation.ACCURATE_RND, "threads": 1}
    last, got = max(wanted), {}
    with av.open(io.BytesIO(data), mode="r") as container:
        stream = container.streams.video[0]
        stream.thread_count = 1  # the actor owns one core; no frame threads, no added frame delay
        packets = [p for p in container.demux(stream) if p.size > 0]
        stamps = [p.pts for p in packets]
        rank = ({pts: i for i, pts in enumerate(sorted(stamps))}
                if None not in stamps and len(set(stamps)) == len(stamps) else None)
        start = 0
        if rank and not from_start:
            first = sorted(stamps)[min(min(wanted), len(stamps) - 1)]
            start = max((k for k, p in enumerate(packets) if p.is_keyframe and p.pts <= first), default=0)
        count = 0
        for packet in [*packets[start:], None]:  # None drains the frames the decoder still holds
            for frame in stream.codec_context.decode(packet):
                i = rank.get(frame.pts, -1) if rank is not None else count
                count += 1
                if i in wanted and i not in got:
                    got[i] = frame.reformat(**convert).to_ndarray()
            if len(got) == len(wanted) or (rank is None and count > last):
                break
    return got, len(packets), start > 0

class VideoDecoder:
    """Planned videos decoded to their frames: by DALI wherever one of its backends takes the
    video, by FFmpeg through PyAV where none does. DALI is fed whole containers and each video's
    planned frame indices (it seeks to the keyframe before each run of frames instead of decoding
    the whole stream).

    ``device_id=None``: DALI's CPU backend for VP8, VP9 and MJPEG; PyAV for H.264, HEVC, AV1 and
    MPEG-4 part 2, which that backend refuses. A device id: the mixed backend (NVDEC) for
    ``GPU_CODECS`` at NVDEC's sizes; MJPEG (which NVDEC does not take) and videos under NVDEC's
    smallest size on the CPU backend when their codec is in ``CPU_CODECS``, else on PyAV; frames
    copied to the host for the resize. A codec neither takes is rejected ``video_codec_needs_gpu``
    (on a GPU machine, ``video_too_small_for_nvdec``).

    NVDEC's codecs differ by GPU (an H200's takes no AV1 through DALI 2.4): a video NVDEC fails on
    is redone on the backend a CPU machine would use, and once that decodes it, its codec goes
    there from then on (``nvdec_refused``)."""

    def __init__(self, device_id: int | None = None, num_threads: int = 1, max_batch: int = 4):
        self.device_id, self.num_threads, self.max_batch = device_id, num_threads, max_batch
        self.name = "cpu" if device_id is None else "gpu"
        self._backends: dict[str, _DaliVideo | _PyAVVideo] = {}
        self.nvdec_refused: set[str] = set()  # codecs NVDEC failed on that another backend decoded
        self._backend("cpu" if device_id is None else "gpu")  # fail fast on a missing DALI or device

    def _backend(self, kind: str) -> _DaliVideo | _PyAVVideo:
        if kind == "pyav":
            return self._backends.setdefault(kind, _PyAVVideo())
        if kind not in self._backends:
            device = None if kind == "cpu" else self.device_id
            self._backends[kind] = _DaliVideo(device, self.num_threads, self.max_batch)
        return self._backends[kind]

    def route(self, header: VideoHeader) -> str | None:
        """Which backend decodes this video here: ``gpu`` (NVDEC), ``cpu`` (DALI's CPU backend),
        ``pyav`` (FFmpeg, where no DALI backend takes it) or None (none can)."""
        least = GPU_CODECS.get(header.codec)
        if (self.device_id is not None and least and header.width >= least[0] and header.height >= least[1]
                and header.codec not in self.nvdec_refused):
            return "gpu"
        return self._without_nvdec(header)

    @staticmethod
    def _without_nvdec(header: VideoHeader) -> str | None:
        if header.codec in CPU_CODECS:
            return "cpu"
        return "pyav" if pyav_decodes(header.codec) else None

    def decode_frames(self, plans: list[VideoPlan]) -> list[np.ndarray | ImageRejected]:
        """The planned frames [F, H, W, 3] uint8 of each video as stored, or why it failed."""
        results: list = [None] * len(plans)
        by_backend: dict[str, list[int]] = {}
        for i, plan in enumerate(plans):
            kind = self.route(plan.header)
            if kind is None and self.device_id is not None:
                h = plan.header
                results[i] = ImageRejected("video_too_small_for_nvdec", f"{h.codec} {h.width}x{h.height} is under "
                                           f"NVDEC's {'x'.join(map(str, GPU_CODECS[h.codec]))}, and this FFmpeg build "
                                           "has no decoder for it")
            elif kind is None:
                results[i] = ImageRejected("video_codec_needs_gpu", f"{plan.header.codec}: neither DALI's CPU decoder "
                                           f"({', '.join(CPU_CODECS)}) nor this FFmpeg build decodes it")
            else:
                by_backend.setdefault(kind, []).append(i)
        for kind, idx in by_backend.items():
            for i, res in zip(idx, self._backend(kind).decode([plans[i] for i in idx])):
                results[i] = res
        for i in by_backend.get("gpu", []):
            if isinstance(results[i], ImageRejected):
                results[i] = self._after_nvdec_failed(plans[i], results[i])
        return results

    def _after_nvdec_failed(self, plan: VideoPlan, rejected: ImageRejected) -> np.ndarray | ImageRejected:
        """A video NVDEC failed on, redone where a CPU machine would decode it; NVDEC's reason
        stands if that fails too (a corrupt video, not a codec NVDEC lacks)."""
        kind = self._without_nvdec(plan.header)
        if kind is None:
            return rejected
        (frames,) = self._backend(kind).decode([plan])
        if isinstance(frames, ImageRejected):
            return rejected
        self.nvdec_refused.add(plan.header.codec)
        return frames

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
